"""A kind of child is a `ChildSpec` (data) composed with the behaviour that is its own (placement): a new
kind needs no kernel edit. Shown with a kind declared here alone, fake actors and no Ray cluster; and held
for the five kinds of the tree: none reaches into the supervisor's private state or inherits it."""

from __future__ import annotations

import ast
import asyncio
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest
from ray.exceptions import ActorDiedError
from test_supervisor import settings, until
from waiting import runner

from rollout_actors.kernel.supervision import Health
from rollout_actors.kernel.supervisor import Child, ChildExited, ChildKind, ChildSpec, Supervisor

ROOT = Path(__file__).resolve().parents[1]
run = runner(20.0)


class Call:
    def __init__(self, method) -> None:
        self._method = method

    def remote(self, *args):
        return self._method(*args)


class Counter:
    """A fake actor: `load()` answers what it loaded (or raises, or dies), `health()` a sign of life,
    `beats(interval)` a stream of loop stalls; `mode` makes it die, freeze or exit."""

    def __init__(self, name: str, corpus: str, fails: bool, dies: bool = False) -> None:
        self.name, self.corpus, self.fails, self.dies = name, corpus, fails, dies
        self.mode, self.killed, self.closed = "alive", False, False
        self.load, self.health, self.close = Call(self._load), Call(self._health), Call(self._close)
        self.beats = Call(self._beats)

    async def _load(self) -> int:
        if self.dies:
            raise ActorDiedError()
        if self.fails:
            raise RuntimeError(f"cannot load {self.corpus}")
        return len(self.corpus)

    async def _health(self) -> dict:
        if self.mode == "dead":
            raise ActorDiedError()
        if self.mode == "frozen":
            await asyncio.sleep(3600)
        return {"exited": self.mode == "exited"}

    async def _beats(self, interval_s: float):
        while self.mode == "alive":
            yield asyncio.sleep(0, 0.0)
            await asyncio.sleep(interval_s)
        await asyncio.sleep(3600)  # frozen: the stream goes silent

    async def _close(self) -> None:
        self.closed = True


class CounterClass:
    """Ray's actor-class surface: `options(**options).remote(*args)` creates one actor."""

    def __init__(self, fails: bool = False, dies: int = 0) -> None:
        self.made: list[Counter] = []
        self.options_seen: list[dict] = []
        self.fails, self.dies = fails, dies
        """`dies`: how many of the first actors die while loading."""

    def options(self, **options) -> CounterClass:
        self.options_seen.append(options)
        return self

    def remote(self, name: str, corpus: str) -> Counter:
        self.made.append(actor := Counter(name, corpus, self.fails, dies=len(self.made) < self.dies))
        return actor


# ------------------------------------------------------------------------------- the new kind


@dataclass(eq=False)
class CounterSlot(Child):
    size: int = 0
    """Read from its readiness answer."""
    held: int = 0


def read_exit(slot: CounterSlot, answer: dict) -> Health:
    if answer["exited"]:
        raise ChildExited("its process exited")
    return Health()


def counter_spec(actor: CounterClass, **declared) -> ChildSpec[CounterSlot]:
    """The whole declaration of a kind: what its children are, as data (`declared`: other fields)."""
    declared = {"read_probe": read_exit, **declared}
    return ChildSpec(
        kind="counter",
        actor=actor,
        options=lambda name: {"name": name, "num_cpus": 0.5},
        args=lambda name: (name, "corpus"),
        name=lambda n: f"counters/{n}",
        record=CounterSlot,
        ready="load",
        read_ready=lambda slot, size: setattr(slot, "size", size),
        stop="close",
        **declared,
    )


class Counters(ChildKind[CounterSlot]):
    """Its placement, and nothing else: the least-held ready counter."""

    def pick(self) -> CounterSlot | None:
        ready = self.supervisor.ready()
        return min(ready, key=lambda s: s.held) if ready else None


def test_a_kind_declared_as_a_spec_and_placement_is_spawned_read_placed_restarted_and_stopped():
    async def body():
        actors = CounterClass()
        sup = Supervisor("counters", counter_spec(actors), settings(max_restarts=1), Counters())
        sup.floor = 2
        first, second = await sup.start()
        assert [c.name for c in (first, second)] == ["counters/0", "counters/1"]
        assert actors.options_seen[0] == {"name": "counters/0", "num_cpus": 0.5}
        assert first.size == len("corpus")  # read from the readiness answer
        first.held = 3
        assert sup.kind.pick() is second
        first.handle.mode = "dead"
        assert (await first.gone)[1] == "died" and first.handle.killed is False  # no Ray: kill is a no-op
        await until(lambda: len(sup.ready()) == 2)
        assert sup.budget.remaining() == 0 and sup.deaths == 1
        second.handle.mode = "exited"  # its answer says it is gone: retired as dead, not judged silent
        reason, cause = await second.gone
        assert cause == "died" and "its process exited" in reason
        await until(lambda: sup.starved)  # the budget is spent: one short, and it says so
        await sup.close()
        assert all(a.closed for a in actors.made if a.mode == "alive")  # the spec's stop, then killed

    run(body())


