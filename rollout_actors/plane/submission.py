"""Admission: how a request gets from `submit` / `submit_group` to the dispatcher.

A payload is validated (a bad one is answered at once with one `caller` result naming the field at
fault), opens its record in the dispatcher (`dispatcher.py`), waits for a slot in its lane
(back-pressure), and is then driven by the dispatcher until it is answered. `RolloutPlane` (plane.py) is
the public facade over this; groups are `groups.py`.

    intake = Intake(plane, dispatcher, lanes, refs, endpoints, streams, metrics, counters)
    request_id = await intake.submit(request)       # waits while the lane is full
    handle = intake.submit_group(request, n=8)      # at once; members wait for the lane in the background
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError

from rollout_actors.kernel import RefResolver
from rollout_actors.plane.dispatcher import Dispatcher
from rollout_actors.plane.groups import GroupHandle, GroupOwner, Stragglers
from rollout_actors.plane.inflight import InFlight
from rollout_actors.plane.lanes import Lane, Lanes
from rollout_actors.plane.streams import ResultStreams
from rollout_actors.rollout.failures import log_failure
from rollout_actors.rollout.metrics import PlaneMetrics
from rollout_actors.wire import SEED_RANGE, CallerError, Result, RolloutRequest, new_id, valid_id

log = logging.getLogger(__name__)

MAX_GROUP_SIZE = 65_536  # rollouts per submit_group call: far past any GRPO group, short of a typo's 10**9


class IntakeOwner(GroupOwner, Protocol):
    """The plane, as admission sees it: it owns the tasks and the groups, and knows the active policy."""

    @property
    def policy_version(self) -> int: ...


class Intake:
    """Validates, admits through the lanes, and hands requests to the dispatcher."""

    def __init__(
        self,
        owner: IntakeOwner,
        dispatcher: Dispatcher,
        lanes: Lanes,
        refs: RefResolver,
        endpoints: Callable[[], Sequence[str]],
        streams: ResultStreams,
        metrics: PlaneMetrics,
        counters: Counter[str],
    ) -> None:
        self._owner = owner
        self._dispatcher = dispatcher
        self._lanes = lanes
        self._refs = refs
        self._endpoints = endpoints
        self._streams = streams
        self._metrics = metrics
        self._counters = counters

    async def submit(self, request: RolloutRequest | dict[str, Any]) -> str:
        checked = self._check(request)
        self._streams.expect_result(checked.request.lane if isinstance(checked, InFlight) else checked.lane)
        if isinstance(checked, Result):
            self.answer_refusal(checked)
            return checked.request_id
        try:
            await self._enter(checked, self._lanes.get(checked.request.lane))
        except asyncio.CancelledError:  # the caller gave up waiting: nothing was submitted
            self._streams.expect_result(checked.request.lane, -1)
            self._dispatcher.forget(checked)
            self._counters["submitted"] -= 1
            raise
        return checked.request.request_id

    def submit_group(
        self,
        request: RolloutRequest | dict[str, Any],
        n: int,
        *,
        stragglers: Stragglers | None = None,
        one_policy: bool = False,
    ) -> GroupHandle:
        raw = request.model_dump() if isinstance(request, BaseModel) else request
        group_id = (valid_id(raw.get("group_id")) if isinstance(raw, dict) else None) or new_id("group")
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_GROUP_SIZE:
            self._counters["submitted"] += 1
            wrong_n = CallerError(f"n: must be an int in [1, {MAX_GROUP_SIZE}], got {n!r:.40}")
            members: list[InFlight | Result] = [Result.refused(raw, None, wrong_n, group_id)]
        elif not isinstance(raw, dict):
            self._counters["submitted"] += n
            not_a_request = CallerError(f"request: a RolloutRequest or a dict, got {type(raw).__name__}")
            members = [Result.refused(raw, None, not_a_request, group_id) for _ in range(n)]
        else:
            members = self._check_members(raw, group_id, n)
        first = members[0]
        handle = GroupHandle(
            self._owner,
            group_id,
            first.request.lane if isinstance(first, InFlight) else first.lane,
            [m.request.request_id if isinstance(m, InFlight) else m.request_id for m in members],
            stragglers=stragglers,
            one_policy=one_policy,
        )
        self._streams.expect_group(handle)
        self._owner.spawn(self._admit_group(handle, members))
        return handle

    def _check_members(self, raw: dict[str, Any], group_id: str, n: int) -> list[InFlight | Result]:
        """The open records of a group's members: the request validated once, and each further member a
        copy of it with its own ids and seed, as `_member` makes them (validating each member anew was a
        tenth of the driver's CPU for groups of 8). A refused request, or seeds that would run past their
        range, take the long road: each member validated on its own."""
        first = self._check(_member(raw, group_id, 0))
        seed = first.request.sampling.seed if isinstance(first, InFlight) else None
        if not isinstance(first, InFlight) or (seed is not None and seed + n - 1 > SEED_RANGE[1]):
            return [first, *(self._check(_member(raw, group_id, i)) for i in range(1, n))]
        request, members = first.request, [first]
        for i in range(1, n):
            update: dict[str, Any] = {"request_id": new_id("req"), "lease_id": new_id("lease")}
            if seed is not None:
                update["sampling"] = request.sampling.model_copy(update={"seed": seed + i})
            self._counters["submitted"] += 1
            self._metrics.submitted(request.lane)
            members.append(self._dispatcher.accept(request.model_copy(update=update)))
        return members

    def _check(self, request: RolloutRequest | dict[str, Any]) -> InFlight | Result:
        """The validated request's open record, or its `caller` result."""
        self._counters["submitted"] += 1
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
        return self._dispatcher.accept(checked)  # its waits start here

    def _validated(self, request: Any) -> RolloutRequest:
        checked = RolloutRequest.model_validate(request)
        self._lanes.get(checked.lane)
        self._refs.check_allowed(checked.env.target)
        if checked.client.base_url is None and not list(self._endpoints()):
            raise CallerError("client.base_url is not set and the plane has no endpoints")
        if self._dispatcher.knows(checked.request_id, checked.lease_id):
            explicit = checked.model_fields_set & {"request_id", "lease_id"}
            if explicit:
                # A lease runs once (contract 5): a caller that names one twice gets a refusal, not a rerun.
                field = "lease_id" if "lease_id" in explicit else "request_id"
                raise CallerError(f"{field}: already submitted to this plane ({getattr(checked, field)!r})")
            # The same request object (its ids are defaults) submitted again: a new rollout of its own.
            checked = checked.model_copy(update={"request_id": new_id("req"), "lease_id": new_id("lease")})
        return checked

    async def _admit_group(self, handle: GroupHandle, members: list[InFlight | Result]) -> None:
        for member in members:
            if isinstance(member, Result):
                self.answer_refusal(member)
            else:
                if handle.one_policy and member.request.policy_version is None:
                    if handle.pinned_version is None:
                        handle.pinned_version = self._owner.policy_version
                    # The group's option, not routing: the member now pins a version as if the caller had.
                    member.request = member.request.model_copy(
                        update={"policy_version": handle.pinned_version}
                    )
                await self._enter(member, self._lanes.get(member.request.lane))
            handle._member_admitted()

    async def _enter(self, record: InFlight, lane: Lane) -> None:
        """Wait for a lane slot, then start the rollout. One cancelled while it waits answers at once and
        never keeps a slot."""
        cancelled = record.cancelled
        if not cancelled.is_set() and lane.try_acquire():  # room now: no tasks to wait with
            self._owner.spawn(self._dispatcher.drive(record, lane))
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
            self._dispatcher.answer_cancelled(record, "while waiting for its lane")
            return
        self._owner.spawn(self._dispatcher.drive(record, lane))

    def answer_refusal(self, result: Result) -> None:
        """Deliver the `caller` result of a payload refused at submission. It holds no lease: its lease id
        may be one in flight (submitted twice) or one the caller will submit again once corrected."""
        self._counters[f"kind.{result.kind}"] += 1
        log_failure(log, result)
        self._streams.deliver(result)
        self._metrics.answered(result)


def _member(raw: dict[str, Any], group_id: str, index: int) -> dict[str, Any]:
    """Member `index` of a group: the request with fresh ids, the group id and its own seed."""
    member = {**raw, "request_id": new_id("req"), "lease_id": new_id("lease"), "group_id": group_id}
    sampling = raw.get("sampling")
    if isinstance(sampling, BaseModel):
        sampling = sampling.model_dump()
    if isinstance(sampling, dict) and isinstance(sampling.get("seed"), int):
        member["sampling"] = {**sampling, "seed": sampling["seed"] + index}
    return member
