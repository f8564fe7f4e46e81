"""The plane under faults: real worker actors killed and wedged, real stand-in server, global deadlines."""

from __future__ import annotations

import asyncio
import functools
import os
import signal

import pytest
import ray
from adapters import served_models, unload_adapters
from planes import plane_factory
from waiting import runner, wait_until

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

# every test here starts real actors or servers (a plane, a pool, a server process): seconds each
pytestmark = pytest.mark.slow

MATH = Ref(target="env_actors.examples.math_env:MathEnv")
DEADLINE_S = 120


run = runner(DEADLINE_S)


plane = plane_factory(lanes={"train": 32, "eval": 8}, workers=2, hang_timeout_s=3.0, probe_interval_s=0.5)


def slow_request(standin, latency_s: float, task_index: int = 0, **overrides) -> RolloutRequest:
    client = ClientConfig(
        base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Latency": str(latency_s)}
    )
    fields = dict(
        env=MATH, task_index=task_index, client=client, sampling=SamplingConfig(max_tokens=64, seed=1)
    )
    fields.update(overrides)
    return RolloutRequest(**fields)


def test_killed_worker_rollouts_are_redispatched_and_answered_once(ray_session, standin):
    async def scenario():
        async with plane() as p:
            ids = [await p.submit(slow_request(standin, 2.0, i)) for i in range(8)]
            await wait_until(lambda: all(s.in_flight > 0 for s in p._workers.live()), 20)
            victim = p._workers.live()[0]
            ray.kill(victim.handle, no_restart=True)
            results = [await p.next_result(timeout=60) for _ in ids]
            return ids, results, p.stats()

    ids, results, stats = run(scenario())
    assert sorted(r.request_id for r in results) == sorted(ids)  # each answered exactly once
    assert all(r.kind == "ok" for r in results), [(r.kind, r.error) for r in results]
    assert stats.redispatched > 0
    assert any(r.attempts == 2 for r in results)
    assert stats.duplicates_dropped == 0  # a killed worker answers nothing late


def test_a_late_answer_for_an_answered_lease_is_dropped_and_counted(ray_session, standin):
    """The plane gives up at the request's deadline (no grace); the worker's own answer comes after."""

    async def scenario():
        async with plane(answer_grace_s=0.0) as p:
            await p.submit(slow_request(standin, 0.0))  # warm: the env pool and renderer are up
            assert (await p.next_result(timeout=60)).kind == "ok"
            await p.submit(slow_request(standin, 10.0, 1, timeout_s=2.0))
            result = await p.next_result(timeout=30)
            await wait_until(lambda: p.stats().duplicates_dropped == 1, 30)
            return result, p.stats()

    result, stats = run(scenario())
    assert result.kind == "infrastructure" and result.error.type == "DeadlineExceeded", result.error
    assert "timeout_s + answer_grace_s" in result.error.message  # the plane's answer, not the worker's
    assert stats.duplicates_dropped == 1 and stats.redispatched == 0
    assert stats.counters.get("kind.infrastructure") == 1  # the late answer was not delivered


def test_wedged_worker_is_detected_within_hang_timeout(ray_session, standin):
    async def scenario():
        async with plane(hang_timeout_s=2.0) as p:
            ids = [await p.submit(slow_request(standin, 1.0, i)) for i in range(4)]
            await wait_until(lambda: all(s.in_flight > 0 for s in p._workers.live()), 20)
            victim = p._workers.live()[0]
            pid = (await victim.handle.ping.remote()).pid
            os.kill(pid, signal.SIGSTOP)  # frozen: Ray alone would leave its calls pending for ever
            try:
                await wait_until(lambda: not victim.alive, 10)
            finally:
                os.kill(pid, signal.SIGKILL)
            results = [await p.next_result(timeout=60) for _ in ids]
            return victim.gone.result()[0], results, p.stats()

    cause, results, stats = run(scenario())
    assert "hang_timeout_s" in cause  # found by the plane's liveness probe, not by Ray
    assert all(r.kind == "ok" for r in results), [(r.kind, r.error) for r in results]
    assert stats.workers_lost >= 1


