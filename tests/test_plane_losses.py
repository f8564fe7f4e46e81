"""Parts of ours lost under running rollouts: what a lost rollout worker held is released by its owners at
once, a rollout whose env server or renderer was lost is re-dispatched under its lease (bounded by
`max_dispatches`), and load alone never kills a worker. Real actors and processes, global deadlines."""

from __future__ import annotations

import copy
import os
import signal

import pytest
import ray
from planes import plane_factory
from waiting import eventually, runner, wait_until

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

# every test here starts real actors or servers (a plane, a pool, a server process): seconds each
pytestmark = pytest.mark.slow

CALC = Ref(target="env_actors.examples.calculator_env:CalculatorEnv")
DEADLINE_S = 180


run = runner(DEADLINE_S)


plane = plane_factory(lanes={"train": 64, "eval": 1}, workers=2, hang_timeout_s=5.0, probe_interval_s=0.5)


def request(standin, index: int, env: Ref = CALC, latency_s: float = 0.0, **overrides) -> RolloutRequest:
    client = ClientConfig(
        base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Latency": str(latency_s)}
    )
    fields = dict(
        env=env, task_index=index, client=client, sampling=SamplingConfig(max_tokens=64, seed=index)
    )
    fields.update(overrides)
    return RolloutRequest(**fields)


async def held(p: RolloutPlane, env: Ref) -> dict[str, int]:
    """Env sessions (as the pool and as its servers count them) and renderer leases the plane holds."""
    stats = await ray.get_actor(p.names.env_pool(env)).stats.remote()
    server_sessions = 0
    for server in stats.servers:
        server_sessions += (await ray.get_actor(server.name).health.remote()).sessions
    renderer = await ray.get_actor(p.names.renderer_pool).stats.remote()
    return {"pool_sessions": stats.sessions, "server_sessions": server_sessions, "leases": renderer.slots}


async def named(name: str):
    """The named actor, once it exists (pools start on their first request)."""

    async def lookup():
        try:
            return ray.get_actor(name)
        except ValueError:
            return None

    return await eventually(lookup, timeout=60)


async def results_of(p: RolloutPlane, n: int) -> list:
    return [await p.next_result(timeout=120) for _ in range(n)]


def test_a_killed_worker_leaves_no_env_session_or_renderer_lease_held(ray_session, standin):
    """32 rollouts in flight on a worker that is killed: the pools end their sessions and return their
    leases at once (the idle timeouts are an hour and six hours), and every rollout is answered once."""

    async def scenario():
        async with plane() as p:
            ids = [await p.submit(request(standin, i, latency_s=3.0)) for i in range(64)]
            await wait_until(lambda: [s.in_flight for s in p._workers.live()] == [32, 32], 30)
            # Every rollout holds its session and its lease (it is in its first 3 s model call).
            await eventually(
                lambda: _holds(p, pool_sessions=64, server_sessions=64, leases=64), timeout=60, interval=0.2
            )
            victim = p._workers.live()[0]
            ray.kill(victim.handle, no_restart=True)
            results = await results_of(p, len(ids))
            released = await eventually(lambda: _holds(p, 0, 0, 0), timeout=10, interval=0.2)
            return ids, results, released, p.stats()

    ids, results, released, stats = run(scenario())
    assert sorted(r.request_id for r in results) == sorted(ids)
    assert all(r.kind == "ok" for r in results), [(r.kind, r.error) for r in results if r.kind != "ok"]
    assert sum(r.attempts == 2 for r in results) == 32
    assert released == {"pool_sessions": 0, "server_sessions": 0, "leases": 0}
    assert stats.workers_lost == 1


async def _holds(p: RolloutPlane, pool_sessions: int, server_sessions: int, leases: int) -> dict | None:
    now = await held(p, CALC)
    wanted = {"pool_sessions": pool_sessions, "server_sessions": server_sessions, "leases": leases}
    return now if now == wanted else None


