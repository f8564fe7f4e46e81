"""The plane's `RolloutWorker` actors: a child spec for the kernel's `Supervisor`, and their placement.

The kernel decides what a loss means (Ray says it died, or nothing showed it alive for `hang_timeout_s`)
and replaces it on the budget. The spec declares the rest as data: readiness is `ping` (which starts the
rollout loop's `LoopWatch`; its answer names the worker's actor id); signs of life come over one
long-lived streaming call (`heartbeats`, see `worker.py`), so they are not queued behind the rollouts a
loaded worker is still receiving; the set is kept at its size (`floor`). What is the workers' own: the
least-loaded pick, and `on_lost`, which lets the owners of what a lost worker's rollouts held (env
sessions, renderer slots) release it; its `gone` tells every rollout waiting on it at once, so the plane
can re-dispatch without waiting for Ray to notice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_actors.kernel import How
from rollout_actors.kernel.supervision import RestartIntensity, Supervision
from rollout_actors.kernel.supervisor import Child, ChildKind, ChildSpec, RetireCause, Supervisor
from rollout_actors.plane.config import WORKER_RESTARTS
from rollout_actors.plane.naming import PoolNames
from rollout_actors.rollout.loop import LoopLimits
from rollout_actors.rollout.worker import remote_worker_class

log = logging.getLogger(__name__)

WORKER_READY_TIMEOUT_S = 60.0  # a fresh worker process imports openai, ray and pydantic: seconds, not minutes
SUSPECT_AFTER_BEATS = 3  # heartbeats missed before a worker gets no new work (while others can take it)


@dataclass(eq=False)
class WorkerSlot(Child):
    in_flight: int = 0
    owner: str | None = None
    """The worker's actor id: the owner tag of the env sessions and renderer slots its rollouts take."""
    peak: int = 0
    """The most rollouts it held at once."""

    @property
    def alive(self) -> bool:
        return self.state != "retired"

    @property
    def how(self) -> How:
        """How it was lost, once `gone` says it was: `wedged` (judged silent) or `died` (Ray said so)."""
        return "wedged" if self.gone.done() and self.gone.result()[1] == "wedged" else "died"


class WorkerSet(ChildKind[WorkerSlot]):
    """Owns the workers, their heartbeats and their replacements; the plane only picks and declares.

    workers = WorkerSet(names, size=4, num_cpus=1, hang_timeout_s=30, probe_interval_s=2,
                        limits=LoopLimits(), capacity=1024, on_lost=release_what_it_held)
    await workers.start()
    slot = await workers.pick_or_wait(timeout=60)   # least loaded below capacity
    ...
    await workers.close()
    """

    def __init__(
        self,
        names: PoolNames,
        size: int,
        num_cpus: float,
        hang_timeout_s: float,
        probe_interval_s: float,
        limits: LoopLimits,
        restarts: RestartIntensity = WORKER_RESTARTS,
        capacity: int | None = None,
        on_lost: Callable[[WorkerSlot], None] | None = None,
    ) -> None:
        self.num_cpus = num_cpus
        """Each worker's CPU request, from the next spawn on (the plane fits it to the cluster at start)."""
        self._capacity = capacity
        """Rollouts one worker is sized for. Beyond it, a dispatch waits for a replacement being started
        rather than pile a dead worker's rollouts onto one survivor; with none coming, it overfills."""
        self._on_lost = on_lost
        settings = Supervision.read(
            restart=restarts,
            ready_timeout_s=WORKER_READY_TIMEOUT_S,
            probe_interval_s=probe_interval_s,
            hang_timeout_s=hang_timeout_s,
        )
        spec = ChildSpec(
            kind="rollout worker",
            actor=remote_worker_class(num_cpus),
            options=lambda name: {"name": name, "num_cpus": self.num_cpus},
            args=lambda name: (limits, name),
            name=lambda n: f"{names.prefix}/worker-{n + 1}",
            record=WorkerSlot,
            ready="ping",
            read_ready=_read_owner,
            liveness="stream",
            probe="heartbeats",
            probe_args=lambda settings: (settings.probe_interval_s,),
        )
        self.supervisor = Supervisor("rollout workers", spec, settings, self)
        self.supervisor.floor = size

    # ------------------------------------------------------------------------------------ its life

    @property
    def floor(self) -> int:
        """How many workers it keeps."""
        return self.supervisor.floor

    @property
    def deaths(self) -> int:
        return self.supervisor.deaths

    async def start(self) -> list[WorkerSlot]:
        return await self.supervisor.start()

    async def close(self) -> None:
        await self.supervisor.close()

    # ------------------------------------------------------------------------------------ dispatch

    def live(self) -> list[WorkerSlot]:
        return self.supervisor.ready()

    async def broadcast(self, method: str, *args: Any, timeout_s: float = 30.0) -> None:
        """Call `method` on every live worker, each under `timeout_s`. A worker that does not answer is
        left to liveness probing (it would be lost anyway); nothing here raises for it."""
        calls = [asyncio.wait_for(getattr(s.handle, method).remote(*args), timeout_s) for s in self.live()]
        await asyncio.gather(*calls, return_exceptions=True)

    def pick(self, within_capacity: bool = False) -> WorkerSlot | None:
        """The least-loaded live worker (with room, if asked), preferring those heard from lately: a worker
        whose heartbeats are overdue may be frozen or cut off, and what it is given meanwhile is lost with
        it; it is given work only when no other worker can take it."""
        live = self.live()
        if within_capacity and self._capacity is not None:
            live = [s for s in live if s.in_flight < self._capacity]
        quiet_s = SUSPECT_AFTER_BEATS * self.supervisor.settings.probe_interval_s
        heard = self.supervisor.heard_lately(live, quiet_s)
        return min(heard, key=lambda s: s.in_flight) if heard else None

    async def pick_or_wait(self, timeout: float = WORKER_READY_TIMEOUT_S) -> WorkerSlot | None:
        """The least-loaded live worker with room. When every live one is at capacity (or none is live)
        and a replacement is being started, wait for it or for room, up to `timeout`; with none coming,
        the least-loaded live worker regardless, or `None` at once rather than queue."""
        wait_s = min(timeout, WORKER_READY_TIMEOUT_S)
        return await self.supervisor.wait_for(lambda: self.pick(within_capacity=True), wait_s) or self.pick()

    def dispatched(self, slot: WorkerSlot) -> None:
        slot.in_flight += 1
        slot.peak = max(slot.peak, slot.in_flight)

    def finished(self, slot: WorkerSlot) -> None:
        slot.in_flight -= 1
        if self._capacity is not None and slot.in_flight == self._capacity - 1:
            self.supervisor.wake()  # room again below capacity: a dispatch waiting for it may go

    def declare_lost(self, slot: WorkerSlot, cause: str, how: How = "died") -> None:
        """Retire a worker from dispatch at once (a call to it said it is lost): the kernel's `retire`."""
        self.supervisor.retire(slot, cause, "wedged" if how == "wedged" else "died")

    # ------------------------------------------------------------------------- the kind's hooks

    def on_retired(self, slot: WorkerSlot, reason: str, cause: RetireCause) -> None:
        if self._on_lost is not None and cause in ("died", "wedged"):
            try:
                self._on_lost(slot)
            except Exception:
                log.exception("releasing what rollout worker %s held", slot.name)


def _read_owner(slot: WorkerSlot, info: Any) -> None:
    slot.owner = info.actor_id
