"""A tiny healthy environment (`EchoEnv`) and variants of it that fail in one specific way each.

Process-level faults (`os._exit`, blocking sleeps) are the point: they are what model-authored code,
sandboxes and dataset loaders do to an env server in production.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from env_actors.adapters import FrameworkLoop
from env_actors.interface import Environment, Message, Reset, ScoreOut, StepOut, check_index
from rollout_actors.kernel import CallerError, ref_target

FOREVER_S = 3600.0


@ref_target()
def constant_grader(value: float) -> Any:
    """A part an environment can take as a nested Ref (`Ref("...:constant_grader", {"value": 1.0})`)."""
    return lambda _answer: value


@dataclass
class _Episode:
    index: int
    turns: int = 0


class EchoEnv(Environment):
    """Healthy: `turns` steps per episode, each answered with one user message; reward 1.0 when finished.
    `step_delay` makes each step take that long (awaited, so the server stays responsive)."""

    def __init__(self, num_tasks: int = 16, turns: int = 2, step_delay: float = 0.0):
        self.count, self.turns, self.step_delay = num_tasks, turns, step_delay
        self.steps_answered = 0

    def num_tasks(self) -> int:
        return self.count

    def task(self, index: int) -> dict[str, Any]:
        return {"index": check_index(index, self.count)}

    async def reset(self, task: dict[str, Any]) -> Reset:
        if not isinstance(task.get("index"), int):
            raise CallerError("an EchoEnv task is {'index': int}")
        messages = [{"role": "user", "content": f"Task {task['index']}: reply with anything."}]
        return Reset(messages=messages, state=_Episode(index=task["index"]))

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        if state.turns >= self.turns:
            raise CallerError("the episode is already over")
        if self.step_delay:
            await asyncio.sleep(self.step_delay)
        state.turns += 1
        self.steps_answered += 1
        done = state.turns >= self.turns
        return StepOut(
            messages=[] if done else [{"role": "user", "content": f"Turn {state.turns} noted."}], done=done
        )

    async def score(self, state: _Episode) -> ScoreOut:
        finished = state.turns >= self.turns
        return ScoreOut(
            reward=float(finished), components={"finished": float(finished)}, metrics={"pid": os.getpid()}
        )


_TOOL_WORDS = (
    "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega table index value column "
    "result error warning status file line path module function return object record field entry"
).split()


class ToolOutputEnv(EchoEnv):
    """Healthy, agentic-shaped: every step is answered with one tool message of `tool_words` words (about
    1.03 tokens a word with Qwen3), so the context grows by a long tool output each turn, as with a coding agent
    reading files. `bench_trajectory.py` runs it to see that a turn costs what it adds."""

    def __init__(self, num_tasks: int = 16, turns: int = 64, tool_words: int = 1450):
        super().__init__(num_tasks=num_tasks, turns=turns)
        self.tool_words = tool_words

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        if state.turns >= self.turns:
            raise CallerError("the episode is already over")
        state.turns += 1
        self.steps_answered += 1
        if state.turns >= self.turns:
            return StepOut(messages=[], done=True)
        words = len(_TOOL_WORDS)
        text = " ".join(_TOOL_WORDS[(state.turns * 7 + i) % words] for i in range(self.tool_words))
        output = {"role": "tool", "tool_call_id": f"call-{state.turns}", "content": text}
        return StepOut(messages=[output], done=False)


def _record(directory: str | None, prefix: str) -> int:
    """Claim the next `prefix-N` file in `directory` (atomic across processes); return N, or -1."""
    if directory is None:
        return -1
    Path(directory).mkdir(parents=True, exist_ok=True)
    for n in range(10_000):
        try:
            os.close(os.open(Path(directory) / f"{prefix}-{n}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return n
        except FileExistsError:
            continue
    raise RuntimeError(f"too many {prefix} records in {directory}")


class LoadRaisesEnv(EchoEnv):
    """`load()` raises: a missing dataset shard. The traceback must reach whoever started the pool."""

    async def load(self) -> None:
        raise FileNotFoundError("dataset shard 'train-00000-of-00001.parquet' is missing")


class DiesOnLoadEnv(EchoEnv):
    """The server process exits during `load()` (think: OOM-killed while loading), every time.
    Each attempt is recorded in `attempts_dir` so a test can count spawns from outside."""

    def __init__(self, attempts_dir: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.attempts_dir = attempts_dir

    async def load(self) -> None:
        _record(self.attempts_dir, "load")
        os._exit(3)


class FlakyLoadEnv(EchoEnv):
    """The first `good_loads` loads (counted across processes in `state_dir`) succeed, later ones raise:
    a replacement spawned mid-serve fails while the original servers keep serving."""

    def __init__(self, state_dir: str, good_loads: int = 1, **kwargs: Any):
        super().__init__(**kwargs)
        self.state_dir, self.good_loads = state_dir, good_loads

    async def load(self) -> None:
        if _record(self.state_dir, "load") >= self.good_loads:
            raise RuntimeError("the sandbox image registry refused the pull")


class HangsInConstructorEnv(EchoEnv):
    """The constructor never returns, and blocks the server's event loop while at it."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        time.sleep(FOREVER_S)


