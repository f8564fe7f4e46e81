"""The finishing step: `step(..., score_if_done=True)` steps, and when the step ends the episode, scores it
and ends the session on its env worker in the same call. Real pools, real EnvServer processes; the pool
handle is wrapped in a spy that counts the calls sent through it (they still go to Ray): steps and score
go to the worker directly, so the pool sees only placement, the handle lookup and the end of a session."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import ray
from env_pools import call_started, env_pool
from waiting import eventually, run

from env_actors.pool import EnvPoolConfig
from env_actors.session import EnvCallFailed, EnvSession
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.rollout.loop import run_rollout
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

pytestmark = pytest.mark.usefixtures("ray_session")

RECORDS_CLOSES = "env_actors.faults.envs:RecordsClosesEnv"
SCORE_RAISES = "env_actors.faults.envs:ScoreRaisesEnv"


def assistant(content: str = "ok") -> dict:
    return {"role": "assistant", "content": content}


class PoolSpy:
    """The real EnvPool handle, counting the calls sent through it by method name."""

    def __init__(self, handle: Any):
        self.handle = handle
        self.sent: Counter[str] = Counter()

    def __getattr__(self, method: str) -> Any:
        target = getattr(self.handle, method)

        def remote(*args: Any, **kwargs: Any) -> Any:
            self.sent[method] += 1
            return target.remote(*args, **kwargs)

        return SimpleNamespace(remote=remote)


def closes(directory: Path) -> int:
    """How many times the environment's `close(state)` ran (RecordsClosesEnv writes one file each)."""
    return len(list(directory.iterdir())) if directory.exists() else 0


async def pool_sessions(pool) -> int:
    return (await pool.stats.remote()).sessions


async def worker_sessions(worker: str) -> int:
    return (await ray.get_actor(worker).health.remote()).sessions


@pytest.mark.timeout(60)
def test_a_done_step_with_score_if_done_returns_the_score_and_ends_the_session_in_the_same_call(tmp_path):
    async def body():
        async with env_pool(RECORDS_CLOSES, turns=1, closes_dir=str(tmp_path)) as pool:
            spy = PoolSpy(pool)
            session = await EnvSession.open(spy, task_index=0, timeout=10)
            assert await worker_sessions(session.server_name) == 1

            out = await session.step(assistant(), timeout=10, score_if_done=True)

            assert out.done and out.score is not None
            assert out.score.reward == 1.0 and out.score.components == {"finished": 1.0}
            assert session.closed
            await eventually(lambda: _no_sessions(pool), 10)  # forgotten by the pool without a close call
            assert [w.sessions for w in (await pool.stats.remote()).servers] == [0]
            assert await worker_sessions(session.server_name) == 0  # the EnvServer dropped the state
            assert closes(tmp_path) == 1  # the environment's close ran, once

            await session.close()
            with pytest.raises(EnvCallFailed) as late:
                await session.score(timeout=10)
            assert late.value.kind == "caller" and late.value.failure.type == "EnvSessionClosed"
            assert spy.sent == Counter(place_many=1, forget_many=1)  # no close, no score
            assert closes(tmp_path) == 1

    run(body(), 50)


@pytest.mark.timeout(60)
def test_a_step_that_is_not_done_carries_no_score_and_leaves_the_session_open(tmp_path):
    async def body():
        async with env_pool(RECORDS_CLOSES, turns=2, closes_dir=str(tmp_path)) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)

            out = await session.step(assistant(), timeout=10, score_if_done=True)

            assert not out.done and out.score is None and out.messages
            assert not session.closed
            assert await pool_sessions(pool) == 1 and await worker_sessions(session.server_name) == 1
            assert closes(tmp_path) == 0
            assert (await session.score(timeout=10)).reward == 0.0  # the session still answers
            await session.close()
            assert await pool_sessions(pool) == 0 and closes(tmp_path) == 1

    run(body(), 50)


@pytest.mark.timeout(60)
def test_without_the_flag_a_done_step_is_just_a_step():
    async def body():
        async with env_pool(RECORDS_CLOSES, turns=1) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            out = await session.step(assistant(), timeout=10)
            assert out.done and out.score is None and not session.closed
            assert await pool_sessions(pool) == 1
            assert (await session.score(timeout=10)).reward == 1.0
            await session.close()
            await eventually(lambda: _no_sessions(pool), 10)

    run(body(), 50)


