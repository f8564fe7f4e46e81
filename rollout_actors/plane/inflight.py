"""What the dispatcher holds and what it talks to: one `InFlight` record per request, the bounded memory
of answered leases, and the protocols of its plane, workers and pools (`RayWorkerCalls`: the worker calls
over Ray, the one place the dispatcher meets it). See `dispatcher.py`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from rollout_actors.kernel import How
from rollout_actors.kernel.faults import ray_part_lost
from rollout_actors.timings import RolloutTimings, clock
from rollout_actors.wire import Ref, Result, RolloutRequest

ANSWERED_LEASES_KEPT = 100_000
"""Answered leases remembered to refuse a caller naming one again: about 12 MB of ids (measured), the last
quarter hour of a plane answering 100 rollouts a second. Older ones are forgotten; a late answer never needs
them (it is matched against open records), only a caller resubmitting a lease that long after is not refused."""


# ------------------------------------------------------------------------------------ what it talks to


@dataclass(frozen=True)
class PolicyChoice:
    """The policy one request samples from, as the plane chose it when its dispatch began."""

    version: int
    model: str | None = None
    """The served name of the adapter it samples from; None: the request's own model (full weights)."""
    checked_out: int | None = None
    """The adapter version checked out for the rollout, checked in when its dispatch ends."""


class DispatchHost(Protocol):
    """What the dispatcher asks of the plane it serves (`RolloutPlane`; a fake in the unit tests)."""

    @property
    def policy_version(self) -> int: ...

    def checkout_policy(self, wanted: int | None) -> PolicyChoice:
        """The policy for a request pinning `wanted` (None: the active one); `CallerError` if not loaded."""
        ...

    def checkin_policy(self, choice: PolicyChoice) -> None: ...

    def deliver(self, result: Result) -> None:
        """Route an answered result to whoever waits for it."""
        ...


class Workers(Protocol):
    """The rollout workers (`worker_set.WorkerSet`): picked, counted, declared lost."""

    async def pick_or_wait(self, timeout: float) -> Any: ...

    def dispatched(self, slot: Any) -> None: ...

    def finished(self, slot: Any) -> None: ...

    def declare_lost(self, slot: Any, cause: str, how: How = "died") -> None: ...


class WorkerCalls(Protocol):
    """The two calls a dispatch makes on a worker."""

    def run(self, slot: Any, dispatch: bytes) -> asyncio.Future[str]:
        """Start one dispatch; the future holds the worker's JSON answer, or raises `PartLost` when the
        worker was lost with it."""
        ...

    async def cancel(self, slot: Any, request_id: str) -> None: ...


class Route(Protocol):
    def wire(self) -> tuple[str, str | None]: ...


class Pools(Protocol):
    """The shared pools (`shared_pools.SharedPools`). Failures are raised as `Fault`s."""

    def env_pool_started(self, env: Ref) -> bool: ...

    async def ensure_env_pool(self, env: Ref) -> None: ...

    async def route(self, request: RolloutRequest, timeout: float, verify: bool = False) -> Route: ...

    def renderer_pool(self) -> Any:
        """The serving renderer pool's handle, or None while there is none."""
        ...


class RayWorkerCalls:
    """`WorkerCalls` on `RolloutWorker` actors. Ray's word on a lost worker becomes `PartLost` here."""

    def run(self, slot: Any, dispatch: bytes) -> asyncio.Future[str]:
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        reply = asyncio.wrap_future(slot.handle.run.remote(dispatch).future())
        reply.add_done_callback(lambda done: _settle(answer, done, slot.name))
        return answer

    async def cancel(self, slot: Any, request_id: str) -> None:
        await slot.handle.cancel.remote(request_id)


def _settle(answer: asyncio.Future[str], reply: asyncio.Future[Any], worker: str) -> None:
    if reply.cancelled():
        answer.cancel()
        return
    exc = reply.exception()
    if exc is None:
        answer.set_result(reply.result())
        return
    answer.set_exception(ray_part_lost(exc, "worker", worker, call="run") or exc)


# ------------------------------------------------------------------------------------------ records


@dataclass(eq=False)
class InFlight:
    """One accepted request until its answer: everything the plane knows of it, in one place."""

    request: RolloutRequest
    """The caller's request as validated: never rewritten (what the plane decides goes in `Dispatch`)."""
    submitted_at: float = field(default_factory=time.time)
    submitted_clock: float = field(default_factory=clock)
    """When it was accepted (wall clock, `timings.clock`): its waits start here."""
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)
    cancel_reason: tuple[str, str] | None = None
    """(failure type, why) when the plane decided the cancellation (group, stale, overload)."""
    waits: RolloutTimings = field(default_factory=RolloutTimings)
    """The plane's waits so far, stamped on its result."""
    policy: PolicyChoice | None = None
    """Once its dispatch began: the policy it samples from."""
    endpoint: str | None = None
    """While it is being dispatched: the inference endpoint the plane routed it to."""
    placed: int = 0
    """When it was routed to `endpoint`, as a sequence number (the controller cancels the youngest)."""
    slot: Any = None
    """The worker running its current dispatch; None while it is being placed or between dispatches."""
    answered: bool = False


class AnsweredLeases:
    """The latest `limit` answered leases; the oldest is forgotten first."""

    def __init__(self, limit: int = ANSWERED_LEASES_KEPT) -> None:
        self.limit = limit
        self._order: deque[str] = deque()
        self._leases: set[str] = set()

    def add(self, lease_id: str) -> None:
        if lease_id in self._leases:
            return
        self._leases.add(lease_id)
        self._order.append(lease_id)
        if len(self._order) > self.limit:
            self._leases.discard(self._order.popleft())

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._leases

    def __len__(self) -> int:
        return len(self._order)
