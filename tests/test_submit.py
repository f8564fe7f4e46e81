"""Bad requests against a started plane: each gets exactly one `caller` result naming the field at fault,
nothing raises out of `submit` / `submit_group` / `drain`, the pending count comes back to zero, and the
plane serves a good request afterwards. One plane for the module (a plane takes seconds to start here)."""

from __future__ import annotations

import asyncio
import threading

import pytest
from planes import plane_on_own_loop

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import RolloutPlane
from rollout_actors.wire import Result, RolloutRequest

DEADLINE_S = 60
MATH = {"target": "env_actors.examples.math_env:MathEnv"}


@pytest.fixture(scope="module")
def served(ray_session, standin):
    """(run, plane, good payload): `run(coro)` runs on the plane's own loop under a deadline."""
    good = {
        "env": MATH,
        "task_index": 0,
        "client": {"base_url": standin.base_url, "model": BUNDLED_MODEL},
        "sampling": {"max_tokens": 16, "seed": 1},
    }
    with plane_on_own_loop({"train": 16, "eval": 4}, DEADLINE_S) as (run, plane):
        yield run, plane, good


async def drained(plane: RolloutPlane) -> list[Result]:
    return [result async for result in plane.drain()]


def nested(depth: int) -> dict:
    root: dict = {}
    node = root
    for _ in range(depth):
        node["a"] = {}
        node = node["a"]
    return root


BAD_FIELDS = {
    "request_id-int": ({"request_id": 123}, "request_id"),
    "lease_id-float": ({"lease_id": 1.5}, "lease_id"),
    "group_id-list": ({"group_id": ["g"]}, "group_id"),
    "request_id-crlf": ({"request_id": "r\r\nX-Injected: 1"}, "request_id"),
    "request_id-5MB": ({"request_id": "r" * 5_000_000}, "request_id"),
    "request_id-empty": ({"request_id": ""}, "request_id"),
    "lease_id-non-ascii": ({"lease_id": "lease-\u00e9"}, "lease_id"),
    "unknown-field": ({"deadline": 5}, "deadline"),
    "deadline-inf": ({"timeout_s": float("inf")}, "timeout_s"),
    "deadline-nan": ({"timeout_s": float("nan")}, "timeout_s"),
    "deadline-negative": ({"timeout_s": -1}, "timeout_s"),
    "deadline-a-century": ({"timeout_s": 100 * 365 * 86400.0}, "timeout_s"),
    "env-config-3000-deep": ({"env": {**MATH, "config": nested(3000)}}, "env.config"),
    "task-3000-deep": ({"task_index": None, "task": nested(3000)}, "task"),
    "metadata-3000-deep": ({"metadata": nested(3000)}, "metadata"),
    "task-not-serialisable": ({"task_index": None, "task": {"lock": threading.Lock()}}, "task"),
    "extra_body-not-serialisable": ({"sampling": {"extra_body": {"f": print}}}, "sampling.extra_body"),
    "template_kwargs-nan": (
        {"renderer": {"template_kwargs": {"x": float("nan")}}},
        "renderer.template_kwargs",
    ),
    "ref-unknown-field": ({"env": {**MATH, "cfg": {}}}, "env.cfg"),
    "ref-outside-allowlist": ({"env": {"target": "os:system"}}, "allowlist"),
    "unknown-lane": ({"lane": "nope"}, "lane"),
    "lane-not-a-string": ({"lane": {"train": 1}}, "lane"),
    "policy_version-negative": ({"policy_version": -1}, "policy_version"),
}


@pytest.mark.parametrize("fields,named", BAD_FIELDS.values(), ids=BAD_FIELDS.keys())
def test_a_bad_field_is_one_caller_result_naming_it(served, fields, named):
    run, plane, good = served

    async def scenario():
        request_id = await plane.submit({**good, **fields})
        return request_id, await drained(plane)

    request_id, results = run(scenario())
    assert [r.request_id for r in results] == [request_id]
    (result,) = results
    assert result.kind == "caller", result
    assert named in result.error.message, result.error.message
    assert len(result.error.message) < 2_000  # huge or hostile values are not echoed back
    assert not plane._streams.results_pending(None)


