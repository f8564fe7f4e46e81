"""EnvPool + EnvSession on real actors, healthy paths: episodes, dispatch, deadlines, caller errors,
cancellation, elastic size. The fault cases live in test_env_faults.py."""

from __future__ import annotations

import asyncio
import json

import pytest
import ray
from env_pools import call_started, env_pool
from waiting import eventually, run

from env_actors.interface import EnvCall
from env_actors.pool import EnvPoolConfig, get_env_pool
from env_actors.session import EnvCallFailed, EnvSession

pytestmark = pytest.mark.usefixtures("ray_session")

ECHO = "env_actors.faults.envs:EchoEnv"


def assistant(content, tool_calls=None):
    return {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}


@pytest.mark.timeout(60)
def test_math_episode_through_the_pool_scores_the_boxed_answer():
    async def body():
        async with env_pool("env_actors.examples.math_env:MathEnv") as pool:
            assert await EnvSession.num_tasks(pool, 5) == 300
            async with await EnvSession.open(pool, task_index=0, timeout=10) as session:
                assert session.messages[-1]["role"] == "user" and session.tools is None
                out = await session.step(assistant("\\boxed{4}"), timeout=10)
                assert out.done
                score = await session.score(timeout=10)
            assert score.reward == 1.0 and score.components == {"correct": 1.0, "format": 1.0}
            assert get_env_pool((await pool.stats.remote()).name) is not None

    run(body(), 50)


@pytest.mark.timeout(60)
def test_calculator_multi_turn_episode_through_the_pool():
    async def body():
        async with env_pool("env_actors.examples.calculator_env:CalculatorEnv", seed=2) as pool:
            task = {"expression": "(17 * 23) + 45"}
            session = await EnvSession.open(pool, task=task, timeout=10)
            try:
                call = {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "calculator", "arguments": json.dumps(task)},
                }
                out = await session.step(assistant(None, [call]), timeout=10)
                assert not out.done and out.messages == [
                    {"role": "tool", "tool_call_id": "c1", "content": "436"}
                ]
                out = await session.step(assistant("So \\boxed{436}."), timeout=10)
                assert out.done
                score = await session.score(timeout=10)
            finally:
                await session.close()
            assert score.reward == 1.0 and score.components == {"correct": 1.0, "used_tool": 1.0}

    run(body(), 50)


@pytest.mark.timeout(60)
def test_caller_mistakes_fail_as_caller_and_env_bugs_as_infrastructure():
    async def body():
        async with env_pool("env_actors.faults.envs:StepRaisesEnv") as pool:
            with pytest.raises(EnvCallFailed) as bad_index:
                await EnvSession.open(pool, task_index=10_000, timeout=10)
            assert bad_index.value.kind == "caller" and bad_index.value.failure.type == "CallerError"
            with pytest.raises(EnvCallFailed) as bad_task:
                await EnvSession.open(pool, task={"index": "seven"}, timeout=10)
            assert bad_task.value.kind == "caller"

            session = await EnvSession.open(pool, task_index=1, timeout=10)
            with pytest.raises(EnvCallFailed) as bug:
                await session.step(assistant("hi"), timeout=10)
            assert bug.value.kind == "env" and bug.value.failure.type == "KeyError"
            assert "reward_model_url" in bug.value.failure.traceback
            await session.close()
            await session.close()  # idempotent
            with pytest.raises(EnvCallFailed) as closed:
                await session.step(assistant("again"), timeout=10)
            assert closed.value.kind == "caller"

    run(body(), 50)


@pytest.mark.timeout(60)
def test_a_call_past_its_deadline_fails_naming_it_and_the_worker_keeps_serving():
    async def body():
        config = EnvPoolConfig(step_timeout_s=0.5)
        async with env_pool(ECHO, config, step_delay=5.0) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            with pytest.raises(EnvCallFailed) as late:
                await session.step(assistant("hi"), timeout=30)  # the pool's 0.5 s wins
            assert late.value.kind == "env" and late.value.failure.type == "EnvDeadline"
            assert "0.5 s deadline" in late.value.failure.message
            stats = await pool.stats.remote()
            assert stats.ready == 1 and stats.deaths == 0
            assert (await session.score(timeout=10)).reward == 0.0
            await session.close()

    run(body(), 50)


@pytest.mark.timeout(60)
def test_new_sessions_go_to_the_least_busy_ready_worker():
    async def body():
        async with env_pool(ECHO, EnvPoolConfig(min_servers=2, max_servers=2)) as pool:
            await eventually(lambda: _ready(pool, 2), 20)
            sessions = [await EnvSession.open(pool, task_index=i, timeout=10) for i in range(4)]
            placed = [s.server_name for s in sessions]
            assert len(set(placed)) == 2 and all(placed.count(w) == 2 for w in placed)
            for s in sessions:
                await s.close()

    run(body(), 50)


