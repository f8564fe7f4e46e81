"""The dispatcher: one record per request in flight, and the exactly-once lifecycle from acceptance to answer.

    dispatcher = Dispatcher(plane, workers, pools, counters, pick_endpoint=plane._pick_endpoint)
    record = dispatcher.accept(request)        # from here on it is answered exactly once
    ...                                        # (its lane slot is taken by the plane)
    await dispatcher.drive(record, lane)       # env pool, policy, endpoint, worker; re-dispatch; answer
    await dispatcher.cancel(request_id)        # answered `cancelled`, wherever it is

Every accepted request has one `InFlight` record until it is answered: its cancellation, its waits, the
policy and endpoint the plane chose, the worker running its current dispatch. `answer` closes the record
and delivers the result; a second answer for it (a late one from a dispatch given up on) is dropped and
counted (`duplicates_dropped`, contract 5). Late answers are matched against open records, so dropping one
never depends on remembering the lease; answered leases are remembered only so that a caller naming one
again is refused, and only the latest `ANSWERED_LEASES_KEPT`.

What the plane decides for a dispatch travels beside the caller's request in a `wire.Dispatch` envelope;
the request itself is never rewritten. A lost rollout worker, env server or renderer is re-dispatched
under the same lease as `RedispatchRule` says (`redispatch.py`), within the request's deadline.

The dispatcher talks to workers, pools and its plane through protocols (`inflight.py`, with its records),
so it runs with fakes and no Ray (`tests/test_dispatcher.py`); `RayWorkerCalls` is where it meets Ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from renderer_actors.key import RendererKey
from rollout_actors.kernel import Loss
from rollout_actors.kernel.faults import Cancelled, DeadlineExceeded, Fault, PartLost, Unavailable
from rollout_actors.plane.inflight import (
    ANSWERED_LEASES_KEPT,
    AnsweredLeases,
    DispatchHost,
    InFlight,
    PolicyChoice,
    Pools,
    RayWorkerCalls,
    WorkerCalls,
    Workers,
)
from rollout_actors.plane.lanes import Lane
from rollout_actors.plane.redispatch import RedispatchRule
from rollout_actors.policy.staleness import STALE, OffPolicyGuard
from rollout_actors.rollout.failures import log_failure
from rollout_actors.timings import clock, since
from rollout_actors.wire import CallerError, Dispatch, Failure, Result, ResultKind, RolloutRequest

log = logging.getLogger(__name__)

REDISPATCH_SPREAD_S = 1.0  # re-dispatches of one loss start spread over this long (see `_dispatch`)
WARM_CALL_TIMEOUT_S = 10.0  # slot calls never wait (slots are instant): this bounds a wedged pool
WARMED_KEYS_KEPT = 64  # (model, renderer config) pairs a plane has warmed: runs use a few


class Dispatcher:
    """Owns every request from acceptance to its one answer. See the module docstring."""

    def __init__(
        self,
        host: DispatchHost,
        workers: Workers,
        pools: Pools,
        counters: Counter[str],
        *,
        pick_endpoint: Callable[[RolloutRequest, PolicyChoice], str | None],
        calls: WorkerCalls | None = None,
        rule: RedispatchRule | None = None,
        guard: OffPolicyGuard | None = None,
        answer_grace_s: float = 60.0,
        cancel_grace_s: float = 10.0,
        answered_kept: int = ANSWERED_LEASES_KEPT,
    ) -> None:
        self._host = host
        self._workers = workers
        self._pools = pools
        self._calls = calls or RayWorkerCalls()
        self._pick_endpoint = pick_endpoint
        self.rule = rule or RedispatchRule()
        self.guard = guard or OffPolicyGuard(None)
        self.counters = counters
        self.answer_grace_s = answer_grace_s
        self.cancel_grace_s = cancel_grace_s
        self._records: dict[str, InFlight] = {}
        """Request id -> its record, in acceptance order."""
        self._leases: dict[str, InFlight] = {}
        """Lease id -> the same records: kept in step with `_records` (added and removed together)."""
        self.answered = AnsweredLeases(answered_kept)
        self.endpoint_load: Counter[str] = Counter()
        """Inference endpoint -> rollouts being dispatched to it."""
        self._placements = itertools.count(1)
        self._warmed: set[tuple[str, str]] = set()
        """(model, renderer config JSON) whose renderer this plane had warmed (see `_warm_renderer`)."""
        self._warming: set[asyncio.Future[None]] = set()
        """Warm-ups still running (held here so that one outliving its dispatch is not collected)."""
        self._wakers: dict[str, Callable[[], None]] = {}
        """Request id -> what wakes its dispatch waiting on a worker (`cancel` calls it)."""

    # records ---------------------------------------------------------------------------------------
    def accept(self, request: RolloutRequest) -> InFlight:
        """Open the record of a validated request: from here on it is answered exactly once."""
        record = InFlight(request)
        self._records[request.request_id] = record
        self._leases[request.lease_id] = record
        return record

    def forget(self, record: InFlight) -> None:
        """Drop a record that was never admitted (its submitter gave up waiting for the lane)."""
        self._close(record)

    def knows(self, request_id: str, lease_id: str) -> bool:
        """Whether a request with these ids is in flight, or its lease was answered (recently)."""
        return request_id in self._records or lease_id in self._leases or lease_id in self.answered

    def in_flight(self) -> Iterator[InFlight]:
        return iter(list(self._records.values()))

    def running_on(self, endpoint: str) -> list[str]:
        """Request ids of the rollouts being dispatched to `endpoint`, oldest routed first."""
        on = [r for r in self._records.values() if r.endpoint == endpoint]
        return [r.request.request_id for r in sorted(on, key=lambda r: r.placed)]

    def _close(self, record: InFlight) -> None:
        self._records.pop(record.request.request_id, None)
        self._leases.pop(record.request.lease_id, None)

    # cancellation ----------------------------------------------------------------------------------
    async def cancel(self, request_id: str, reason: tuple[str, str] | None = None) -> bool:
        """Cancel one request (waiting for its lane, being placed or running); it answers `cancelled`,
        with `reason` (failure type, why) on its error when given. False when it is not in flight."""
        record = self._records.get(request_id) if isinstance(request_id, str) else None
        if record is None:
            return False
        if reason is not None and record.cancel_reason is None:
            record.cancel_reason = reason
        if record.cancelled.is_set():
            return False
        record.cancelled.set()
        wake = self._wakers.get(request_id)
        if wake is not None:  # its dispatch is waiting on its worker: it now waits `cancel_grace_s` at most
            wake()
        slot = record.slot  # None while being placed: `_attempt` checks the event before it sends
        if slot is not None and slot.alive:
            with contextlib.suppress(Exception):  # the dispatch still answers after `cancel_grace_s`
                await asyncio.wait_for(self._calls.cancel(slot, request_id), self.cancel_grace_s)
        return True

    async def cancel_all(self) -> int:
        ids = [r.request.request_id for r in self._records.values() if not r.cancelled.is_set()]
        await asyncio.gather(*(self.cancel(request_id) for request_id in ids))
        return len(ids)

    async def cancel_stale(self, active: int) -> int:
        """Cancel the rollouts that policy `active` leaves more than the guard allows behind."""
        stale = [
            (r.request.request_id, r.policy.version)
            for r in self._records.values()
            if r.policy is not None and self.guard.too_old(r.policy.version, active)
        ]
        why = {rid: (STALE, self.guard.why(version, active)) for rid, version in stale}
        await asyncio.gather(*(self.cancel(rid, why[rid]) for rid in why))
        return len(stale)

    # answers ---------------------------------------------------------------------------------------
    def answer(self, record: InFlight, result: Result) -> None:
        """Deliver `result` as the record's one answer (contract 5); a second one is dropped and counted."""
        if record.answered:
            self.counters["duplicates_dropped"] += 1
            return
        record.answered = True
        self._close(record)
        self.answered.add(record.request.lease_id)
        if result.timings.submitted_at is None:
            result.timings.submitted_at = round(record.submitted_at, 3)
        if result.finished_at is None:  # answered by the plane itself: the timeline still places it
            result.finished_at = time.time()
        self.counters[f"kind.{result.kind}"] += 1
        if result.worker is None:  # classified here, not by a worker (which logged its own)
            log_failure(log, result)
        if result.policy_version_start is not None:
            result.policy_version_end = self._host.policy_version
        if record.cancel_reason is not None and result.kind == "cancelled":
            failure_type, why = record.cancel_reason
            result.error = Cancelled(f"rollout was cancelled ({why})", type_name=failure_type).failure
            self.counters[f"cancelled.{failure_type}"] += 1
            self.guard.cancelled += failure_type == STALE
        self.guard.finished(result.versions_behind)
        self._host.deliver(result)

    def _late_answer(self, future: asyncio.Future[str]) -> None:
        """An answer that came after its dispatch was given up on: delivered if its record is still open
        (a re-dispatch is still running), else dropped and counted."""
        if future.cancelled() or future.exception() is not None:
            return
        try:
            result = Result.model_validate_json(future.result())
        except Exception:  # cannot happen short of a bug: the worker encoded it from a valid Result
            log.exception("a late answer could not be decoded; it is dropped")
            return
        record = self._leases.get(result.lease_id)
        if record is None:
            self.counters["duplicates_dropped"] += 1
            return
        self.answer(record, result)

    # the lifecycle ---------------------------------------------------------------------------------
    async def drive(self, record: InFlight, lane: Lane) -> None:
        """Dispatch `record` until a result stands, give back its lane slot, answer it. Never raises."""
        request = record.request
        # The deadline (loop time) covers everything from here: its env pool's start, waiting for a
        # worker, and every attempt (a re-dispatch gets what is left, not a fresh budget).
        deadline = asyncio.get_running_loop().time() + request.timeout_s
        started = time.time()
        record.waits.lane_s = since(record.submitted_clock)
        try:
            result = await self._prepare(record, deadline)
        except Exception as exc:  # a bug of ours must still answer the request
            log.exception("dispatch of %s failed", request.request_id)
            result = self._failed(record, "infrastructure", Failure.from_exception(exc))
        finally:
            await lane.release()
        waits, stamped = record.waits, result.timings  # the worker's own waits are on it already
        stamped.lane_s, stamped.env_pool_s = waits.lane_s, waits.env_pool_s
        stamped.worker_s, stamped.dispatch_s = waits.worker_s, waits.dispatch_s
        if result.started_at is None:  # answered here, not by a worker: timed from its dispatch
            result.started_at, result.finished_at = started, time.time()
        self.answer(record, result)

    async def _prepare(self, record: InFlight, deadline: float) -> Result:
        """Its env pool started, its policy chosen, its endpoint picked; then `_dispatch`."""
        env = record.request.env
        try:
            if not self._pools.env_pool_started(env):  # else: no task per dispatch to find it so
                started = clock()
                # A cold start: the renderer of the request's key loads meanwhile, not after its env opens.
                warming = asyncio.ensure_future(self._warm_renderer(record.request))
                self._warming.add(warming)
                warming.add_done_callback(self._warming.discard)
                try:
                    await asyncio.wait_for(self._pools.ensure_env_pool(env), deadline - _now())
                finally:  # its slot is given back before the rollout asks for its own, within the deadline;
                    # left running (never raising, bounded) if this dispatch ends first
                    await asyncio.wait({warming}, timeout=max(0.0, deadline - _now()))
                record.waits.env_pool_s = since(started)
        except TimeoutError:
            return self._deadline_exceeded(record, "while its env pool was starting")
        except Fault as exc:  # the env's own failure (import error, bad Ref) says whose fault it was
            return self._failed(record, exc.kind, exc.failure)
        except Exception as exc:
            return self._failed(record, "infrastructure", Failure.from_exception(exc))
        try:
            record.policy = policy = self._host.checkout_policy(record.request.policy_version)
        except CallerError as exc:
            return self._failed(record, "caller", exc.failure)
        active = self._host.policy_version
        if self.guard.too_old(policy.version, active):  # not on a worker yet: answered before dispatch
            record.cancel_reason = record.cancel_reason or (STALE, self.guard.why(policy.version, active))
            record.cancelled.set()
        endpoint = self._pick_endpoint(record.request, policy)
        if endpoint is not None:
            # One endpoint for the rollout's whole life: its turns share one server's prefix cache.
            record.endpoint, record.placed = endpoint, next(self._placements)
            self.endpoint_load[endpoint] += 1
        try:
            return await self._dispatch(record, deadline)
        finally:
            if endpoint is not None:
                self.endpoint_load[endpoint] -= 1
                record.endpoint = None
            self._host.checkin_policy(policy)

    async def _warm_renderer(self, request: RolloutRequest) -> None:
        """Have the renderer pool start loading the renderer of `request`'s key: one slot taken and given
        back (the first slot of a key starts its first renderer, which stays while the pool lives). Once
        per key and plane, only where the rollout will render (token and agent mode). Never raises: a
        failure here is the rollout's own to meet, and report, when it asks for its slot."""
        if request.mode == "chat":
            return
        seen = (request.client.model, request.renderer.model_dump_json())
        pool = self._pools.renderer_pool()
        if seen in self._warmed or pool is None:
            return
        if len(self._warmed) >= WARMED_KEYS_KEPT:
            self._warmed.clear()
        self._warmed.add(seen)
        try:  # the key a dispatch's renderer uses: an adapter keeps its base model's tokenizer, so the same
            key_json = RendererKey.from_config(request.client.model, request.renderer).to_json()
            slot = await asyncio.wait_for(
                pool.acquire.remote(key_json, request.renderer.multiplex), WARM_CALL_TIMEOUT_S
            )
            await asyncio.wait_for(pool.release.remote(slot.slot_id), WARM_CALL_TIMEOUT_S)
        except Exception as exc:
            log.debug("warming the renderer of %s: %s", request.request_id, exc)

    async def _dispatch(self, record: InFlight, deadline: float) -> Result:
        """Dispatch until a result stands. A lost rollout worker, env server or renderer (contract 5) is
        re-dispatched under the same lease as `self.rule` says, within the deadline: `max_dispatches`
        dispatches for losses of its own (collateral ones have a bound of their own), and not again
        once its losses show a poison request."""
        request, rule, waits = record.request, self.rule, record.waits
        losses: list[Loss] = []
        """What each lost dispatch lost, oldest first: the chain every answer after a loss carries."""
        base: Result | None = None
        """The last attempt's own result (its turns, its times): what a poison or spent answer builds on."""
        quarantine = False
        """Whether this dispatch runs alone on an env server of its own (`RedispatchRule`: quarantine)."""
        for attempt in range(1, rule.most_dispatches + 1):
            if record.cancelled.is_set():
                return self._cancelled(record, "before dispatch")
            if deadline - _now() <= 0:
                return self._deadline_exceeded(
                    record, f"after {attempt - 1} dispatch(es) lost", losses, attempt - 1
                )
            started = clock()
            try:  # a pool being restarted is waited for; after a loss (attempt > 1) each is checked first
                route = await self._pools.route(request, deadline - _now(), verify=attempt > 1)
            except Fault as exc:
                return self._failed(record, exc.kind, exc.failure, attempts=attempt - 1)
            slot = await self._workers.pick_or_wait(timeout=max(0.0, deadline - _now()))
            if slot is None:
                failure = Unavailable("no live rollout worker", type_name="NoLiveWorker", losses=losses)
                return self._failed(record, "infrastructure", failure.failure, attempts=attempt - 1)
            waits.worker_s = round(waits.worker_s + since(started), 4)
            left, started = deadline - _now(), clock()
            if left <= 0:
                return self._deadline_exceeded(
                    record, "while waiting for a rollout worker", losses, attempt - 1
                )
            env_pool, renderer_pool = route.wire()
            assert record.policy is not None
            envelope = Dispatch(
                request=request,
                attempt=attempt,
                endpoint=record.endpoint,
                model=record.policy.model,
                policy_version=record.policy.version,
                remaining_timeout_s=left,
                env_pool=env_pool,
                renderer_pool=renderer_pool,
                quarantine=quarantine,
            )
            outcome = await self._attempt(record, envelope, slot)
            last: Failure | None = None
            waits.dispatch_s = round(waits.dispatch_s + max(0.0, since(started) - _worker_time(outcome)), 4)
            if isinstance(outcome, Result):
                base = outcome
                if not rule.redispatches(outcome.error):
                    outcome.attempts = attempt
                    if losses and outcome.error is not None:
                        outcome.error.losses = [*losses, *outcome.error.losses]
                    return outcome
                last = outcome.error
                assert last is not None and last.lost is not None
                losses.append(last.lost)
            else:  # its worker was lost: nothing of this attempt came back
                base = None
                losses.append(outcome)
            decision = rule.decide(losses)
            if decision == "poison":
                self.counters["poisoned"] += 1
                kind, failure = rule.poison(losses, last)
                log.warning(
                    "rollout %s (lease %s) is poison: %s",
                    request.request_id,
                    request.lease_id,
                    failure.message,
                )
                return self._after_losses(record, base, kind, failure, attempt)
            if decision == "spent":
                # The budget is spent: what every dispatch lost, the last one's traceback.
                chain = "; ".join(loss.describe() for loss in losses)
                spent = Unavailable(
                    f"{attempt} dispatches lost ({chain})" + (f"; last: {last.message}" if last else ""),
                    type_name="WorkerLost" if last is None else last.type,
                    traceback=last.traceback if last is not None else None,
                    losses=losses,
                )
                return self._after_losses(record, base, "infrastructure", spent.failure, attempt)
            self.counters["redispatched"] += 1
            quarantine = decision == "quarantine"
            self.counters["quarantined"] += quarantine
            log.warning(
                "re-dispatching rollout %s (lease %s, worker %s%s): %s",
                request.request_id,
                request.lease_id,
                slot.name,
                ", in quarantine" if quarantine else "",
                losses[-1].describe(),
            )
            # Spread re-dispatches over a moment: a node's workers are reported dead one by one over
            # tens of milliseconds, and a lost worker's rollouts re-dispatched in the same tick would
            # pile onto a worker whose death is not known yet, then onto the one survivor.
            spread = random.uniform(0.0, REDISPATCH_SPREAD_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(record.cancelled.wait(), min(spread, max(0.0, deadline - _now())))
        raise AssertionError("the rule answers `spent` by its most_dispatches")

    async def _attempt(self, record: InFlight, envelope: Dispatch, slot: Any) -> Result | Loss:
        """One dispatch. Returns the worker's result, or the loss of its worker."""
        if record.cancelled.is_set():
            # Cancelled while this dispatch was being placed (route, worker pick): `cancel` found no slot
            # to tell, so nothing would stop the worker. From here to `record.slot` nothing awaits, so a
            # later cancel finds the slot and reaches the worker after `run`.
            return self._cancelled(record, "before dispatch")
        try:
            answer = self._calls.run(slot, envelope.model_dump_json().encode())  # work is data: JSON
        except Exception as exc:  # Ray could not take the request: validation let through what it must not
            log.exception("submitting %s to %s", record.request.request_id, slot.name)
            return self._failed(record, "infrastructure", Failure.from_exception(exc))
        self._workers.dispatched(slot)
        record.slot = slot
        lost = slot.gone  # the supervisor's: resolved when the worker is retired (never cancelled here)
        wait_s = envelope.remaining_timeout_s + self.answer_grace_s
        request_id = record.request.request_id
        try:
            # One future woken by the answer, the loss or `cancel` (through `_wakers`), not `asyncio.wait`
            # over a task waiting on the event: a task per dispatch was a tenth of the driver's CPU.
            await _first_of((answer, lost), wait_s, self._wakers, request_id)
            if record.cancelled.is_set() and not answer.done() and not lost.done():
                # The worker was asked to cancel: it has `cancel_grace_s` to clean up and answer.
                await _first_of((answer, lost), self.cancel_grace_s, self._wakers, request_id)
            if answer.done():
                try:
                    return Result.model_validate_json(answer.result())  # the worker answers JSON
                except PartLost as exc:  # its worker was lost: Ray said so before the plane's probe did
                    how = exc.lost.how if exc.lost is not None else "died"
                    self._workers.declare_lost(slot, f"actor {how}: {exc.type_name}", how)
                    return _worker_loss(slot)
                except Exception as exc:
                    return self._failed(record, "infrastructure", Failure.from_exception(exc))
            if record.cancelled.is_set():
                return self._cancelled(record, "worker did not confirm within cancel_grace_s")
            if lost.done() or not slot.alive:
                return _worker_loss(slot)
            late = DeadlineExceeded(f"no answer within timeout_s + answer_grace_s = {wait_s:g} s")
            return self._failed(record, "infrastructure", late.failure)
        finally:
            self._workers.finished(slot)
            record.slot = None
            if not answer.done():
                # A late answer from this attempt, if any, goes through `_late_answer`: delivered if the
                # record is still open, otherwise counted and dropped.
                answer.add_done_callback(self._late_answer)

    # results the plane answers itself --------------------------------------------------------------
    def _failed(self, record: InFlight, kind: str, failure: Failure, **extra: Any) -> Result:
        """A result the plane answers itself, carrying the policy it chose (if it got that far)."""
        if record.policy is not None:
            extra.setdefault("policy_version_start", record.policy.version)
            if record.policy.model is not None:
                extra.setdefault("model", record.policy.model)
        return Result.failed(record.request, _kind(kind), failure, **extra)

    def answer_cancelled(self, record: InFlight, why: str) -> None:
        """Answer a request cancelled before it was driven (while it waited for its lane)."""
        self.answer(record, self._cancelled(record, why))

    def _cancelled(self, record: InFlight, why: str) -> Result:
        return self._failed(record, "cancelled", cancelled_failure(why))

    def _deadline_exceeded(
        self, record: InFlight, when: str, losses: list[Loss] | None = None, attempts: int = 1
    ) -> Result:
        message = f"the request's deadline (timeout_s={record.request.timeout_s:g}) passed {when}"
        if losses:
            message += f": {'; '.join(loss.describe() for loss in losses)}"
        failure = DeadlineExceeded(message, losses=losses or ())
        return self._failed(record, "infrastructure", failure.failure, attempts=attempts)

    def _after_losses(
        self, record: InFlight, base: Result | None, kind: str, failure: Failure, attempts: int
    ) -> Result:
        """The answer of a request the plane stops dispatching: the last attempt's own result (its turns
        and times) when a worker answered it, with the plane's verdict as its kind and failure."""
        if base is None:
            return self._failed(record, kind, failure, attempts=attempts)
        return base.model_copy(update={"kind": kind, "error": failure, "attempts": attempts, "reward": None})


def cancelled_failure(why: str) -> Failure:
    return Cancelled(f"rollout was cancelled ({why})").failure


def _kind(kind: str) -> ResultKind:
    assert kind in ("ok", "model", "env", "infrastructure", "caller", "cancelled"), kind
    return kind  # type: ignore[return-value]


def _now() -> float:
    return asyncio.get_running_loop().time()


async def _first_of(
    futures: tuple[asyncio.Future[Any], ...], timeout: float, wakers: dict[str, Callable[[], None]], key: str
) -> None:
    """Wait until one of `futures` is done, `wakers[key]` is called, or `timeout` passes. Cancels none of
    them, and leaves no callback behind."""
    woken = asyncio.get_running_loop().create_future()

    def wake(_: Any = None) -> None:
        if not woken.done():
            woken.set_result(None)

    if any(future.done() for future in futures):
        return
    for future in futures:
        future.add_done_callback(wake)
    wakers[key] = wake
    timer = asyncio.get_running_loop().call_later(timeout, wake)
    try:
        await woken
    finally:
        timer.cancel()
        wakers.pop(key, None)
        for future in futures:
            future.remove_done_callback(wake)


def _worker_loss(slot: Any) -> Loss:
    """A rollout worker's loss: never poison (a worker carries many rollouts; its loss strikes them all)."""
    return Loss(part="worker", how=slot.how, name=slot.name)


def _worker_time(outcome: Result | Loss) -> float:
    """Seconds the worker itself spent on an answered dispatch (0 for a lost one: its time counts whole)."""
    if isinstance(outcome, Result) and outcome.started_at is not None and outcome.finished_at is not None:
        return outcome.finished_at - outcome.started_at
    return 0.0