@pytest.mark.timeout(60)
def test_a_raising_score_fails_the_finishing_step_as_infrastructure_and_close_still_ends_it(tmp_path):
    async def body():
        async with env_pool(SCORE_RAISES, turns=1, closes_dir=str(tmp_path)) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)

            with pytest.raises(EnvCallFailed) as failed:
                await session.step(assistant(), timeout=10, score_if_done=True)

            assert failed.value.kind == "env" and failed.value.failure.type == "ConnectionError"
            assert "reward-model:8000" in failed.value.failure.traceback
            assert "in score" in failed.value.failure.traceback  # the environment's own frame
            assert not session.closed
            assert await pool_sessions(pool) == 1  # the pool did not forget it
            assert await worker_sessions(session.server_name) == 1 and closes(tmp_path) == 0

            await session.close()
            await eventually(lambda: _no_sessions(pool), 10)
            assert await worker_sessions(session.server_name) == 0 and closes(tmp_path) == 1

    run(body(), 50)


@pytest.mark.timeout(60)
def test_the_finishing_step_gets_the_step_plus_the_score_deadline():
    async def body():
        # A 1 s step misses a 0.5 s step deadline alone, and fits in 0.5 s + 5 s when it also scores.
        config = EnvPoolConfig(step_timeout_s=0.5, score_timeout_s=5.0)
        async with env_pool(RECORDS_CLOSES, config, turns=1, step_delay=1.0) as pool:
            plain = await EnvSession.open(pool, task_index=0, timeout=10)
            with pytest.raises(EnvCallFailed) as late:
                await plain.step(assistant(), timeout=30)
            assert late.value.failure.type == "EnvDeadline"
            await plain.close()

            finishing = await EnvSession.open(pool, task_index=1, timeout=10)
            out = await finishing.step(assistant(), timeout=30, score_if_done=True)
            assert out.score is not None and out.score.reward == 1.0
            await eventually(lambda: _no_sessions(pool), 10)

    run(body(), 50)


@pytest.mark.timeout(60)
def test_worker_killed_during_the_finishing_step_fails_it_as_infrastructure():
    async def body():
        async with env_pool(
            RECORDS_CLOSES, EnvPoolConfig(probe_interval_s=0.2), turns=1, step_delay=30.0
        ) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            pid = next(w.pid for w in (await pool.stats.remote()).servers if w.name == session.server_name)
            step = asyncio.ensure_future(session.step(assistant(), timeout=60, score_if_done=True))
            await call_started(session.server_name)
            os.kill(pid, signal.SIGKILL)
            with pytest.raises(EnvCallFailed) as failed:
                await step
            assert failed.value.kind == "infrastructure" and failed.value.failure.type == "EnvServerLost"
            assert failed.value.server_exit and not session.closed
            await session.close()
            await eventually(lambda: _no_sessions(pool), 10)
            await eventually(lambda: _ready(pool), 20)  # replaced as after any death

    run(body(), 50)


async def _no_sessions(pool) -> bool:
    return await pool_sessions(pool) == 0


async def _ready(pool) -> bool:
    return (await pool.stats.remote()).ready >= 1


# ------------------------------------------------------------------------------------ the rollout


class OneEnvPool:
    """A `PoolDirectory` with one env pool and no renderer (chat mode needs none)."""

    def __init__(self, pool: Any):
        self.pool = pool

    def renderer_pool(self) -> Any:
        raise AssertionError("a chat-mode rollout asked for a renderer")

    def env_pool(self, request: RolloutRequest) -> Any:
        return self.pool


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "max_turns, reward, sent",
    [
        (
            4,
            1.0,
            Counter(place_many=1, forget_many=1),
        ),  # done on turn 2: the step scored and ended it
        (
            1,
            0.0,
            Counter(place_many=1, end_session=1),
        ),  # out of turns: scored directly, closed as before
    ],
    ids=["done", "out-of-turns"],
)
def test_rollout_reward_comes_from_the_finishing_step_or_from_score_when_turns_run_out(
    standin, tmp_path, max_turns, reward, sent
):
    async def body():
        async with env_pool(RECORDS_CLOSES, turns=2, closes_dir=str(tmp_path)) as pool:
            spy = PoolSpy(pool)
            request = RolloutRequest(
                env=Ref(target=RECORDS_CLOSES),
                task_index=0,
                client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL),
                sampling=SamplingConfig(max_tokens=16, seed=7),
                mode="chat",
                max_turns=max_turns,
                timeout_s=60,
            )
            result = await run_rollout(request, OneEnvPool(spy))
            assert result.kind == "ok", result.error
            assert result.reward == reward and result.components == {"finished": reward}
            assert len(result.turns) == min(max_turns, 2)
            await eventually(lambda: _no_sessions(pool), 10)
            assert spy.sent == sent and closes(tmp_path) == 1

    run(body(), 100)