@pytest.mark.parametrize("payload", [42, None, "request", [1, 2], b"\x00"], ids=repr)
def test_a_payload_that_is_not_a_request_is_one_caller_result(served, payload):
    run, plane, _ = served

    async def scenario():
        request_id = await plane.submit(payload)
        return request_id, await drained(plane)

    request_id, results = run(scenario())
    assert [(r.request_id, r.kind) for r in results] == [(request_id, "caller")]


def test_submit_group_of_a_non_request_gives_n_caller_results_in_one_group(served):
    run, plane, _ = served

    async def scenario():
        handle = await plane.submit_group(42, 3)
        return handle, await handle.wait(timeout=10)

    handle, group = run(scenario())
    assert len(set(handle.request_ids)) == 3
    assert [r.request_id for r in group.results] == list(handle.request_ids)
    assert {r.kind for r in group.results} == {"caller"}
    assert {r.group_id for r in group.results} == {handle.group_id}
    assert "request" in group.results[0].error.message


@pytest.mark.parametrize("n", [0, -1, "3", 2.0, True, None, 10**9], ids=repr)
def test_submit_group_with_a_bad_n_is_a_group_of_one_caller_result_naming_n(served, n):
    run, plane, good = served

    async def scenario():
        handle = await plane.submit_group(good, n)
        return await handle.wait(timeout=10)

    (result,) = run(scenario()).results
    assert result.kind == "caller" and "n:" in result.error.message


def test_the_same_request_object_submitted_twice_is_answered_twice(served):
    run, plane, good = served
    request = RolloutRequest.model_validate(good)

    async def scenario():
        ids = [await plane.submit(request), await plane.submit(request)]
        return ids, await drained(plane)

    ids, results = run(scenario())
    assert len(set(ids)) == 2
    assert sorted(r.request_id for r in results) == sorted(ids)
    assert all(r.kind == "ok" for r in results), [r.error for r in results]
    assert len({r.lease_id for r in results}) == 2


def test_an_explicit_lease_submitted_twice_runs_once_and_the_second_is_refused(served):
    run, plane, good = served
    payload = {**good, "request_id": "req-explicit-1", "lease_id": "lease-explicit-1"}

    async def scenario():
        await plane.submit(payload)
        await plane.submit(payload)
        first = await drained(plane)
        await plane.submit(payload)  # after it was answered: still refused, a lease runs once
        return first + await drained(plane)

    results = run(scenario())
    assert sorted(r.kind for r in results) == ["caller", "caller", "ok"]
    refusals = [r for r in results if r.kind == "caller"]
    assert all("lease_id" in r.error.message for r in refusals)


def test_a_caller_that_gives_up_on_a_full_lane_leaves_nothing_pending(served):
    run, plane, good = served

    async def scenario():
        await plane.set_limit("eval", 1)
        slow = {**good, "lane": "eval", "client": {**good["client"], "headers": {"X-Standin-Latency": "1.0"}}}
        first = await plane.submit(slow)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(plane.submit(slow), 0.2)  # the lane is full: back-pressure
        results = await drained(plane)
        await plane.set_limit("eval", 4)
        return first, results

    first, results = run(scenario())
    assert [(r.request_id, r.kind) for r in results] == [(first, "ok")]
    assert not plane._streams.results_pending(None)


def test_the_plane_serves_a_good_request_after_the_bad_ones(served):
    run, plane, good = served

    async def scenario():
        await plane.submit(good)
        return await drained(plane), plane.stats()

    results, stats = run(scenario())
    assert [r.kind for r in results] == ["ok"], results[0].error
    assert all(worker.in_flight == 0 for worker in stats.workers)
    assert stats.counters["submitted"] == sum(v for k, v in stats.counters.items() if k.startswith("kind."))