class ExitsMidCallEnv(EchoEnv):
    """Answers `answer_steps` steps, then the process exits in the middle of the next step."""

    def __init__(self, answer_steps: int = 0, **kwargs: Any):
        super().__init__(**kwargs)
        self.answer_steps = answer_steps

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        if self.steps_answered >= self.answer_steps:
            await asyncio.sleep(0.05)  # the call is in flight on the caller's side
            os._exit(7)
        return await super().step(state, assistant_message)


class ExitsAfterAnsweringEnv(EchoEnv):
    """Answers `answer_steps` steps, then exits on its own shortly after the last answer left."""

    def __init__(self, answer_steps: int = 3, exit_delay: float = 0.2, **kwargs: Any):
        super().__init__(**kwargs)
        self.answer_steps, self.exit_delay = answer_steps, exit_delay

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        out = await super().step(state, assistant_message)
        if self.steps_answered == self.answer_steps:
            threading.Timer(self.exit_delay, os._exit, args=(0,)).start()
        return out


class BlocksLoopEnv(EchoEnv):
    """Each step blocks the server's event loop (a synchronous call where an await belonged); with
    `blocking_tasks`, only the steps of tasks below that index do (the rest are healthy echoes)."""

    def __init__(self, block_s: float = FOREVER_S, blocking_tasks: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.block_s = block_s
        self.blocking_tasks = blocking_tasks

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        if self.blocking_tasks is None or state.index < self.blocking_tasks:
            time.sleep(self.block_s)
        return await super().step(state, assistant_message)


class BlocksThreadEnv(EchoEnv):
    """Each step (of the tasks below `blocking_tasks`; of all without it) blocks its thread with a
    synchronous sleep; the rest are healthy echoes. `step` is a plain method, which the server runs in its
    thread pool, as skyrl-gym's are: a hung step holds one of a few threads for good."""

    def __init__(self, block_s: float = FOREVER_S, blocking_tasks: int | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.block_s, self.blocking_tasks = block_s, blocking_tasks

    def _block(self, state: _Episode) -> None:
        if self.blocking_tasks is None or state.index < self.blocking_tasks:
            time.sleep(self.block_s)

    def step(self, state: _Episode, assistant_message: Message) -> StepOut:  # type: ignore[override]
        self._block(state)
        return asyncio.run(EchoEnv.step(self, state, assistant_message))


class BlocksFrameworkLoopEnv(BlocksThreadEnv):
    """`BlocksThreadEnv` whose steps run as coroutines on one event loop of the environment's own, shared by
    every session, as a verifiers adapter runs verifiers (`FrameworkLoop`): a blocking step is a classic
    tool that calls `time.sleep`, and every session's later calls wait behind it."""

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._loop = FrameworkLoop("blocks-framework-loop")

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:  # type: ignore[override]
        return await self._loop.run(self._framework_step(state, assistant_message))

    async def _framework_step(self, state: _Episode, assistant_message: Message) -> StepOut:
        self._block(state)
        return await EchoEnv.step(self, state, assistant_message)


class StepRaisesEnv(EchoEnv):
    """Each step raises an ordinary exception: a bug in environment code (an `env` failure)."""

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        raise KeyError("reward_model_url")


class RecordsClosesEnv(EchoEnv):
    """Healthy; every `close(state)` is recorded in `closes_dir`, so a test counts closes from outside."""

    def __init__(self, closes_dir: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.closes_dir = closes_dir

    async def close(self, state: _Episode) -> None:
        _record(self.closes_dir, "close")


class ScoreRaisesEnv(RecordsClosesEnv):
    """Scoring raises an ordinary exception: a reward model that cannot be reached (`infrastructure`)."""

    async def score(self, state: _Episode) -> ScoreOut:
        raise ConnectionError("reward model at http://reward-model:8000 refused the connection")


class SleepsOnRequestEnv(EchoEnv):
    """Healthy; a step whose assistant message says `sleep:<seconds>` takes that long (awaited)."""

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        content = str(assistant_message.get("content") or "")
        if content.startswith("sleep:"):
            await asyncio.sleep(float(content.removeprefix("sleep:")))
        return await super().step(state, assistant_message)


class BadMessagesEnv(EchoEnv):
    """Each step answers with a message no renderer can take: `kind` is `assistant` (speaks for the
    model), `robot` (an unknown role) or `int_content` (content that is not text)."""

    BAD = {
        "assistant": {"role": "assistant", "content": "I am the model now."},
        "robot": {"role": "robot", "content": "beep"},
        "int_content": {"role": "user", "content": 42},
    }

    def __init__(self, kind: str = "assistant", **kwargs: Any):
        super().__init__(**kwargs)
        self.kind = kind

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        state.turns += 1
        return StepOut(messages=[self.BAD[self.kind]], done=False)


class WrongTypesEnv(EchoEnv):
    """Each step returns a string where a `StepOut` belongs."""

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        return "done"  # type: ignore[return-value]


class BadRewardEnv(EchoEnv):
    """Scores every episode with `reward` given as text: "nan", "inf" or "-inf"."""

    def __init__(self, reward: str = "nan", **kwargs: Any):
        super().__init__(**kwargs)
        self.reward = float(reward)

    async def score(self, state: _Episode) -> ScoreOut:
        return ScoreOut.model_construct(reward=self.reward, components={}, metrics={})


class NeverReturnsEnv(EchoEnv):
    """Each step awaits for ever (the event loop stays free): only its deadline ends it."""

    async def step(self, state: _Episode, assistant_message: Message) -> StepOut:
        await asyncio.sleep(FOREVER_S)
        raise AssertionError("unreachable")
