"""The plane's metrics, exported through Ray's metrics API (`ray_rollouts_*` on each node's Prometheus
endpoint and in the Ray dashboard). Counters move where things happen (`submitted`, `answered`); gauges
and the counters the plane already keeps are sampled by one loop the plane owns (`PlaneMetrics.run`)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from rollout_actors.kernel.metric import LATENCY_BUCKETS_S, Metric
from rollout_actors.timings import SERVER_PHASES, TURN_PHASES, WAIT_PHASES, phase_name

log = logging.getLogger(__name__)

REFRESH_S = 1.0  # gauges are sampled this often; Ray exports every few seconds anyway

SUBMITTED = Metric(kind="counter", name="submitted", description="Rollouts submitted", tag_keys=("lane",))
FINISHED = Metric(
    kind="counter",
    name="finished",
    description="Rollouts answered, by result kind",
    tag_keys=("lane", "kind"),
)
IN_FLIGHT = Metric(kind="gauge", name="in_flight", description="Rollouts in flight", tag_keys=("lane",))
LANE_LIMIT = Metric(kind="gauge", name="lane_limit", description="Lane concurrency limit", tag_keys=("lane",))
LATENCY = Metric(
    kind="histogram",
    name="rollout_latency_s",
    description="Rollout wall time from start to result, seconds",
    tag_keys=("lane", "kind"),
    boundaries=LATENCY_BUCKETS_S,
)
TURNS = Metric(
    kind="histogram",
    name="turns_per_rollout",
    description="Model turns per rollout",
    tag_keys=("lane",),
    boundaries=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128),
)
REDISPATCHED = Metric(
    kind="counter", name="redispatched", description="Rollouts re-dispatched under their lease"
)
DUPLICATES = Metric(kind="counter", name="duplicates_dropped", description="Late answers for answered leases")
WORKERS_LOST = Metric(
    kind="counter", name="workers_lost", description="Rollout workers lost (dead or wedged)"
)
WORKERS_LIVE = Metric(kind="gauge", name="workers_live", description="Live rollout workers")
LOOP_STALL = Metric(
    kind="gauge",
    name="worker_loop_stall_s",
    description="Seconds a rollout worker's event loop has gone without progress (load shows as lag, a wedge grows)",
    tag_keys=("worker",),
)
MODEL_CALL_LATENCY = Metric(
    kind="histogram",
    name="model_call_latency_s",
    description="One model call, all attempts, seconds",
    tag_keys=("outcome",),
    boundaries=LATENCY_BUCKETS_S,
)
POLICY_VERSION = Metric(kind="gauge", name="policy_version", description="Active policy version")
PHASE_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
)
"""From a renderer call (~1 ms) to a slow model call or a cold pool start (minutes)."""
TURN_PHASE = Metric(
    kind="histogram",
    name="turn_phase_s",
    description="Seconds one turn spent in a phase: render (or bridge), model (of which queue: the server's "
    "own, where it reports it), parse, env",
    tag_keys=("phase",),
    boundaries=PHASE_BUCKETS_S,
)
ROLLOUT_WAIT = Metric(
    kind="histogram",
    name="rollout_wait_s",
    description="Seconds a rollout waited outside its turns: lane, env_pool, worker, dispatch, env_open, "
    "renderer, score, teardown",
    tag_keys=("phase",),
    boundaries=PHASE_BUCKETS_S,
)


_TURN_TAGS = tuple((field, {"phase": phase_name(field)}) for field in TURN_PHASES + SERVER_PHASES)
_WAIT_TAGS = tuple((field, {"phase": phase_name(field)}) for field in WAIT_PHASES)


class PlaneMetrics:
    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        """Last value of each plane counter exported, so the loop adds only what changed."""

    def submitted(self, lane: str) -> None:
        SUBMITTED.record(1, {"lane": lane})

    def answered(self, result: Any) -> None:
        lane = getattr(result, "lane", None) or "unknown"
        FINISHED.record(1, {"lane": lane, "kind": result.kind})
        if result.started_at is not None and result.finished_at is not None:
            LATENCY.record(result.finished_at - result.started_at, {"lane": lane, "kind": result.kind})
        TURNS.record(len(result.turns), {"lane": lane})
        waits = result.timings
        for field, tags in _WAIT_TAGS:
            value = getattr(waits, field)
            if value:  # a wait that did not happen is no observation (most rollouts never wait for a lane)
                ROLLOUT_WAIT.record(value, tags)
        for turn in result.turns:
            phases = turn.timings
            for field, tags in _TURN_TAGS:
                value = getattr(phases, field)
                if value:  # chat mode neither renders nor parses here
                    TURN_PHASE.record(value, tags)

    def sample(self, plane: Any) -> None:
        stats = plane.stats()
        for lane, figures in stats.lanes.items():
            IN_FLIGHT.record(figures.in_flight, {"lane": lane})
            LANE_LIMIT.record(figures.limit, {"lane": lane})
        WORKERS_LIVE.record(len(stats.workers))
        POLICY_VERSION.record(plane.policy_version or 0)
        for metric, value in (
            (REDISPATCHED, stats.redispatched),
            (DUPLICATES, stats.duplicates_dropped),
            (WORKERS_LOST, stats.workers_lost),
        ):
            delta = value - self._seen.get(metric.name, 0)
            if delta > 0:
                metric.record(delta)
                self._seen[metric.name] = value

    async def run(self, plane: Any) -> None:
        """Sample the plane's gauges until cancelled (the plane owns this task). A sample that fails is
        logged with its traceback and the loop goes on: it never dies silently."""
        while True:
            try:
                self.sample(plane)
            except Exception:
                log.exception("plane metrics: a sample failed")
            await asyncio.sleep(REFRESH_S)
