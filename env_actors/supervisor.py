"""The supervisor inside an `EnvPool`: the one place that decides what a worker's death means.

It spawns `EnvServer` actors, runs their readiness handshake (`start()` loaded the environment, then one
`health()` answer), probes the ready ones, retires the dead and the wedged, and replaces and scales them
under the pool's restart budget:

- A worker is *dead* when Ray says so (`ActorDiedError` on a call or a probe), *wedged* when nothing shows
  it alive for `hang_timeout_s`: no probe answered, or its event loop stalled (probes run on their own loop,
  see `server.py`): the kernel's `Liveness`, the rule every supervisor of the plane uses. Either way it
  is retired at once: out of dispatch, its in-flight calls answered with a failure, its sessions lost,
  the actor killed.
- Every spawn after the initial `min_workers` (a replacement or growth) spends one restart from the budget.
  No restart left: no spawn; the pool serves with what it has, and the denial is counted and logged.
- A spawn that never becomes ready is logged and leaves the pool one short. When spawns fail more times in
  a row than the budget allows restarts, the environment is crash-looping: spawning stops for good.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

import ray

from env_actors.config import EnvPoolConfig, WorkerInfo
from env_actors.runtime_env_check import started_unless_pip_fails
from env_actors.server import create_env_server
from env_actors.sessions import OpenSessions
from rollout_actors.kernel import Failure, Ref
from rollout_actors.kernel.faults import CallerError, exit_detail, ray_loss, runtime_env_failed
from rollout_actors.kernel.metric import Metric
from rollout_actors.kernel.supervision import Liveness, RestartBudget

logger = logging.getLogger(__name__)

_POOL_TAGS = ("pool", "env")
ENV_WORKERS = Metric(
    kind="gauge", name="env_workers", description="Env servers", tag_keys=(*_POOL_TAGS, "state")
)
ENV_SESSIONS = Metric(kind="gauge", name="env_sessions", description="Open env sessions", tag_keys=_POOL_TAGS)
ENV_RESTARTS_USED = Metric(
    kind="gauge",
    name="env_restarts_used",
    description="Restart budget spent in its window",
    tag_keys=_POOL_TAGS,
)

BLOCKED_S = 0.5  # a probe reporting less loop stall than this says the loop runs: no call blocks it
TICK_S = 0.1  # supervision resolution: wedge detection lands within hang_timeout_s + TICK_S
DIAGNOSE_TIMEOUT_S = 0.5  # one probe to say why a worker missed its readiness deadline
RETIRED_HISTORY = 32
SHUTDOWN_WAIT_S = 2.0  # for cancelled background tasks to unwind

RetireCause = Literal["died", "wedged", "spawn_failed", "shrunk", "shutdown"]


async def resolve(ref: Any) -> Any:
    """Await an ObjectRef inside a task (so it can sit in `asyncio.wait` next to other futures)."""
    return await ref


@dataclass(eq=False)
class ServerSlot:
    """One EnvServer as the supervisor sees it. Its sessions are counted in the pool's `OpenSessions`."""

    name: str
    handle: Any
    gone: asyncio.Future
    """Resolved with `(reason, cause)` at retirement; in-flight calls wait on it next to their answer."""
    state: Literal["starting", "ready", "retired"] = "starting"
    inflight: int = 0
    pid: int | None = None
    node_id: str | None = None
    life: Liveness = field(default_factory=lambda: Liveness(hang_timeout_s=0.0))
    """When the worker last showed life (readiness, then probe answers dated back by its loop stall)."""
    idle_since: float = 0.0
    blocking: str | None = None
    """The session whose env call held its loop at the last probe (the one that wedged it, if it was)."""
    unreachable_at: float | None = None
    """When a session last found it unreachable; it takes no new session until it shows life after that."""

    def info(self, sessions: int) -> WorkerInfo:
        state = "ready" if self.state == "ready" else "starting"
        return WorkerInfo(
            worker=self.name,
            state=state,
            sessions=sessions,
            inflight=self.inflight,
            pid=self.pid,
            node_id=self.node_id,
        )


@dataclass
class SpawnOutcome:
    status: Literal["ready", "load_error", "died", "timeout"]
    failure: Failure | None = None


