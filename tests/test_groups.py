"""The orchestrator's side of the plane: group handles, results per lane, staleness, the sync wrapper.

Real Ray, real stand-in server, real env and renderer actors. Lanes are kept small so that "a member is
still waiting for its lane" is a state the test sets up, not a timing it hopes for.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from adapters import unload_adapters
from env_pools import TEST_REF_PREFIXES
from planes import plane_factory
from waiting import runner, wait_until

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.plane.groups import Stragglers
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

# every test here starts real actors or servers (a plane, a pool, a server process): seconds each
pytestmark = pytest.mark.slow

MATH = Ref(target="env_actors.examples.math_env:MathEnv")
ECHO = Ref(target="env_actors.faults.envs:EchoEnv", config={"num_tasks": 8, "turns": 3})
DEADLINE_S = 120


run = runner(DEADLINE_S)


plane = plane_factory(lanes={"train": 8, "eval": 4})


def request(standin, latency_s: float = 0.0, env=MATH, **overrides) -> RolloutRequest:
    client = ClientConfig(
        base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Latency": str(latency_s)}
    )
    fields = dict(env=env, task_index=0, client=client, sampling=SamplingConfig(max_tokens=32, seed=11))
    fields.update(overrides)
    return RolloutRequest(**fields)


def test_submit_before_start_says_what_to_do_instead_of_a_bare_assert():
    p = RolloutPlane(PlaneConfig(workers=1))
    with pytest.raises(RuntimeError, match=r"before start\(\)"):
        asyncio.run(p.submit({}))
    with pytest.raises(RuntimeError, match=r"before start\(\)"):
        asyncio.run(p.submit_group({}, n=2))


def test_submit_group_returns_its_ids_before_any_member_waits_and_cancels_as_a_whole(ray_session, standin):
    """The lane is full (limit 1, one slow rollout): the handle still comes back at once with every id,
    and cancelling the group answers every member without one ever taking the lane."""

    async def scenario():
        async with plane(lanes={"train": 1, "eval": 1}) as p:
            slow = await p.submit(request(standin, latency_s=3.0))
            handle = await p.submit_group(request(standin), n=3)
            lane = p.lanes.get("train")
            state_at_return = (len(set(handle.request_ids)), lane.in_flight, handle.done())
            assert await handle.cancel() == 3
            group = await handle
            slow_still_running = lane.in_flight == 1
            slow_result = await p.next_result(timeout=60)
            return state_at_return, group, slow_still_running, slow, slow_result, lane.peak

    state, group, slow_still_running, slow, slow_result, peak = run(scenario())
    assert state == (3, 1, False)
    assert [r.kind for r in group.results] == ["cancelled"] * 3
    assert [r.request_id for r in group.results] == list(group.results[i].request_id for i in range(3))
    assert slow_still_running and peak == 1  # no member ever held the lane
    assert slow_result.request_id == slow and slow_result.kind == "ok"


def test_complete_groups_stream_per_lane_and_a_handle_claims_its_group(ray_session, standin):
    async def scenario():
        async with plane() as p:
            train = [await p.submit_group(request(standin, task_index=i), n=2) for i in range(3)]
            evals = [await p.submit_group(request(standin, task_index=i, lane="eval"), n=2) for i in range(2)]
            claimed = await train[0]  # awaited through its handle: not in the stream below
            single = await p.submit(request(standin, lane="eval", metadata={"tag": "single"}))
            eval_groups = [g async for g in p.groups(lane="eval")]
            train_groups = [g async for g in p.groups(lane="train")]
            eval_single = await p.next_result(timeout=60, lane="eval")
            return train, evals, claimed, eval_groups, train_groups, single, eval_single

    train, evals, claimed, eval_groups, train_groups, single, eval_single = run(scenario())
    assert {g.group_id for g in eval_groups} == {h.group_id for h in evals}
    assert {g.group_id for g in train_groups} == {h.group_id for h in train[1:]}
    assert claimed.group_id == train[0].group_id
    for group in [claimed, *eval_groups, *train_groups]:
        assert len(group.results) == 2 and all(r.kind == "ok" for r in group.results)
        assert {r.group_id for r in group.results} == {group.group_id}
        assert [r.seed for r in group.results] == [11, 12]  # consecutive seeds
        assert all(r.lane == group.lane for r in group.results)
        assert len(group.samples()) == 2 and group.policy_versions == [0]
    assert (eval_single.request_id, eval_single.lane, eval_single.metadata) == (
        single,
        "eval",
        {"tag": "single"},
    )


def test_a_straggler_rule_cancels_the_slowest_member_once_enough_finished(ray_session):
    """Lane limit 2, group of 3: two members run, the third starts when the first finishes, and is cut
    as soon as the second makes two `ok` (deadline 0 s). It answers `cancelled` with what it sampled.
    The third needs 3 turns x 2 s: the second, started with the first, finishes well before that (at
    0.5 s a turn a loaded CI run once let the second lag the first by more than the third's 1.5 s, and
    at 1 s a loaded local suite by more than 3 s). A
    stand-in of its own: calls other tests abandoned on the shared one (it finishes them, as vLLM would
    not) share its KV cache and could hold the second back past the third."""
    from conftest import served_like_vllm

    from rollout_actors.inference.standin import StandinServer

    async def scenario(server):
        async with plane(lanes={"train": 2, "eval": 1}) as p:
            # Pools started and one renderer loaded before the group: a member that waits for a pool or a
            # renderer to load (seconds) would lag the others by more than the third member's turns.
            await p.submit(request(server, env=ECHO))
            warm = await p.next_result(timeout=120)
            assert warm.kind == "ok", warm.error
            handle = await p.submit_group(
                request(server, latency_s=2.0, env=ECHO), n=3, stragglers=Stragglers(after_s=0, min_ok=2)
            )
            return await handle, p.stats()

    with StandinServer(served_like_vllm()) as own:
        group, stats = run(scenario(own))
    kinds = sorted(r.kind for r in group.results)
    assert kinds == ["cancelled", "ok", "ok"], [
        (r.kind, r.error, r.started_at, r.finished_at, r.timings, len(r.turns)) for r in group.results
    ]
    (cut,) = [r for r in group.results if r.kind == "cancelled"]
    assert cut.error.type == "Straggler" and "straggler" in cut.error.message
    assert stats.counters["cancelled.Straggler"] == 1


def test_a_request_without_base_url_takes_the_planes_endpoint_or_is_refused(ray_session, standin):
    bare = request(standin).model_copy(update={"client": ClientConfig(model=BUNDLED_MODEL)})  # no base_url

    async def one(rollouts: RolloutPlane):
        async with rollouts as p:
            await p.submit(bare)
            return await p.next_result(timeout=60)

    async def scenario():  # two independent planes, started side by side
        return await asyncio.gather(one(plane(endpoints=[standin.base_url])), one(plane()))

    ok, refused = run(scenario())
    assert ok.kind == "ok", ok.error
    assert refused.kind == "caller" and "base_url" in refused.error.message


def adapter(seed: int):
    from rollout_actors.policy.lora import LoraAdapter, lora_config

    rng = np.random.default_rng(seed)
    tensors = {
        f"base_model.model.layers.0.self_attn.q_proj.lora_{ab}.weight": rng.standard_normal(
            (8, 8), dtype=np.float32
        )
        for ab in ("A", "B")
    }
    return LoraAdapter(tensors, lora_config(8, 16, ["q_proj"], BUNDLED_MODEL))


def test_rollouts_too_far_off_policy_are_cancelled_when_a_new_policy_is_active(
    ray_session, standin, tmp_path
):
    """max_off_policy_steps=1: a rollout started on the base model survives v1 and is cancelled at v2
    (error type `Stale`, turns kept); a group pinned to one policy samples all its members from it."""
    endpoints = [standin.base_url]

    async def scenario():
        config = dict(endpoints=endpoints, policy_storage_dir=str(tmp_path), max_off_policy_steps=1)
        async with plane(**config) as p:
            slow = await p.submit(request(standin, latency_s=4.0, env=ECHO))  # 12 s: outlives v2
            await wait_until(lambda: standin.session_counts().get(slow, 0) >= 2, 30)  # turn 2 on v0
            v1 = (await (await p.publish_policy(adapter(1), version=1)).wait(timeout=30)).name
            pinned = await p.submit_group(request(standin, latency_s=0.2, task_index=1), n=3, one_policy=True)
            await pinned.admitted()
            await (await p.publish_policy(adapter(2), version=2)).wait(timeout=30)
            stale = await p.next_result(timeout=60)
            group = await pinned
            fresh = await p.submit(request(standin, task_index=2))
            fresh_result = await p.next_result(timeout=60)
            return slow, stale, group, fresh, fresh_result, p.stats(), v1

    try:
        slow, stale, group, fresh, fresh_result, stats, v1 = run(scenario())
    finally:
        unload_adapters(endpoints)
    assert stale.request_id == slow and stale.kind == "cancelled"
    assert stale.error.type == "Stale" and "v0" in stale.error.message and stale.turns
    assert (stale.policy_version_start, stale.policy_version_end, stale.versions_behind) == (0, 2, 2)
    assert group.policy_versions == [1] and {r.model for r in group.results} == {v1}
    assert all(r.kind == "ok" for r in group.results), [r.error for r in group.results]
    assert fresh_result.request_id == fresh and fresh_result.versions_behind == 0
    assert stats.off_policy.cancelled_stale == 1


def test_a_script_without_asyncio_runs_rollouts_and_groups_through_the_sync_wrapper(ray_session, standin):
    from rollout_actors.plane.sync import SyncRolloutPlane

    config = PlaneConfig(
        lanes={"train": 4, "eval": 1},
        workers=1,
        worker_num_cpus=0.25,
        env_pool={"num_cpus": 0.25},
        allowed_ref_prefixes=TEST_REF_PREFIXES,
    )
    with SyncRolloutPlane(config) as p:
        results = p.run([request(standin, task_index=i) for i in range(3)], timeout=60)
        group = p.run_group(request(standin, task_index=5), n=2, timeout=60)
        p.call(lambda plane: plane.set_limit("train", 2))
        stats = p.stats()
    assert [(r.kind, r.task_index) for r in results] == [("ok", 0), ("ok", 1), ("ok", 2)]
    assert [r.kind for r in group.results] == ["ok", "ok"] and group.results[0].task_index == 5
    assert stats.lanes["train"].limit == 2


def test_the_orchestrator_demo_runs_its_loop_and_prints_a_line_per_step(
    ray_session, standin, tmp_path, capsys
):
    """The worked example stays working: two steps with an eval round, against the suite's stand-in."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "scripts" / "orchestrator_demo.py"
    spec = importlib.util.spec_from_file_location("orchestrator_demo", path)
    demo = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = demo  # its dataclasses look their module up there
    spec.loader.exec_module(demo)
    argv = "--steps 2 --group-size 2 --groups-per-step 2 --in-flight 3 --train-s 0.1 --eval-every 1"
    args = demo.parse_args([*argv.split(), "--eval-tasks", "2", "--latency", "0.05"])
    try:
        run(demo.main(args, [standin.base_url], str(tmp_path)))
    finally:
        unload_adapters([standin.base_url])  # the shared stand-in serves only the base model again
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step")]
    assert len(lines) == 2, lines
    assert all("reward" in line and "off-policy lag" in line and "failures" in line for line in lines)


def test_a_rollout_cancelled_while_its_dispatch_is_placed_never_runs(ray_session, standin):
    """The cancel lands while the dispatch is being placed (its pools routed, before a worker is told):
    there is no worker to tell yet, so the dispatch itself must notice, or the worker would run the
    rollout to `ok` inside the cancel grace (what a straggler rule saw under load)."""

    async def scenario():
        async with plane() as p:
            entered, gate = asyncio.Event(), asyncio.Event()
            route = p._pools.route

            async def held_route(*args, **kwargs):
                entered.set()
                await gate.wait()
                return await route(*args, **kwargs)

            p._pools.route = held_route
            request_id = await p.submit(request(standin, latency_s=0.5))
            await asyncio.wait_for(entered.wait(), 60)
            assert await p.cancel(request_id)
            gate.set()
            return request_id, await p.next_result(timeout=60), p.stats()

    request_id, result, stats = run(scenario())
    assert (result.request_id, result.kind, result.turns) == (request_id, "cancelled", [])
    assert [w.peak for w in stats.workers] == [0]  # no worker ever ran it
