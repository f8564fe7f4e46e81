"""The kernel's one supervisor, with fake children and no Ray cluster: restarts within the budget, growth on
the same budget, a spent budget as a typed failure, the supervisor's own deafness excused, and background
loops that never die silently."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from ray.exceptions import ActorDiedError
from waiting import runner

from rollout_actors.kernel.faults import Unavailable
from rollout_actors.kernel.supervision import Health, RestartIntensity, Supervision
from rollout_actors.kernel.supervisor import (
    Child,
    ChildKind,
    ChildSpec,
    RestartBudgetSpent,
    Supervisor,
    TaskOwner,
)

DEADLINE_S = 20.0
run = runner(DEADLINE_S)


def settings(max_restarts: int = 2, hang_timeout_s: float = 0.5) -> Supervision:
    return Supervision(
        restart=RestartIntensity(max_restarts=max_restarts, window_s=60),
        ready_timeout_s=2.0,
        probe_interval_s=0.05,
        probe_timeout_s=0.1,
        hang_timeout_s=hang_timeout_s,
    )


class FakeMethod:
    def __init__(self, answer) -> None:
        self._answer = answer

    def remote(self):
        return self._answer()


class FakeActor:
    """Answers `health()` while `mode` is `alive`; `dead`: raises Ray's death; `frozen`: never answers.
    `close()` stops it gracefully (after a moment, and before any kill); `hang()` never returns."""

    def __init__(self, stopped: list[str], name: str) -> None:
        self.mode = "alive"
        self.killed = False
        self.health = FakeMethod(self._health)
        self.close = FakeMethod(self._close)
        self.hang = FakeMethod(lambda: asyncio.sleep(3600))
        self._stopped, self._name = stopped, name

    async def _close(self) -> None:
        await asyncio.sleep(0.05)
        assert not self.killed  # stopped first, killed after
        self.mode = "closed"
        self._stopped.append(self._name)

    async def _health(self) -> Health:
        if self.mode == "dead":
            raise ActorDiedError()
        if self.mode == "frozen":
            await asyncio.sleep(3600)
        return Health(pid=1)


class FakeActorClass:
    """Ray's actor-class surface (`options(...).remote(...)`), starting `FakeActor`s its kind can see."""

    def __init__(self, kind: Fakes) -> None:
        self.kind = kind

    def options(self, **options) -> FakeActorClass:
        return self

    def remote(self, name: str) -> FakeActor:
        self.kind.actors.append(actor := FakeActor(self.kind.stopped, name))
        return actor


class Fakes(ChildKind[Child]):
    def __init__(self, fail_ready: bool = False) -> None:
        self.actors: list[FakeActor] = []
        self.fail_ready = fail_ready
        self.lost: list[tuple[str, str]] = []
        self.stopped: list[str] = []

    def spec(self, **declared) -> ChildSpec[Child]:
        return ChildSpec(kind="fake", actor=FakeActorClass(self), args=lambda name: (name,), **declared)

    async def handshake(self, child: Child) -> None:
        if self.fail_ready:
            raise RuntimeError("load failed")
        await child.handle.health.remote()

    def on_retired(self, child: Child, reason: str, cause: str) -> None:
        self.lost.append((child.name, cause))

    def kill(self, child: Child) -> None:
        child.handle.killed = True


def supervise(kind: Fakes, settings: Supervision, **declared) -> Supervisor[Child]:
    """The kernel's supervisor composed of a fake kind and its spec (`declared`: the spec's other fields)."""
    return Supervisor("fakes", kind.spec(**declared), settings, kind)


async def until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


def test_a_child_that_dies_is_retired_killed_and_replaced_within_the_budget():
    async def body():
        kind = Fakes()
        sup = supervise(kind, settings(max_restarts=2))
        first = sup.spawn("initial")
        await first.up
        first.handle.mode = "dead"
        assert (await first.gone)[1] == "died"
        assert first.handle.killed and kind.lost == [(first.name, "died")]
        await until(lambda: len(sup.ready()) == 1)
        assert sup.budget.remaining() == 1 and sup.deaths == 1
        await sup.close()

    run(body())


def test_a_silent_child_is_judged_wedged_and_replaced():
    async def body():
        sup = supervise(Fakes(), settings(hang_timeout_s=0.3))
        first = sup.spawn("initial")
        await first.up
        first.handle.mode = "frozen"
        reason, cause = await first.gone
        assert cause == "wedged" and "no sign of life" in reason
        await until(lambda: len(sup.ready()) == 1)
        await sup.close()

    run(body())


