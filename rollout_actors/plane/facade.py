"""`RolloutPlane`: the orchestrator's handle on ray-rollouts.

    async with RolloutPlane(PlaneConfig(lanes={"train": 512, "eval": 64})) as plane:
        handle = await plane.submit_group(request, n=8)     # at once; members then wait for the lane
        async for group in plane.groups(lane="train"):      # complete groups, as they complete
            ...
        await plane.submit(single)                          # waits while the lane is full
        async for result in plane.drain(lane="eval"):       # single results, one lane at a time
            ...

The plane is the public facade: it owns the shared actors it started (renderer pool, env pools, workers)
and stops them in `close`, and the policy rollouts sample from. Each request gets exactly one `Result`
(contract 3), re-dispatched under the same lease id when a part of ours is lost (contract 5): admission is
`submission.py`, the request's record and its exactly-once lifecycle `dispatcher.py`, where answered
results go `streams.py`; groups are `groups.py`; off-policy cancellation is `staleness.py`.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_args

import ray

from env_actors.session import EnvSession
from rollout_actors.inference.load import LoadReader
from rollout_actors.kernel import Ref, RefResolver
from rollout_actors.kernel.faults import Unavailable, ray_loss, start_error
from rollout_actors.plane.concurrency import ConcurrencyController
from rollout_actors.plane.config import PlaneConfig
from rollout_actors.plane.dispatcher import Dispatcher
from rollout_actors.plane.groups import Group, GroupHandle, Stragglers
from rollout_actors.plane.inflight import PolicyChoice
from rollout_actors.plane.lanes import Lanes
from rollout_actors.plane.naming import PoolNames
from rollout_actors.plane.placement import Placement, prefix_key
from rollout_actors.plane.redispatch import RedispatchRule
from rollout_actors.plane.shared_pools import SharedPools
from rollout_actors.plane.sizing import cpu_fit, started_here
from rollout_actors.plane.stats import PlaneStats, WorkerStats
from rollout_actors.plane.streams import ResultStreams
from rollout_actors.plane.submission import Intake
from rollout_actors.plane.worker_set import WorkerSet
from rollout_actors.policy.lora import AdapterLimits
from rollout_actors.policy.publish import PolicyPublisher, PublishHandle
from rollout_actors.policy.staleness import OffPolicyGuard
from rollout_actors.policy.weights import Joiner, WeightUpdater, WeightUpdateReport
from rollout_actors.rollout.loop import LoopLimits
from rollout_actors.rollout.metrics import PlaneMetrics
from rollout_actors.wire import CallerError, Result, ResultKind, RolloutRequest

if TYPE_CHECKING:
    from rollout_actors.inference.server_set import InferenceServerSet

log = logging.getLogger(__name__)


def _refuse_inside_ray_worker() -> None:
    from ray._private import worker as ray_worker

    if ray.is_initialized() and ray_worker.global_worker.mode == ray_worker.WORKER_MODE:
        raise RuntimeError(
            "RolloutPlane must be built on the driver (the orchestrator process), not inside a Ray task or "
            "actor: it owns workers and pools whose lifetimes must follow the driver's."
        )


class PlaneStartError(RuntimeError):
    """`start()` could not bring up the plane's own actors (a rollout worker whose process cannot import
    the project, a constructor that raises): one line naming the part and quoting its error; Ray's full
    report is the cause."""


class RolloutPlane:
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
        self._tasks: set[asyncio.Task[Any]] = set()
        self.counters: Counter[str] = Counter()
        self._metrics = PlaneMetrics()
        self._dispatcher = Dispatcher(
            self,
            self._workers,
            self._pools,
            self.counters,
            pick_endpoint=self._pick_endpoint,
            rule=RedispatchRule(max_dispatches=self.config.max_dispatches),
            guard=OffPolicyGuard(self.config.max_off_policy_steps),
            answer_grace_s=self.config.answer_grace_s,
            cancel_grace_s=self.config.cancel_grace_s,
        )
        self._endpoint_load = self._dispatcher.endpoint_load
        """Inference endpoint -> rollouts being dispatched to it (the dispatcher keeps it)."""
        self._placement = Placement(self.config.placement)
        self._intake = Intake(
            self,
            self._dispatcher,
            self.lanes,
            RefResolver(self.config.allowed_ref_prefixes),
            self._endpoints,
            self._streams,
            self._metrics,
            self.counters,
        )
        self._controller: ConcurrencyController | None = None
        self._controller_task: asyncio.Task[None] | None = None
        self._publisher: PolicyPublisher | None = None
        self._weights_version = 0
        """The full-weight version every server holds (0: the weights they started with)."""
        self._updater: WeightUpdater | None = None
        self.weights_loader: Callable[[str], Awaitable[None]] | None = None
        """Brings a server that joins routing after a full-weight update to the current weights (e.g. the
        trainer sends them to it). Without one, such a server is kept out of routing (`prepare_server`)."""
        self._metrics_task: asyncio.Task[None] | None = None
        self._started = False

    # lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> RolloutPlane:
        if not ray.is_initialized():
            ray.init()
        self._fit_to_cluster()
        # Side by side: a worker looks its pools up per dispatch, so neither start waits for the other.
        started = await asyncio.gather(self._pools.start(), self._workers.start(), return_exceptions=True)
        parts = ("shared pools", "rollout workers")
        failed = [(part, out) for part, out in zip(parts, started, strict=True) if isinstance(out, BaseException)]
        if failed:  # nothing half-started is left behind (the caller's `async with` never reached exit)
            await self._workers.close()
            await self._pools.close()
            part, error = failed[0]
            if ray_loss(error) is None:
                raise error
            raise PlaneStartError(f"the plane could not start its {part}: {start_error(error)}") from error
        self._metrics_task = asyncio.get_running_loop().create_task(self._metrics.run(self))
        if self.config.concurrency is not None:
            reader = LoadReader(self._api_key_var)
            self._controller = ConcurrencyController(self, self.config.concurrency, reader)
            self._controller_task = asyncio.get_running_loop().create_task(self._controller.run())
        self._started = True
        return self

    def _fit_to_cluster(self) -> None:
        """Scale the actors' CPU requests to the cluster's free CPUs where they cannot all start and the
        cluster cannot grow (`PlaneConfig.fit_cpus`); say so either way: never a silent wait for CPUs."""
        fit = cpu_fit(self.config, self._workers.floor, ray.available_resources().get("CPU", 0.0))
        if fit.scale < 1 and (started_here() if self.config.fit_cpus is None else self.config.fit_cpus):
            log.warning("%s: every CPU request scaled by %.3g to fit", fit.describe(), fit.scale)
            self.config = self._pools.config = fit.config
            self._workers.num_cpus = fit.config.worker_num_cpus
        elif fit.need > fit.free:
            log.warning("%s: its actors wait for CPUs (an autoscaler's, or a release)", fit.describe())

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
            workers_lost=self._workers.deaths,
            off_policy=self._dispatcher.guard.snapshot(),
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
        (`WeightUpdateFailure.paused`) until a retry succeeds. See `rollout_actors.policy.weights`."""
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

    def checkout_policy(self, wanted: int | None) -> PolicyChoice:
        """The policy a request pinning `wanted` (None: the active one) samples from; the adapter version
        is checked out until `checkin_policy`. CallerError when the pinned version is not loaded."""
        policy = None
        if self._publisher is not None and wanted != 0:
            policy = self._publisher.checkout(wanted)
        if policy is None:
            if wanted not in (None, self._weights_version):
                raise CallerError(
                    f"policy_version={wanted} is not loaded on the servers (active: {self.policy_version})"
                )
            return PolicyChoice(version=self._weights_version)
        return PolicyChoice(version=policy.version, model=policy.name, checked_out=policy.version)

    def checkin_policy(self, choice: PolicyChoice) -> None:
        if choice.checked_out is not None and self._publisher is not None:
            self._publisher.checkin(choice.checked_out)

    # control ---------------------------------------------------------------------------------------
    async def set_limit(self, lane: str, limit: int) -> None:
        await self.lanes.get(lane).set_limit(limit)

    # endpoints -------------------------------------------------------------------------------------
    def live_endpoints(self) -> list[str]:
        """The inference base URLs rollouts are routed to now."""
        return list(self._endpoints())

    def running_on(self, endpoint: str) -> list[str]:
        """Request ids of the rollouts in flight on `endpoint`, oldest first."""
        return self._dispatcher.running_on(endpoint)

    def _pick_endpoint(self, request: RolloutRequest, policy: PolicyChoice) -> str | None:
        key = prefix_key(request, model=policy.model, policy_version=policy.version)
        return self._placement.place(key, list(self._endpoints()), self._endpoint_load)

    # submission ------------------------------------------------------------------------------------
    async def submit(self, request: RolloutRequest | dict[str, Any]) -> str:
        """Queue one rollout; waits while its lane is full. Returns its request id; the result comes out of
        `next_result` / `drain`. Never raises for a bad request: that comes back as exactly one `caller`
        result naming the field at fault."""
        self._require_started("submit")
        return await self._intake.submit(request)

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
        return self._intake.submit_group(request, n, stragglers=stragglers, one_policy=one_policy)

    async def num_tasks(self, env: Ref, timeout: float = 30.0) -> int:
        """How many tasks `env` has. Starts its pool as its first request would (that cold start is then
        paid here, not by the first rollouts) and asks it; raises `CallerError` for a Ref outside the
        allowlist and the pool's startup failure as the first request would meet it."""
        self._require_started("num_tasks")
        RefResolver(self.config.allowed_ref_prefixes).check_allowed(env.target)
        await self._pools.ensure_env_pool(env)
        pool = self._pools.supervisor(env).current()
        if pool is None:  # lost since it started: its replacement learns the count again when ready
            raise Unavailable(f"the env pool of {env.target} is being replaced")
        return await EnvSession.num_tasks(pool, timeout)

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

    def deliver(self, result: Result) -> None:
        """The dispatcher answered a request: route its result (`streams.py`)."""
        self._streams.deliver(result)
        self._metrics.answered(result)

    # cancellation ----------------------------------------------------------------------------------
    async def cancel(self, request_id: str) -> bool:
        """Cancel one rollout (waiting for its lane or running); it answers `cancelled` with the turns it
        had. False when it already answered."""
        return await self._dispatcher.cancel(request_id)

    async def cancel_members(self, request_ids: list[str], why: str, failure_type: str = "Cancelled") -> int:
        """Cancel these rollouts, saying why on each result (`error.type`, `error.message`)."""
        reason = (failure_type, why)
        cancels = (self._dispatcher.cancel(request_id, reason) for request_id in request_ids)
        return sum(await asyncio.gather(*cancels))

    async def cancel_all(self) -> int:
        return await self._dispatcher.cancel_all()

    async def policy_changed(self) -> int:
        """A new policy is active (published adapter or updated weights): cancel the rollouts in flight it
        leaves more than `max_off_policy_steps` behind. Returns how many were asked to stop."""
        return await self._dispatcher.cancel_stale(self.policy_version)
