"""A verifiers v1 taskset (0.4.x), written as a user would: the stand-in's word problems, answered in
`\\boxed{}`, scored by two weighted rewards and a metric, with a response stop.

Installed as a top-level package, as verifiers loads tasksets by id (`framework-vf-tasks`); the env
pools ship it with `runtime_env.py_modules`. The config plugs in more, as `vf-eval`'s `--env.taskset.task.*`
would: `task.rewards.explodes.fn = "framework_vf_tasks:explodes"` (a reward that raises),
`task.rewards.on_disk.fn = "framework_vf_tasks:on_disk"` (a reward that needs a runtime),
`task.rewards.reasoned.fn = "framework_vf_tasks:reasoned"` (a reward that reads the model's reasoning).
"""

import re

import verifiers.v1 as vf
from framework_envs import PROBLEMS

BOXED = re.compile(r"\\boxed\{(-?\d+)\}")
RAMBLING_WORDS = 40


class MathData(vf.TaskData):
    answer: str


class MathTask(vf.Task[MathData, vf.State]):
    @vf.stop
    async def rambles(self, response: vf.Response) -> bool:
        return len((response.message.content or "").split()) > RAMBLING_WORDS

    @vf.stop
    async def prompt_too_long(self, request: vf.Request) -> bool:
        return sum(len(str(m.content)) for m in request.messages) > 20_000

    @vf.reward(weight=1.0)
    async def correct(self, task: MathData, trace: vf.Trace) -> float:
        found = BOXED.findall(trace.last_reply)
        return 1.0 if found and found[-1] == task.answer else 0.0

    @vf.reward(weight=0.25)
    async def formatted(self, trace: vf.Trace) -> float:
        return 1.0 if BOXED.search(trace.last_reply) else 0.0

    @vf.metric
    async def reply_words(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply.split()))


class MathTaskset(vf.Taskset[MathTask, vf.TasksetConfig]):
    def load(self):
        for question, answer in PROBLEMS:
            data = MathData(
                prompt=f"{question} Answer in \\boxed{{}}.",
                system_prompt="Solve the word problem.",
                answer=str(answer),
            )
            yield MathTask(data, self.config.task)


async def explodes(trace: vf.Trace) -> float:
    raise ZeroDivisionError("the grader divided by zero")


async def reasoned(trace: vf.Trace) -> float:
    return 1.0 if any(m.reasoning_content for m in trace.assistant_messages) else 0.0


async def on_disk(trace: vf.Trace, runtime: vf.Runtime) -> float:
    result = await runtime.run(["test", "-f", "answer.txt"], {})
    return 1.0 if result.exit_code == 0 else 0.0


__all__ = ["MathTaskset"]
