"""`Supervisor`: the one supervision loop, written once; every kind of child actor plugs into it.

    spec = ChildSpec(kind="env server", actor=EnvServerActor, options=lambda name: {"num_cpus": 1},
                     name=lambda n: f"env-{n}", record=ServerSlot, crash_loop_stops=True)    # data
    servers = Supervisor("env pool math", spec, settings, EnvServers(...))  # + behaviour: placement, blame
    await servers.start()                            # the initial `floor` children, ready (free), then kept
    server = await servers.wait_for(pick, 5.0)       # a ready child `pick` chooses, waiting for a starting one
    ...
    await servers.close()                            # every child stopped (`ChildSpec.stop`) and killed

A kind is two things, composed (Erlang/OTP's child spec; Ray Serve's replica set): a `ChildSpec`, what
its children are as data (actor class, options, name, readiness method and what to read from it, liveness
channel, stop method, kill linger), and a `ChildKind`, the behaviour that is truly its own (placement,
blame, a startup hold), whose hooks all default to what the spec says. Growth is a wanted count: the
kernel keeps `floor` children (a lost one is replaced on the budget) and reconciles toward the count the
kind's `wanted` asks for, growing on the budget, shrinking by retiring what the kind's `idle` offers.

One loop for all (Erlang/OTP's supervisor, with our liveness rule): each child's life runs in one owned
task (spawn -> ready -> signs of life, each a `Health`, dated back by the loop stall it reports); one tick
judges silence against `hang_timeout_s` (`Liveness`), excusing the time the supervisor itself was deaf;
a ready child Ray says died, that says it exited (`ChildExited`), or that wedged, is retired at once (out
of service, `gone` resolved, killed) and replaced on the same budget growth draws on, unless the kind
blames the loss on something bounded elsewhere (`budgets_replacement`). A kind may ask for one last probe
before a wedged child is retired (`wants_last_probe`): its answer may say what wedged it, or that it lives
after all. Load is never a wedge: a busy child keeps sending signs, and the supervisor's own stall is not
held against it. A spent budget refuses the spawn (counted, logged once per episode); the kind decides
what a refusal means (overfill, fail fast with `RestartBudgetSpent`). More spawn failures in a row than
the budget allows restarts is a crash loop: a spec may stop there (a failed spawn is retried on the
budget, always).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Generic, Literal

from rollout_actors.kernel.child import C, Child, ChildExited, ChildSpec, RetireCause
from rollout_actors.kernel.faults import Unavailable, exit_detail, ray_loss
from rollout_actors.kernel.metric import Metric
from rollout_actors.kernel.supervision import Health, Liveness, Recent, RestartBudget, Supervision
from rollout_actors.kernel.tasks import TaskOwner, kill_actor, retrieve_exception

__all__ = [
    "Child",
    "ChildExited",
    "ChildKind",
    "ChildSpec",
    "RestartBudgetSpent",
    "RetireCause",
    "Supervisor",
    "TaskOwner",
    "retrieve_exception",
]

log = logging.getLogger(__name__)

TICK_S = 0.1  # judging resolution: a wedge is declared within hang_timeout_s + TICK_S
DEAF_S = 1.0  # a tick this late means the supervisor's own loop stalled: that time is nobody's silence
RETIRED_MEMORY = 1_000  # retired children remembered: whoever finds one gone can ask why (`gone`)
RECORD_EVERY_S = 1.0
"""Gauges are set this often, on the judging tick: at most (ten ticks a second would be waste), and at least
(Ray drops a gauge that is not set again for a while: about 20 s with Ray 2.60)."""
_TAGS = ("supervisor", "kind")
CHILDREN = Metric(
    kind="gauge", name="supervised_children", description="Children by state", tag_keys=(*_TAGS, "state")
)
RESTARTS_USED = Metric(
    kind="gauge", name="supervised_restarts_used", description="Restarts spent in the window", tag_keys=_TAGS
)

SpawnWhy = Literal["initial", "restart", "grow", "blamed", "quarantine"]
"""Why a child is spawned: `initial` (the set the owner started with) is free; so is `blamed`, the
replacement of a ready child whose loss the kind blamed on something with a bound of its own
(`ChildKind.budgets_replacement`), and `quarantine`, a child started for one suspect request alone (its
dispatches bound it). `restart` and `grow` spend one restart from the budget (docs/design.md contract 9:
scale-up draws on the same budget)."""
FREE_SPAWNS: frozenset[SpawnWhy] = frozenset({"initial", "blamed", "quarantine"})
SHRUNK = "idle: shrunk"


class RestartBudgetSpent(Unavailable):
    """A child was lost or wanted, and the supervisor's restart budget refused its spawn."""