def test_a_kind_whose_children_never_load_stops_spawning_after_a_crash_loop():
    async def body():
        actors = CounterClass(fails=True)
        spec = counter_spec(actors, crash_loop_stops=True)
        sup = Supervisor("counters", spec, settings(max_restarts=2), Counters())
        with pytest.raises(RuntimeError, match="cannot load corpus"):
            await sup.start(n=1)
        sup = Supervisor("counters", spec, settings(max_restarts=2), Counters())
        for _ in range(3):
            with pytest.raises(RuntimeError):
                await sup.spawn("initial").up
        assert sup.stopped and "3 spawns failed in a row" in sup.stopped
        assert sup.spawn("restart") is None and len(actors.made) == 4
        await sup.close()

    run(body())


def test_a_child_lost_while_starting_is_replaced_at_once_on_the_budget_not_held_as_a_load_error():
    class Told(Counters):
        def __init__(self) -> None:
            self.told: list[str] = []

        def on_spawn_failed(self, child: CounterSlot, exc: BaseException) -> None:
            self.told.append(child.name)

    async def body():
        kind = Told()
        sup = Supervisor("counters", counter_spec(CounterClass(dies=1)), settings(max_restarts=1), kind)
        first = sup.spawn("initial")  # no floor: only a loss while starting brings a second one
        with pytest.raises(ActorDiedError):
            await first.up
        await until(lambda: len(sup.ready()) == 1)
        assert sup.spawned_for["restart"] == 1 and sup.budget.remaining() == 0 and kind.told == []
        await sup.close()

    run(body())


def test_a_streamed_liveness_that_goes_silent_is_judged_wedged():
    async def body():
        actors = CounterClass()
        spec = counter_spec(
            actors,
            liveness="stream",
            probe="beats",
            probe_args=lambda s: (s.probe_interval_s,),
            read_probe=None,  # each item is a loop stall
        )
        sup = Supervisor("counters", spec, settings(hang_timeout_s=0.3), Counters())
        (child,) = await sup.start(n=1)
        await asyncio.sleep(0.5)
        assert child.state == "ready"  # its beats are heard
        child.handle.mode = "frozen"
        reason, cause = await child.gone
        assert cause == "wedged" and "no sign of life" in reason
        await sup.close()

    run(body())


def test_growth_is_a_wanted_count_the_kernel_reconciles_on_the_budget():
    class Wants(Counters):
        want = 3

        def wanted(self, now: float) -> int:
            return self.want

        def idle(self, now: float) -> list[CounterSlot]:
            return sorted((c for c in self.supervisor.ready() if not c.held), key=lambda c: -c.born)

    async def body():
        kind = Wants()
        sup = Supervisor("counters", counter_spec(CounterClass()), settings(max_restarts=2), kind)
        sup.floor = 1
        (first,) = await sup.start()
        await until(lambda: len(sup.ready()) == 3)
        assert sup.spawned_for["grow"] == 2 and sup.budget.remaining() == 0
        first.held = 1
        kind.want = 1
        await until(lambda: len(sup.children) == 1)
        assert list(sup.children.values()) == [first] and sup.shrunk == 2
        await sup.close()

    run(body())


# ------------------------------------------------------------------------------- the tree's kinds

KINDS = {
    "rollout_actors/plane/worker_set.py": {
        "WorkerSlot",
        "live",
        "broadcast",
        "pick",
        "pick_or_wait",
        "dispatched",
        "finished",
    },
    "rollout_actors/plane/pool_supervisor.py": {
        "_Incarnation",
        "serving",
        "_unavailable",
        "current",  # placement
        "PoolStatus",
        "status",
        "state",  # status
    },
    "env_actors/supervisor.py": {
        "ServerSlot",
        "least_busy",
        "spawn_alone",
        "_unreachable",  # placement
        "probe",
        "_read_blocker",
        "wants_last_probe",
        "budgets_replacement",
        "on_retired",  # blame
    },
    "renderer_actors/renderer_set.py": {
        "RendererChild",
        "place",
        "_preference",  # placement
        "stats",  # status
        "on_spawn_failed",  # startup hold
    },
    "rollout_actors/inference/server_set.py": {"_Server", "endpoints", "status"},
}
"""Each kind's module, and what in it is truly its own: its placement (the record its placement reads
included), its status, the env servers' blame, the renderers' startup hold."""
MAX_CODE_LINES = 100
"""Code lines of a kind's module outside what is its own (docstrings, comments, blank lines not counted)."""


