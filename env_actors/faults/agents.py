"""Agent programs for the agent-mode tests: real agents, each with the same task as a token-mode twin.

- `TwoToolCalculatorEnv`: the token-mode twin, the bundled calculator task with a second tool offered.
- `SdkAgentEnv`: an in-process agent loop with the OpenAI SDK (`AsyncOpenAI`) and the same two tools.
- `ProgramAgentEnv`: a subprocess agent (`agent_cli.py`) that uses the official `openai` client from its own
  process; its `behaviour` config makes it misbehave the ways the tests need.

All three score as `CalculatorEnv` does (boxed answer right and the calculator used), so the same task
reaches the same reward in token and agent mode. They live with the fault environments (outside the
default allowlist; tests widen it explicitly) because env servers import a Ref's module from the installed
packages, where the tests folder is not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from env_actors.agent import AgentEndpoint, AgentEnvironment, last_json_line, python_program, run_program
from env_actors.examples.calculator_agent import CalculatorAgentEnv
from env_actors.examples.calculator_env import CalculatorEnv
from env_actors.interface import Reset, ScoreOut

NOTE_TOOL = {
    "type": "function",
    "function": {
        "name": "note",
        "description": "Write a note to yourself; answers 'noted'.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
    },
}


class TwoToolCalculatorEnv(CalculatorEnv):
    """The calculator task with a second tool offered (`note`): the token-mode twin of the agents here."""

    async def reset(self, task: dict[str, Any]) -> Reset:
        start = await super().reset(task)
        return Reset(messages=start.messages, state=start.state, tools=[*(start.tools or []), NOTE_TOOL])

    def _answer(self, state: Any, call: dict[str, Any]) -> dict[str, Any]:
        if (call.get("function") or {}).get("name") == "note":
            return {"role": "tool", "tool_call_id": call.get("id", ""), "content": "noted"}
        return super()._answer(state, call)


class SdkAgentEnv(CalculatorAgentEnv):
    """An in-process agent: the bundled example's `AsyncOpenAI` chat loop (it runs the tools itself, through
    the twin's tool answers) with the two tools of `TwoToolCalculatorEnv`."""

    twin = TwoToolCalculatorEnv


class ProgramAgentEnv(AgentEnvironment):
    """A subprocess agent: `agent_cli.py` with the task's messages and tools on stdin; it prints its final
    answer as a JSON line. A task may say how the agent behaves (one env pool serves every variant):
    `behaviour` (`normal`, `never_calls`, `rewrite`, `leak`: see `agent_cli.py`), `pid_dir` and
    `leak_file` (where it tells a test its pid and, for `leak`, its endpoint)."""

    def __init__(self, max_turns: int = 4):
        self._twin = TwoToolCalculatorEnv(max_turns=max_turns)
        self._max_turns = max_turns

    async def load(self) -> None:
        await self._twin.load()

    def num_tasks(self) -> int:
        return self._twin.num_tasks()

    def task(self, index: int) -> dict[str, Any]:
        return self._twin.task(index)

    async def reset(self, task: dict[str, Any]) -> Reset:
        start = await self._twin.reset(task)
        job = {
            "behaviour": task.get("behaviour", "normal"),
            "pid_dir": task.get("pid_dir", ""),
            "leak_file": task.get("leak_file", ""),
            "max_turns": self._max_turns,
            "messages": start.messages,
            "tools": start.tools,
        }
        return Reset(messages=start.messages, state={"twin": start.state, "job": job}, tools=start.tools)

    async def run_agent(self, state: Any, endpoint: AgentEndpoint) -> None:
        program = python_program(str(Path(__file__).with_name("agent_cli.py")))
        run = await run_program(program, endpoint, stdin=json.dumps(state["job"]))
        answer = last_json_line(run.stdout)
        twin = state["twin"]
        twin.final_text, twin.tool_calls, twin.turns = answer["final"], answer["tool_calls"], answer["turns"]

    async def score(self, state: Any) -> ScoreOut:
        return await self._twin.score(state["twin"])
