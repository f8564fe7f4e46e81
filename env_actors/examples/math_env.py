"""`MathEnv`: single-turn arithmetic word problems, answered in `\\boxed{}`.

    Ref("env_actors.examples.math_env:MathEnv", {})                       # the bundled 300 problems
    Ref("env_actors.examples.math_env:MathEnv", {"path": "/data/my.jsonl", "limit": 1000})

The user message is a problem from `data/math_problems.jsonl` (see `generate_math.py` for its phrasing)
followed by `INSTRUCTION`. The episode ends after one assistant turn. Reward is 1.0 when the last
`\\boxed{...}` of the answer equals the exact integer answer, else 0.0; components `correct` and `format`
(a boxed answer was given at all).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from env_actors.examples.answers import boxed_equals, content_text
from env_actors.interface import Environment, Message, Reset, ScoreOut, StepOut, check_index
from rollout_actors.kernel import CallerError

BUNDLED_PATH = Path(__file__).parent / "data" / "math_problems.jsonl"
SYSTEM_PROMPT = "You are a careful assistant who solves arithmetic word problems step by step."
INSTRUCTION = "Put your final answer in \\boxed{}."


@dataclass
class _Episode:
    task: dict[str, Any]
    answer_text: str | None = None
    turns: int = 0


class MathEnv(Environment):
    """Single-turn word problems with an exact integer answer."""

    def __init__(self, path: str | None = None, limit: int | None = None, system_prompt: str = SYSTEM_PROMPT):
        self.path = Path(path) if path else BUNDLED_PATH
        self.limit = limit
        self.system_prompt = system_prompt
        self._tasks: list[dict[str, Any]] = []

    async def load(self) -> None:
        text = await asyncio.to_thread(self.path.read_text)
        tasks = [json.loads(line) for line in text.splitlines() if line.strip()]
        self._tasks = tasks[: self.limit] if self.limit is not None else tasks
        for task in self._tasks:
            _check_task(task)

    def num_tasks(self) -> int:
        return len(self._tasks)

    def task(self, index: int) -> dict[str, Any]:
        return dict(self._tasks[check_index(index, len(self._tasks))])

    async def reset(self, task: dict[str, Any]) -> Reset:
        _check_task(task)
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": f"{task['question']} {INSTRUCTION}"})
        return Reset(messages=messages, state=_Episode(task=task))

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        if state.turns >= 1:
            raise CallerError("MathEnv is single-turn: the episode is already over")
        state.turns += 1
        state.answer_text = content_text(assistant_message)
        return StepOut(messages=[], done=True)

    async def score(self, state: _Episode) -> ScoreOut:
        correct, formatted = boxed_equals(state.answer_text or "", state.task["answer"])
        return ScoreOut(
            reward=1.0 if correct else 0.0,
            components={"correct": float(correct), "format": float(formatted)},
            metrics={"turns": state.turns, "answer": state.task["answer"]},
        )


def _check_task(task: Any) -> None:
    if not isinstance(task, dict) or not isinstance(task.get("question"), str):
        raise CallerError("a MathEnv task is a dict with a 'question' string and an integer 'answer'")
    answer = task.get("answer")
    if isinstance(answer, bool) or not isinstance(answer, int):
        raise CallerError("a MathEnv task is a dict with a 'question' string and an integer 'answer'")