def test_three_consecutive_losses_end_as_infrastructure(ray_session, standin):
    async def scenario():
        async with plane(workers=1, max_dispatches=3) as p:
            await p.submit(slow_request(standin, 5.0))
            killed = 0
            while killed < 3:
                await wait_until(lambda: any(s.in_flight > 0 for s in p._workers.live()), 30)
                slot = next(s for s in p._workers.live() if s.in_flight > 0)
                ray.kill(slot.handle, no_restart=True)
                killed += 1
                await wait_until(lambda s=slot: s not in p._workers.live(), 10)
            return await p.next_result(timeout=30), p.stats()

    result, stats = run(scenario())
    assert result.kind == "infrastructure"
    assert result.error.type == "WorkerLost"
    assert stats.redispatched == 2


def test_lane_bounds_and_set_limit_hold(ray_session, standin):
    async def scenario():
        async with plane(lanes={"train": 3, "eval": 2}) as p:
            observed = []

            async def watch():
                while True:
                    observed.append(p.lanes.snapshot())
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            submitter = asyncio.ensure_future(
                asyncio.gather(*(p.submit(slow_request(standin, 0.3, i)) for i in range(12)))
            )
            evals = [await p.submit(slow_request(standin, 0.3, i, lane="eval")) for i in range(2)]
            await asyncio.sleep(0.6)
            await p.set_limit("train", 6)
            await submitter
            results = [await p.next_result(timeout=60) for _ in range(14)]
            watcher.cancel()
            return observed, results, evals, p.lanes.snapshot()

    observed, results, evals, final = run(scenario())
    # Each snapshot pairs the bound with what was in flight at that instant: no clock in the assertions.
    assert all(s[lane].in_flight <= s[lane].limit for s in observed for lane in ("train", "eval"))
    assert any(s["train"].limit == 3 and s["train"].in_flight == 3 for s in observed)  # bound reached
    assert final["train"].peak > 3  # the raised limit was used
    assert len({r.request_id for r in results}) == 14
    assert all(r.kind == "ok" for r in results)


def test_sticky_endpoint_per_rollout_across_turns(ray_session, standin, standin_pair):
    async def scenario():
        endpoints = [server.base_url for server in standin_pair]
        async with plane(endpoints=endpoints) as p:
            calc = Ref(target="env_actors.examples.calculator_env:CalculatorEnv")
            ids = [await p.submit(slow_request(standin, 0.05, i, env=calc)) for i in range(8)]
            return ids, [await p.next_result(timeout=60) for _ in ids]

    ids, results = run(scenario())
    assert all(r.kind == "ok" for r in results), [(r.kind, r.error) for r in results]
    sessions = [server.session_counts() for server in standin_pair]
    for request_id in ids:
        served_by = [i for i, counts in enumerate(sessions) if counts.get(request_id)]
        assert len(served_by) == 1, (request_id, sessions)
    assert all(counts for counts in sessions)  # both endpoints got rollouts


def test_plane_built_inside_an_actor_is_refused(ray_session):
    @ray.remote(num_cpus=0)
    def build() -> str:
        try:
            RolloutPlane(PlaneConfig())
        except RuntimeError as exc:
            return str(exc)
        return "built"

    message = ray.get(build.remote(), timeout=60)
    assert "driver" in message


@pytest.mark.parametrize("lane", ["nope"])
def test_unknown_lane_is_a_caller_result(ray_session, standin, lane):
    async def scenario():
        async with plane(workers=1) as p:
            await p.submit(slow_request(standin, 0.0, lane=lane))
            return await p.next_result(timeout=30)

    result = run(scenario())
    assert result.kind == "caller" and "lane" in result.error.message


