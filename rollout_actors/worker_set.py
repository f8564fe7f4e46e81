"""The plane's set of `RolloutWorker` actors: spawn, watch, declare lost, replace, pick the least loaded.

A worker is lost when Ray says it died, or when nothing shows it alive for `hang_timeout_s`: its
heartbeats stopped (a frozen process, a hung node: Ray alone would leave those calls pending), or they
report its rollout loop stalled (one synchronous call blocking it). Load alone is not a sign of death:
the heartbeats come from the worker's own probe loop over one long-lived streaming call (see
`worker.py`), so they are not queued behind the rollouts a loaded worker is still receiving, and the
silence the plane holds against a worker is counted only while the plane itself was listening (a driver
whose own loop stalled does not blame the workers for it). A lost worker is killed and replaced, every
rollout waiting on it is told at once through `lost`, so the plane can re-dispatch without waiting for
Ray to notice, and `on_lost` lets the owners of what its rollouts held (env sessions, renderer leases)
release it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from rollout_actors.config import WORKER_RESTARTS
from rollout_actors.kernel import How
from rollout_actors.kernel.faults import ray_loss
from rollout_actors.kernel.supervision import Liveness, RestartBudget, RestartIntensity
from rollout_actors.naming import PoolNames
from rollout_actors.rollout import LoopLimits
from rollout_actors.worker import remote_worker_class

log = logging.getLogger(__name__)

WORKER_READY_TIMEOUT_S = 60.0  # a fresh worker process imports openai, ray and pydantic: seconds, not minutes
SUSPECT_AFTER_BEATS = 3  # heartbeats missed before a worker gets no new work (while others can take it)
JUDGE_TICK_S = 0.25  # how often silence is judged: a loss is declared within hang_timeout_s + this
DRIVER_STALL_S = 1.0  # a judge tick this late means the plane's own loop stalled: that time is not silence


@dataclass
class WorkerSlot:
    name: str
    handle: Any
    in_flight: int = 0
    alive: bool = True
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    cause: str = ""
    how: How = "died"
    """How it was lost, once `cause` is set: `died` (Ray said so) or `wedged` (judged silent)."""
    owner: str | None = None
    """The worker's actor id: the owner tag of the env sessions and renderer leases its rollouts take."""
    life: Liveness = field(default_factory=lambda: Liveness(hang_timeout_s=float("inf")))
    """When the worker last showed life (a heartbeat read, minus the stall its rollout loop reported);
    its hang timeout is set by the `WorkerSet` that spawns it."""
    peak: int = 0
    """The most rollouts it held at once."""
    last_answer: float = 0.0
    """When its last heartbeat was read (0: never)."""
    last_stall_s: float = 0.0
    """The rollout-loop stall its last heartbeat reported."""