@pytest.mark.timeout(60)
def test_closing_or_cancelling_a_session_ends_it_on_its_worker():
    async def body():
        async with env_pool(ECHO, step_delay=30.0) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            worker = ray.get_actor(session.server_name)
            assert (await worker.health.remote()).sessions == 1

            async def rollout():
                try:
                    await session.step(assistant("thinking"), timeout=60)
                finally:
                    await session.close()

            task = asyncio.ensure_future(rollout())
            await call_started(session.server_name)  # cancelled mid-step, not before the step left
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await eventually(lambda: _worker_sessions(worker, 0), 5)
            assert (await pool.stats.remote()).sessions == 0
            assert await eventually(lambda: _nothing_in_flight(pool), 5)  # the step was cancelled too

    run(body(), 50)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_pool_grows_with_open_sessions_and_shrinks_back_when_idle():
    async def body():
        config = EnvPoolConfig(
            min_servers=1, max_servers=2, multiplex=2, grow_fraction=0.5, idle_timeout_s=0.5
        )
        async with env_pool(ECHO, config) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            await eventually(lambda: _ready(pool, 2), 20)  # 1 session >= 0.5 x 1 worker x 2
            stats = await pool.stats.remote()
            assert stats.spawns == 2 and stats.restarts_left == 2  # growth spends the restart budget
            await session.close()
            await eventually(lambda: _ready(pool, 1, exact=True), 20)
            assert (await pool.stats.remote()).deaths == 0

    run(body(), 50)


@pytest.mark.timeout(60)
def test_a_session_its_owner_abandoned_is_closed_after_the_idle_timeout():
    async def body():
        async with env_pool(ECHO, EnvPoolConfig(session_idle_timeout_s=0.5)) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            worker = ray.get_actor(session.server_name)
            assert await eventually(lambda: _worker_sessions(worker, 0), 10)
            assert (await pool.stats.remote()).sessions == 0

    run(body(), 50)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_session_stepping_directly_on_its_worker_is_not_idle_to_the_pool():
    """Steps bypass the pool; its reaper must ask the worker before calling a session abandoned."""

    async def body():
        async with env_pool(ECHO, EnvPoolConfig(session_idle_timeout_s=1.0), turns=100) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            assert session.server is not None  # steps go straight to the worker
            for _ in range(12):  # 3.6 s of steps, more than three idle timeouts by the pool's own clock
                await session.step({"role": "assistant", "content": "again"}, timeout=10)
                await asyncio.sleep(0.3)
            assert (await pool.stats.remote()).sessions == 1
            worker = ray.get_actor(session.server_name)
            assert await eventually(lambda: _worker_sessions(worker, 0), 10)  # abandoned now: reaped
            assert (await pool.stats.remote()).sessions == 0

    run(body(), 50)


@pytest.mark.timeout(60)
def test_a_slow_step_does_not_hold_back_a_fast_one_sent_in_the_same_batch():
    """Steps to one worker in one tick travel in one `call_many`; each answers on its own time."""

    async def body():
        async with env_pool("env_actors.faults.envs:SleepsOnRequestEnv", turns=5) as pool:
            slow, fast = [await EnvSession.open(pool, task_index=i, timeout=10) for i in range(2)]
            assert slow.server_name == fast.server_name
            # Both in one tick, so one batch: the fast answer must not wait for the 2 s step.
            slow_step = asyncio.ensure_future(
                slow.step({"role": "assistant", "content": "sleep:2.0"}, timeout=10)
            )
            fast_step = asyncio.ensure_future(fast.step({"role": "assistant", "content": "now"}, timeout=10))
            await fast_step
            assert not slow_step.done()
            await slow_step
            for session in (slow, fast):
                await session.close()

    run(body(), 50)


@pytest.mark.timeout(60)
def test_a_reset_that_arrives_after_its_session_was_closed_does_not_start_it():
    """A cancelled opener closes its placement; its reset may still be on the way to the worker."""

    async def body():
        async with env_pool(ECHO) as pool:
            (placed,) = await pool.place_many.remote(["envsess-late"])
            assert placed.success and (await pool.stats.remote()).sessions == 1
            await pool.end_session.remote("envsess-late", 5.0)  # the opener gave up: the pool ends it first
            worker = placed.value["handle"]
            (reply,) = await worker.call_many.remote([EnvCall("reset", "envsess-late", (0, None), 5.0)])
            answer = reply.response
            assert not answer.success and answer.kind == "caller" and "closed before" in answer.error.message
            assert (await worker.health.remote()).sessions == 0
            assert (await pool.stats.remote()).sessions == 0

    run(body(), 50)


async def _ready(pool, count: int, exact: bool = False) -> bool:
    ready = (await pool.stats.remote()).ready
    return ready == count if exact else ready >= count


async def _worker_sessions(worker, count: int) -> bool:
    return (await worker.health.remote()).sessions == count


async def _nothing_in_flight(pool) -> bool:
    return all(w.inflight == 0 for w in (await pool.stats.remote()).servers)