def test_published_policy_reaches_new_rollouts_while_in_flight_ones_keep_theirs(
    ray_session, standin_pair, tmp_path
):
    import numpy as np

    from rollout_actors.policy.lora import LoraAdapter, lora_config

    rng = np.random.default_rng(0)
    tensors = {
        f"base_model.model.layers.0.self_attn.q_proj.lora_{ab}.weight": rng.standard_normal(
            (8, 8), dtype=np.float32
        )
        for ab in ("A", "B")
    }
    adapter = LoraAdapter(tensors, lora_config(8, 16, ["q_proj"], BUNDLED_MODEL))
    endpoints = [server.base_url for server in standin_pair]

    async def scenario():
        async with plane(endpoints=endpoints, policy_storage_dir=str(tmp_path)) as p:
            early = await p.submit(slow_request(standin_pair[0], 3.0, 0))
            await wait_until(lambda: any(s.in_flight > 0 for s in p._workers.live()), 20)
            handle = await p.publish_policy(adapter, version=1)
            active = await handle.wait(timeout=30)
            late = await p.submit(slow_request(standin_pair[0], 0.0, 1))
            results = {r.request_id: r for r in [await p.next_result(timeout=60) for _ in range(2)]}
            return active, results[early], results[late]

    try:
        active, early, late = run(scenario())
    finally:
        unload_adapters(endpoints)
    assert early.kind == "ok" and late.kind == "ok", (early.error, late.error)
    assert (early.policy_version_start, early.policy_version_end) == (0, 1)  # the base model is version 0
    assert (late.policy_version_start, late.policy_version_end) == (1, 1)
    assert [t.policy_version for t in early.turns] == [0] and [t.policy_version for t in late.turns] == [1]
    assert active.version == 1


def test_an_adapter_in_use_is_not_unloaded_however_many_versions_follow(ray_session, standin_pair, tmp_path):
    """Retention (4 adapters) must not unload the one a rollout in flight still samples from."""
    import numpy as np

    from rollout_actors.policy.lora import LoraAdapter, lora_config

    def adapter(seed: int) -> LoraAdapter:
        rng = np.random.default_rng(seed)
        tensors = {
            f"base_model.model.layers.0.self_attn.q_proj.lora_{ab}.weight": rng.standard_normal(
                (8, 8), dtype=np.float32
            )
            for ab in ("A", "B")
        }
        return LoraAdapter(tensors, lora_config(8, 16, ["q_proj"], BUNDLED_MODEL))

    endpoints = [server.base_url for server in standin_pair]
    served = functools.partial(served_models, endpoints[0])

    async def scenario():
        async with plane(endpoints=endpoints, policy_storage_dir=str(tmp_path)) as p:
            v1 = (await (await p.publish_policy(adapter(1), version=1)).wait(timeout=30)).name
            echo = Ref(target="env_actors.faults.envs:EchoEnv", config={"num_tasks": 4, "turns": 3})
            await p.submit(slow_request(standin_pair[0], 1.5, 0, env=echo))  # 3 turns of 1.5 s on v1
            await wait_until(lambda: any(s.in_flight > 0 for s in p._workers.live()), 20)
            for version in range(2, 7):  # retention alone would unload v1 at v5
                await (await p.publish_policy(adapter(version), version=version)).wait(timeout=30)
            still_loaded = v1 in served()
            result = await p.next_result(timeout=60)
            await wait_until(lambda: v1 not in served(), 20)  # retired once its user is done
            return still_loaded, result

    try:
        still_loaded, result = run(scenario())
    finally:
        unload_adapters(endpoints)
    assert still_loaded
    assert result.kind == "ok", result.error
    assert (result.policy_version_start, result.policy_version_end) == (1, 6)
    assert len(result.turns) == 3


def test_endpoint_that_drops_out_of_the_live_set_gets_no_new_rollouts(ray_session, standin_pair):
    live = [server.base_url for server in standin_pair]

    async def scenario():
        p = RolloutPlane(
            PlaneConfig(
                lanes={"train": 8, "eval": 1}, workers=1, worker_num_cpus=0.25, env_pool={"num_cpus": 0.25}
            ),
            endpoints=lambda: live,
        )
        async with p:
            first = [await p.submit(slow_request(standin_pair[0], 0.0, i)) for i in range(4)]
            _ = [await p.next_result(timeout=60) for _ in first]
            live.remove(standin_pair[1].base_url)  # e.g. InferenceServerSet saw it die
            second = [await p.submit(slow_request(standin_pair[0], 0.0, i)) for i in range(4)]
            results = [await p.next_result(timeout=60) for _ in second]
            return second, results

    second, results = run(scenario())
    assert all(r.kind == "ok" for r in results)
    dropped = standin_pair[1].session_counts()
    assert not any(request_id in dropped for request_id in second)
    assert all(request_id in standin_pair[0].session_counts() for request_id in second)
