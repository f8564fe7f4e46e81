"""The env servers of one `EnvPool` as a kind of child of the kernel's `Supervisor`: placement and growth.

The kernel decides what a death means (probes, wedges, retirement, replacement on the restart budget;
`rollout_actors.kernel.supervisor`). What is the environment's own:

- readiness: `start()` loaded the environment, then one `health()` answer; a load error fails the pool's
  start at once with the environment's traceback, a runtime_env that did not build is the caller's;
- placement: the ready server with the fewest sessions, preferring those that showed life lately;
- growth: one server more when open sessions reach `grow_fraction` of capacity, one less when idle for
  `idle_timeout_s` above `min_servers`; a server lost below `min_servers` is replaced. Every spawn after
  the initial `min_servers` (replacement or growth) spends one restart from the budget, but one:
- blame: a server judged wedged while one session's call blocked its loop (`ServerSlot.blocking`, named
  by its probe answers; asked once more before retirement when they named nobody) is replaced outside
  the budget, and so is a server started for one suspect session alone (quarantine, `spawn_alone`).
  That request pays for it instead: its poison bound (two servers at one point, `max_dispatches` in
  all) limits what it costs, and its fellow sessions are told they were collateral.
  Losses nobody can be blamed for (deaths, wedges of unknown cause, spawn failures) spend the budget.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

from env_actors.config import EnvPoolConfig, EnvServerHealth, EnvServerInfo
from env_actors.failures import EnvReadinessTimeout, EnvServerDied, LoadError, UnexplainedEnvFailure
from env_actors.runtime_env_check import interpreter_problem, started_unless_pip_fails
from env_actors.sessions import OpenSessions
from env_actors.spawn import create_env_server
from rollout_actors.kernel import Failure, Ref
from rollout_actors.kernel.faults import CallerError, ray_loss, runtime_env_failed
from rollout_actors.kernel.metric import Metric
from rollout_actors.kernel.supervisor import Child, ChildKind, RestartBudgetSpent, RetireCause
from rollout_actors.kernel.supervisor import Supervisor as KernelSupervisor
from rollout_actors.kernel.tasks import resolve

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

DIAGNOSE_TIMEOUT_S = 0.5  # one probe to say why a server missed its readiness deadline

__all__ = ["ServerSlot", "Supervisor", "resolve"]


def _read_blocker(slot: ServerSlot, sent: int, answer: asyncio.Future[EnvServerHealth]) -> None:
    if answer.cancelled() or answer.exception() is not None or sent < slot.answered:
        return
    if slot.state == "ready":  # a retired server's blocker was read at its retirement
        slot.answered, slot.blocking = sent, answer.result().blocking


@dataclass(eq=False)
class ServerSlot(Child):
    """One EnvServer as the pool sees it. Its sessions are counted in the pool's `OpenSessions`."""

    inflight: int = 0
    pid: int | None = None
    node_id: str | None = None
    idle_since: float = 0.0
    blocking: str | None = None
    """The session whose env call held its loop at the newest-sent probe answered (the one that wedged
    it, if it was), late answers included; None once an answer shows the loop running, or names no call."""
    probes_sent: int = 0
    answered: int = 0
    """The newest probe (by `probes_sent`) whose answer set `blocking`: an older answer arriving late
    does not overwrite a newer one."""
    unreachable_at: float | None = None
    """When a session last found it unreachable; it takes no new session until it shows life after that."""
    alone_for: str | None = None
    """The session it was started for alone (quarantine): it takes no other while that one is open."""
    only_session: str | None = None
    """The one session it held when it was retired, if it held exactly one: its loss is that session's."""

    def info(self, sessions: int) -> EnvServerInfo:
        state = "ready" if self.state == "ready" else "starting"
        return EnvServerInfo(
            name=self.name,
            state=state,
            sessions=sessions,
            inflight=self.inflight,
            pid=self.pid,
            node_id=self.node_id,
        )