def test_a_rollout_whose_env_server_died_is_redispatched_under_its_lease(ray_session, standin):
    """The only env server dies (SIGKILL) while four rollouts have sessions on it: each is re-dispatched,
    its placement waits for the replacement server, and it ends `ok` on its second attempt."""
    slow_echo = Ref(target="env_actors.faults.envs:EchoEnv", config={"turns": 1, "step_delay": 4.0})

    async def scenario():
        async with plane(workers=1) as p:
            ids = [await p.submit(request(standin, i, env=slow_echo)) for i in range(4)]
            pool = await named(p.names.env_pool(slow_echo))

            async def sessions_open():
                stats = await pool.stats.remote()
                return stats.servers[0] if stats.sessions == 4 else None

            worker = await eventually(sessions_open, timeout=60)
            os.kill(worker.pid, signal.SIGKILL)
            results = await results_of(p, len(ids))
            return ids, results, p.stats(), await pool.stats.remote()

    ids, results, stats, pool_stats = run(scenario())
    assert sorted(r.request_id for r in results) == sorted(ids)
    assert [r.kind for r in results] == ["ok"] * 4, [r.error for r in results]
    assert [r.attempts for r in results] == [2] * 4
    assert stats.redispatched == 4
    assert pool_stats.deaths == 1 and pool_stats.sessions == 0


def test_an_env_server_that_dies_at_the_same_step_of_every_dispatch_makes_the_rollout_poison(
    ray_session, standin
):
    """An environment that kills its server in every step: the rollout is dispatched twice, not
    `max_dispatches` times, and ends `env` (`PoisonRequest`) with the chain of both losses."""
    dies = Ref(target="env_actors.faults.envs:ExitsMidCallEnv", config={"turns": 1})

    async def scenario():
        config = {"num_cpus": 0.25, "restart": {"max_restarts": 5, "window_s": 60}}
        async with plane(workers=1, max_dispatches=3, env_pool=config) as p:
            await p.submit(request(standin, 0, env=dies))
            return await p.next_result(timeout=120), p.stats()

    result, stats = run(scenario())
    assert result.kind == "env" and result.error.type == "PoisonRequest", result.error
    assert [(loss.part, loss.how, loss.call, loss.step) for loss in result.error.losses] == [
        ("env server", "died", "step", 1)
    ] * 2
    assert result.attempts == 2 and stats.redispatched == 1 and stats.poisoned == 1


def test_env_servers_killed_from_outside_twice_under_healthy_rollouts_make_none_of_them_poison(
    ray_session, standin
):
    """Contract 5: a death nobody was named for never makes a healthy request poison. The pool's one env
    server is SIGKILLed while four healthy rollouts are in their first step, and its replacement again
    at the same step: each rollout lost two servers at one point, among other sessions. None is answered
    `env` poison; each runs its third dispatch alone on a server of its own (quarantine) and ends `ok`.
    On 6adb045 all four ended `env` (PoisonRequest)."""
    slow_echo = Ref(target="env_actors.faults.envs:EchoEnv", config={"turns": 1, "step_delay": 8.0})
    env_pool = {"num_cpus": 0.1, "max_servers": 1, "restart": {"max_restarts": 5, "window_s": 60}}

    async def scenario():
        async with plane(workers=1, max_dispatches=3, env_pool=env_pool) as p:
            ids = [await p.submit(request(standin, i, env=slow_echo)) for i in range(4)]
            pool = await named(p.names.env_pool(slow_echo))
            killed: set[int] = set()

            async def all_four_stepping():  # a fresh server, its four sessions in their step
                for server in (await pool.stats.remote()).servers:
                    if server.state == "ready" and server.pid not in killed:
                        health = await ray.get_actor(server.name).health.remote()
                        if health.calls == 4:
                            return server
                return None

            for _ in range(2):
                server = await eventually(all_four_stepping, timeout=90)
                os.kill(server.pid, signal.SIGKILL)
                killed.add(server.pid)
            results = await results_of(p, len(ids))
            return results, p.stats(), await pool.stats.remote()

    results, stats, pool_stats = run(scenario())
    assert [r.kind for r in results] == ["ok"] * 4, [r.error for r in results]
    assert [r.attempts for r in results] == [3] * 4
    assert stats.poisoned == 0 and stats.counters["quarantined"] == 4
    assert pool_stats.quarantined == 4 and pool_stats.budget_denials == 0, pool_stats


