"""The plane supervises its pool actors: a killed or wedged renderer pool or env pool is restarted within
its restart budget, new rollouts succeed again on the same rollout workers (nothing is looked up by name
or cached past a pool's death), every request is answered exactly once, and the rollouts that were using
the lost pool are re-dispatched under their lease. Real actors and processes (ray.kill, SIGSTOP), real
stand-in server, global deadlines. Each loss scenario runs once per module; its tests read its outcome."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

import psutil
import pytest
import ray
from planes import plane_factory
from waiting import runner, wait_until

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import RolloutPlane
from rollout_actors.plane.pool_supervisor import PoolStatus, SupervisedPool
from rollout_actors.plane.stats import PlaneStats
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig

pytestmark = pytest.mark.slow

MATH = Ref(target="env_actors.examples.math_env:MathEnv")
ECHO = Ref(target="env_actors.faults.envs:EchoEnv")
DEADLINE_S = 150
IN_FLIGHT = 6
SUPERVISION = {"probe_interval_s": 0.2, "hang_timeout_s": 10.0}


run = runner(DEADLINE_S)


plane = plane_factory(
    lanes={"train": 32}, workers=2, hang_timeout_s=10.0, probe_interval_s=0.5, pool_supervision=SUPERVISION
)


def request(standin, latency_s: float = 0.0, task_index: int = 0, env: Ref = MATH) -> RolloutRequest:
    headers = {"X-Standin-Latency": str(latency_s)} if latency_s else {}
    client = ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL, headers=headers)
    return RolloutRequest(
        env=env, task_index=task_index, client=client, sampling=SamplingConfig(max_tokens=32, seed=1)
    )


async def holding(p: RolloutPlane, count: int, within: float = 60) -> None:
    """Until `count` rollouts hold an env session and a renderer lease (they are past dispatch)."""
    env, renderer = p._pools.supervisor(MATH).current(), p._pools.supervisor().current()
    deadline = asyncio.get_running_loop().time() + within
    while (await env.stats.remote()).sessions < count or (await renderer.stats.remote()).slots < count:
        assert asyncio.get_running_loop().time() < deadline, "the rollouts never took sessions and leases"
        await asyncio.sleep(0.05)


@dataclass
class Loss:
    """What one pool loss under load came to."""

    in_flight: list[Result]
    """The rollouts holding sessions and leases when the pool was lost."""
    after: list[Result]
    """Rollouts submitted once the supervisor had a replacement serving."""
    duplicate_answers: int
    stats: PlaneStats
    workers_before: set[str]
    status: PoolStatus


async def lose_pool_under_load(
    standin, which: Callable[[RolloutPlane], SupervisedPool], lose, **config
) -> Loss:
    async with plane(**config) as p:
        await p.submit(request(standin))
        assert (await p.next_result(timeout=60)).kind == "ok"
        workers = {w.name for w in p.stats().workers}
        pool = which(p)
        in_flight = [await p.submit(request(standin, 1.5, i)) for i in range(IN_FLIGHT)]
        await holding(p, IN_FLIGHT)
        lose(pool.current())
        await wait_until(lambda: pool.incarnation == 2 and pool.state == "serving", 60)
        after = [await p.submit(request(standin, 0.0, i)) for i in range(IN_FLIGHT)]
        answers = [await p.next_result(timeout=60) for _ in range(2 * IN_FLIGHT)]
        by_id = {r.request_id: r for r in answers}
        return Loss(
            in_flight=[by_id[i] for i in in_flight if i in by_id],
            after=[by_id[i] for i in after if i in by_id],
            duplicate_answers=len(answers) - len(by_id),
            stats=p.stats(),
            workers_before=workers,
            status=pool.status(),
        )


def kill(handle) -> None:
    ray.kill(handle, no_restart=True)


@pytest.fixture(scope="module")
def renderer_pool_killed(ray_session, standin) -> Loss:
    return run(lose_pool_under_load(standin, lambda p: p._pools.supervisor(), kill))


@pytest.fixture(scope="module")
def env_pool_killed(ray_session, standin) -> Loss:
    return run(lose_pool_under_load(standin, lambda p: p._pools.supervisor(MATH), kill))


@pytest.fixture(scope="module")
def env_pool_frozen(ray_session, standin) -> tuple[Loss, list[int]]:
    frozen: list[int] = []

    def freeze(handle) -> None:
        frozen.append(ray.get(handle.health.remote(), timeout=10).pid)
        os.kill(frozen[-1], signal.SIGSTOP)  # frozen: Ray alone would leave every call to it pending

    async def scenario() -> Loss:
        settings = {**SUPERVISION, "hang_timeout_s": 3.0}
        loss = await lose_pool_under_load(
            standin, lambda p: p._pools.supervisor(MATH), freeze, pool_supervision=settings
        )
        # Killed by its supervisor: Ray ends a process too frozen to exit by itself a few seconds
        # later (SIGKILL), and the env servers it owned with it.
        await wait_until(lambda: not any(psutil.pid_exists(pid) for pid in frozen), 30)
        return loss

    try:
        return run(scenario()), frozen
    finally:
        for pid in frozen:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def check_served_again(loss: Loss) -> None:
    assert len(loss.in_flight) == len(loss.after) == IN_FLIGHT and loss.duplicate_answers == 0  # once each
    assert loss.stats.duplicates_dropped == 0
    assert all(r.kind == "ok" for r in loss.after), [(r.kind, r.error) for r in loss.after]
    # The same rollout workers serve the new incarnation: none was replaced, none kept a stale handle.
    assert {w.name for w in loss.stats.workers} == loss.workers_before
    assert loss.stats.workers_lost == 0
    assert loss.status.state == "serving" and loss.status.incarnation == 2 and loss.status.restarts == 1


def check_redispatched(loss: Loss) -> None:
    assert all(r.kind == "ok" for r in loss.in_flight), [(r.kind, r.error) for r in loss.in_flight]
    assert all(r.attempts >= 2 for r in loss.in_flight)
    assert loss.stats.redispatched >= IN_FLIGHT


def test_killed_renderer_pool_is_restarted_and_new_rollouts_succeed_on_the_same_workers(renderer_pool_killed):
    check_served_again(renderer_pool_killed)
    assert renderer_pool_killed.status.last_loss.startswith("died: ")
    assert renderer_pool_killed.stats.pools[0].pool == "renderer pool"


def test_rollouts_using_a_killed_renderer_pool_are_redispatched_under_their_lease(renderer_pool_killed):
    check_redispatched(renderer_pool_killed)


def test_killed_env_pool_is_restarted_and_new_rollouts_succeed_on_the_same_workers(env_pool_killed):
    check_served_again(env_pool_killed)
    assert env_pool_killed.status.last_loss.startswith("died: ")


def test_rollouts_using_a_killed_env_pool_are_redispatched_under_their_lease(env_pool_killed):
    check_redispatched(env_pool_killed)


def test_wedged_env_pool_is_killed_and_restarted_after_its_hang_timeout(env_pool_frozen):
    loss, frozen = env_pool_frozen
    check_served_again(loss)
    assert (
        loss.status.last_loss.startswith("wedged: no sign of life")
        and "hang_timeout_s 3 s" in loss.status.last_loss
    )
    assert frozen and not any(psutil.pid_exists(pid) for pid in frozen)
    # In flight, each rollout ended exactly once, whichever way (its env servers outlived the frozen pool
    # until Ray killed it, so a step may still have been answered).
    assert {r.kind for r in loss.in_flight} <= {"ok", "infrastructure"}


def test_a_pool_past_its_restart_budget_answers_at_once_and_says_why(ray_session, standin):
    async def scenario():
        budget = {**SUPERVISION, "restart": {"max_restarts": 0, "window_s": 300}}
        async with plane(pool_supervision=budget) as p:
            await p.submit(request(standin, env=ECHO))
            assert (await p.next_result(timeout=60)).kind == "ok"
            pool = p._pools.supervisor(ECHO)
            kill(pool.current())
            await wait_until(lambda: pool.state == "failed", 30)
            await p.submit(request(standin, env=ECHO))
            return await p.next_result(timeout=30), pool.status()

    result, status = run(scenario())
    assert result.kind == "infrastructure" and result.error.type == "PoolUnavailable"
    assert "restart budget spent (0 restarts in 300 s)" in result.error.message
    assert status.state == "failed" and "died" in result.error.message