class Supervisor(KernelSupervisor[ServerSlot], ChildKind[ServerSlot]):
    """The server set of one pool: the kernel's supervisor with the environment's policy plugged in."""

    crash_loop_stops = True  # an environment that fails every load fails loudly, for good

    def __init__(
        self,
        name: str,
        env: Ref,
        config: EnvPoolConfig,
        sessions: OpenSessions,
    ):
        self.env, self.config = env, config
        self.sessions = sessions
        """The pool's record of open sessions, read here (placement, scaling), written by the pool."""
        self.num_tasks: int | None = None
        self._incarnation = uuid.uuid4().hex[:6]  # server names stay unique across pools of one name
        super().__init__(name, self, config.supervision)
        self.floor = config.min_servers

    # ---------------------------------------------------------------------------------- placement

    def least_busy(self) -> ServerSlot | None:
        """The ready server with the fewest sessions, preferring those that showed life lately: one whose
        probes went unanswered, or that a session found unreachable, gets no new session (it would fail
        at once, so its count would drop and draw every re-dispatched session onto it) until it answers
        again or is judged wedged."""
        ready = [w for w in self.ready() if w.alone_for is None]
        if not ready:
            return None
        now = time.monotonic()
        trusted = [w for w in ready if not self._suspect(w, now)] or ready
        return min(trusted, key=lambda w: (self.sessions.on(w.name), w.inflight))

    def spawn_alone(self, session_id: str) -> ServerSlot | None:
        """A server started for `session_id` alone (quarantine), outside the restart budget: a request is
        quarantined only after losing env servers at one point twice, and its dispatches bound it."""
        slot = self.spawn("quarantine")
        if slot is not None:
            slot.alone_for = session_id
        return slot

    def _suspect(self, slot: ServerSlot, now: float) -> bool:
        quiet_s = max(
            3 * self.config.probe_interval_s, self.config.probe_timeout_s + self.config.probe_interval_s
        )
        if slot.unreachable_at is not None and slot.life.last_alive <= slot.unreachable_at:
            return True
        return slot.life.silent_s(now) > quiet_s

    # ------------------------------------------------------------------------------------ startup

    async def start_first(self, ready_timeout: float) -> Failure | None:
        """Spawn `min_servers` and wait for the first to be ready (the kernel's `start`: a server that died
        while loading is replaced on the budget within the deadline). On failure everything is retired and
        the failure returned: a load error at once (with the environment's traceback), servers that died
        while loading past the restart budget, or the readiness deadline; an interpreter (`py_executable`)
        that cannot start a Ray worker before anything is spawned (`runtime_env_check`)."""
        runtime_env = self.config.runtime_env
        if runtime_env is not None and runtime_env.py_executable:  # before a server is spawned with it
            problem = await interpreter_problem(runtime_env.py_executable, runtime_env.env_vars)
            if problem is not None:
                return CallerError(problem).failure
        try:
            await self.start(ready_timeout_s=ready_timeout, need=1)
            return None
        except LoadError as exc:
            return exc.failure
        except TimeoutError as exc:
            return EnvReadinessTimeout(str(exc)).failure
        except Exception as exc:
            if not isinstance(exc, RestartBudgetSpent) and ray_loss(exc) != "died":
                return Failure.from_exception(exc)  # e.g. nothing could be created (malformed resources)
            deadline = f"readiness deadline ({ready_timeout:g} s) passed; last loss: {self.last_loss}"
            why = exc if isinstance(exc, RestartBudgetSpent) else deadline
            message = f"env server died while loading {self.spawn_failures} time(s); {why}"
            return EnvServerDied(message).failure

    # ------------------------------------------------------------------------- the kind's hooks

    def create(self, name: str) -> ServerSlot:
        name = f"{self.name}.env{self.spawns - 1}-{self._incarnation}"
        return ServerSlot(name, create_env_server(name, self.env, self.config))  # idle from when it is ready

    async def handshake(self, slot: ServerSlot) -> None:
        try:
            # pip's verdict on the pool's own packages, beside Ray's slower build of them
            response = await started_unless_pip_fails(
                resolve(slot.handle.start.remote()), self.config.runtime_env
            )
        except Exception as exc:
            if runtime_env_failed(exc):  # the pool's own packages did not build: its configuration
                raise LoadError(
                    CallerError(f"its runtime_env failed to build: {exc}"[-4000:]).failure
                ) from exc
            raise
        if not response.success:
            raise LoadError(response.error or UnexplainedEnvFailure("start failed").failure)
        await resolve(slot.handle.health.remote())
        info = response.value or {}
        slot.pid, slot.node_id = info.get("pid"), info.get("node_id")
        self.num_tasks = info.get("num_tasks", self.num_tasks)

    async def diagnose(self, slot: ServerSlot) -> str:
        try:
            health = await asyncio.wait_for(resolve(slot.handle.health.remote()), DIAGNOSE_TIMEOUT_S)
        except Exception:
            wants = {"CPU": self.config.num_cpus, **self.config.resources}
            return f"it never answered a probe: resources {wants} never granted, or its process is frozen"
        return (
            f"stuck in phase {health.phase!r} with its event loop stalled {health.loop_stall_s:.1f} s "
            "(a hanging constructor or load()?)"
        )

    async def probe(self, slot: ServerSlot) -> EnvServerHealth:
        # The supervisor stops waiting at `probe_timeout_s`; the answer is still read when it comes (on a
        # loaded machine a probe may take longer than that, and a late answer still names the call that
        # blocks the loop). An answer names a call only while the loop is stalled past
        # `BLOCKING_AFTER_S`: kept through the stall, forgotten with a newer answer once the loop runs.
        slot.probes_sent += 1
        answer = asyncio.ensure_future(resolve(slot.handle.health.remote()))
        answer.add_done_callback(lambda done, sent=slot.probes_sent: _read_blocker(slot, sent, done))
        return await asyncio.shield(answer)

    def wants_last_probe(self, slot: ServerSlot) -> bool:
        # Under load no answer may have come since the stall grew long enough to name its call: one more
        # probe tells a request that wedged it from a frozen process, and the collateral from the culprit.
        return slot.blocking is None

    def budgets_replacement(self, slot: ServerSlot, cause: RetireCause) -> bool:
        return not (cause == "wedged" and slot.blocking is not None)

    def on_ready(self, slot: ServerSlot) -> None:
        slot.idle_since = time.monotonic()

    def on_retired(self, slot: ServerSlot, reason: str, cause: RetireCause) -> None:
        # A server holding one session (in quarantine, or by chance) was lost by it, if by anyone: what it
        # names when no probe named the call that wedged it, and what names a death (`EnvPool.server_lost`).
        slot.only_session = self.sessions.only_one_on(slot.name)
        if cause == "wedged" and slot.blocking is None:
            slot.blocking = slot.only_session
        # Their calls fail on the dead server; `end_session` finds them gone.
        self.sessions.drop_server(slot.name)

    def tick(self, now: float) -> None:
        cfg = self.config
        ready, starting = self.ready(), self.starting()
        live = len(ready) + len(starting)
        sessions = sum(self.sessions.on(w.name) for w in ready)
        if live < self.floor:
            return  # the kernel spawns one more, on the budget
        if (
            not starting
            and live < cfg.max_servers
            and sessions >= cfg.grow_fraction * len(ready) * cfg.multiplex
        ):
            self.spawn("grow")
        elif len(ready) > cfg.min_servers and sessions < cfg.grow_fraction * (len(ready) - 1) * cfg.multiplex:
            idle = [
                w
                for w in ready
                if not self.sessions.on(w.name)
                and not w.inflight
                and now - w.idle_since >= cfg.idle_timeout_s
            ]
            if idle:
                self.retire(min(idle, key=lambda w: w.idle_since), "idle: shrinking the pool", "shrunk")

    def record(self) -> None:
        tags = {"pool": self.name, "env": self.env.target}
        ready = self.ready()
        ENV_WORKERS.record(len(ready), {**tags, "state": "ready"})
        ENV_WORKERS.record(len(self.starting()), {**tags, "state": "starting"})
        ENV_SESSIONS.record(sum(self.sessions.on(w.name) for w in ready), tags)
        ENV_RESTARTS_USED.record(self.budget.used(), tags)
