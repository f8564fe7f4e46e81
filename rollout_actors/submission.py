"""The plane's public half: submitting rollouts and groups, cancelling them, reading results per lane.

`RolloutPlane` (plane.py) is built from this and its dispatch half. Here, a request goes from `submit` /
`submit_group` through validation and its lane (back-pressure) to `_drive`; an answered result comes back
through `_deliver`, which stamps what only the plane knows (end version, why it cancelled) and routes it
(`streams.py`). Groups are `groups.py`; off-policy cancellation is `staleness.py`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from rollout_actors.groups import Group, GroupHandle, Stragglers
from rollout_actors.kernel import RefResolver
from rollout_actors.lanes import Lane, Lanes
from rollout_actors.metrics import PlaneMetrics
from rollout_actors.staleness import STALE, OffPolicyGuard
from rollout_actors.streams import ResultStreams
from rollout_actors.timings import clock
from rollout_actors.wire import CallerError, Failure, Result, RolloutRequest, new_id, valid_id
from rollout_actors.worker_set import WorkerSlot

log = logging.getLogger(__name__)

MAX_GROUP_SIZE = 65_536  # rollouts per submit_group call: far past any GRPO group, short of a typo's 10**9


class Submission:
    """Mixed into `RolloutPlane`; the attributes below are set up by its `__init__`."""

    config: Any
    lanes: Lanes
    counters: Counter[str]
    _refs: RefResolver
    _endpoints: Callable[[], Sequence[str]]
    _metrics: PlaneMetrics
    _streams: ResultStreams
    _guard: OffPolicyGuard
    _tasks: set[asyncio.Task[Any]]
    _running: dict[str, WorkerSlot]
    _cancelled: dict[str, asyncio.Event]
    _cancel_reasons: dict[str, tuple[str, str]]
    _submitted_at: dict[str, tuple[float, float]]
    """request id -> (failure type, why) for cancellations the plane decided (group, stale)."""
    _started: bool

    if TYPE_CHECKING:  # the dispatch half, in plane.py
        policy_version: int

        def _answer(self, result: Result) -> None: ...

        def _answer_refusal(self, result: Result) -> None: ...

        _open_leases: set[str]
        _answered: set[str]

        async def _drive(self, request: RolloutRequest, lane: Lane) -> None: ...

    # submission ------------------------------------------------------------------------------------
    async def submit(self, request: RolloutRequest | dict[str, Any]) -> str:
        """Queue one rollout; waits while its lane is full. Returns its request id; the result comes out of
        `next_result` / `drain`. Never raises for a bad request: that comes back as exactly one `caller`
        result naming the field at fault."""
        self._require_started("submit")
        checked = self._check(request)
        self._streams.expect_result(checked.lane)
        if isinstance(checked, Result):
            self._answer_refusal(checked)
        else:
            try:
                await self._enter(checked, self.lanes.get(checked.lane))
            except asyncio.CancelledError:  # the caller gave up waiting: nothing was submitted
                self._streams.expect_result(checked.lane, -1)
                self._cancelled.pop(checked.request_id, None)
                self._open_leases.discard(checked.lease_id)
                self._submitted_at.pop(checked.request_id, None)
                self.counters["submitted"] -= 1
                raise
        return checked.request_id

    async def submit_group(
        self,
        request: RolloutRequest | dict[str, Any],
        n: int,
        *,
        stragglers: Stragglers | None = None,
        one_policy: bool = False,
    ) -> GroupHandle:
        """`n` rollouts of one task under one group id, with consecutive seeds. Returns the handle at once,
        ids assigned; members then wait for their lane in the background (`await handle.admitted()` waits
        with them). `one_policy`: every member samples from the version active when the first starts.
        An invalid request gives a group of `n` `caller` results, complete at once; an invalid `n`, a group
        of one `caller` result naming it. Neither raises."""
        self._require_started("submit_group")
        raw = request.model_dump() if isinstance(request, BaseModel) else request
        group_id = (valid_id(raw.get("group_id")) if isinstance(raw, dict) else None) or new_id("group")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_GROUP_SIZE:
            self.counters["submitted"] += 1
            wrong_n = CallerError(f"n: must be an int in [1, {MAX_GROUP_SIZE}], got {n!r:.40}")
            members: list[RolloutRequest | Result] = [Result.refused(raw, None, wrong_n, group_id)]
        elif not isinstance(raw, dict):
            self.counters["submitted"] += n
            not_a_request = CallerError(f"request: a RolloutRequest or a dict, got {type(raw).__name__}")
            members = [Result.refused(raw, None, not_a_request, group_id) for _ in range(n)]
        else:
            members = [self._check(_member(raw, group_id, i)) for i in range(n)]
        lane = members[0].lane
        handle = GroupHandle(
            self,
            group_id,
            lane,
            [m.request_id for m in members],
            stragglers=stragglers,
            one_policy=one_policy,
        )
        self._streams.expect_group(handle)
        self.spawn(self._admit_group(handle, members))
        return handle

    def _check(self, request: RolloutRequest | dict[str, Any]) -> RolloutRequest | Result:
        """The validated request, or its `caller` result."""
        self.counters["submitted"] += 1
        try:
            checked = self._validated(request)
        except Exception as exc:  # whatever a payload makes validation raise, it is the payload's fault
            if not isinstance(exc, (ValidationError, CallerError, KeyError)):
                log.warning("request refused by an unexpected %s", type(exc).__name__, exc_info=exc)
            given = (
                request.get("request_id")
                if isinstance(request, dict)
                else getattr(request, "request_id", None)
            )
            return Result.refused(request, given, exc)
        self._metrics.submitted(checked.lane)
        self._submitted_at[checked.request_id] = (time.time(), clock())  # its waits start here
        self._cancelled[checked.request_id] = asyncio.Event()
        self._open_leases.add(checked.lease_id)
        return checked

    def _validated(self, request: Any) -> RolloutRequest:
        checked = RolloutRequest.model_validate(request)
        self.lanes.get(checked.lane)
        self._refs.check_allowed(checked.env.target)
        if checked.client.base_url is None and not list(self._endpoints()):
            raise CallerError("client.base_url is not set and the plane has no endpoints")
        if (
            checked.lease_id in self._open_leases
            or checked.lease_id in self._answered
            or checked.request_id in self._cancelled
        ):
            explicit = checked.model_fields_set & {"request_id", "lease_id"}
            if explicit:
                # A lease runs once (contract 5): a caller that names one twice gets a refusal, not a rerun.
                field = "lease_id" if "lease_id" in explicit else "request_id"
                raise CallerError(f"{field}: already submitted to this plane ({getattr(checked, field)!r})")
            # The same request object (its ids are defaults) submitted again: a new rollout of its own.
            checked = checked.model_copy(update={"request_id": new_id("req"), "lease_id": new_id("lease")})
        return checked

    async def _admit_group(self, handle: GroupHandle, members: list[RolloutRequest | Result]) -> None:
        for member in members:
            if isinstance(member, Result):
                self._answer_refusal(member)
            else:
                if handle.one_policy and member.policy_version is None:
                    if handle.pinned_version is None:
                        handle.pinned_version = self.policy_version
                    member = member.model_copy(update={"policy_version": handle.pinned_version})
                await self._enter(member, self.lanes.get(member.lane))
            handle._member_admitted()

    async def _enter(self, request: RolloutRequest, lane: Lane) -> None:
        """Wait for a lane slot, then start the rollout. One cancelled while it waits answers at once and
        never keeps a slot."""
        cancelled = self._cancelled[request.request_id]
        if not cancelled.is_set() and lane.try_acquire():  # room now: no tasks to wait with
            self.spawn(self._drive(request, lane))
            return
        slot = asyncio.ensure_future(lane.acquire())
        stop = asyncio.ensure_future(cancelled.wait())
        try:
            await asyncio.wait({slot, stop}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            slot.cancel()  # no-op once it holds the slot
            await asyncio.gather(slot, return_exceptions=True)  # a cancelled acquire ends at once
            holds = not slot.cancelled() and slot.exception() is None
            if holds and (cancelled.is_set() or asyncio.current_task().cancelling()):  # type: ignore[union-attr]
                await lane.release()
                holds = False
        if not holds:
            self._answer(_cancelled(request, "while waiting for its lane"))
            return
        self.spawn(self._drive(request, lane))

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` as a task the plane owns: cancelled in `close` if still running."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _require_started(self, what: str) -> None:
        if not self._started:
            raise RuntimeError(
                f"RolloutPlane.{what}() before start(): use `async with RolloutPlane(config) as plane:` "
                "or `await plane.start()` first"
            )

    # results ---------------------------------------------------------------------------------------
    async def next_result(self, timeout: float | None = None, lane: str | None = None) -> Result:
        """The next result of a single `submit` (of `lane`, or of any lane). Group members come with their
        group instead."""
        return await self._streams.next_result(lane, timeout)

    async def drain(self, lane: str | None = None) -> AsyncIterator[Result]:
        """Single results (of `lane`, or of any lane) until every one submitted so far is answered."""
        while self._streams.results_pending(lane):
            yield await self._streams.next_result(lane, None)

    async def next_group(self, timeout: float | None = None, lane: str | None = None) -> Group:
        """The next complete group (of `lane`, or of any lane) whose handle nobody awaited."""
        return await self._streams.next_group(lane, timeout)

    async def groups(self, lane: str | None = None) -> AsyncIterator[Group]:
        """Complete groups as they complete, until no group submitted so far is left. A loop that submits
        more groups while it iterates keeps it going."""
        while self._streams.groups_pending(lane):
            yield await self._streams.next_group(lane, None)

    def claim(self, handle: GroupHandle) -> None:
        self._streams.claim(handle)

    # cancellation ----------------------------------------------------------------------------------
    async def cancel(self, request_id: str) -> bool:
        """Cancel one rollout (waiting for its lane or running); it answers `cancelled` with the turns it
        had. False when it already answered."""
        event = self._cancelled.get(request_id) if isinstance(request_id, str) else None
        if event is None or event.is_set():
            return False
        event.set()
        slot = self._running.get(request_id)
        if slot is not None and slot.alive:
            try:
                await asyncio.wait_for(slot.handle.cancel.remote(request_id), self.config.cancel_grace_s)
            except Exception:  # the drive loop still answers `cancelled` after the grace period
                pass
        return True

    async def cancel_members(self, request_ids: list[str], why: str, failure_type: str = "Cancelled") -> int:
        """Cancel these rollouts, saying why on each result (`error.type`, `error.message`)."""
        for request_id in request_ids:
            self._cancel_reasons.setdefault(request_id, (failure_type, why))
        return sum(await asyncio.gather(*(self.cancel(request_id) for request_id in request_ids)))

    async def cancel_all(self) -> int:
        ids = [rid for rid, event in self._cancelled.items() if not event.is_set()]
        await asyncio.gather(*(self.cancel(rid) for rid in ids))
        return len(ids)

    async def policy_changed(self) -> int:
        """A new policy is active (published adapter or updated weights): cancel the rollouts in flight it
        leaves more than `max_off_policy_steps` behind. Returns how many were asked to stop."""
        active = self.policy_version
        stale = self._guard.stale(active)
        for request_id, version in stale:
            self._cancel_reasons.setdefault(request_id, (STALE, self._guard.why(version, active)))
        await asyncio.gather(*(self.cancel(request_id) for request_id, _ in stale))
        return len(stale)

    # delivery (the public side of an answer) -------------------------------------------------------
    def _on_policy_stamped(self, request: RolloutRequest) -> None:
        """The rollout's start version is known: track it, or stop it now if it is already too old."""
        version, active = request.policy_version or 0, self.policy_version
        self._guard.started(request.request_id, version)
        if self._guard.too_old(version, active):
            self._cancel_reasons.setdefault(request.request_id, (STALE, self._guard.why(version, active)))
            self._cancelled[request.request_id].set()  # not on a worker yet: answered before dispatch

    def _deliver(self, result: Result) -> None:
        """Stamp what only the plane knows (the end version, why it cancelled), then route it."""
        if result.policy_version_start is not None:
            result.policy_version_end = self.policy_version
        reason = self._cancel_reasons.pop(result.request_id, None)
        if reason is not None and result.kind == "cancelled":
            result.error = Failure(type=reason[0], message=f"rollout was cancelled ({reason[1]})")
            self.counters[f"cancelled.{reason[0]}"] += 1
            self._guard.cancelled += reason[0] == STALE
        self._guard.finished(result.request_id, result.versions_behind)
        self._streams.deliver(result)


def _cancelled(request: RolloutRequest, why: str) -> Result:
    return Result.failed(
        request, "cancelled", Failure(type="Cancelled", message=f"rollout was cancelled ({why})")
    )


def _member(raw: dict[str, Any], group_id: str, index: int) -> dict[str, Any]:
    """Member `index` of a group: the request with fresh ids, the group id and its own seed."""
    member = {**raw, "request_id": new_id("req"), "lease_id": new_id("lease"), "group_id": group_id}
    sampling = raw.get("sampling")
    if isinstance(sampling, BaseModel):
        sampling = sampling.model_dump()
    if isinstance(sampling, dict) and isinstance(sampling.get("seed"), int):
        member["sampling"] = {**sampling, "seed": sampling["seed"] + index}
    return member