class Supervisor:
    """Owns the worker set of one pool and every background task that keeps it healthy."""

    def __init__(
        self,
        name: str,
        env: Ref,
        config: EnvPoolConfig,
        sessions: OpenSessions,
        on_retire: Callable[[ServerSlot, str], None],
    ):
        self.name, self.env, self.config = name, env, config
        self.sessions = sessions
        """The pool's record of open sessions, read here (placement, scaling), written by the pool."""
        self.workers: dict[str, ServerSlot] = {}
        self.budget = RestartBudget(config.restart)
        self.num_tasks: int | None = None
        self.spawns = self.spawn_failures = self.deaths = self.budget_denials = 0
        self.spawning_stopped: str | None = None
        self.retired: deque[str] = deque(maxlen=RETIRED_HISTORY)
        self._on_retire = on_retire
        self._incarnation = uuid.uuid4().hex[:6]  # worker names stay unique across pools of one name
        self._failures_in_a_row = 0
        self._denied = False
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self._changed = asyncio.Event()
        """Pulsed (set, then replaced) when a worker becomes ready or is retired."""

    # ------------------------------------------------------------------------------------ queries

    def ready(self) -> list[ServerSlot]:
        return [w for w in self.workers.values() if w.state == "ready"]

    def starting(self) -> list[ServerSlot]:
        return [w for w in self.workers.values() if w.state == "starting"]

    def least_busy(self) -> ServerSlot | None:
        """The ready worker with the fewest sessions, preferring those that showed life lately: one whose
        probes went unanswered, or that a session found unreachable, gets no new session (it would fail
        at once, so its count would drop and draw every re-dispatched session onto it) until it answers
        again or is judged wedged."""
        ready = self.ready()
        if not ready:
            return None
        now = time.monotonic()
        trusted = [w for w in ready if not self._suspect(w, now)] or ready
        return min(trusted, key=lambda w: (self.sessions.on(w.name), w.inflight))

    def _suspect(self, slot: ServerSlot, now: float) -> bool:
        quiet_s = max(
            3 * self.config.probe_interval_s, self.config.probe_timeout_s + self.config.probe_interval_s
        )
        if slot.unreachable_at is not None and slot.life.last_alive <= slot.unreachable_at:
            return True
        return slot.life.silent_s(now) > quiet_s

    async def ready_worker(self, wait_s: float) -> ServerSlot | None:
        """The least-busy ready worker. With none ready but one starting (the replacement of one that
        died), wait for it up to `wait_s`; with none coming, None at once: no live worker fails fast."""
        deadline = time.monotonic() + wait_s
        while (slot := self.least_busy()) is None and self.starting() and not self._closed:
            try:
                await asyncio.wait_for(self._changed.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        return slot

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # ------------------------------------------------------------------------------------ startup

    async def start(self, ready_timeout: float) -> Failure | None:
        """Spawn `min_workers` and wait for the first to be ready. On failure everything is retired and
        the failure returned: a load error at once (with the environment's traceback), a worker that died
        while loading after the restart budget, or the readiness deadline."""
        deadline = time.monotonic() + ready_timeout
        pending = {self._spawn(ready_timeout) for _ in range(self.config.min_workers)}
        died: list[Failure] = []
        failure: Failure | None = None
        while pending and failure is None:
            wait_s = max(0.0, deadline - time.monotonic()) + DIAGNOSE_TIMEOUT_S + 1.0
            done, pending = await asyncio.wait(pending, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                failure = Failure(
                    type="EnvReadinessTimeout", message=f"no env worker ready in {ready_timeout} s"
                )
            for task in done:
                outcome = task.result()
                if outcome.status == "ready":
                    self.own(self._supervise())
                    return None
                if outcome.status != "died":
                    failure = outcome.failure
                    break
                died.append(outcome.failure)
                if time.monotonic() < deadline and self.budget.try_spend():
                    pending.add(self._spawn(deadline - time.monotonic()))
        if failure is None:
            why = (
                self.budget.spent_message()
                if time.monotonic() < deadline
                else f"readiness deadline ({ready_timeout:g} s) passed"
            )
            last = died[-1] if died else None
            failure = Failure(
                type="EnvWorkerDied",
                message=f"env worker died while loading {len(died)} time(s); {why}; last: "
                f"{last.message if last else 'unknown'}",
                traceback=last.traceback if last else None,
            )
        await self.shutdown()
        return failure

    # ------------------------------------------------------------------------------ spawn / ready

    def _spawn(self, ready_timeout: float) -> asyncio.Task:
        """Create one EnvServer and start its readiness handshake; the task returns a `SpawnOutcome`."""
        name = f"{self.name}.env{self.spawns}-{self._incarnation}"
        self.spawns += 1
        now = time.monotonic()
        try:
            handle = create_env_server(name, self.env, self.config)
        except Exception as exc:  # e.g. malformed resources: nothing was created
            self._note_spawn_failure(name, f"could not be created: {exc}")
            return self.own(_done(SpawnOutcome("load_error", Failure.from_exception(exc))))
        slot = ServerSlot(
            name,
            handle,
            asyncio.get_running_loop().create_future(),
            life=Liveness(self.config.hang_timeout_s),
            idle_since=now,
        )
        self.workers[name] = slot
        return self.own(self._bring_up(slot, ready_timeout))

    async def _bring_up(self, slot: ServerSlot, ready_timeout: float) -> SpawnOutcome:
        started = time.monotonic()
        try:
            start = started_unless_pip_fails(resolve(slot.handle.start.remote()), self.config.runtime_env)
            response = await asyncio.wait_for(start, ready_timeout)
            if response.success:
                remaining = max(self.config.probe_timeout_s, ready_timeout - (time.monotonic() - started))
                await asyncio.wait_for(resolve(slot.handle.health.remote()), remaining)
        except TimeoutError:
            reason = f"not ready within {ready_timeout:.1f} s: {await self._diagnose(slot)}"
            self._spawn_failed(slot, reason)
            return SpawnOutcome("timeout", Failure(type="EnvReadinessTimeout", message=reason))
        except asyncio.CancelledError:
            self.retire(slot, "cancelled while starting", "shutdown")
            raise
        except Exception as exc:
            if runtime_env_failed(exc):  # the pool's own packages did not build: its configuration
                reason = f"its runtime_env failed to build: {exc}"
                self._spawn_failed(slot, reason)
                return SpawnOutcome("load_error", CallerError(reason[-4000:]).failure)
            if ray_loss(exc) == "died":
                reason = f"died while loading: {exit_detail(exc)}"
                self._spawn_failed(slot, reason)
                return SpawnOutcome("died", Failure(type="EnvWorkerDied", message=reason))
            # Unreachable and the like: not ready is not ready.
            self._spawn_failed(slot, f"failed its readiness handshake: {exc}")
            return SpawnOutcome("load_error", Failure.from_exception(exc))
        if not response.success:
            error = response.error or Failure(type="EnvLoadError", message="start failed")
            self._spawn_failed(slot, f"failed to load: {error.type}: {error.message}")
            return SpawnOutcome("load_error", error)
        if self._closed or slot.state != "starting":
            self.retire(slot, "pool shut down while it started", "shutdown")
            return SpawnOutcome("load_error", Failure(type="EnvPoolClosed", message="pool shut down"))
        info = response.value or {}
        now = time.monotonic()
        slot.state, slot.pid, slot.node_id = "ready", info.get("pid"), info.get("node_id")
        slot.idle_since = now
        slot.life.heard(now=now)
        self.num_tasks = info.get("num_tasks", self.num_tasks)
        self._failures_in_a_row = 0
        self.own(self._probe(slot))
        self._pulse()
        logger.info("env pool %s: worker %s ready in %.2f s", self.name, slot.name, now - started)
        return SpawnOutcome("ready")

    async def _diagnose(self, slot: ServerSlot) -> str:
        try:
            health = await asyncio.wait_for(resolve(slot.handle.health.remote()), DIAGNOSE_TIMEOUT_S)
        except Exception:
            wants = {"CPU": self.config.num_cpus, **self.config.resources}
            return f"it never answered a probe: resources {wants} never granted, or its process is frozen"
        return (
            f"stuck in phase {health['phase']!r} with its event loop stalled {health['loop_stall_s']:.1f} s "
            "(a hanging constructor or load()?)"
        )

    def _spawn_failed(self, slot: ServerSlot, reason: str) -> None:
        self.retire(slot, reason, "spawn_failed")
        self._note_spawn_failure(slot.name, reason)

    def _note_spawn_failure(self, name: str, reason: str) -> None:
        self.spawn_failures += 1
        self._failures_in_a_row += 1
        logger.warning(
            "env pool %s: spawn of %s failed (%d ready): %s", self.name, name, len(self.ready()), reason
        )
        if self._failures_in_a_row > self.config.restart.max_restarts and not self.spawning_stopped:
            self.spawning_stopped = f"{self._failures_in_a_row} spawns failed in a row; last: {reason}"
            logger.error("env pool %s stops spawning (crash loop): %s", self.name, self.spawning_stopped)

    # ------------------------------------------------------------------------------ liveness

    async def _probe(self, slot: ServerSlot) -> None:
        """Probe one ready worker until it is retired. Dead: retire now. Silent: `_supervise` decides."""
        while slot.state == "ready":
            sent = time.monotonic()
            try:
                health = await asyncio.wait_for(
                    resolve(slot.handle.health.remote()), self.config.probe_timeout_s
                )
                slot.life.heard(float(health["loop_stall_s"]))
                # Kept through the stall (a later probe may go unanswered), forgotten once the loop runs.
                if health.get("blocking") is not None or float(health["loop_stall_s"]) < BLOCKED_S:
                    slot.blocking = health.get("blocking")
            except Exception as exc:
                if ray_loss(exc) == "died":
                    self.retire(slot, f"died: {exit_detail(exc)}", "died")
                    return
                # A timeout, or unreachable: silence, judged against hang_timeout_s.
            await asyncio.sleep(max(0.0, self.config.probe_interval_s - (time.monotonic() - sent)))

    async def _supervise(self) -> None:
        while not self._closed:
            try:
                self._tick(time.monotonic())
            except Exception:  # a bug in one tick must not end supervision
                logger.exception("env pool %s: supervision tick failed", self.name)
            await asyncio.sleep(TICK_S)

    def _tick(self, now: float) -> None:
        self._record()
        for slot in self.ready():
            if slot.life.wedged(now):
                self.retire(slot, f"wedged: {slot.life.verdict(now)}", "wedged")
        self._scale(now)

    def _record(self) -> None:
        tags = {"pool": self.name, "env": self.env.target}
        ready = self.ready()
        ENV_WORKERS.record(len(ready), {**tags, "state": "ready"})
        ENV_WORKERS.record(len(self.starting()), {**tags, "state": "starting"})
        ENV_SESSIONS.record(sum(self.sessions.on(w.name) for w in ready), tags)
        ENV_RESTARTS_USED.record(self.budget.used(), tags)

    def _scale(self, now: float) -> None:
        cfg = self.config
        ready, starting = self.ready(), self.starting()
        live = len(ready) + len(starting)
        sessions = sum(self.sessions.on(w.name) for w in ready)
        want = None
        if live < cfg.min_workers:
            want = "replace"
        elif (
            not starting
            and live < cfg.max_workers
            and sessions >= cfg.grow_fraction * len(ready) * cfg.multiplex
        ):
            want = "grow"
        if want and not self._closed and not self.spawning_stopped:
            if self.budget.try_spend(now):
                self._denied = False
                logger.info("env pool %s: spawning a worker (%s)", self.name, want)
                self._spawn(cfg.spawn_timeout_s)
            elif not self._denied:
                self._denied = True
                self.budget_denials += 1
                logger.warning("env pool %s: wants to %s but the restart budget is spent", self.name, want)
            return
        if len(ready) > cfg.min_workers and sessions < cfg.grow_fraction * (len(ready) - 1) * cfg.multiplex:
            idle = [
                w
                for w in ready
                if not self.sessions.on(w.name)
                and not w.inflight
                and now - w.idle_since >= cfg.idle_timeout_s
            ]
            if idle:
                self.retire(min(idle, key=lambda w: w.idle_since), "idle: shrinking the pool", "shrunk")

    # ---------------------------------------------------------------------------- retirement

    def retire(self, slot: ServerSlot, reason: str, cause: RetireCause) -> None:
        """Take a worker out of service at once: no new dispatch, in-flight calls released (via `gone`),
        its sessions lost, the actor killed. Idempotent."""
        if slot.state == "retired":
            return
        was_ready = slot.state == "ready"
        slot.state = "retired"
        self.workers.pop(slot.name, None)
        if not slot.gone.done():
            slot.gone.set_result((reason, cause))
        if was_ready and cause in ("died", "wedged"):
            self.deaths += 1
            logger.warning("env pool %s: worker %s retired: %s", self.name, slot.name, reason)
        self.retired.append(f"{slot.name}: {reason}")
        self._on_retire(slot, reason)
        try:
            ray.kill(slot.handle, no_restart=True)
        except Exception:  # already gone; killing is best effort by nature
            pass
        if was_ready and cause in ("died", "wedged") and not self._closed:
            # Its replacement starts now, not at the next tick: a session re-dispatched in the meantime
            # waits for it (`ready_worker`) instead of finding nothing starting and failing.
            self._scale(time.monotonic())
        self._pulse()

    async def shutdown(self) -> None:
        """Stop supervising and kill every worker. In-flight calls fail at once."""
        self._closed = True
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        for slot in list(self.workers.values()):
            self.retire(slot, "pool shut down", "shutdown")
        if tasks:
            await asyncio.wait(tasks, timeout=SHUTDOWN_WAIT_S)

    def own(self, coro: Coroutine[Any, Any, Any] | Awaitable[Any]) -> asyncio.Task:
        """Run `coro` as a background task this supervisor owns: `shutdown()` cancels and awaits it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _done(outcome: SpawnOutcome) -> SpawnOutcome:
    return outcome
