"""`RolloutPlane`: the orchestrator's handle on ray-rollouts.

    async with RolloutPlane(PlaneConfig(lanes={"train": 512, "eval": 64})) as plane:
        handle = await plane.submit_group(request, n=8)     # at once; members then wait for the lane
        async for group in plane.groups(lane="train"):      # complete groups, as they complete
            ...
        await plane.submit(single)                          # waits while the lane is full
        async for result in plane.drain(lane="eval"):       # single results, one lane at a time
            ...

The plane owns every rollout it started: each request gets exactly one `Result` (contract 3), re-dispatched
under the same lease id when its worker is lost, at most `max_dispatches` times (contract 5). It also owns
the shared actors it started (renderer pool, env pools, workers) and stops them in `close`. Where answered
results go is `streams.py`; groups are `groups.py`; off-policy cancellation is `staleness.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

import ray

from rollout_actors.concurrency import ConcurrencyController
from rollout_actors.config import PlaneConfig
from rollout_actors.failures import log_failure
from rollout_actors.inference.load import LoadReader
from rollout_actors.inference.weights import Joiner, WeightUpdater, WeightUpdateReport
from rollout_actors.kernel import Loss, RefResolver
from rollout_actors.kernel.faults import Unavailable, ray_loss
from rollout_actors.lanes import Lane, Lanes
from rollout_actors.lora import AdapterLimits
from rollout_actors.metrics import PlaneMetrics
from rollout_actors.naming import PoolNames
from rollout_actors.placement import Placement, prefix_key
from rollout_actors.plane_stats import PlaneStats, WorkerStats
from rollout_actors.pool_lookup import PoolRoute
from rollout_actors.pool_supervisor import PoolUnavailable
from rollout_actors.publish import PolicyPublisher, PublishHandle
from rollout_actors.redispatch import RedispatchRule
from rollout_actors.rollout import LoopLimits
from rollout_actors.shared_pools import SharedPools
from rollout_actors.staleness import OffPolicyGuard
from rollout_actors.streams import ResultStreams
from rollout_actors.submission import Submission, _cancelled
from rollout_actors.timings import RolloutTimings, clock, since
from rollout_actors.wire import (
    CallerError,
    Failure,
    Result,
    ResultKind,
    RolloutRequest,
)
from rollout_actors.worker_set import WorkerSet, WorkerSlot

if TYPE_CHECKING:
    from rollout_actors.inference.server_set import InferenceServerSet

log = logging.getLogger(__name__)

REDISPATCH_SPREAD_S = 1.0  # re-dispatches of one loss start spread over this long (see _dispatch_to_workers)


def _refuse_inside_ray_worker() -> None:
    from ray._private import worker as ray_worker

    if ray.is_initialized() and ray_worker.global_worker.mode == ray_worker.WORKER_MODE:
        raise RuntimeError(
            "RolloutPlane must be built on the driver (the orchestrator process), not inside a Ray task or "
            "actor: it owns workers and pools whose lifetimes must follow the driver's."
        )


class RolloutPlane(Submission):
    def __init__(
        self,
        config: PlaneConfig | None = None,
        endpoints: Callable[[], Sequence[str]] | None = None,
        servers: InferenceServerSet | None = None,
    ) -> None:
        """`endpoints`: a live source of inference base URLs, asked at each dispatch, so a server that died
        drops out of routing; otherwise `config.endpoints`.

        `servers`: the `InferenceServerSet` to route to. The plane then reads its live endpoints and owns
        its `before_routing`: a replacement server loads the active policy (`prepare_server`) before it
        takes traffic."""
        _refuse_inside_ray_worker()
        self.config = config or PlaneConfig()
        if servers is not None:
            if endpoints is not None:
                raise ValueError("give either `servers` or `endpoints`, not both")
            endpoints = servers.endpoints
            servers.before_routing = self.prepare_server
        self._servers = servers
        self._endpoints = endpoints or (lambda: self.config.endpoints)
        prefix = self.config.name_prefix or f"rollouts-{uuid.uuid4().hex[:8]}"
        self.names = PoolNames(prefix=prefix)
        self.lanes = Lanes(self.config.lanes)
        self._refs = RefResolver(self.config.allowed_ref_prefixes)
        self._pools = SharedPools(self.names, self.config)
        size = self.config.workers or max(
            1, math.ceil(self.lanes.total_limit / self.config.rollouts_per_worker)
        )
        self._workers = WorkerSet(
            self.names,
            size=size,
            num_cpus=self.config.worker_num_cpus,
            hang_timeout_s=self.config.hang_timeout_s,
            probe_interval_s=self.config.probe_interval_s,
            limits=LoopLimits(
                call_timeout_s=self.config.call_timeout_s, batch_window_s=self.config.batch_window_s
            ),
            restarts=self.config.worker_restart,
            capacity=self.config.rollouts_per_worker,
            on_lost=lambda slot: self._pools.release_owner(slot.owner),
        )
        self._streams = ResultStreams()
        self._guard = OffPolicyGuard(self.config.max_off_policy_steps)
        self._rule = RedispatchRule(max_dispatches=self.config.max_dispatches)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._answered: set[str] = set()
        self._open_leases: set[str] = set()
        """Leases submitted and not yet answered: a second submission of one is refused (or renamed)."""
        self._submitted_at: dict[str, tuple[float, float]] = {}
        """Requests accepted and not yet answered -> when: (wall clock, `timings.clock`)."""
        self._waits: dict[str, RolloutTimings] = {}
        """Rollouts being dispatched -> the plane's waits so far (stamped on their result)."""
        self._running: dict[str, WorkerSlot] = {}
        self._cancelled: dict[str, asyncio.Event] = {}
        self._cancel_reasons: dict[str, tuple[str, str]] = {}
        self._endpoint_load: Counter[str] = Counter()
        self._rollout_endpoint: dict[str, str] = {}
        self._placement = Placement(self.config.placement)
        """Rollouts in flight -> their endpoint, in start order (the controller cancels the youngest)."""
        self._controller: ConcurrencyController | None = None
        self._controller_task: asyncio.Task[None] | None = None
        self.counters: Counter[str] = Counter()
        self._publisher: PolicyPublisher | None = None
        self._weights_version = 0
        """The full-weight version every server holds (0: the weights they started with)."""
        self._updater: WeightUpdater | None = None
        self.weights_loader: Callable[[str], Awaitable[None]] | None = None
        """Brings a server that joins routing after a full-weight update to the current weights (e.g. the
        trainer sends them to it). Without one, such a server is kept out of routing (`prepare_server`)."""
        self._metrics = PlaneMetrics()
        self._metrics_task: asyncio.Task[None] | None = None
        self._started = False

    # lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> RolloutPlane:
        if not ray.is_initialized():
            ray.init()
        await self._pools.start()
        await self._workers.start()
        self._metrics_task = asyncio.get_running_loop().create_task(self._metrics.run(self))
        if self.config.concurrency is not None:
            reader = LoadReader(self._api_key_var)
            self._controller = ConcurrencyController(self, self.config.concurrency, reader)
            self._controller_task = asyncio.get_running_loop().create_task(self._controller.run())
        self._started = True
        return self

    async def close(self) -> None:
        """Cancel what is still running, then stop workers and pools. Every request still gets its result."""
        if self._controller_task is not None:  # no limit moves or overload cancels while closing
            self._controller_task.cancel()
        await self.cancel_all()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=self.config.cancel_grace_s + 5)
        for task in list(self._tasks):
            task.cancel()
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        if self._controller is not None:
            await self._controller.aclose()
        await self._workers.close()
        await self._pools.close()
        if self._publisher is not None:
            await self._publisher.aclose()
        if self._updater is not None:
            await self._updater.aclose()

    async def __aenter__(self) -> RolloutPlane:
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def stats(self) -> PlaneStats:
        return PlaneStats(
            counters=dict(self.counters),
            kinds={kind: self.counters[f"kind.{kind}"] for kind in get_args(ResultKind)},
            redispatched=self.counters["redispatched"],
            poisoned=self.counters["poisoned"],
            duplicates_dropped=self.counters["duplicates_dropped"],
            lanes=self.lanes.snapshot(),
            workers=tuple(
                WorkerStats(name=s.name, in_flight=s.in_flight, peak=s.peak) for s in self._workers.live()
            ),
            workers_lost=self._workers.lost_count,
            off_policy=self._guard.snapshot(),
            concurrency=self._controller.snapshot() if self._controller is not None else None,
            pools=tuple(self._pools.statuses()),
        )

    # policy ----------------------------------------------------------------------------------------
    @property
    def policy_version(self) -> int:
        """The policy new rollouts sample from: the active adapter's version, or the full weights'
        (`update_weights`); 0 is the base model as the servers started."""
        current = self._publisher.current() if self._publisher is not None else None
        return max(current.version if current is not None else 0, self._weights_version)

    @property
    def _api_key_var(self) -> str | None:
        """The servers' API key, sent with the plane's own calls to them (LoRA, pause/resume, weights)."""
        return self._servers.spec.api_key_var if self._servers is not None else self.config.server_api_key_var

    def _weight_updater(self) -> WeightUpdater:
        if self._updater is None:
            backend = self._servers.spec.weight_transfer_backend if self._servers is not None else "nccl"
            self._updater = WeightUpdater(self._api_key_var, backend=backend)
        return self._updater

    async def init_weight_transfer(
        self, init_info: dict[str, Any], *, transfer: Awaitable[Any] | None = None, join: Joiner | None = None
    ) -> None:
        """vLLM's `/init_weight_transfer_engine` on every live server, once before the first
        `update_weights` (NCCL: `init_info` names the trainer's rendezvous; `transfer`, the trainer joining
        the group, runs while the calls are open). `join(url)` gives a server that joins later (a
        replacement) its own `TransferJoin` before it takes traffic; without it such a server is kept out."""
        servers = list(self._endpoints())
        if not servers:
            raise RuntimeError("no live inference server to initialise")
        await self._weight_updater().init_transfer(servers, init_info, transfer=transfer, join=join)

    async def update_weights(
        self,
        update_info: dict[str, Any] | list[dict[str, Any]],
        version: int,
        *,
        transfer: Awaitable[Any] | None = None,
        mode: Literal["keep", "abort"] = "keep",
    ) -> WeightUpdateReport:
        """Load new full weights on every server without dropping rollouts in flight: pause (`keep`: their
        requests freeze in place), `update_info` through vLLM's weight-update routes (`transfer`, e.g. a
        trainer's NCCL broadcast, runs while they are open), label them `version`, resume. Turns in flight
        continue on the new weights and record where the version changed (`Turn.version_changes`); new
        rollouts start under `version`. `mode="abort"` (vLLM frees the KV of requests in flight): token
        turns the pause aborted resume from the tokens they had, token-exact, once the servers resumed.
        Needs `init_weight_transfer` first. A failure once the update started leaves the servers paused
        (`WeightUpdateFailure.paused`) until a retry succeeds. See `rollout_actors.inference.weights`."""
        if version <= self.policy_version:
            raise ValueError(f"policy version {version} is not newer than {self.policy_version}")
        servers = list(self._endpoints())
        if not servers:
            raise RuntimeError("no live inference server to update")
        updater = self._weight_updater()

        async def tell_workers() -> None:
            self._weights_version = version
            await self._workers.broadcast("set_policy_version", version)

        if mode == "abort":  # turns the pause aborts are ours: they resume from their tokens afterwards
            await self._workers.broadcast("begin_planned_pause")
        try:
            report = await updater.update(
                servers, update_info, version, transfer=transfer, mode=mode, on_updated=tell_workers
            )
        finally:
            if mode == "abort":
                await self._workers.broadcast("end_planned_pause")
        await self.policy_changed()  # rollouts it leaves too far behind stop (`max_off_policy_steps`)
        return report

    @property
    def publisher(self) -> PolicyPublisher:
        """The plane's publisher (created on first use; needs `PlaneConfig.policy_storage_dir`)."""
        if self._publisher is None:
            if self.config.policy_storage_dir is None:
                raise ValueError("policy publication needs PlaneConfig.policy_storage_dir")
            limits = self._servers.spec.adapter_limits() if self._servers is not None else AdapterLimits()
            self._publisher = PolicyPublisher(
                self._endpoints,
                self.config.policy_storage_dir,
                # Adapter names are this plane's own: a restarted orchestrator's `v1` on long-lived servers
                # must not collide with (or be mistaken for) the previous run's, still loaded there.
                name_prefix=f"{self.names.prefix}-policy",
                limits=limits,
                api_key_var=self._api_key_var,
            )
        return self._publisher

    async def publish_policy(self, adapter: Any, version: int, donate: bool = False) -> PublishHandle:
        """Publish a LoRA adapter (arrays or a directory) to every endpoint. Returns once an immutable CPU
        capture exists; `await handle.wait()` for the servers. New rollouts switch to it atomically when
        every server has loaded it; rollouts in flight keep the policy they started with. `donate=True`
        hands fresh arrays over instead of copying them (they are frozen; see `capture_adapter`)."""
        handle = await self.publisher.publish(adapter, version, donate=donate)
        self.spawn(self._after_publication(handle))
        return handle

    async def _after_publication(self, handle: PublishHandle) -> None:
        try:
            await handle.wait()
        except Exception:
            return  # the previous policy stays active; the caller hears of it through its handle
        await self.policy_changed()

    async def prepare_server(self, url: str) -> None:
        """Make a server that is about to join routing serve the active policy (load the active adapter).
        `InferenceServerSet.before_routing` when the plane was given the set; raising keeps it out."""
        if self._updater is not None:
            await self._updater.join_server(url)  # its weight transfer first: updates need it
        if self._weights_version:
            if self.weights_loader is None:
                raise RuntimeError(
                    f"{url} would serve the starting weights, not v{self._weights_version}: set "
                    "RolloutPlane.weights_loader to bring a new server to the current weights"
                )
            await self.weights_loader(url)
        if self._publisher is not None:
            await self._publisher.load_current(url)

    def _with_policy(self, request: RolloutRequest) -> tuple[RolloutRequest, int | None]:
        """The request on its policy: the active one, or the version it pins. Returns the request and the
        adapter version checked out for it (until `_dispatch` checks it in). CallerError when the pinned
        version is not loaded."""
        wanted = request.policy_version
        policy = None
        if self._publisher is not None and wanted != 0:
            policy = self._publisher.checkout(wanted)
        if policy is None:
            if wanted not in (None, self._weights_version):
                raise CallerError(
                    f"policy_version={wanted} is not loaded on the servers (active: {self.policy_version})"
                )
            return request.model_copy(update={"policy_version": self._weights_version}), None
        client = request.client.model_copy(update={"model": policy.name})
        # The renderer keeps the base model's tokenizer: an adapter does not change the vocabulary.
        renderer = request.renderer
        if renderer.tokenizer is None:
            renderer = renderer.model_copy(update={"tokenizer": request.client.model})
        updated = request.model_copy(
            update={"client": client, "renderer": renderer, "policy_version": policy.version}
        )
        return updated, policy.version

    # control ---------------------------------------------------------------------------------------
    async def set_limit(self, lane: str, limit: int) -> None:
        await self.lanes.get(lane).set_limit(limit)

    # dispatch --------------------------------------------------------------------------------------
    async def _drive(self, request: RolloutRequest, lane: Lane) -> None:
        # The request's deadline covers everything from here: its env pool's start, waiting for a
        # worker, and every attempt (a re-dispatch gets what is left, not a fresh budget).
        deadline = time.monotonic() + request.deadline_s
        started = time.time()
        submitted = self._submitted_at.get(request.request_id)
        waits = self._waits[request.request_id] = RolloutTimings(
            lane_s=since(submitted[1]) if submitted is not None else 0.0
        )
        try:
            result = await self._dispatch(request, deadline)
        except Exception as exc:  # a bug of ours must still answer the request
            log.exception("dispatch of %s failed", request.request_id)
            result = Result.failed(request, "infrastructure", Failure.from_exception(exc))
        finally:
            await lane.release()
            self._waits.pop(request.request_id, None)
        stamped = result.timings  # the worker's own waits are on it already
        stamped.lane_s, stamped.env_pool_s = waits.lane_s, waits.env_pool_s
        stamped.worker_s, stamped.dispatch_s = waits.worker_s, waits.dispatch_s
        if result.started_at is None:  # answered here, not by a worker: timed from its dispatch
            result.started_at, result.finished_at = started, time.time()
        self._answer(result)

    async def _dispatch(self, request: RolloutRequest, deadline: float) -> Result:
        cancelled = self._cancelled[request.request_id]
        try:
            if not self._pools.env_pool_started(request.env):  # else: no task per dispatch to find it so
                started = clock()
                await asyncio.wait_for(self._pools.ensure_env_pool(request.env), deadline - time.monotonic())
                self._waits[request.request_id].env_pool_s = since(started)
        except TimeoutError:
            return _deadline_exceeded(request, "while its env pool was starting")
        except Exception as exc:
            # The env's own failure (import error, bad Ref) says whose fault it was; keep its traceback.
            failure = getattr(exc, "failure", None) or Failure.from_exception(exc)
            kind = "caller" if isinstance(exc, CallerError) or failure.fault == "caller" else "infrastructure"
            return Result.failed(request, kind, failure)
        try:
            request, checked_out = self._with_policy(request)
        except CallerError as exc:
            return Result.failed(request, "caller", Failure.from_exception(exc))
        self._on_policy_stamped(request)
        try:
            return await self._dispatch_on_policy(request, cancelled, deadline)
        finally:
            if checked_out is not None and self._publisher is not None:
                self._publisher.checkin(checked_out)

    async def _dispatch_on_policy(
        self, request: RolloutRequest, cancelled: asyncio.Event, deadline: float
    ) -> Result:
        endpoint = self._pick_endpoint(request)
        if endpoint is not None:
            # One endpoint for the rollout's whole life: its turns share one server's prefix cache.
            request = request.model_copy(
                update={"client": request.client.model_copy(update={"base_url": endpoint})}
            )
            self._endpoint_load[endpoint] += 1
            self._rollout_endpoint[request.request_id] = endpoint
        try:
            return await self._dispatch_to_workers(request, cancelled, deadline)
        finally:
            if endpoint is not None:
                self._endpoint_load[endpoint] -= 1
                self._rollout_endpoint.pop(request.request_id, None)

    def live_endpoints(self) -> list[str]:
        """The inference base URLs rollouts are routed to now."""
        return list(self._endpoints())

    def running_on(self, endpoint: str) -> list[str]:
        """Request ids of the rollouts in flight on `endpoint`, oldest first."""
        return [rid for rid, url in self._rollout_endpoint.items() if url == endpoint]

    def _pick_endpoint(self, request: RolloutRequest) -> str | None:
        return self._placement.place(prefix_key(request), list(self._endpoints()), self._endpoint_load)

    async def _dispatch_to_workers(
        self, request: RolloutRequest, cancelled: asyncio.Event, deadline: float
    ) -> Result:
        """Dispatch until a result stands. A lost rollout worker, env server or renderer (contract 5) is
        re-dispatched under the same lease as `self._rule` says (`redispatch.py`), within the deadline:
        `max_dispatches` dispatches for losses of its own (collateral ones have a bound of their own), and
        not again once its losses show a poison request."""
        losses: list[Loss] = []
        """What each lost dispatch lost, oldest first: the chain every answer after a loss carries."""
        base: Result | None = None
        """The last attempt's own result (its turns, its times): what a poison or spent answer builds on."""
        rule = self._rule
        for attempt in range(1, rule.most_dispatches + 1):
            if cancelled.is_set():
                return _cancelled(request, "before dispatch")
            left = deadline - time.monotonic()
            if left <= 0:
                return _deadline_exceeded(
                    request, f"after {attempt - 1} dispatch(es) lost", losses, attempt - 1
                )
            waits, started = self._waits[request.request_id], clock()
            try:  # a pool being restarted is waited for; after a loss (attempt > 1) each is checked first
                route = await self._pools.route(request, left, verify=attempt > 1)
            except PoolUnavailable as exc:
                return Result.failed(request, "infrastructure", exc.failure, attempts=attempt - 1)
            slot = await self._workers.pick_or_wait(timeout=max(0.0, deadline - time.monotonic()))
            if slot is None:
                failure = Unavailable("no live rollout worker", type_name="NoLiveWorker", losses=losses)
                return Result.failed(request, "infrastructure", failure.failure, attempts=attempt - 1)
            waits.worker_s = round(waits.worker_s + since(started), 4)
            left, started = deadline - time.monotonic(), clock()
            if left <= 0:
                return _deadline_exceeded(request, "while waiting for a rollout worker", losses, attempt - 1)
            outcome = await self._attempt(
                request.model_copy(update={"deadline_s": left}), slot, cancelled, route
            )
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
                return _answered_after_losses(request, base, kind, failure, attempt)
            if decision == "spent":
                # The budget is spent: what every dispatch lost, the last one's traceback.
                chain = "; ".join(loss.describe() for loss in losses)
                spent = Unavailable(
                    f"{attempt} dispatches lost ({chain})" + (f"; last: {last.message}" if last else ""),
                    type_name="WorkerLost" if last is None else last.type,
                    traceback=last.traceback if last is not None else None,
                    losses=losses,
                )
                return _answered_after_losses(request, base, "infrastructure", spent.failure, attempt)
            self.counters["redispatched"] += 1
            log.warning(
                "re-dispatching rollout %s (lease %s, worker %s): %s",
                request.request_id,
                request.lease_id,
                slot.name,
                losses[-1].describe(),
            )
            # Spread re-dispatches over a moment: a node's workers are reported dead one by one over
            # tens of milliseconds, and a lost worker's rollouts re-dispatched in the same tick would
            # pile onto a worker whose death is not known yet, then onto the one survivor.
            spread = random.uniform(0.0, REDISPATCH_SPREAD_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(cancelled.wait(), min(spread, max(0.0, deadline - time.monotonic())))
        raise AssertionError("the rule answers `spent` by its most_dispatches")

    async def _attempt(
        self, request: RolloutRequest, slot: WorkerSlot, cancelled: asyncio.Event, route: PoolRoute
    ) -> Result | Loss:
        """One dispatch. Returns the worker's result, or the loss of its worker."""
        if cancelled.is_set():
            # Cancelled while this dispatch was being placed (route, worker pick): `cancel` found no slot
            # to tell, so nothing would stop the worker. From here to `_running` nothing awaits, so a later
            # cancel finds the slot and reaches the worker after `run`.
            return _cancelled(request, "before dispatch")
        try:
            ref = slot.handle.run.remote(request.model_dump_json().encode(), *route.wire())  # as JSON
        except Exception as exc:  # Ray could not take the request: validation let through what it must not
            log.exception("submitting %s to %s", request.request_id, slot.name)
            return Result.failed(request, "infrastructure", Failure.from_exception(exc))
        self._workers.dispatched(slot)
        self._running[request.request_id] = slot
        answer = asyncio.wrap_future(ref.future())
        lost = asyncio.ensure_future(slot.lost.wait())
        cancel = asyncio.ensure_future(cancelled.wait())
        deadline = request.deadline_s + self.config.answer_grace_s
        try:
            done, _ = await asyncio.wait(
                {answer, lost, cancel}, timeout=deadline, return_when=asyncio.FIRST_COMPLETED
            )
            if done == {cancel}:
                # The worker was asked to cancel: it has `cancel_grace_s` to clean up and answer.
                done, _ = await asyncio.wait(
                    {answer, lost}, timeout=self.config.cancel_grace_s, return_when=asyncio.FIRST_COMPLETED
                )
            if answer in done:
                try:
                    return Result.model_validate_json(answer.result())  # the worker answers JSON
                except Exception as exc:
                    how = ray_loss(exc)
                    if how is not None:
                        self._workers.declare_lost(slot, f"actor {how}: {type(exc).__name__}", how)
                        return _worker_loss(slot)
                    return Result.failed(request, "infrastructure", Failure.from_exception(exc))
            if cancelled.is_set():
                return _cancelled(request, "worker did not confirm within cancel_grace_s")
            if lost in done or not slot.alive:
                return _worker_loss(slot)
            late = Unavailable(
                f"no answer within deadline_s + answer_grace_s = {deadline:g} s", type_name="DeadlineExceeded"
            )
            return Result.failed(request, "infrastructure", late.failure)
        finally:
            self._workers.finished(slot)
            self._running.pop(request.request_id, None)
            lost.cancel()
            cancel.cancel()
            if not answer.done():
                # A late answer from this attempt, if any, goes through `_answer`: delivered if the
                # lease is still open, otherwise counted and dropped.
                answer.add_done_callback(self._late_answer)

    def _late_answer(self, future: asyncio.Future[Any]) -> None:
        if future.cancelled() or future.exception() is not None:
            return
        try:
            result = Result.model_validate_json(future.result())
        except Exception:  # cannot happen short of a bug: the worker encoded it from a valid Result
            log.exception("a late answer could not be decoded; it is dropped")
            return
        self._answer(result)

    def _answer(self, result: Result) -> None:
        """Deliver at most one result per lease (contract 5)."""
        if result.lease_id in self._answered:
            self.counters["duplicates_dropped"] += 1
            return
        self._answered.add(result.lease_id)
        self._open_leases.discard(result.lease_id)
        submitted = self._submitted_at.pop(result.request_id, None)
        if submitted is not None and result.timings.submitted_at is None:
            result.timings.submitted_at = round(submitted[0], 3)
        if result.finished_at is None:  # answered by the plane itself: the timeline still places it
            result.finished_at = time.time()
        self.counters[f"kind.{result.kind}"] += 1
        self._cancelled.pop(result.request_id, None)
        if result.worker is None:  # classified here, not by a worker (which logged its own)
            log_failure(log, result)
        self._deliver(result)
        self._metrics.answered(result)

    def _answer_refusal(self, result: Result) -> None:
        """Deliver the `caller` result of a payload refused at submission. It holds no lease: its lease id
        may be one in flight (submitted twice) or one the caller will submit again once corrected."""
        self.counters[f"kind.{result.kind}"] += 1
        log_failure(log, result)
        self._deliver(result)
        self._metrics.answered(result)


def _answered_after_losses(
    request: RolloutRequest, base: Result | None, kind: str, failure: Failure, attempts: int
) -> Result:
    """The answer of a request the plane stops dispatching: the last attempt's own result (its turns and
    times) when a worker answered it, with the plane's verdict as its kind and failure."""
    if base is None:
        return Result.failed(request, kind, failure, attempts=attempts)  # type: ignore[arg-type]
    return base.model_copy(update={"kind": kind, "error": failure, "attempts": attempts, "reward": None})


def _worker_loss(slot: WorkerSlot) -> Loss:
    """A rollout worker's loss: never poison (a worker carries many rollouts; its loss strikes them all)."""
    return Loss(part="worker", how=slot.how, name=slot.name)


def _worker_time(outcome: Result | Loss) -> float:
    """Seconds the worker itself spent on an answered dispatch (0 for a lost one: its time counts whole)."""
    if isinstance(outcome, Result) and outcome.started_at is not None and outcome.finished_at is not None:
        return outcome.finished_at - outcome.started_at
    return 0.0


def _deadline_exceeded(
    request: RolloutRequest, when: str, losses: list[Loss] | None = None, attempts: int = 1
) -> Result:
    message = f"the request's deadline_s={request.deadline_s:g} passed {when}"
    if losses:
        message += f": {'; '.join(loss.describe() for loss in losses)}"
    failure = Unavailable(message, type_name="DeadlineExceeded", losses=losses or ())
    return Result.failed(request, "infrastructure", failure.failure, attempts=attempts)
