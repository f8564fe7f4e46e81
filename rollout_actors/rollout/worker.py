"""`RolloutWorker`: an async actor on which each rollout is one actor task.

A rollout is almost entirely waiting on a model, so one async actor holds thousands of them (docs/design.md,
"Why actor tasks"). The worker classifies every failure before it leaves the actor and turns a
cancellation into a `cancelled` result after the rollout's own cleanup has run.

Liveness is answered off the rollout loop: `heartbeats` streams from the `probe` concurrency group (its
own thread and loop) how long the rollout loop has gone without progress (`loop_watch.py`): a loop busy
with thousands of rollouts makes progress, one blocked by a synchronous call does not, and a frozen or
dead process sends nothing. The plane judges both (`worker_set.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import ray
from pydantic import BaseModel, ConfigDict

from rollout_actors.kernel.coalescer import batch_counts, batch_window, set_batch_window
from rollout_actors.kernel.collector import collector_stats, settle_actor
from rollout_actors.kernel.faults import Cancelled
from rollout_actors.kernel.loop_watch import HEARTBEAT_S, LoopWatch
from rollout_actors.rollout.agent.endpoint import endpoint_stats
from rollout_actors.rollout.client import open_client_count
from rollout_actors.rollout.failures import log_failure
from rollout_actors.rollout.loop import LoopLimits, run_rollout
from rollout_actors.rollout.metrics import LOOP_STALL
from rollout_actors.rollout.pool_lookup import PoolLookup, PoolLookupFailed, PoolRoute
from rollout_actors.wire import Dispatch, Failure, Result

MAX_ROLLOUTS_PER_WORKER = 100_000  # Ray's async-actor concurrency cap; the plane's lanes bound it for real
PROBE_GROUP = "probe"
PROBE_GROUP_SIZE = 4  # a heartbeat stream, and slack for one reopened while the old one winds down

log = logging.getLogger(__name__)


class RolloutWorkerInfo(BaseModel):
    """A `RolloutWorker`'s answer to `ping`, its readiness call."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    actor_id: str
    """The owner tag of the env sessions and renderer slots this worker's rollouts take."""
    pid: int
    in_flight: int
    """Rollouts running on the worker now."""
    done: int
    """Rollouts the worker has finished since it started."""


