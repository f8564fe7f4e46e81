"""Load-aware concurrency: the control law against scripted loads, then against a real stand-in whose
finite KV cache fills."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest
from env_pools import TEST_REF_PREFIXES
from waiting import wait_until

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.load import ServerLoad
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.plane.concurrency import OVERLOAD, ConcurrencyConfig, ConcurrencyController
from rollout_actors.plane.lanes import Lanes
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

A, B = "http://a:8000/v1", "http://b:8000/v1"


class ScriptedReader:
    """Answers each server's load from a dict the test sets; a missing server fails to read."""

    def __init__(self) -> None:
        self.loads: dict[str, ServerLoad] = {}

    async def read(self, url: str) -> ServerLoad:
        if url not in self.loads:
            raise ConnectionError(f"{url} is down")
        return self.loads[url]

    async def aclose(self) -> None:
        pass


@dataclass
class FakePlane:
    lanes: Lanes
    running: dict[str, list[str]] = field(default_factory=dict)
    cancelled: list[tuple[list[str], str, str]] = field(default_factory=list)

    def live_endpoints(self) -> list[str]:
        return [A, B]

    def running_on(self, endpoint: str) -> list[str]:
        return self.running.get(endpoint, [])

    async def set_limit(self, lane: str, limit: int) -> None:
        await self.lanes.get(lane).set_limit(limit)

    async def cancel_members(self, request_ids: list[str], why: str, failure_type: str = "Cancelled") -> int:
        self.cancelled.append((request_ids, why, failure_type))
        return len(request_ids)


def load(kv: float, waiting: int = 0, preemptions: int = 0, running: int = 10) -> ServerLoad:
    return ServerLoad(kv_cache_usage=kv, running=running, waiting=waiting, preemptions=preemptions)


def controller(limit: int = 40, in_flight: int = 40, **config):
    lanes = Lanes({"train": limit, "eval": 4})
    lanes.get("train").in_flight = in_flight
    plane = FakePlane(lanes)
    reader = ScriptedReader()
    law = {"min_limit": 4, "smoothing": 1.0, "grow_below": 0.75, "aim": 0.8, "grow_factor": 1.25}
    config = ConcurrencyConfig(**{**law, **config})  # the law's arithmetic below, whatever the defaults
    return ConcurrencyController(plane, config, reader), plane, reader


def test_grows_only_while_the_kv_cache_has_room_and_the_limit_is_what_holds_the_lane_back():
    async def scenario():
        c, plane, reader = controller(limit=40, in_flight=40)
        reader.loads = {A: load(0.1), B: load(0.1)}
        grown = await c.step()  # x(1 + 0.25 x (1 - 0.1 / 0.8)): the step tapers toward `aim`
        plane.lanes.get("train").in_flight = 48
        reader.loads = {A: load(0.3), B: load(0.7)}
        rising = await c.step()  # KV rose 0.6 in one poll: what was admitted has not shown yet
        unpaid = await c.step()  # steady, but the servers run no more requests than before the growth
        reader.loads = {A: load(0.3), B: load(0.7, running=12)}  # 2 more: a quarter of the 8 new slots
        near = await c.step()  # x1.03, within the limit that would put KV at `aim`
        plane.lanes.get("train").in_flight = 10  # far below the limit: more room would not be used
        reader.loads = {A: load(0.1)}
        idle = await c.step()
        plane.lanes.get("train").in_flight = 49
        reader.loads = {A: load(0.85)}  # between grow_below and shrink_above
        full = await c.step()
        return grown, rising, unpaid, near, idle, full, plane.lanes.get("eval").limit

    grown, rising, unpaid, near, idle, full, eval_limit = asyncio.run(scenario())
    assert (grown.action, grown.limit) == ("grow", 48)
    assert (rising.action, rising.limit) == ("hold", 48)
    assert (unpaid.action, unpaid.limit) == ("hold", 48)
    assert (near.action, near.limit) == ("grow", 49)
    assert (idle.action, idle.limit) == ("hold", 49)
    assert (full.action, full.limit) == ("hold", 49)
    assert eval_limit == 4  # a lane it does not steer keeps its limit


def test_shrinks_when_the_fullest_server_is_under_pressure_or_requests_keep_waiting():
    async def scenario():
        c, plane, reader = controller(limit=40, in_flight=40, settle_s=0)
        reader.loads = {A: load(0.2), B: load(0.93)}
        first = await c.step()
        reader.loads = {A: load(0.5, waiting=3), B: load(0.5)}
        unsettled = await c.step()  # 40 in flight, limit 30: the shrink has not acted yet
        plane.lanes.get("train").in_flight = 30
        once = await c.step()  # waiting twice in a row is pressure
        return first, unsettled, once

    first, unsettled, twice = asyncio.run(scenario())
    assert (first.action, first.limit) == ("shrink", 30)
    assert (unsettled.action, unsettled.limit) == ("hold", 30)
    assert (twice.action, twice.limit) == ("shrink", 22)