def test_growth_spends_the_same_budget_as_restarts():
    async def body():
        sup = supervise(Fakes(), settings(max_restarts=2))
        await sup.spawn("initial").up
        await sup.spawn("grow").up
        assert sup.budget.remaining() == 1
        lost = sup.ready()[0]
        lost.handle.mode = "dead"
        await lost.gone
        await until(lambda: len(sup.ready()) == 2)
        assert sup.budget.remaining() == 0 and sup.spawn("grow") is None and sup.budget_denials == 1
        await sup.close()

    run(body())


def test_a_spent_budget_refuses_the_replacement_with_a_typed_failure():
    async def body():
        sup = supervise(Fakes(), settings(max_restarts=0))
        child = sup.spawn("initial")
        await child.up
        child.handle.mode = "dead"
        await child.gone
        assert not sup.children and sup.budget_denials == 1
        failure = sup.budget_spent("the fake pool")
        assert isinstance(failure, RestartBudgetSpent) and isinstance(failure, Unavailable)
        assert "restart budget spent (0 restarts in 60 s)" in str(failure)
        assert failure.failure.fault == "unavailable"
        await sup.close()

    run(body())


def test_spawns_failing_in_a_row_past_the_budget_stop_spawning():
    async def body():
        kind = Fakes(fail_ready=True)
        sup = supervise(kind, settings(max_restarts=5), crash_loop_stops=True)
        for _ in range(sup.settings.restart.max_restarts + 1):
            child = sup.spawn("initial")
            with pytest.raises(RuntimeError, match="load failed"):
                await child.up
        assert sup.stopped and sup.spawn("initial") is None
        await sup.close()

    run(body())


def test_the_supervisors_own_stall_is_not_held_against_its_children():
    async def body():
        sup = supervise(Fakes(), settings(hang_timeout_s=0.5))
        child = sup.spawn("initial")
        await child.up
        time.sleep(1.5)  # the supervisor's loop blocked: no answer could be read, none was missed
        await asyncio.sleep(0.3)
        assert child.state == "ready" and sup.deaths == 0
        await sup.close()

    run(body())


def test_close_retires_every_child_and_answers_their_waiters():
    async def body():
        kind = Fakes()
        sup = supervise(kind, settings())
        ready = sup.spawn("initial")
        await ready.up
        await sup.close()
        assert ready.gone.result()[1] == "shutdown" and all(a.killed for a in kind.actors)
        assert sup.spawn("initial") is None

    run(body())


def test_a_kept_loop_that_dies_is_logged_and_restarted(caplog):
    runs: list[int] = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("a bug in the loop")
        await asyncio.sleep(3600)

    async def body():
        owner = TaskOwner("owner")
        owner.keep(flaky, "flaky")
        await until(lambda: len(runs) == 3)
        await owner.close()

    with caplog.at_level(logging.ERROR):
        run(body())
    assert caplog.text.count("background loop 'flaky' died") == 2


def test_a_task_that_dies_tells_its_owner():
    deaths: list[str] = []

    async def body():
        owner = TaskOwner("owner", on_death=lambda name, exc: deaths.append(f"{name}: {exc}"))

        async def broken() -> None:
            raise RuntimeError("boom")

        owner.own(broken(), "broken")
        await until(lambda: deaths)
        await owner.close()

    run(body())
    assert deaths == ["owner: broken: boom"]


def test_a_pool_is_restarted_as_a_new_incarnation_then_past_its_budget_answers_at_once():
    from rollout_actors.plane.config import PoolSupervision
    from rollout_actors.plane.pool_supervisor import PoolUnavailable, SupervisedPool

    async def body():
        started: list[str] = []

        async def start(actor_name: str) -> FakeActor:
            started.append(actor_name)
            return FakeActor([], actor_name)

        settings = PoolSupervision(
            restart={"max_restarts": 1, "window_s": 60}, hang_timeout_s=0.5, probe_interval_s=0.05
        )
        pool = SupervisedPool("fake pool", "p/pool", start, settings)
        (await pool.start()).mode = "dead"
        await until(lambda: pool.incarnation == 2 and pool.state == "serving")
        assert (await pool.serving(5)).incarnation == 2 and started == ["p/pool", "p/pool@2"]
        pool.current().mode = "frozen"
        await until(lambda: pool.state == "failed")
        with pytest.raises(
            PoolUnavailable, match=r"restart budget spent \(1 restarts in 60 s\); last loss: wedged"
        ):
            await pool.serving(5)
        assert pool.status().restarts == 1 and pool.status().incarnation == 2
        await pool.close()

    run(body())


def test_a_kinds_growth_policy_waits_for_the_owners_first_spawn():
    class KeepsOne(Fakes):
        def wanted(self, now: float) -> int:
            return 1

    async def body():
        sup = supervise(KeepsOne(), settings())
        await asyncio.sleep(0.3)  # the owner is still starting: nothing is spawned behind its back
        assert not sup.children and sup.budget.remaining() == 2
        await sup.spawn("initial").up
        await sup.close()

    run(body())


