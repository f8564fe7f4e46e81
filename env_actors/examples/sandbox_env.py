"""`SandboxEnv`: an agentic episode whose every step waits on a sandbox, as a coding agent's tool runs do.

    Ref("env_actors.examples.sandbox_env:SandboxEnv", {"num_tasks": 64, "turns": 3, "step_wait_s": 5.0})

Each task asks the model to work through `turns` steps. Every step stands for one command run in a
sandbox: it waits `step_wait_s` seconds (awaited, so the env server holds thousands of such steps at
once, as it would with remote sandboxes) and answers with one `tool`-free user message saying what the
command printed. The episode ends after exactly `turns` steps, whatever the model wrote; reward 1.0 when
it got there. `bench_long_waits.py` runs it to see the plane hold thousands of rollouts that spend
their life waiting.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from env_actors.interface import Environment, Message, Reset, ScoreOut, StepOut, check_index
from rollout_actors.kernel import CallerError

MAX_STEP_WAIT_S = 600.0  # a sandbox command past this is a wedged sandbox, not a slow one


@dataclass
class _Episode:
    index: int
    steps: int = 0


class SandboxEnv(Environment):
    """`turns` steps per episode, each waiting `step_wait_s` seconds before it answers."""

    def __init__(self, num_tasks: int = 64, turns: int = 3, step_wait_s: float = 5.0):
        if turns < 1:
            raise CallerError(f"turns must be >= 1, got {turns}")
        if not 0 <= step_wait_s <= MAX_STEP_WAIT_S:
            raise CallerError(f"step_wait_s must be in [0, {MAX_STEP_WAIT_S:g}], got {step_wait_s}")
        self.count, self.turns, self.step_wait_s = num_tasks, turns, step_wait_s

    def num_tasks(self) -> int:
        return self.count

    def task(self, index: int) -> dict[str, Any]:
        return {"index": check_index(index, self.count)}

    async def reset(self, task: dict[str, Any]) -> Reset:
        if not isinstance(task.get("index"), int):
            raise CallerError("a SandboxEnv task is {'index': int}")
        prompt = f"Task {task['index']}: inspect the repository, one shell command per reply."
        return Reset(messages=[{"role": "user", "content": prompt}], state=_Episode(index=task["index"]))

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        if state.steps >= self.turns:
            raise CallerError("the episode is already over")
        await asyncio.sleep(self.step_wait_s)  # the sandbox runs the command
        state.steps += 1
        if state.steps >= self.turns:
            return StepOut(messages=[], done=True)
        output = f"$ step {state.steps} exited 0 after {self.step_wait_s:g} s"
        return StepOut(messages=[{"role": "user", "content": output}], done=False)

    async def score(self, state: _Episode) -> ScoreOut:
        finished = float(state.steps >= self.turns)
        return ScoreOut(reward=finished, components={"finished": finished})