class ChildKind(Generic[C]):
    """The behaviour of a kind that is its own: each hook defaults to its `ChildSpec` (or does nothing).
    The supervisor sets `supervisor` when it composes the kind; a kind uses its public surface only."""

    supervisor: Supervisor[C]

    def on_created(self, child: C) -> None:
        """A child was created (before its handshake): set what its placement reads."""

    async def handshake(self, child: C) -> None:
        """Its readiness: loaded what it serves and answering (the supervisor bounds the wait); raise if not."""
        spec = self.supervisor.spec
        answer = await getattr(child.handle, spec.ready).remote()
        if spec.read_ready is not None:
            spec.read_ready(child, answer)

    async def probe(self, child: C) -> Health:
        """One sign of life (the supervisor bounds the wait)."""
        spec = self.supervisor.spec
        answer = await getattr(child.handle, spec.probe).remote(*spec.probe_args(self.supervisor.settings))
        return answer if spec.read_probe is None else spec.read_probe(child, answer)

    async def signs(self, child: C) -> AsyncIterator[Health]:
        """Its signs of life, until it stops answering (then the supervisor asks again)."""
        spec, settings = self.supervisor.spec, self.supervisor.settings
        if spec.liveness == "stream":
            async for item in getattr(child.handle, spec.probe).remote(*spec.probe_args(settings)):
                answer = await item
                read = spec.read_probe
                yield read(child, answer) if read is not None else Health(loop_stall_s=float(answer))
            return
        while child.state == "ready":
            sent = time.monotonic()
            yield await asyncio.wait_for(self.probe(child), settings.probe_timeout_s)
            await asyncio.sleep(max(0.0, settings.probe_interval_s - (time.monotonic() - sent)))

    def wants_last_probe(self, child: C) -> bool:
        """Whether a child judged wedged is probed once more (within `probe_timeout_s`) before it is
        retired: for a kind whose answers can say what wedged it, when its last answers did not."""
        return False

    def budgets_replacement(self, child: C, cause: RetireCause) -> bool:
        """Whether replacing this ready child, lost this way, spends the restart budget. Yes, unless the
        kind can name what lost it and that has a bound of its own (an env server wedged by one known
        request's call: that request's poison bound limits what it costs). A loss nobody can be blamed
        for (a death, a wedge of unknown cause) spends it, and spawn failures (crash loops) always do."""
        return True

    async def diagnose(self, child: C) -> str:
        """Why it missed its readiness deadline, as far as can be told."""
        return "no answer to its readiness handshake"

    def on_spawn_failed(self, child: C, exc: BaseException) -> None:
        """Its spawn failed (before it is retired): a load error, a timeout. A child Ray says was lost while
        starting is a loss instead, replaced at once on the budget: this hook is not told of it."""

    def on_ready(self, child: C) -> None:
        """It became ready (before anyone waiting for a ready child is woken)."""

    def on_retired(self, child: C, reason: str, cause: RetireCause) -> None:
        """It left service (before it is killed): release what it held."""

    def wanted(self, now: float) -> int | None:
        """How many children the kind wants now (growth and shrink), never fewer than `floor`: the kernel
        spawns one more on the budget (`grow`) per tick while short, and retires what `idle` offers while
        over. None: as many as there are."""
        return None

    def idle(self, now: float) -> list[C]:
        """Children that may be retired to shrink, first to go first."""
        return []

    def kill(self, child: C) -> None:
        """Kill it for good (best effort: it may be gone already)."""
        kill_actor(child.handle)

    def record(self) -> None:
        """Set the kind's own gauges (every `RECORD_EVERY_S`, on the judging tick)."""


