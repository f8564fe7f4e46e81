"""One test per fault-table case (scripts/fault_table.py), on real actors and real processes: SIGKILL,
SIGSTOP, ray.kill, os._exit, blocked event loops. They assert behaviour, never timing; each carries its
own deadline so a regression to "a stalled future" fails fast."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import suppress

import pytest
import ray
from env_pools import call_started, env_pool, pool_name, widened
from waiting import eventually, run

from env_actors.pool import EnvPoolConfig, EnvStartupError, start_env_pool
from env_actors.session import EnvCallFailed, EnvSession
from rollout_actors.kernel.supervision import RestartIntensity
from rollout_actors.wire import Ref

# every test here starts real actors or servers (a plane, a pool, a server process): seconds each
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

ECHO = "env_actors.faults.envs:EchoEnv"
PROBES = dict(probe_interval_s=0.2)
"""Frequent probes, so deaths without a call in flight are noticed quickly."""
WEDGE = dict(hang_timeout_s=2.0, probe_interval_s=0.2, probe_timeout_s=0.5)
"""Wedge detection in seconds (production waits longer); only for the tests that need it, so a worker
starved of CPU on a busy test machine is not mistaken for a wedged one elsewhere."""


def assistant(content: str = "ok") -> dict:
    return {"role": "assistant", "content": content}


async def ready_count(pool, count: int) -> bool:
    return (await pool.stats.remote()).ready >= count


async def worker_pid(pool, worker: str) -> int:
    return next(w.pid for w in (await pool.stats.remote()).servers if w.name == worker)


async def full_episode(pool) -> float:
    async with await EnvSession.open(pool, task_index=0, timeout=10) as session:
        while not (await session.step(assistant(), timeout=10)).done:
            pass
        return (await session.score(timeout=10)).reward


def no_actor_named(prefix: str) -> bool:
    return not [n for n in ray.util.list_named_actors() if n.startswith(prefix)]


# ------------------------------------------------------------------------------------- startup


@pytest.mark.timeout(60)
def test_healthy_pool_serves_as_soon_as_start_returns():
    async def body():
        async with env_pool(ECHO, EnvPoolConfig()) as pool:
            stats = await pool.stats.remote()
            assert stats.ready == 1 and stats.num_tasks == 16
            assert await full_episode(pool) == 1.0

    run(body(), 50)


@pytest.mark.timeout(60)
def test_environment_that_fails_to_import_raises_with_its_traceback():
    async def body():
        with pytest.raises(EnvStartupError) as failed:
            await start_env_pool(
                pool_name(), Ref(target="env_actors.faults.broken_import:BrokenImportEnv"), widened()
            )
        text = str(failed.value)
        assert "ray_rollouts_missing_dependency" in text and "broken_import.py" in text
        assert failed.value.failure.type == "CallerError"

    run(body(), 50)


@pytest.mark.timeout(60)
def test_environment_whose_load_raises_fails_startup_with_its_traceback():
    async def body():
        with pytest.raises(EnvStartupError) as failed:
            await start_env_pool(pool_name(), Ref(target="env_actors.faults.envs:LoadRaisesEnv"), widened())
        assert "train-00000-of-00001.parquet" in str(failed.value) and "in load" in str(failed.value)

    run(body(), 50)


@pytest.mark.timeout(60)
def test_environment_that_dies_on_every_load_fails_after_the_budget_without_a_respawn_loop(tmp_path):
    async def body():
        config = EnvPoolConfig(restart=RestartIntensity(max_restarts=2, window_s=60))
        env = Ref(target="env_actors.faults.envs:DiesOnLoadEnv", config={"attempts_dir": str(tmp_path)})
        with pytest.raises(EnvStartupError) as failed:
            await start_env_pool(pool_name(), env, widened(config), 30)
        assert failed.value.failure.type == "EnvServerDied" and "3 time(s)" in str(failed.value)
        await asyncio.sleep(1.0)  # a respawn loop would keep adding attempts
        assert len(list(tmp_path.iterdir())) == 3  # the first spawn + 2 restarts, then nothing

    run(body(), 50)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "target, config, symptom",
    [
        ("env_actors.faults.envs:HangsInConstructorEnv", {}, "stuck in phase 'constructing'"),
        (ECHO, {"resources": {"never_granted": 1.0}}, "never granted"),
    ],
    ids=["constructor-hangs", "resources-never-granted"],
)
def test_worker_that_never_gets_ready_is_reported_and_killed_not_left_pending(target, config, symptom):
    async def body():
        name = pool_name()
        with pytest.raises(EnvStartupError) as failed:
            await start_env_pool(
                name, Ref(target=target), widened(EnvPoolConfig(**config)), ready_timeout=2.0
            )
        assert failed.value.failure.type == "EnvReadinessTimeout" and symptom in str(failed.value)
        assert await eventually(lambda: _async(no_actor_named(name)), 10)

    run(body(), 50)


async def _async(value):
    return value


# ---------------------------------------------------------------------------------- mid-serve


@pytest.mark.timeout(60)
def test_worker_killed_with_a_call_in_flight_fails_that_call_and_is_replaced():
    async def body():
        async with env_pool(ECHO, EnvPoolConfig(**PROBES), step_delay=30.0) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            step = asyncio.ensure_future(session.step(assistant(), timeout=60))
            await call_started(session.server_name)
            os.kill(await worker_pid(pool, session.server_name), signal.SIGKILL)
            with pytest.raises(EnvCallFailed) as failed:
                await step
            assert failed.value.kind == "infrastructure" and failed.value.failure.type == "EnvServerLost"
            assert failed.value.server_exit
            await session.close()
            await eventually(lambda: ready_count(pool, 1), 20)
            stats = await pool.stats.remote()
            assert stats.deaths == 1 and stats.spawns == 2
            replacement = await EnvSession.open(pool, task_index=1, timeout=10)
            assert replacement.server_name != session.server_name
            await replacement.close()

    run(body(), 50)


@pytest.mark.timeout(60)
def test_frozen_worker_is_detected_as_wedged_its_calls_fail_and_it_is_replaced():
    async def body():
        async with env_pool(ECHO, EnvPoolConfig(**WEDGE), step_delay=30.0) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            pid = await worker_pid(pool, session.server_name)
            step = asyncio.ensure_future(session.step(assistant(), timeout=60))
            await call_started(session.server_name)
            os.kill(pid, signal.SIGSTOP)
            try:
                with pytest.raises(EnvCallFailed) as failed:
                    await step
                assert failed.value.kind == "infrastructure" and "wedged" in failed.value.server_exit
                await eventually(lambda: ready_count(pool, 1), 20)
                replacement = await EnvSession.open(pool, task_index=1, timeout=10)
                assert replacement.server_name != session.server_name
                await replacement.close()
            finally:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    run(body(), 50)


@pytest.mark.timeout(60)
def test_worker_whose_event_loop_is_blocked_is_retired_as_wedged():
    async def body():
        async with env_pool(
            "env_actors.faults.envs:BlocksLoopEnv", EnvPoolConfig(**WEDGE), block_s=30.0
        ) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            with pytest.raises(EnvCallFailed) as failed:
                await session.step(assistant(), timeout=60)
            assert "wedged" in failed.value.server_exit
            await eventually(lambda: ready_count(pool, 1), 20)

    run(body(), 50)


@pytest.mark.timeout(60)
def test_session_whose_worker_is_killed_mid_episode_fails_as_infrastructure_others_finish():
    async def body():
        async with env_pool(ECHO, EnvPoolConfig(min_servers=2, max_servers=2, **PROBES), turns=3) as pool:
            await eventually(lambda: ready_count(pool, 2), 20)
            doomed = await EnvSession.open(pool, task_index=0, timeout=10)
            survivor = await EnvSession.open(pool, task_index=1, timeout=10)
            assert doomed.server_name != survivor.server_name
            assert not (await doomed.step(assistant(), timeout=10)).done
            assert not (await survivor.step(assistant(), timeout=10)).done
            ray.kill(ray.get_actor(doomed.server_name))
            # ray.kill is asynchronous: a step sent at once may still be answered. Wait for the death.
            await eventually(lambda: _deaths(pool, 1), 10)
            with pytest.raises(EnvCallFailed) as failed:
                await doomed.step(assistant(), timeout=10)
            assert failed.value.kind == "infrastructure"
            while not (await survivor.step(assistant(), timeout=10)).done:
                pass
            assert (await survivor.score(timeout=10)).reward == 1.0
            await doomed.close()
            await survivor.close()

    run(body(), 50)


@pytest.mark.timeout(60)
def test_worker_that_answered_then_exited_keeps_its_answers():
    async def body():
        env = "env_actors.faults.envs:ExitsAfterAnsweringEnv"
        async with env_pool(env, EnvPoolConfig(**PROBES), answer_steps=3, turns=5) as pool:
            sessions = [await EnvSession.open(pool, task_index=i, timeout=10) for i in range(3)]
            answers = await asyncio.gather(*(s.step(assistant(), timeout=10) for s in sessions))
            assert [a.done for a in answers] == [False] * 3  # all three answered, none relabelled
            await eventually(lambda: _deaths(pool, 1), 10)
            with pytest.raises(EnvCallFailed) as lost:
                await sessions[0].step(assistant(), timeout=10)
            assert lost.value.kind == "infrastructure" and lost.value.failure.type == "EnvServerLost"
            for s in sessions:
                await s.close()

    run(body(), 50)


async def _deaths(pool, count: int) -> bool:
    return (await pool.stats.remote()).deaths >= count


@pytest.mark.timeout(60)
def test_with_no_live_worker_calls_fail_at_once_instead_of_queueing():
    async def body():
        config = EnvPoolConfig(restart=RestartIntensity(max_restarts=0, window_s=60), **PROBES)
        async with env_pool(ECHO, config) as pool:
            session = await EnvSession.open(pool, task_index=0, timeout=10)
            ray.kill(ray.get_actor(session.server_name))
            await eventually(lambda: _deaths(pool, 1), 10)
            with pytest.raises(EnvCallFailed) as failed:
                await EnvSession.open(pool, task_index=0, timeout=60)
            assert failed.value.kind == "infrastructure" and failed.value.failure.type == "NoLiveEnvServer"
            assert await eventually(lambda: _budget_denied(pool), 5)

    run(body(), 50)


async def _budget_denied(pool) -> bool:
    return (await pool.stats.remote()).budget_denials >= 1


@pytest.mark.timeout(60)
def test_sustained_load_after_the_budget_is_spent_does_not_scale_up():
    async def body():
        config = EnvPoolConfig(
            max_servers=3,
            multiplex=2,
            grow_fraction=0.5,
            restart=RestartIntensity(max_restarts=1, window_s=60),
            **PROBES,
        )
        async with env_pool(ECHO, config) as pool:
            first = (await pool.stats.remote()).servers[0].name
            ray.kill(ray.get_actor(first))  # the replacement spends the only restart
            await eventually(lambda: _deaths(pool, 1), 10)
            await eventually(lambda: ready_count(pool, 1), 20)
            sessions = [await EnvSession.open(pool, task_index=i, timeout=10) for i in range(6)]
            await asyncio.sleep(1.0)  # several supervision ticks under load
            stats = await pool.stats.remote()
            assert stats.spawns == 2 and stats.ready == 1 and stats.budget_denials >= 1
            assert len({s.server_name for s in sessions}) == 1
            for s in sessions:
                await s.close()

    run(body(), 50)


@pytest.mark.timeout(60)
def test_spawn_failure_mid_serve_leaves_the_pool_one_short_and_the_supervisor_alive(tmp_path):
    async def body():
        config = EnvPoolConfig(
            min_servers=2, max_servers=2, restart=RestartIntensity(max_restarts=1, window_s=60), **PROBES
        )
        env = "env_actors.faults.envs:FlakyLoadEnv"
        async with env_pool(env, config, state_dir=str(tmp_path), good_loads=2) as pool:
            await eventually(lambda: ready_count(pool, 2), 20)
            survivor = await EnvSession.open(pool, task_index=0, timeout=10)
            doomed = next(
                w.name for w in (await pool.stats.remote()).servers if w.name != survivor.server_name
            )
            ray.kill(ray.get_actor(doomed))
            await eventually(lambda: _spawn_failures(pool, 1), 20)
            stats = await pool.stats.remote()
            assert stats.ready == 1 and stats.starting == 0 and stats.deaths == 1
            while not (await survivor.step(assistant(), timeout=10)).done:
                pass
            assert (await survivor.score(timeout=10)).reward == 1.0
            await survivor.close()
            assert await full_episode(pool) == 1.0

    run(body(), 50)


async def _spawn_failures(pool, count: int) -> bool:
    return (await pool.stats.remote()).spawn_failures >= count
