"""A verifiers v1 taskset (0.4.x) with a toolset, written as a user would: arithmetic to be done with a
`calculator` tool (an MCP server, `toolset.Calculator`, launched per rollout by verifiers), answered in
`\\boxed{}`. The stand-in calls the tool, reads its answer and replies, so each episode is multi-turn:
a model call, a tool call, a model call on the tool's answer.

Installed as a top-level package (`framework-vf-tools`), shipped to env pools with
`runtime_env.py_modules`, like `framework_vf_tasks`.
"""

import re

import verifiers.v1 as vf
from framework_envs import EXPRESSIONS

from framework_vf_tools.toolset import Calculator

BOXED = re.compile(r"\\boxed\{(-?\d+)\}")


class ArithmeticData(vf.TaskData):
    answer: str


class ArithmeticTask(vf.Task[ArithmeticData, vf.State]):
    @classmethod
    def toolsets(cls, config: vf.TaskConfig) -> list[vf.Toolset]:
        return [Calculator(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def correct(self, task: ArithmeticData, trace: vf.Trace) -> float:
        found = BOXED.findall(trace.last_reply)
        return 1.0 if found and found[-1] == task.answer else 0.0

    @vf.metric
    async def tool_calls(self, trace: vf.Trace) -> float:
        return float(sum(len(m.tool_calls or []) for m in trace.assistant_messages))


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, vf.TasksetConfig]):
    def load(self):
        for expression, value in EXPRESSIONS:
            prompt = f"Compute {expression} using the calculator tool. Answer in \\boxed{{}}."
            system = "Use the calculator tool for arithmetic."
            data = ArithmeticData(prompt=prompt, system_prompt=system, answer=str(value))
            yield ArithmeticTask(data, self.config.task)


__all__ = ["ArithmeticTaskset"]