class WorkerSet:
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
        self._names = names
        self._size = size
        self._cls = remote_worker_class(num_cpus)
        self._hang_timeout_s = hang_timeout_s
        self._probe_interval_s = probe_interval_s
        self._limits = limits
        self._capacity = capacity
        """Rollouts one worker is sized for. Beyond it, a dispatch waits for a replacement being started
        rather than pile a dead worker's rollouts onto one survivor; with none coming, it overfills."""
        self._budget = RestartBudget(restarts)
        self._on_lost = on_lost
        self._serial = 0
        self.slots: list[WorkerSlot] = []
        self.lost_count = 0
        self._replacing = 0
        self._changed = asyncio.Event()
        """Pulsed (set, then replaced) whenever a worker is admitted, a replacement gives up, or a dispatch
        ends (load went down)."""
        self._tasks: set[asyncio.Task[None]] = set()
        """Heartbeat watchers, the judge and replacements: owned here, cancelled in `close`."""
        self._closed = False

    async def start(self) -> None:
        slots = [self._spawn() for _ in range(self._size)]
        await asyncio.gather(*(self._wait_ready(slot) for slot in slots))
        for slot in slots:
            self._admit(slot)
        self._own(self._judge())

    def _spawn(self) -> WorkerSlot:
        self._serial += 1
        name = f"{self._names.prefix}/worker-{self._serial}"
        handle = self._cls.options(name=name).remote(self._limits, name)
        return WorkerSlot(name=name, handle=handle, life=Liveness(self._hang_timeout_s))

    async def _wait_ready(self, slot: WorkerSlot) -> None:
        try:
            info = await asyncio.wait_for(slot.handle.ping.remote(), WORKER_READY_TIMEOUT_S)
        except BaseException:
            ray.kill(slot.handle, no_restart=True)
            raise
        slot.owner = info.get("actor_id")

    def _admit(self, slot: WorkerSlot) -> None:
        slot.life.heard()
        self._own(self._watch(slot))
        self.slots.append(slot)
        self._signal()

    def _own(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------------------------ dispatch

    def live(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.alive]

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
        quiet_after = time.monotonic() - SUSPECT_AFTER_BEATS * self._probe_interval_s
        heard = [s for s in live if s.life.last_alive >= quiet_after] or live
        return min(heard, key=lambda s: s.in_flight) if heard else None

    async def pick_or_wait(self, timeout: float = WORKER_READY_TIMEOUT_S) -> WorkerSlot | None:
        """The least-loaded live worker with room. When every live one is at capacity (or none is live)
        and a replacement is being started, wait for it or for room, up to `timeout`; with none coming,
        the least-loaded live worker regardless, or `None` at once rather than queue."""
        deadline = time.monotonic() + min(timeout, WORKER_READY_TIMEOUT_S)
        while (slot := self.pick(within_capacity=True)) is None and self._replacing > 0:
            try:
                await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        return slot or self.pick()

    def dispatched(self, slot: WorkerSlot) -> None:
        slot.in_flight += 1
        slot.peak = max(slot.peak, slot.in_flight)

    def finished(self, slot: WorkerSlot) -> None:
        slot.in_flight -= 1
        if self._capacity is not None and slot.in_flight == self._capacity - 1:
            self._signal()  # room again below capacity: a dispatch waiting for it may go

    # ------------------------------------------------------------------------------------ liveness

    async def _watch(self, slot: WorkerSlot) -> None:
        """Read one worker's heartbeat stream until it is lost. Dead: lost now. Silent or stalled:
        `_judge` decides against `hang_timeout_s`. A stream that ends without a death is opened again."""
        while slot.alive and not self._closed:
            try:
                async for beat in slot.handle.heartbeats.remote(self._probe_interval_s):
                    slot.last_stall_s = float(await beat)
                    slot.last_answer = time.monotonic()
                    slot.life.heard(slot.last_stall_s, now=slot.last_answer)
            except asyncio.CancelledError:
                return
            except Exception as exc:
                if ray_loss(exc) is not None:
                    self.declare_lost(slot, f"actor died: {type(exc).__name__}")
                    return
                # The stream broke without a death: silence meanwhile, judged as such.
                log.warning("heartbeat stream of %s broke (%s); reopening", slot.name, exc)
            await asyncio.sleep(self._probe_interval_s)

    async def _judge(self) -> None:
        last = time.monotonic()
        while not self._closed:
            await asyncio.sleep(JUDGE_TICK_S)
            now = time.monotonic()
            stalled = now - last - JUDGE_TICK_S
            last = now
            if stalled > DRIVER_STALL_S:
                # The plane's own loop stalled: no heartbeat could be read meanwhile. That time is
                # not the workers' silence; judge again once their answers have been read.
                for slot in self.live():
                    slot.life.excuse(stalled, now)
                continue
            for slot in self.live():
                if slot.life.wedged(now):
                    silent = slot.life.silent_s(now)
                    heard = (
                        f"last heartbeat {now - slot.last_answer:.1f} s ago, reporting a "
                        f"{slot.last_stall_s:.1f} s rollout-loop stall"
                        if slot.last_answer
                        else "no heartbeat yet"
                    )
                    self.declare_lost(
                        slot,
                        f"no sign of life for {silent:.1f} s (hang_timeout_s={self._hang_timeout_s:g}; "
                        f"{heard}): frozen, its rollout loop blocked, or its node gone",
                        how="wedged",
                    )

    def declare_lost(self, slot: WorkerSlot, cause: str, how: How = "died") -> None:
        """Retire a worker from dispatch at once, wake everything waiting on it, kill it, have what its
        rollouts held released, replace it."""
        if not slot.alive:
            return
        slot.alive = False
        slot.cause = cause
        slot.how = how
        slot.lost.set()
        self.lost_count += 1
        log.warning("rollout worker %s lost: %s", slot.name, cause)
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:  # already gone
            pass
        self.slots.remove(slot)
        if self._on_lost is not None:
            try:
                self._on_lost(slot)
            except Exception:
                log.exception("releasing what rollout worker %s held", slot.name)
        if self._closed:
            return
        if self._budget.try_spend():
            self._replacing += 1
            self._own(self._replace())
        else:
            log.error("rollout worker %s not replaced: %s", slot.name, self._budget.spent_message())
        self._signal()

    async def _replace(self) -> None:
        """Counted in `_replacing` from the moment the loss is declared, so a re-dispatch issued in the
        same tick waits for this replacement instead of failing for want of a live worker."""
        try:
            while True:
                slot = self._spawn()
                try:
                    await self._wait_ready(slot)
                    break
                except Exception as exc:
                    log.error("replacement rollout worker %s failed to start: %s", slot.name, exc)
                    # E.g. Ray placed it on a node being lost and not yet declared dead: try again, on the
                    # budget (a worker that cannot start at all spends it and stops).
                    if self._closed or not self._budget.try_spend():
                        return
            if self._closed:
                ray.kill(slot.handle, no_restart=True)
                return
            self._admit(slot)
        finally:
            self._replacing -= 1
            self._signal()

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        for slot in list(self.slots):
            try:
                ray.kill(slot.handle, no_restart=True)
            except Exception:
                pass
        self.slots.clear()
