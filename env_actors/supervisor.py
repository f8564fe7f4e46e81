"""The env servers of one `EnvPool`: a child spec for the kernel's `Supervisor`, placement, growth and blame.

The kernel decides what a death means (probes, wedges, retirement, replacement on the restart budget,
reconciling toward the wanted count; `rollout_actors.kernel.supervisor`). The spec declares the actor
(`spawn.py`: its options, its pool's runtime_env) and that a crash loop stops spawning. What is the
environment's own:

- readiness: `start()` loaded the environment, then one `health()` answer; a load error fails the pool's
  start at once with the environment's traceback, a runtime_env that did not build is the caller's;
- placement: the ready server with the fewest sessions, preferring those that showed life lately;
- growth: the wanted count is one server more when open sessions reach `grow_fraction` of capacity, one
  less when one was idle for `idle_timeout_s` above `min_servers`; a server lost below `min_servers` is
  replaced. Every spawn after
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
from env_actors.readiness import diagnose, handshake, start_first
from env_actors.sessions import OpenSessions
from env_actors.spawn import ENV_SERVER_ACTOR, env_server_args, env_server_options
from rollout_actors.kernel import Failure, Ref
from rollout_actors.kernel.metric import Metric
from rollout_actors.kernel.supervisor import (
    Child,
    ChildKind,
    ChildSpec,
    RetireCause,
    Supervisor,
)
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

__all__ = ["EnvServers", "ServerSlot", "resolve"]


def _read_blocker(slot: ServerSlot, sent: int, answer: asyncio.Future[EnvServerHealth]) -> None:
    if answer.cancelled() or answer.exception() is not None or sent < slot.answered:
        return
    if slot.state == "ready":  # a retired server's blocker was read at its retirement
        slot.answered, slot.blocking = sent, answer.result().blocking


def _unreachable(slot: ServerSlot) -> bool:
    """A session found it unreachable, and it showed no life since."""
    return slot.unreachable_at is not None and slot.life.last_alive <= slot.unreachable_at


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


class EnvServers(ChildKind[ServerSlot]):
    """The server set of one pool: the kernel's supervisor with the environment's policy plugged in."""

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
        incarnation = uuid.uuid4().hex[:6]  # server names stay unique across pools of one name
        spec = ChildSpec(
            kind="env server",
            actor=ENV_SERVER_ACTOR,
            options=lambda server: env_server_options(server, config),
            args=lambda server: env_server_args(server, env, config),
            name=lambda n: f"{name}.env{n}-{incarnation}",
            record=ServerSlot,
            crash_loop_stops=True,  # an environment that fails every load fails loudly, for good
        )
        self.supervisor = Supervisor(name, spec, config.supervision, self)
        self.supervisor.floor = config.min_servers

    # ---------------------------------------------------------------------------------- placement

    def least_busy(self) -> ServerSlot | None:
        """The ready server with the fewest sessions, preferring those that showed life lately: one whose
        probes went unanswered, or that a session found unreachable, gets no new session (it would fail
        at once, so its count would drop and draw every re-dispatched session onto it) until it answers
        again or is judged wedged."""
        ready = [w for w in self.supervisor.ready() if w.alone_for is None]
        if not ready:
            return None
        cfg = self.config
        quiet_s = max(3 * cfg.probe_interval_s, cfg.probe_timeout_s + cfg.probe_interval_s)
        trusted = self.supervisor.heard_lately(ready, quiet_s, _unreachable)
        return min(trusted, key=lambda w: (self.sessions.on(w.name), w.inflight))

    def spawn_alone(self, session_id: str) -> ServerSlot | None:
        """A server started for `session_id` alone (quarantine), outside the restart budget: a request is
        quarantined only after losing env servers at one point twice, and its dispatches bound it."""
        slot = self.supervisor.spawn("quarantine")
        if slot is not None:
            slot.alone_for = session_id
        return slot

    # ------------------------------------------------------------------------------------ startup

    async def start_first(self, ready_timeout: float) -> Failure | None:
        """Spawn `min_servers` and wait for the first to be ready (`readiness.start_first`)."""
        return await start_first(self.supervisor, self.config, ready_timeout)

    async def handshake(self, slot: ServerSlot) -> None:
        info = await handshake(slot, self.config)
        slot.pid, slot.node_id = info.get("pid"), info.get("node_id")
        self.num_tasks = info.get("num_tasks", self.num_tasks)

    async def diagnose(self, slot: ServerSlot) -> str:
        return await diagnose(slot, self.config)

    # ------------------------------------------------------------------------------------ blame

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

    def wanted(self, now: float) -> int:
        cfg, sup = self.config, self.supervisor
        ready, starting = sup.ready(), sup.starting()
        live = len(ready) + len(starting)
        sessions = sum(self.sessions.on(w.name) for w in ready)
        if (
            not starting
            and live < cfg.max_servers
            and sessions >= cfg.grow_fraction * len(ready) * cfg.multiplex
        ):
            return live + 1
        if len(ready) > cfg.min_servers and sessions < cfg.grow_fraction * (len(ready) - 1) * cfg.multiplex:
            return live - 1  # one less, if one is idle
        return live

    def idle(self, now: float) -> list[ServerSlot]:
        timeout_s = self.config.idle_timeout_s
        ready = self.supervisor.ready()
        idle = [
            w
            for w in ready
            if not self.sessions.on(w.name) and not w.inflight and now - w.idle_since >= timeout_s
        ]
        return sorted(idle, key=lambda w: w.idle_since)

    def record(self) -> None:
        sup = self.supervisor
        tags = {"pool": sup.name, "env": self.env.target}
        ready = sup.ready()
        ENV_WORKERS.record(len(ready), {**tags, "state": "ready"})
        ENV_WORKERS.record(len(sup.starting()), {**tags, "state": "starting"})
        ENV_SESSIONS.record(sum(self.sessions.on(w.name) for w in ready), tags)
        ENV_RESTARTS_USED.record(sup.budget.used(), tags)