class BlamesWedges(Fakes):
    """A kind that can name what wedged a child (an env server names the request whose call blocks its
    loop) and charges that instead of the budget; a death is nobody's to blame."""

    def budgets_replacement(self, child: Child, cause: str) -> bool:
        return cause != "wedged"


def test_a_loss_the_kind_blames_is_replaced_outside_the_budget_and_a_death_still_spends_it():
    async def body():
        sup = supervise(BlamesWedges(), settings(max_restarts=2, hang_timeout_s=0.3))
        first = sup.spawn("initial")
        await first.up
        first.handle.mode = "frozen"
        assert (await first.gone)[1] == "wedged"
        await until(lambda: len(sup.ready()) == 1)
        assert sup.budget.remaining() == 2 and sup.spawned_for["blamed"] == 1
        second = sup.ready()[0]
        second.handle.mode = "dead"
        assert (await second.gone)[1] == "died"
        await until(lambda: len(sup.ready()) == 1)
        assert sup.budget.remaining() == 1 and sup.spawned_for["restart"] == 1 and sup.deaths == 2
        await sup.close()

    run(body())


class AsksLast(Fakes):
    """Its regular probes go unanswered (a loaded node); the last probe, asked before a wedged child is
    retired, is answered with a loop stall of `last_stall_s` (None: unanswered too). Like the env servers'
    kind, it reads an answer in its own `probe` and what it read where a loss is decided (`on_retired`)."""

    def __init__(self, last_stall_s: float | None) -> None:
        super().__init__()
        self.last_stall_s = last_stall_s
        self.asked: list[str] = []
        self.answered: dict[str, float] = {}
        self.read_at_retirement: list[tuple[str, float | None]] = []

    async def signs(self, child: Child):
        await asyncio.sleep(3600)
        yield Health()

    def wants_last_probe(self, child: Child) -> bool:
        return True

    async def probe(self, child: Child) -> Health:
        self.asked.append(child.name)
        if self.last_stall_s is None:
            await asyncio.sleep(3600)
        self.answered[child.name] = self.last_stall_s
        return Health(pid=1, loop_stall_s=self.last_stall_s)

    def on_retired(self, child: Child, reason: str, cause: str) -> None:
        self.read_at_retirement.append((child.name, self.answered.get(child.name)))
        super().on_retired(child, reason, cause)


async def silent_child(last_stall_s: float | None) -> tuple[AsksLast, Supervisor, Child]:
    kind = AsksLast(last_stall_s)
    sup = supervise(kind, settings(hang_timeout_s=0.3))
    child = sup.spawn("initial")
    await child.up
    return kind, sup, child


def test_a_child_judged_wedged_is_asked_once_more_and_its_answer_is_read_before_it_is_retired():
    async def body():
        kind, sup, child = await silent_child(last_stall_s=10.0)
        reason, cause = await child.gone
        assert cause == "wedged" and "no sign of life" in reason
        assert kind.asked.count(child.name) == 1
        assert kind.read_at_retirement == [(child.name, 10.0)]  # its answer was read before it was retired
        await sup.close()

    run(body())


def test_a_child_whose_last_probe_shows_its_loop_running_is_not_retired():
    async def body():
        kind, sup, child = await silent_child(last_stall_s=0.0)
        await until(lambda: len(kind.asked) >= 3)  # silent again after each answer: asked again
        assert child.state == "ready" and sup.deaths == 0 and not child.handle.killed
        await sup.close()

    run(body())


def test_a_child_that_does_not_answer_its_last_probe_is_retired_as_wedged():
    async def body():
        kind, sup, child = await silent_child(last_stall_s=None)
        assert (await child.gone)[1] == "wedged"
        assert kind.asked.count(child.name) == 1 and child.handle.killed
        assert kind.read_at_retirement == [(child.name, None)]
        await sup.close()

    run(body())


def test_start_brings_up_the_floor_and_keeps_it_on_the_budget():
    async def body():
        sup = supervise(Fakes(), settings(max_restarts=1))
        sup.floor = 2
        first, second = await sup.start()
        assert sup.budget.remaining() == 1  # the initial set is free
        second.handle.mode = "dead"
        await second.gone
        await until(lambda: len(sup.ready()) == 2)
        assert sup.budget.remaining() == 0
        sup.kind.fail_ready = True  # the next replacement fails to start: the floor asks again, refused
        first.handle.mode = "dead"
        await first.gone
        await until(lambda: sup.budget_denials > 0)
        assert len(sup.ready()) == 1
        await sup.close()

    run(body())