class RolloutWorker:
    """Runs rollouts. Built by `RolloutPlane`; not meant to be created by hand."""

    def __init__(self, limits: LoopLimits | None = None, worker_name: str = "") -> None:
        self._limits = limits or LoopLimits()
        set_batch_window(self._limits.batch_window_s)
        self._pools = PoolLookup()
        self._name = worker_name
        self._running: dict[str, asyncio.Task[Any]] = {}
        self._started = time.time()
        self._done = 0
        self._weights_version: int | None = None
        self._pause_epoch = 0
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._loop_watch = LoopWatch()
        settle_actor()

    # Remote API ----------------------------------------------------------------------------------
    # No Ray task events for the call made once per rollout (nor for the batched renderer calls): each
    # is a few status events recorded here, buffered and sent to the GCS, thousands a second in a wave,
    # for a task table the plane never reads; its own timings and metrics say what a rollout did.
    @ray.method(enable_task_events=False)
    async def run(self, dispatch_json: bytes) -> str:
        """Run one dispatch of a rollout (`wire.Dispatch`: the caller's request and what the plane decided
        for it) against the pool incarnations it names, by actor name (the plane supervises the pools and
        names only serving ones; see `pool_lookup.py`).

        The dispatch comes as its JSON and the result goes back as its JSON: work is data (contract 1),
        and a pydantic model crosses Ray pickled class by class, which cost the plane's driver about a
        quarter of its CPU in a wave of 2,048 rollouts (see `kernel.EXACT_JSON`)."""
        dispatch = Dispatch.model_validate_json(dispatch_json)
        request = dispatch.rollout_request()
        env_pool, renderer_pool, quarantine = dispatch.env_pool, dispatch.renderer_pool, dispatch.quarantine
        # The dispatch is not kept for the rollout's life beside the request it yields: ~3.7 KB per
        # in-flight rollout of pydantic objects (measured: 10.8 KB the two, 7.1 KB the request alone).
        del dispatch
        task = asyncio.current_task()
        assert task is not None
        self._running[request.request_id] = task
        try:
            pools = await self._pools.resolve(PoolRoute.from_wire(env_pool, renderer_pool))
            result = await run_rollout(request, pools, self._limits, policy=self, quarantine=quarantine)
        except PoolLookupFailed as exc:  # lost after the plane named it: a lost part, re-dispatched
            result = Result.failed(request, exc.kind, exc.failure)
        except asyncio.CancelledError:
            result = Result.failed(request, "cancelled", Cancelled("rollout was cancelled").failure)
        except Exception as exc:  # run_rollout classifies everything; this is the last line of defence
            result = Result.failed(request, "infrastructure", Failure.from_exception(exc))
        finally:
            self._running.pop(request.request_id, None)
            self._done += 1
        result.worker = self._name
        log_failure(log, result)  # classified here, so logged here (once)
        return result.model_dump_json()  # were it not JSON, the plane reports the error as the result

    async def cancel(self, request_id: str | None = None) -> int:
        """Cancel one rollout (or all with `None`). Each comes back from `run` as `cancelled`."""
        targets = list(self._running.values()) if request_id is None else [self._running.get(request_id)]
        count = 0
        for task in targets:
            if task is not None and not task.done():
                task.cancel()
                count += 1
        return count

    def policy_version(self) -> int | None:
        """The full-weight version the servers sample under, as the plane last said (None: never said)."""
        return self._weights_version

    async def set_policy_version(self, version: int) -> None:
        """Told by `RolloutPlane.update_weights` before the servers resume: turns sent from now on carry
        this version's `cache_salt`."""
        self._weights_version = version

    def pause_epoch(self) -> int:
        """How many pauses the plane has announced (a rollout compares it before and after a call)."""
        return self._pause_epoch

    async def begin_planned_pause(self) -> None:
        """The plane is about to pause the servers in `abort` mode: a turn that comes back aborted from now
        on was stopped by the plane and resumes from its tokens once `end_planned_pause` says so."""
        self._pause_epoch += 1
        self._unpaused.clear()

    async def end_planned_pause(self) -> None:
        self._unpaused.set()

    async def unpaused(self, timeout: float) -> None:
        """Return at once, or (while the plane pauses the servers in abort mode, which refuses new
        requests with 503) when it resumed them; at most `timeout`."""
        if self._unpaused.is_set():  # every turn asks: no task or timer for the common case
            return
        await asyncio.wait_for(self._unpaused.wait(), timeout)

    async def planned_resume(self, since_epoch: int, timeout: float) -> bool:
        """True when the plane paused the servers since `since_epoch` (the abort was ours); waits, at most
        `timeout`, until it resumed them. False: nobody here asked for it."""
        if self._pause_epoch == since_epoch:
            return False
        await asyncio.wait_for(self._unpaused.wait(), timeout)
        return True

    async def ping(self) -> RolloutWorkerInfo:
        """Readiness: answered on the rollout event loop, whose heartbeat it starts."""
        self._loop_watch.bind()
        return RolloutWorkerInfo(
            actor_id=ray.get_runtime_context().get_actor_id(),
            pid=os.getpid(),
            in_flight=len(self._running),
            done=self._done,
        )

    @ray.method(concurrency_group=PROBE_GROUP, num_returns="streaming")
    async def heartbeats(self, interval_s: float) -> AsyncIterator[float]:
        """The rollout loop's stall (seconds without progress), every `interval_s`, for as long as the
        caller reads: one call, many answers. Answers of a call already running travel back on their
        own, so they are not queued behind the thousands of `run` calls a loaded worker is still
        receiving (a fresh call is: measured, 4-6 s on two cores when a lost worker's rollouts land)."""
        next_beat = 0.0
        while True:
            self._loop_watch.sample()
            if time.monotonic() >= next_beat:
                next_beat = time.monotonic() + interval_s
                stall = self._loop_watch.stall_s()
                LOOP_STALL.record(stall, {"worker": self._name})
                yield stall
            await asyncio.sleep(HEARTBEAT_S)

    async def debug_resources(self, port: int | None = None) -> dict[str, Any]:
        """Debug endpoint, not used by the plane: what this process holds (open clients, established TCP
        connections, optionally to one port, threads, RSS, rollouts running, batched calls sent: (calls,
        items) by kind, the batch window, what garbage collection cost: `kernel.collector`, and the agent
        endpoint's routes and connections: `agent.endpoint.endpoint_stats`), for leak
        checks in tests and `bench_plane.py`, and for an operator chasing a leak or a cost. It walks the
        heap: call it rarely."""
        import psutil

        proc = psutil.Process()
        conns = [
            c
            for c in proc.net_connections(kind="tcp")
            if c.raddr and (port is None or c.raddr.port == port) and c.status == psutil.CONN_ESTABLISHED
        ]
        return {
            "open_clients": open_client_count(),
            "connections": len(conns),
            "threads": threading.active_count(),
            "os_threads": proc.num_threads(),
            "rss": proc.memory_info().rss,
            "pid": os.getpid(),
            "in_flight": len(self._running),
            "batches": batch_counts(),
            "batch_window_s": batch_window(),
            "collector": collector_stats(),
            "agent": endpoint_stats(),
        }


def remote_worker_class(num_cpus: float) -> Any:
    # SPREAD: workers land on different nodes where there are several, so one node loss costs a fraction.
    return ray.remote(
        num_cpus=num_cpus,
        max_concurrency=MAX_ROLLOUTS_PER_WORKER,
        concurrency_groups={PROBE_GROUP: PROBE_GROUP_SIZE},
        max_restarts=0,
        scheduling_strategy="SPREAD",
    )(RolloutWorker)