def test_a_server_that_preempted_since_the_last_poll_makes_the_limit_shrink_and_stop_growing():
    async def scenario():
        c, plane, reader = controller(limit=40, in_flight=40, settle_s=0)
        reader.loads = {A: load(0.5, preemptions=7), B: load(0.5)}
        first = await c.step()  # the counter's first reading is history, not news: room to grow
        plane.lanes.get("train").in_flight = 43
        reader.loads = {A: load(0.5, preemptions=9), B: load(0.5)}
        preempted = await c.step()
        plane.lanes.get("train").in_flight = 32
        reader.loads = {A: load(0.5, preemptions=1), B: load(0.5)}  # A restarted: its one is new
        restarted = await c.step()
        plane.lanes.get("train").in_flight = 24
        reader.loads = {A: load(0.5, preemptions=1), B: load(0.5)}
        calm = await c.step()
        return first, preempted, restarted, calm

    first, preempted, restarted, calm = asyncio.run(scenario())
    assert (first.action, first.limit) == ("grow", 43)
    assert (preempted.action, preempted.limit) == ("shrink", 32)
    assert (restarted.action, restarted.limit) == ("shrink", 24)
    assert calm.action == "grow"


def test_a_server_about_to_preempt_cuts_the_limit_and_cancels_its_youngest_rollouts_once():
    async def scenario():
        c, plane, reader = controller(limit=40, in_flight=40, cancel_fraction=0.1, settle_s=60)
        plane.running = {B: [f"req-{i}" for i in range(30)], A: ["req-a"]}
        reader.loads = {A: load(0.4), B: load(0.99, waiting=5)}
        cut = await c.step()
        plane.lanes.get("train").in_flight = 20  # drained below the new limit, the queue not yet
        settling = await c.step()
        reader.loads = {A: load(0.4), B: load(0.6)}  # the queue emptied: settled, and room to grow
        plane.lanes.get("train").in_flight = 30
        regrown = await c.step()
        return cut, settling, regrown, plane.cancelled

    cut, settling, regrown, cancelled = asyncio.run(scenario())
    assert (cut.action, cut.limit, cut.cancelled) == ("cut", 30, 3)
    ids, why, failure_type = cancelled[0]
    assert ids == ["req-27", "req-28", "req-29"] and failure_type == OVERLOAD and B in why
    assert (settling.action, settling.limit, len(cancelled)) == ("hold", 30, 1)
    assert (regrown.action, regrown.limit) == ("grow", 31)


def test_grow_and_shrink_read_kv_usage_smoothed_over_polls_while_a_cut_reads_the_latest():
    async def scenario():
        c, plane, reader = controller(limit=40, in_flight=40, smoothing=0.5)
        reader.loads = {A: load(0.5)}
        await c.step()  # grows to 43; the smoothed usage starts at 0.5
        plane.lanes.get("train").in_flight = 43
        reader.loads = {A: load(0.95)}  # one high poll: smoothed 0.725, so no shrink; no growth either
        blip = await c.step()
        reader.loads = {A: load(0.99, waiting=2)}  # about to preempt: acts on this poll alone
        cut = await c.step()
        return blip, cut

    blip, cut = asyncio.run(scenario())
    assert blip.action == "hold" and blip.limit == 43
    assert cut.action == "cut"


def test_an_unreadable_server_is_left_out_and_no_server_means_no_move():
    async def scenario():
        c, plane, reader = controller(limit=40, in_flight=40)
        reader.loads = {A: load(0.2)}  # B does not answer
        grown = await c.step()
        reader.loads = {}
        nothing = await c.step()
        return grown, nothing, plane.lanes.get("train").limit

    grown, nothing, limit = asyncio.run(scenario())
    assert grown.action == "grow" and nothing is None and limit == 47


def test_thresholds_must_be_ordered():
    with pytest.raises(ValueError, match="grow_below"):
        ConcurrencyConfig(grow_below=0.95, aim=0.95, shrink_above=0.9)


@pytest.mark.slow
def test_the_controller_lowers_the_limit_when_a_real_servers_kv_cache_fills(ray_session):
    """A stand-in whose KV cache holds about three model calls, a train lane of 24 full of slow
    rollouts: the controller reads the stand-in's /metrics, and the lane limit comes down."""
    from rollout_actors.inference.standin.launch import StandinOptions, StandinServer

    async def scenario(server):
        config = PlaneConfig(
            lanes={"train": 24, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
            endpoints=[server.base_url],
            concurrency=ConcurrencyConfig(min_limit=2, interval_s=0.2),
        )
        client = ClientConfig(model=BUNDLED_MODEL, headers={"X-Standin-Latency": "2.0"})
        async with RolloutPlane(config) as plane:
            for i in range(24):
                await plane.submit(
                    RolloutRequest(
                        env=Ref("env_actors.examples.math_env:MathEnv"),
                        task_index=i,
                        client=client,
                        sampling=SamplingConfig(max_tokens=64, seed=i),
                    )
                )
            await wait_until(lambda: plane.lanes.get("train").limit < 24, 60)
            results = [await plane.next_result(timeout=120) for _ in range(24)]
            return results, plane.stats().concurrency

    with StandinServer(StandinOptions(kv_cache_tokens=800)) as server:
        results, stats = asyncio.run(asyncio.wait_for(scenario(server), 240))
    assert stats.limit < 24
    assert stats.actions.get("shrink", 0) + stats.actions.get("cut", 0) >= 1
    assert sorted({r.kind for r in results}) in (["ok"], ["cancelled", "ok"]), [r.error for r in results]
    assert all(r.error.type == OVERLOAD for r in results if r.kind == "cancelled")