def test_a_start_that_fails_leaves_nothing_running():
    async def body():
        kind = Fakes(fail_ready=True)
        sup = supervise(kind, settings())
        sup.floor = 2
        with pytest.raises(RuntimeError, match="load failed"):
            await sup.start()
        assert sup.closed and not sup.children and all(a.killed for a in kind.actors)
        await asyncio.sleep(0.3)  # closed: nothing is spawned again behind the failed start
        assert len(kind.actors) == 2

    run(body())


def test_wait_for_waits_for_a_starting_child_and_with_none_coming_answers_at_once():
    async def body():
        sup = supervise(Fakes(), settings(max_restarts=1))
        sup.floor = 1
        (first,) = await sup.start()
        first.handle.mode = "dead"
        await first.gone  # its replacement is starting now, not at the next tick
        replacement = await sup.wait_for(lambda: next(iter(sup.ready()), None), 5.0)
        assert replacement is not None and replacement is not first
        replacement.handle.mode = "dead"  # the budget (one restart) is spent: nothing starts now
        await replacement.gone
        assert not sup.starting() and sup.budget_denials == 1
        # Nothing is coming: None at once, not after an hour (the test's own deadline would fail it).
        assert await sup.wait_for(lambda: next(iter(sup.ready()), None), 3600.0) is None
        await sup.close()

    run(body())


def test_close_waits_for_each_childs_graceful_stop_and_a_lost_child_is_killed_at_once():
    async def body():
        kind = Fakes()  # stopped gracefully at shutdown (like the plane's pools); a lost one killed at once
        sup = supervise(kind, settings(), stop="close", stop_only_at_close=True)
        sup.floor = 2
        first, second = await sup.start()
        first.handle.mode = "dead"
        await first.gone
        assert first.handle.killed and kind.stopped == []
        await until(lambda: len(sup.ready()) == 2)
        serving = sorted(c.name for c in sup.ready())
        await sup.close()
        assert second.name in serving and sorted(kind.stopped) == serving
        assert all(a.killed for a in kind.actors)

    run(body())


def test_a_pool_whose_first_start_fails_raises_it_and_leaves_no_loop_running():
    from rollout_actors.plane.config import PoolSupervision
    from rollout_actors.plane.pool_supervisor import SupervisedPool

    async def start(actor_name: str) -> FakeActor:
        raise RuntimeError("bad import")

    async def body():
        pool = SupervisedPool("fake pool", "p/pool", start, PoolSupervision())
        with pytest.raises(RuntimeError, match="bad import"):
            await pool.start()
        assert pool.state == "failed" and pool.closed  # its judge stopped: nothing ticks on behind it
        with pytest.raises(RuntimeError, match="bad import"):
            await pool.serving(5)
        await pool.close()

    run(body())


class DiesWhileStarting(Fakes):
    """The first `deaths` children die while starting (Ray's death, as a killed or OOM'd process)."""

    def __init__(self, deaths: int) -> None:
        super().__init__()
        self.deaths = deaths

    async def handshake(self, child: Child) -> None:
        if len(self.actors) <= self.deaths:
            raise ActorDiedError()
        await child.handle.health.remote()


def test_a_start_that_needs_one_child_replaces_deaths_while_starting_on_the_budget():
    async def body():
        sup = supervise(DiesWhileStarting(deaths=2), settings(max_restarts=2))
        sup.floor = 1
        (child,) = await sup.start(need=1)
        assert child.state == "ready" and sup.spawn_failures == 2 and sup.budget.remaining() == 0
        await sup.close()

    run(body())


def test_a_start_whose_deaths_while_starting_spend_the_budget_raises_it_and_leaves_nothing_running():
    async def body():
        kind = DiesWhileStarting(deaths=10)
        sup = supervise(kind, settings(max_restarts=2))
        sup.floor = 1
        with pytest.raises(RestartBudgetSpent, match="restart budget spent"):
            await sup.start(need=1)
        assert len(kind.actors) == 3 and sup.closed and all(a.killed for a in kind.actors)

    run(body())


def test_a_start_that_needs_every_child_fails_on_a_death_while_starting():
    async def body():
        sup = supervise(DiesWhileStarting(deaths=1), settings(max_restarts=2))
        sup.floor = 1
        with pytest.raises(ActorDiedError):
            await sup.start()
        assert sup.closed and sup.budget.remaining() == 2

    run(body())


def test_a_graceful_stop_that_hangs_is_cut_at_the_kinds_stop_timeout_and_the_child_killed():
    async def body():
        kind = Fakes()
        sup = supervise(kind, settings(), stop="hang", stop_timeout_s=0.2)
        sup.floor = 1
        (child,) = await sup.start()
        await sup.close()  # the test's own deadline fails it if close waits for the hung stop
        assert child.handle.killed

    run(body())