class Supervisor(Generic[C]):
    """Spawns, probes, judges, retires and replaces the children of one kind, within one budget."""

    def __init__(
        self, name: str, spec: ChildSpec[C], settings: Supervision, kind: ChildKind[C] | None = None
    ) -> None:
        self.name, self.spec, self.settings = name, spec, settings
        self.kind: ChildKind[C] = kind if kind is not None else ChildKind()
        self.kind.supervisor = self
        self.children: dict[str, C] = {}
        self.budget = RestartBudget(settings.restart)
        self.tasks = TaskOwner(name)
        self.spawns = self.spawn_failures = self.deaths = self.budget_denials = self.shrunk = 0
        self.stopped: str | None = None
        """Why spawning stopped for good (a crash loop), or None."""
        self.refused: str | None = None
        """Why the last spawn the budget refused was refused; None once one was allowed again."""
        self.retired: Recent[str, C] = Recent(RETIRED_MEMORY)
        """The newest retired children by name, oldest first: each one's `gone` says why and how."""
        self.last_loss: str | None = None
        """Why the last child that died, wedged or failed to start left."""
        self.spawned_for: Counter[SpawnWhy] = Counter()
        self._lives: dict[str, asyncio.Task[None]] = {}
        self._stopping: set[asyncio.Task[None]] = set()
        """Graceful stops under way: `close` waits for them (each bounded by its kind)."""
        self._last_probes: dict[str, asyncio.Task[None]] = {}
        """Children judged wedged, awaiting the last probe their kind asked for before retirement."""
        self.floor = 0
        """Children kept: below this many (a spawn failed, a loss was not replaced), one more is spawned
        on every tick, on the budget."""
        self._failures_in_a_row = 0
        self._in_start = False
        """`start` is bringing up the initial children: a death while starting is its to handle."""
        self._changed = asyncio.Event()
        self._judging = False
        """The judge starts with the first spawn: before it, there is nothing to judge or keep full."""

    # ------------------------------------------------------------------------------------ queries

    def ready(self) -> list[C]:
        return [c for c in self.children.values() if c.state == "ready"]

    def starting(self) -> list[C]:
        return [c for c in self.children.values() if c.state == "starting"]

    @property
    def closed(self) -> bool:
        return self.tasks.closed

    async def changed(self, timeout_s: float) -> bool:
        """Wait until a child becomes ready or is retired (True), or `timeout_s` passes (False)."""
        try:
            await asyncio.wait_for(self._changed.wait(), max(0.0, timeout_s))
            return True
        except TimeoutError:
            return False

    async def wait_for(self, pick: Callable[[], C | None], timeout_s: float) -> C | None:
        """`pick()`'s child; while it finds none and a child is starting (a replacement, a growth), wait for
        it up to `timeout_s`. With none coming, None at once: no live child fails fast, never queues."""
        deadline = time.monotonic() + timeout_s
        while (child := pick()) is None and self.starting() and not self.closed:
            if not await self.changed(deadline - time.monotonic()):
                break
        return child

    def heard_lately(
        self, children: list[C], quiet_s: float, suspect: Callable[[C], bool] = lambda child: False
    ) -> list[C]:
        """Those of `children` heard from within `quiet_s` (and not `suspect`), or all of them when none
        was: one whose signs of life are overdue may be frozen or cut off, and what it is given meanwhile
        is lost with it, so placement gives it work only when no other child can take it."""
        now = time.monotonic()
        heard = [c for c in children if c.life.silent_s(now) <= quiet_s and not suspect(c)]
        return heard or children

    @property
    def starved(self) -> bool:
        """Fewer children than `floor`, and the budget refused the last spawn: short until its window has
        room (an owner answers what needs one at once, saying so)."""
        return self.refused is not None and len(self.children) < self.floor

    def wake(self) -> None:
        """Wake whoever waits in `wait_for` / `changed` to pick again (a child just got room)."""
        self._changed.set()
        self._changed = asyncio.Event()

    def more(self) -> C | None:
        """One more child on demand (a kind's placement found none with room): the first ever is free
        (`initial`), then `grow` while others live, `restart` when none does. None when refused."""
        return self.spawn("initial" if not self.spawns else "grow" if self.children else "restart")

    # ------------------------------------------------------------------------------------ spawning

    async def start(
        self, n: int | None = None, ready_timeout_s: float | None = None, need: int | None = None
    ) -> list[C]:
        """Spawn the initial `n` children (free; `floor` by default) and wait until `need` of them (all by
        default) are ready. The first failure is raised after every child is retired: a failed start leaves
        nothing running. `need`: the owner serves once that many are ready (an env pool: its first server),
        so a child Ray says died while starting is a loss, replaced on the budget within the readiness
        deadline (`RestartBudgetSpent` once none is left)."""
        n = self.floor if n is None else n
        timeout_s = ready_timeout_s or self.settings.ready_timeout_s
        deadline = time.monotonic() + timeout_s
        self._in_start = True
        try:
            for _ in range(n):
                self.spawn("initial", timeout_s)
            while len(self.ready()) < (n if need is None else need):
                if not (starting := [child.up for child in self.starting()]):
                    raise self.budget_spent(self.name)
                done, _ = await asyncio.wait(starting, return_when=asyncio.FIRST_COMPLETED)
                for exc in filter(None, (up.exception() for up in done)):
                    if need is None or ray_loss(exc) != "died" or time.monotonic() >= deadline:
                        raise exc
                    if len(self.children) < n:  # one restart per death, unless the floor's tick did it
                        self.spawn("restart", deadline - time.monotonic())
        except BaseException:
            await self.close()
            raise
        finally:
            self._in_start = False
        return self.ready()

    def spawn(self, why: SpawnWhy, ready_timeout_s: float | None = None) -> C | None:
        """Start one child (its readiness runs in the background: await `child.up`). None when the budget
        refuses it (see `refused`), spawning stopped, the supervisor is closed or creation failed.
        `ready_timeout_s`: this spawn's readiness deadline, if not the setting's."""
        if self.closed or self.stopped:
            return None
        if not self._judging:
            self._judging = True
            self.tasks.keep(self._judge, "judge")
        if why not in FREE_SPAWNS:
            if not self.budget.try_spend():
                self.budget_denials += 1
                if self.refused is None:
                    log.warning("%s: cannot %s a child: %s", self.name, why, self.budget.spent_message())
                self.refused = self.budget.spent_message()
                return None
            self.refused = None
        name = self.spec.name(self.spawns)
        self.spawns += 1
        try:
            child = self._create(name)
        except Exception as exc:  # e.g. malformed resources: nothing was created
            self._count_spawn_failure(name, f"could not be created: {exc}")
            if why == "initial":  # the owner is starting: its configuration's fault is its to raise
                raise
            return None  # mid-serve: one short and logged, the supervisor lives on
        child.life = Liveness(self.settings.hang_timeout_s)
        self.children[child.name] = child
        self.spawned_for[why] += 1
        life = self._live(child, ready_timeout_s or self.settings.ready_timeout_s)
        self._lives[child.name] = self.tasks.own(life, child.name)
        return child

    def _create(self, name: str) -> C:
        spec = self.spec
        handle = None
        if spec.actor is not None:
            handle = spec.actor.options(**spec.options(name)).remote(*spec.args(name))
        child = spec.record(name, handle)
        self.kind.on_created(child)
        return child

    def budget_spent(
        self, what: str, cls: type[RestartBudgetSpent] = RestartBudgetSpent
    ) -> RestartBudgetSpent:
        """The typed failure for a request that needed a child the budget refused (or a crash loop
        stopped): one message for every kind, with the last loss."""
        why = self.stopped or self.refused or self.budget.spent_message()
        loss = f"; last loss: {self.last_loss}" if self.last_loss else ""
        return cls(f"{what} is not restarted: {why}{loss}")

    async def _live(self, child: C, ready_timeout_s: float) -> None:
        try:
            await asyncio.wait_for(self.kind.handshake(child), ready_timeout_s)
        except asyncio.CancelledError:
            self.retire(child, "cancelled while starting", "shutdown")
            raise
        except Exception as exc:
            if child.state == "retired":  # retired meanwhile (shrunk, reported dead): no spawn failure
                return
            if isinstance(exc, TimeoutError):
                exc = TimeoutError(
                    f"not ready within {ready_timeout_s:g} s: {await self.kind.diagnose(child)}"
                )
            lost = ray_loss(exc)
            reason = f"died while starting: {exit_detail(exc)}" if lost else f"{exc}"
            if not child.up.done():
                child.up.set_exception(exc)
            self._count_spawn_failure(child.name, reason)
            if not lost:
                self.kind.on_spawn_failed(child, exc)
            self.retire(child, reason, "died" if lost == "died" else "spawn_failed")
            if lost and not self._in_start and not self.closed:
                # A loss (killed, its node lost), not a load error: replaced at once, on the budget; while
                # `start` runs, replacing is its to decide.
                self.spawn("restart")
            return
        if child.state != "starting":
            return
        child.state = "ready"
        child.life.heard()
        self._failures_in_a_row = 0
        self.kind.on_ready(child)
        child.up.set_result(None)
        self.wake()
        log.info("%s: %s ready in %.2f s", self.name, child.name, time.monotonic() - child.born)
        while child.state == "ready":
            try:
                async for health in self.kind.signs(child):
                    child.life.heard(health.loop_stall_s)
            except ChildExited as exc:
                self.retire(child, f"died: {exc}", "died")
                return
            except Exception as exc:
                if ray_loss(exc) == "died":
                    self.retire(child, f"died: {exit_detail(exc)}", "died")
                    return
                # No answer in time, or unreachable for now: silence, judged against hang_timeout_s.
            await asyncio.sleep(self.settings.probe_interval_s)

    def _count_spawn_failure(self, name: str, reason: str) -> None:
        self.spawn_failures += 1
        self._failures_in_a_row += 1
        log.warning("%s: spawn of %s failed (%d ready): %s", self.name, name, len(self.ready()), reason)
        crash_loop = self._failures_in_a_row > self.settings.restart.max_restarts
        if crash_loop and self.spec.crash_loop_stops and not self.stopped:
            self.stopped = f"{self._failures_in_a_row} spawns failed in a row; last: {reason}"
            log.error("%s stops spawning (crash loop): %s", self.name, self.stopped)

    # ------------------------------------------------------------------------------------ judging

    async def _judge(self) -> None:
        last = recorded = time.monotonic()
        while not self.closed:
            await asyncio.sleep(TICK_S)
            now = time.monotonic()
            deaf_s, last = now - last - TICK_S, now
            if deaf_s > DEAF_S:  # our own loop stalled: no answer could be read meanwhile
                for child in self.ready():
                    child.life.excuse(deaf_s, now)
                continue
            for child in self.ready():
                if not child.life.wedged(now) or child.name in self._last_probes:
                    continue
                if self.kind.wants_last_probe(child):
                    task = self.tasks.own(self._last_probe(child), f"{child.name}: last probe")
                    self._last_probes[child.name] = task
                else:
                    self.retire(child, f"wedged: {child.life.verdict(now)}", "wedged")
            self._reconcile(now)
            if now - recorded >= RECORD_EVERY_S:
                recorded = now
                self._record()

    def _reconcile(self, now: float) -> None:
        """Toward the wanted count: below `floor`, one restart per tick; below the kind's `wanted`, one
        growth per tick; above it, retire what the kind's `idle` offers, down to the count."""
        live = len(self.children)
        if live < self.floor:
            self.spawn("restart")
            return
        want = self.kind.wanted(now)
        if want is None:
            return
        want = max(want, self.floor)
        if live < want:
            self.spawn("grow")
        elif live > want:
            for child in self.kind.idle(now)[: live - want]:
                self.retire(child, SHRUNK, "shrunk")
                self.shrunk += 1

    def _record(self) -> None:
        tags = {"supervisor": self.name, "kind": self.spec.kind}
        CHILDREN.record(len(self.ready()), {**tags, "state": "ready"})
        CHILDREN.record(len(self.starting()), {**tags, "state": "starting"})
        RESTARTS_USED.record(self.budget.used(), tags)
        self.kind.record()

    async def _last_probe(self, child: C) -> None:
        """One more probe of a child judged wedged, on the probe's own timeout, then the verdict again:
        an answer may say what wedged it (the kind reads it in its `probe`) or show it alive after all
        (a late sign of life under load: then it is not retired)."""
        try:
            await self.check(child, self.settings.probe_timeout_s)  # no answer: the verdict stands
        finally:
            self._last_probes.pop(child.name, None)
        if child.state == "ready" and child.life.wedged(now := time.monotonic()):
            self.retire(child, f"wedged: {child.life.verdict(now)}", "wedged")

    async def check(self, child: C, timeout_s: float) -> bool:
        """Probe it once now: True when it answered (a sign of life); a death Ray reports retires it."""
        try:
            health = await asyncio.wait_for(self.kind.probe(child), timeout_s)
        except ChildExited as exc:
            self.retire(child, f"died: {exc}", "died")
            return False
        except Exception as exc:
            if ray_loss(exc) == "died":
                self.retire(child, f"died: {exit_detail(exc)}", "died")
            return False
        if child.state == "ready":
            child.life.heard(health.loop_stall_s)
        return True

    async def confirm(self, child: C, probe_timeout_s: float) -> None:
        """Probe it now, then every `probe_interval_s`, until it answers (alive) or is retired (dead now,
        or judged by its liveness meanwhile): for an owner that saw reason to doubt it."""
        while child.state == "ready":
            sent = time.monotonic()
            if await self.check(child, probe_timeout_s):
                return
            # Unreachable or slow: not dead yet; ask again while the judge decides.
            await asyncio.sleep(max(0.0, self.settings.probe_interval_s - (time.monotonic() - sent)))

    def retire(self, child: C, reason: str, cause: RetireCause) -> None:
        """Take a child out of service at once: `gone` resolved, the kind told, the actor killed; a ready
        one that died or wedged is replaced now, on the budget unless the kind blames the loss on
        something bounded elsewhere (`budgets_replacement`; a spawn that failed is retried on the budget
        by the `floor`, or by the kind's `tick`). Idempotent."""
        if child.state == "retired":
            return
        lost = cause in ("died", "wedged") and child.state == "ready"
        if lost:
            self.deaths += 1
            log.warning("%s: %s retired: %s", self.name, child.name, reason)
        child.state = "retired"
        self.children.pop(child.name, None)
        if not child.up.done():
            child.up.set_exception(Unavailable(f"{child.name} {reason}"))
        if not child.gone.done():
            child.gone.set_result((reason, cause))
        self.retired[child.name] = child
        if cause not in ("shrunk", "shutdown"):
            self.last_loss = reason
        for task in (self._lives.pop(child.name, None), self._last_probes.pop(child.name, None)):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        try:
            self.kind.on_retired(child, reason, cause)
        finally:
            self._end(child)
            if lost and not self.closed:
                # Its replacement starts now, not at the next tick: a request re-dispatched meanwhile
                # waits for it instead of finding nothing starting.
                self.spawn("restart" if self.kind.budgets_replacement(child, cause) else "blamed")
            self.wake()

    async def close(self) -> None:
        """Stop supervising, retire every child and wait for their graceful stops (`ChildSpec.stop`)."""
        await self.tasks.close()
        for child in list(self.children.values()):
            self.retire(child, "shut down", "shutdown")
        if self._stopping:
            await asyncio.wait(self._stopping)
        self.wake()

    def _end(self, child: C) -> None:
        spec = self.spec
        graceful = None
        if (
            spec.stop is not None
            and child.handle is not None
            and (self.closed or not spec.stop_only_at_close)
        ):
            graceful = getattr(child.handle, spec.stop).remote()
        if graceful is None:
            if child.linger and spec.kill_linger_s and not self.closed:
                asyncio.get_running_loop().call_later(spec.kill_linger_s, self._kill, child)
            else:
                self._kill(child)
            return

        async def stop() -> None:
            try:
                await asyncio.wait_for(graceful, spec.stop_timeout_s)
            except Exception as exc:  # dead, wedged or too slow: killed all the same
                log.warning("%s: stopping %s: %r", self.name, child.name, exc)
            self._kill(child)

        task = asyncio.get_running_loop().create_task(stop())
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    def _kill(self, child: C) -> None:
        self.kind.kill(child)
