"""Fuzzed request payloads (hypothesis): wrong types, unknown fields, deep nesting, huge strings, Refs to
anything, absurd numbers. Each broken payload is exactly one `caller` result naming the field at fault,
and nothing raises out of `submit` / `submit_group` / `drain`.

Two layers, to stay fast: the submission check itself, with many examples and no Ray at all; then one
started plane for the module, swept with fewer examples through the public calls, which then serves a
good request."""

from __future__ import annotations

import math
from typing import Any

import pytest
from env_pools import TEST_REF_PREFIXES
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planes import plane_on_own_loop

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import Result, RolloutRequest

DEADLINE_S = 60
GOOD: dict[str, Any] = {
    "env": {"target": "env_actors.examples.math_env:MathEnv"},
    "task_index": 0,
    "client": {"base_url": "http://127.0.0.1:9/v1", "model": BUNDLED_MODEL},
    "sampling": {"max_tokens": 16, "seed": 1},
}
FIELDS = set(RolloutRequest.model_fields)


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def huge(n: int) -> st.SearchStrategy[str]:
    return st.text(min_size=1, max_size=8).map(lambda s: (s * (n // len(s) + 1))[:n])


# Values no field of a request accepts anywhere: (strategy, which field paths it may be put at).
NOT_JSON = st.sampled_from([object(), {1, 2}, b"bytes", float("nan"), float("inf"), print, RolloutRequest])
BAD_ID = st.one_of(
    st.integers(),
    st.floats(allow_nan=True),
    st.lists(st.text(max_size=3), max_size=2),
    st.just(""),
    huge(5_000),
    st.text(alphabet="\r\n\x00\x1b", min_size=1, max_size=4).map(lambda s: f"id{s}x"),
)
ABSURD = st.sampled_from(
    [-1, 0, -(2**70), float("inf"), float("-inf"), float("nan"), 1e300, "ten", None, [3]]
)
REF_TO_ANYTHING = st.one_of(
    st.from_regex(r"\A[a-z_][a-z0-9_.]{0,30}:[a-z_][a-z0-9_]{0,20}\Z").filter(
        lambda target: not target.startswith("env_actors")  # the allowlist's own prefixes
    ),
    st.sampled_from(["os:system", "subprocess:run", "builtins:eval", "rollout_actors.kernel:RefResolver"]),
    st.text(max_size=40),
    huge(100_000),
)

MUTATIONS: dict[str, st.SearchStrategy[tuple[dict[str, Any], str]]] = {
    "id": st.tuples(st.sampled_from(["request_id", "lease_id", "group_id"]), BAD_ID).map(
        lambda kv: ({kv[0]: kv[1]}, kv[0])
    ),
    "unknown field": st.text(min_size=1, max_size=20)
    .filter(lambda k: k not in FIELDS)
    .map(lambda k: ({k: 1}, k[:20])),
    "deep nesting": st.tuples(
        st.sampled_from(["task", "env.config", "metadata", "sampling.extra_body"]), st.integers(40, 3_000)
    ).map(lambda pd: (_at(pd[0], nested(pd[1])), pd[0])),
    "not JSON": st.tuples(
        st.sampled_from(["task", "env.config", "metadata", "sampling.extra_body"]), NOT_JSON
    ).map(lambda pv: (_at(pv[0], {"k": pv[1]}), pv[0])),
    "ref to anything": REF_TO_ANYTHING.map(lambda target: ({"env": {"target": target}}, "env")),
    "absurd deadline": ABSURD.map(lambda v: ({"timeout_s": v}, "timeout_s")),
    "absurd max_turns": st.sampled_from([0, -5, 1.5, "many", None]).map(
        lambda v: ({"max_turns": v}, "max_turns")
    ),
    "absurd policy_version": st.sampled_from([-1, -(2**70), 1.5, "v1"]).map(
        lambda v: ({"policy_version": v}, "policy_version")
    ),
    "wrong type": st.tuples(
        st.sampled_from(["env", "client", "sampling", "renderer", "mode", "lane", "metadata"]),
        st.one_of(st.integers(), st.lists(st.integers(), max_size=2), st.just(None)),
    ).map(lambda fv: ({fv[0]: fv[1]}, fv[0])),
    "task not an object": st.one_of(
        st.integers(), st.text(max_size=5), st.lists(st.integers(), max_size=2)
    ).map(lambda v: ({"task_index": None, "task": v}, "task")),
    "unknown lane": huge(300).map(lambda lane: ({"lane": lane}, "lane")),
}


def _at(path: str, value: Any) -> dict[str, Any]:
    """A payload patch putting `value` at a dotted path of `GOOD`."""
    head, _, rest = path.partition(".")
    if not rest:
        return {head: value}
    return {head: {**GOOD.get(head, {}), rest: value}}


def broken(draw_from: st.DrawFn) -> tuple[dict[str, Any], str]:
    """A good request with one mutation; returns the payload and the field its refusal must name."""
    patch, field = draw_from(st.one_of(*MUTATIONS.values()))
    return {**GOOD, **patch}, field


BROKEN = st.composite(broken)()


def names(result: Result, field: str) -> bool:
    """The refusal names the field (a Ref outside the allowlist is named by the allowlist)."""
    message = result.error.message if result.error else ""
    return field in message or (field == "env" and "allowlist" in message)


# --------------------------------------------------------------------------- the check, no Ray


@pytest.fixture(scope="module")
def unstarted() -> RolloutPlane:
    return RolloutPlane(PlaneConfig(lanes={"train": 4, "eval": 1}, allowed_ref_prefixes=TEST_REF_PREFIXES))


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(payload_and_field=BROKEN)
def test_every_broken_payload_is_a_caller_result_naming_its_field(unstarted, payload_and_field):
    payload, field = payload_and_field
    checked = unstarted._intake._check(payload)
    assert isinstance(checked, Result), f"accepted: {field}"
    assert checked.kind == "caller"
    assert names(checked, field), (field, checked.error.message)
    assert len(checked.error.message) < 3_000
    Result.model_validate_json(checked.model_dump_json())  # the refusal itself is valid JSON data


@settings(max_examples=100, deadline=None)
@given(payload=st.one_of(st.none(), st.integers(), st.text(), st.lists(st.integers()), st.binary(), NOT_JSON))
def test_a_payload_that_is_not_a_mapping_is_a_caller_result(unstarted, payload):
    checked = unstarted._intake._check(payload)
    assert isinstance(checked, Result) and checked.kind == "caller"


# ------------------------------------------------------------------------- a started plane, swept


@pytest.fixture(scope="module")
def served(ray_session, standin):
    good = {**GOOD, "client": {"base_url": standin.base_url, "model": BUNDLED_MODEL}}
    with plane_on_own_loop({"train": 8, "eval": 1}, DEADLINE_S) as (run, plane):
        yield run, plane, good


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)
@given(
    payload_and_field=BROKEN,
    n=st.one_of(st.integers(-3, 5), st.sampled_from([None, "2", 2.0, True, 10**9])),
)
def test_broken_payloads_through_a_started_plane_raise_nothing_and_leave_nothing_pending(
    served, payload_and_field, n
):
    run, plane, _ = served
    payload, field = payload_and_field

    async def scenario():
        request_id = await plane.submit(payload)
        singles = [r async for r in plane.drain()]
        handle = await plane.submit_group(payload, n)
        group = await handle.wait(timeout=DEADLINE_S)
        return request_id, singles, handle, group

    request_id, singles, handle, group = run(scenario())
    assert [(r.request_id, r.kind) for r in singles] == [(request_id, "caller")]
    assert names(singles[0], field), (field, singles[0].error.message)
    valid_n = isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 65_536
    assert len(group.results) == (n if valid_n else 1)
    assert [r.request_id for r in group.results] == list(handle.request_ids)
    if field not in ("request_id", "lease_id", "group_id") or not valid_n:  # members get ids of their own
        assert {r.kind for r in group.results} == {"caller"}
    assert not plane._streams.results_pending(None) and not plane._streams.groups_pending(None)


def test_the_swept_plane_still_serves_a_good_request(served):
    run, plane, good = served

    async def scenario():
        await plane.submit(good)
        return [r async for r in plane.drain()]

    (result,) = run(scenario())
    assert result.kind == "ok", result.error
    assert math.isfinite(result.reward)
