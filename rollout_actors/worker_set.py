"""The plane's set of `RolloutWorker` actors: spawn, probe, declare lost, replace, pick the least loaded.

A worker is lost when Ray says it died, or when it stops answering its liveness probe for `hang_timeout_s`
(a blocked event loop, a frozen process, a hung node: Ray alone would leave those calls pending). A lost
worker is killed and replaced, and every rollout waiting on it is told at once through `lost`, so the plane
can re-dispatch without waiting for Ray to notice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from rollout_actors.config import WORKER_RESTARTS
from rollout_actors.kernel import RestartBudget, RestartIntensity
from rollout_actors.naming import PoolNames
from rollout_actors.rollout import LoopLimits
from rollout_actors.worker import remote_worker_class

log = logging.getLogger(__name__)

WORKER_READY_TIMEOUT_S = 60.0  # a fresh worker process imports openai, ray and pydantic: seconds, not minutes


@dataclass
class WorkerSlot:
    name: str
    handle: Any
    in_flight: int = 0
    alive: bool = True
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    cause: str = ""


class WorkerSet:
    def __init__(
        self,
        names: PoolNames,
        size: int,
        num_cpus: float,
        hang_timeout_s: float,
        probe_interval_s: float,
        limits: LoopLimits,
        restarts: RestartIntensity = WORKER_RESTARTS,
    ) -> None:
        self._names = names
        self._size = size
        self._cls = remote_worker_class(num_cpus)
        self._hang_timeout_s = hang_timeout_s
        self._probe_interval_s = probe_interval_s
        self._limits = limits
        self._budget = RestartBudget(restarts)
        self._serial = 0
        self.slots: list[WorkerSlot] = []
        self.lost_count = 0
        self._replacing = 0
        self._changed = asyncio.Event()
        """Pulsed (set, then replaced) whenever a worker is admitted or a replacement gives up."""
        self._tasks: set[asyncio.Task[None]] = set()
        """Probe loops and replacements: owned here, cancelled in `close`."""
        self._closed = False

    async def start(self) -> None:
        slots = [self._spawn() for _ in range(self._size)]
        await asyncio.gather(*(self._wait_ready(slot) for slot in slots))
        for slot in slots:
            self._admit(slot)

    def _spawn(self) -> WorkerSlot:
        self._serial += 1
        name = f"{self._names.prefix}/worker-{self._serial}"
        handle = self._cls.options(name=name).remote(self._names, self._limits, name)
        return WorkerSlot(name=name, handle=handle)

    async def _wait_ready(self, slot: WorkerSlot) -> None:
        try:
            await asyncio.wait_for(slot.handle.ping.remote(), WORKER_READY_TIMEOUT_S)
        except Exception:
            ray.kill(slot.handle, no_restart=True)
            raise

    def _admit(self, slot: WorkerSlot) -> None:
        self._own(self._probe_loop(slot))
        self.slots.append(slot)
        self._signal()

    def _own(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _signal(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def live(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.alive]

    async def broadcast(self, method: str, *args: Any, timeout_s: float = 30.0) -> None:
        """Call `method` on every live worker, each under `timeout_s`. A worker that does not answer is
        left to liveness probing (it would be lost anyway); nothing here raises for it."""
        calls = [asyncio.wait_for(getattr(s.handle, method).remote(*args), timeout_s) for s in self.live()]
        await asyncio.gather(*calls, return_exceptions=True)

    def pick(self) -> WorkerSlot | None:
        live = self.live()
        return min(live, key=lambda s: s.in_flight) if live else None

    async def pick_or_wait(self) -> WorkerSlot | None:
        """The least-loaded live worker. With none live, wait for a replacement already being started
        (bounded by its readiness deadline); with none coming, answer `None` at once rather than queue."""
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while (slot := self.pick()) is None and self._replacing > 0:
            try:
                await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                return None
        return slot

    async def _probe_loop(self, slot: WorkerSlot) -> None:
        while slot.alive and not self._closed:
            try:
                await asyncio.wait_for(slot.handle.ping.remote(), self._hang_timeout_s)
            except TimeoutError:
                self.declare_lost(slot, f"no liveness answer within hang_timeout={self._hang_timeout_s:g} s")
                return
            except ray.exceptions.RayActorError as exc:
                self.declare_lost(slot, f"actor died: {type(exc).__name__}")
                return
            except asyncio.CancelledError:
                return
            await asyncio.sleep(self._probe_interval_s)

    def declare_lost(self, slot: WorkerSlot, cause: str) -> None:
        """Retire a worker from dispatch at once, wake everything waiting on it, kill it, replace it."""
        if not slot.alive:
            return
        slot.alive = False
        slot.cause = cause
        slot.lost.set()
        self.lost_count += 1
        log.warning("rollout worker %s lost: %s", slot.name, cause)
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:  # already gone
            pass
        self.slots.remove(slot)
        if self._closed:
            return
        if self._budget.try_spend():
            self._replacing += 1
            self._own(self._replace())
        else:
            log.error("rollout worker %s not replaced: %s", slot.name, self._budget.spent_message())

    async def _replace(self) -> None:
        """Counted in `_replacing` from the moment the loss is declared, so a re-dispatch issued in the
        same tick waits for this replacement instead of failing for want of a live worker."""
        try:
            slot = self._spawn()
            try:
                await self._wait_ready(slot)
            except Exception as exc:
                log.error("replacement rollout worker %s failed to start: %s", slot.name, exc)
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