def test_a_rollout_whose_renderer_stays_unavailable_is_redispatched(ray_session, standin):
    """The renderer freezes (SIGSTOP) under a rollout: its call misses the call deadline, the rollout is
    re-dispatched, and once the frozen renderer is gone the second attempt ends `ok`."""

    async def scenario():
        renderer_pool = {"probe_interval_s": 600.0}  # the pool does not notice on its own in this test
        async with plane(workers=1, call_timeout_s=3.0, renderer_pool=renderer_pool) as p:
            # Warm the renderer first, so the frozen one is the only one and is known to be ready.
            await p.submit(request(standin, 0))
            assert (await p.next_result(timeout=120)).kind == "ok"
            pid = await _only_renderer_pid(ray.get_actor(p.names.renderer_pool))
            before = p.stats().redispatched  # the warm-up may have been re-dispatched already
            await p.submit(request(standin, 1, latency_s=1.0))
            os.kill(pid, signal.SIGSTOP)
            try:
                await wait_until(lambda: p.stats().redispatched > before, 60)
            finally:
                os.kill(pid, signal.SIGKILL)
            return await p.next_result(timeout=120)

    result = run(scenario())
    assert result.kind == "ok", result.error
    assert result.attempts >= 2


async def _only_renderer_pid(pool) -> int:
    (key_json,) = (await pool.stats.remote()).keys
    lease = await pool.acquire.remote(key_json)
    try:
        return (await lease.renderer.health.remote()).pid
    finally:
        await pool.release.remote(lease.slot_id)


def _lose_three_of_four(standin, n: int, **config):
    """`n` rollouts in flight over four workers; three are killed at once (a node's worth). Returns the
    results, the survivor's slot as it was when the last result came (before the plane's close retired
    it) and the plane's stats."""

    async def scenario():
        async with plane(workers=4, lanes={"train": n, "eval": 1}, hang_timeout_s=5.0, **config) as p:
            for i in range(n):
                await p.submit(request(standin, i % 300, latency_s=1.0))
            await wait_until(lambda: sum(s.in_flight for s in p._workers.live()) == n, 60)
            *victims, survivor = p._workers.live()
            for victim in victims:
                ray.kill(victim.handle, no_restart=True)
            results = await results_of(p, n)
            return results, copy.copy(survivor), p.stats()

    return run(scenario())


@pytest.mark.slow
def test_a_survivor_loaded_with_the_rollouts_of_three_lost_workers_is_not_judged_wedged(ray_session, standin):
    """Three of four workers die at once and their 768 rollouts land on the survivor (and on the
    replacements as they come up). A fresh call to the survivor then waits seconds behind the rollouts it
    is still receiving (measured: 4-6 s here, past the 5 s `hang_timeout_s` that cascaded before); its
    heartbeats stream on a call already running, report a rollout loop that is busy, not stalled, and it
    is never killed."""
    results, survivor, stats = _lose_three_of_four(standin, 1024)
    assert survivor.alive, survivor.gone
    assert stats.workers_lost == 3
    assert all(r.kind == "ok" for r in results), {(r.kind, r.error.type) for r in results if r.error}


def test_redispatch_waits_for_replacements_rather_than_overload_a_survivor(ray_session, standin):
    """With workers sized for 48 rollouts each, the 144 rollouts of three lost workers do not pile onto the
    survivor: they wait for the replacements, and no worker ever holds more than it is sized for."""
    results, survivor, stats = _lose_three_of_four(standin, 192, rollouts_per_worker=48)
    assert all(r.kind == "ok" for r in results), {(r.kind, r.error.type) for r in results if r.error}
    assert survivor.peak == 48
    assert all(worker.peak <= 48 for worker in stats.workers)
    assert len(stats.workers) == 4  # three replacements took the rest