def _supervisor_expr(node: ast.expr) -> bool:
    """`x.supervisor`, `x._supervisor`, or a local named `sup` / `supervisor`."""
    if isinstance(node, ast.Attribute):
        return node.attr in ("supervisor", "_supervisor")
    return isinstance(node, ast.Name) and node.id in ("sup", "supervisor")


@pytest.mark.parametrize("path", [*KINDS, "env_actors/pool.py", "renderer_actors/pool.py"])
def test_no_kind_reaches_into_a_supervisors_private_state_or_inherits_it(path):
    tree = ast.parse((ROOT / path).read_text())
    private = [
        f"line {n.lineno}: .{n.attr}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr.startswith("_") and _supervisor_expr(n.value)
    ]
    assert not private, private
    bases = [
        ast.unparse(base)
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef)
        for base in n.bases
        if "Supervisor" in ast.unparse(base)
    ]
    assert not bases, bases


def test_no_kind_silences_an_override():
    found = [
        f"{path}:{i}"
        for path in [*KINDS, "rollout_actors/kernel/supervisor.py"]
        for i, line in enumerate((ROOT / path).read_text().splitlines(), 1)
        if "type: ignore[override]" in line
    ]
    assert not found, found


def _code_lines(source: str, skip: set[str]) -> int:
    tree = ast.parse(source)
    left_out: set[int] = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            left_out.update(range(node.lineno, node.end_lineno + 1))  # docstrings
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in skip:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            left_out.update(range(first, node.end_lineno + 1))  # its own
    lines: set[int] = set()
    ignored = (
        tokenize.COMMENT,
        tokenize.NL,
        tokenize.NEWLINE,
        tokenize.INDENT,
        tokenize.DEDENT,
        tokenize.ENDMARKER,
    )
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in ignored:
            lines.update(line for line in range(token.start[0], token.end[0] + 1) if line not in left_out)
    return len(lines)


@pytest.mark.parametrize("path", KINDS)
def test_a_kinds_module_outside_its_placement_is_small(path):
    assert _code_lines((ROOT / path).read_text(), KINDS[path]) <= MAX_CODE_LINES


def test_the_line_count_counts_code_and_leaves_out_placement():
    source = 'def place():\n    return 1\n\n\ndef other():\n    """doc"""\n    # why\n    return 2\n'
    assert _code_lines(source, {"place"}) == 2 and _code_lines(source, set()) == 4


def test_placement_prefers_children_heard_from_lately_and_falls_back_to_all():
    async def body():
        sup = Supervisor("counters", counter_spec(CounterClass()), settings(hang_timeout_s=5), Counters())
        sup.floor = 2
        quiet, heard = await sup.start()
        quiet.handle.mode = "frozen"  # its probes go unanswered: silent, not yet judged wedged
        await asyncio.sleep(0.4)
        assert sup.heard_lately([quiet, heard], 0.2) == [heard]
        assert sup.heard_lately([quiet], 0.2) == [quiet]  # nobody else can take it
        assert sup.heard_lately([quiet, heard], 0.2, suspect=lambda c: c is heard) == [quiet, heard]
        await sup.close()

    run(body())


def test_confirm_returns_once_a_doubted_child_answers_or_is_retired():
    async def body():
        sup = Supervisor("counters", counter_spec(CounterClass()), settings(hang_timeout_s=0.4), Counters())
        sup.floor = 3
        alive, frozen, dead = await sup.start()
        await asyncio.wait_for(sup.confirm(alive, 0.1), 1.0)  # it answers: at once
        frozen.handle.mode, dead.handle.mode = "frozen", "dead"
        doubt = asyncio.ensure_future(sup.confirm(frozen, 0.1))
        await asyncio.sleep(0.2)
        assert not doubt.done()  # unanswered, not yet judged: still in doubt
        await asyncio.wait_for(doubt, 2.0)
        assert frozen.gone.result()[1] == "wedged"
        await asyncio.wait_for(sup.confirm(dead, 0.1), 1.0)
        assert dead.gone.result()[1] == "died"
        await sup.close()

    run(body())
