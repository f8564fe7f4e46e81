"""`SyncRewardEnv`: an environment written synchronously, the way the field's packages are (skyrl-gym,
verifiers reward functions), with per-step rewards and a reward that burns the CPU.

    Ref("env_actors.faults.sync_env:SyncRewardEnv", {"turns": 2, "score_cpu_s": 5.0})

Each step echoes the completion's raw text back (`"you wrote: <raw_text>"`), rewards the turn with
`1 / (turn + 1)`, and ends after `turns` steps. `score` computes for `score_cpu_s` seconds in pure Python
(a math verifier, say) before answering: run on the server's event loop that would stall it past any
sane `hang_timeout_s`; the server runs plain methods in a thread, so its loop keeps turning.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from env_actors.interface import RAW_TEXT_KEY, Environment, Message, Reset, ScoreOut, StepOut, check_index

ECHO_PREFIX = "you wrote: "


@dataclass
class _Episode:
    rewards: list[float] = field(default_factory=list)


class SyncRewardEnv(Environment):
    def __init__(self, turns: int = 2, score_cpu_s: float = 0.0, tasks: int = 4):
        self.turns = turns
        self.score_cpu_s = score_cpu_s
        self.tasks = tasks

    def num_tasks(self) -> int:
        return self.tasks

    def task(self, index: int) -> dict[str, Any]:
        return {"index": check_index(index, self.tasks)}

    def reset(self, task: dict[str, Any]) -> Reset:
        return Reset(
            messages=[{"role": "user", "content": f"Say something about {task.get('index')}."}],
            state=_Episode(),
        )

    def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        state.rewards.append(1.0 / (len(state.rewards) + 1))
        done = len(state.rewards) >= self.turns
        echo = [] if done else [{"role": "user", "content": ECHO_PREFIX + assistant_message[RAW_TEXT_KEY]}]
        return StepOut(messages=echo, done=done, reward=state.rewards[-1])

    def score(self, state: _Episode) -> ScoreOut:
        until, spins = time.monotonic() + self.score_cpu_s, 0
        while time.monotonic() < until:  # CPU, holding the GIL between switches: no sleep, no await
            spins += sum(i * i for i in range(1000)) > 0
        return ScoreOut(reward=sum(state.rewards), metrics={"spins": spins})
