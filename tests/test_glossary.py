"""docs/design.md, "Words": one meaning per word. A deadline is a point on a clock and `*_timeout_s` a
duration; a worker is a `RolloutWorker`, an env *server* runs environments, a renderer *slot* is what a
rollout holds of a renderer, a *lease* only a request's; liveness settings are spelled as the kernel's
`Supervision`. The public names renamed to these words keep working for now, each with a
`DeprecationWarning` naming the new one, and the new names are the ones the docs, configs and code use."""

from __future__ import annotations

import importlib
import re
import sys
import warnings
from pathlib import Path

import pytest

from env_actors.config import EnvPoolConfig, EnvPoolStats, EnvServerInfo
from renderer_actors.config import RendererPoolConfig, RendererPoolStats
from rollout_actors.cli import _parser, overrides_from_flags
from rollout_actors.inference.server_actor import ServerSpec
from rollout_actors.job.run_config import RunConfig
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest

ROOT = Path(__file__).resolve().parent.parent

SPEC = {"kind": "standin", "model": "m", "tool_call_parser": None, "reasoning_parser": None}
REQUEST = {"env": Ref(target="env_actors.examples.math_env:MathEnv"), "client": ClientConfig(model="m")}

RENAMED_FIELDS = [
    # (build with these fields, the old field, the new field, where the new one is read)
    (RendererPoolConfig, {}, "health_interval_s", "probe_interval_s", "supervision.probe_interval_s"),
    (RendererPoolConfig, {}, "health_timeout_s", "hang_timeout_s", "supervision.hang_timeout_s"),
    (RendererPoolConfig, {}, "startup_timeout_s", "ready_timeout_s", "supervision.ready_timeout_s"),
    (RendererPoolConfig, {}, "max_lease_s", "slot_timeout_s", "slot_timeout_s"),
    (EnvPoolConfig, {}, "spawn_timeout_s", "ready_timeout_s", "supervision.ready_timeout_s"),
    (EnvPoolConfig, {"max_servers": 9}, "min_workers", "min_servers", "min_servers"),
    (EnvPoolConfig, {}, "max_workers", "max_servers", "max_servers"),
    (ServerSpec, SPEC, "startup_timeout_s", "ready_timeout_s", "ready_timeout_s"),
    (ServerSpec, SPEC, "health_interval_s", "probe_interval_s", "probe_interval_s"),
    (ServerSpec, SPEC, "health_timeout_s", "probe_timeout_s", "probe_timeout_s"),
    (RolloutRequest, REQUEST, "deadline_s", "timeout_s", "timeout_s"),
]


def read(obj, dotted: str):
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def deprecated(call):
    """(the value `call()` returned, the messages of the DeprecationWarnings it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = call()
    return value, [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]


@pytest.mark.parametrize(
    "model, base, old, new, where", RENAMED_FIELDS, ids=lambda v: getattr(v, "__name__", v)
)
def test_an_old_field_name_still_sets_the_new_field_and_warns_naming_it(model, base, old, new, where):
    built, messages = deprecated(lambda: model(**base, **{old: 7.0 if "_s" in old else 3}))
    assert read(built, where) == (7.0 if "_s" in old else 3)
    assert messages == [f"{model.__name__}: {old} is now {new} (the old name will go)"]
    _, quiet = deprecated(lambda: model(**base, **{new: 7.0 if "_s" in old else 3}))
    assert quiet == []  # the new name is the one that does not warn


@pytest.mark.parametrize(
    "model, base, old, new, where", RENAMED_FIELDS[:3], ids=lambda v: getattr(v, "__name__", v)
)
def test_an_old_and_a_new_name_of_one_setting_together_are_refused(model, base, old, new, where):
    with pytest.raises(ValueError, match=f"{old} and {new} are the same setting"):
        model(**base, **{old: 1.0, new: 2.0})


def test_a_run_config_with_the_old_deadline_key_still_sets_the_rollout_timeout():
    config, messages = deprecated(lambda: RunConfig(run={"deadline_s": 42.0}))
    assert config.run.timeout_s == 42.0 and messages == [
        "JobSettings: deadline_s is now timeout_s (the old name will go)"
    ]


def test_the_old_deadline_flag_is_a_hidden_alias_of_timeout(capsys):
    assert overrides_from_flags(_parser().parse_args(["run", "--deadline", "5"])) == {"run.timeout_s": 5.0}
    assert "--deadline is now --timeout" in capsys.readouterr().err
    assert overrides_from_flags(_parser().parse_args(["run", "--timeout", "6"])) == {"run.timeout_s": 6.0}
    run = next(
        a
        for a in _parser()._subparsers._group_actions[0].choices["run"]._actions
        if "--timeout" in a.option_strings
    )
    assert run.dest == "run.timeout_s"
    help_text = _parser()._subparsers._group_actions[0].choices["run"].format_help()
    assert "--timeout" in help_text and "--deadline" not in help_text


def test_old_attribute_and_import_names_still_read_with_a_warning():
    from env_actors.config import WorkerInfo
    from env_actors.direct import EnvCallFailed
    from env_actors.session import EnvSession
    from renderer_actors.calls import RendererLease, RendererSlot
    from rollout_actors.inference.server_set import InferenceServerSet
    from rollout_actors.kernel import Failure

    assert WorkerInfo is EnvServerInfo and RendererLease is RendererSlot
    info = EnvServerInfo(name="pool.env0", state="ready", sessions=1, inflight=0)
    stats = EnvPoolStats(
        name="p", servers=[info], ready=1, starting=0, sessions=1, spawns=1, spawn_failures=0, deaths=0,
        restarts_left=3, budget_denials=0,
    )  # fmt: skip
    session = EnvSession(
        pool=None, session_id="s", messages=[], tools=None, server_name="pool.env0", server=None
    )
    failed = EnvCallFailed(Failure(type="EnvServerLost", message="gone"), server_exit="killed")
    renderers = RendererPoolStats(keys={}, slots=2, expired_slots=1)
    client = ClientConfig(model="m", call_timeout_s=5)
    cases = [
        (lambda: stats.workers, [info], "EnvPoolStats.workers is now servers"),
        (lambda: info.worker, "pool.env0", "EnvServerInfo.worker is now name"),
        (lambda: session.worker, "pool.env0", "EnvSession.worker is now server_name"),
        (lambda: failed.worker_exit, "killed", "EnvCallFailed.worker_exit is now server_exit"),
        (lambda: renderers.leases, 2, "RendererPoolStats.leases is now slots"),
        (lambda: renderers.expired_leases, 1, "RendererPoolStats.expired_leases is now expired_slots"),
        (lambda: client.call_deadline, 5.0, "ClientConfig.call_deadline is now total_call_timeout_s"),
        (lambda: RendererSlot("s1", None, "r", True).lease_id, "s1", "RendererSlot.lease_id is now slot_id"),
        (
            lambda: InferenceServerSet(ServerSpec(**SPEC), watch_period=3.0).probe_interval_s,
            3.0,
            "InferenceServerSet(watch_period=) is now probe_interval_s=",
        ),
    ]
    for read_old, value, message in cases:
        got, messages = deprecated(read_old)
        assert got == value and messages == [f"{message} (the old name will go)"], message


def test_the_old_stop_verbs_still_stop_with_a_warning(monkeypatch):
    """docs/design.md: close / `aclose` is the one verb for stopping what one owns."""
    import asyncio

    import env_actors.pool
    from rollout_actors.inference.standin.launch import StandinServer
    from rollout_actors.inference.standin.server import StandinOptions

    # Never started: stopping it is a no-op that still answers (and warns).
    _, messages = deprecated(lambda: StandinServer(StandinOptions()).stop())
    assert messages == ["StandinServer.stop() is now close() (the old name will go)"]
    closed = []

    async def close_env_pool(handle, timeout):  # no Ray here: what the old name forwards to is recorded
        closed.append((handle, timeout))

    monkeypatch.setattr(env_actors.pool, "close_env_pool", close_env_pool)
    _, messages = deprecated(lambda: asyncio.run(env_actors.pool.stop_env_pool("pool", timeout=1)))
    assert closed == [("pool", 1)] and messages == [
        "stop_env_pool is now close_env_pool (the old name will go)"
    ]


OLD_NAMES = (
    "deadline_s", "spawn_timeout_s", "startup_timeout_s", "health_interval_s", "health_timeout_s",
    "max_lease_s", "watch_period", "min_workers", "max_workers", "EnvWorkerLost", "EnvWorkerUnreachable",
    "EnvWorkerDied", "NoLiveEnvWorker", "RendererLease", "WorkerInfo", "call_deadline", "worker_exit",
    "expired_leases", "lease_many", "stop_env_pool",
)  # fmt: skip
OLD = re.compile(r"\b(" + "|".join(OLD_NAMES) + r")\b")
SAYS_OLD = re.compile(
    r"old name|old spelling|renamed_fields|warn_renamed|was `|were `|ThreadPoolExecutor|serve_env\(|^\s*\"\w+\": \"\w+\",?$"
)
"""Where an old name may still appear: where it is kept working (a `renamed_fields` map entry, a warning)
or documented as the old one (and Python's own `ThreadPoolExecutor(max_workers=)`, verifiers' own
`serve_env(max_workers=)`)."""


def stale_lines(path: Path, window: int) -> list[str]:
    lines = path.read_text().splitlines()
    found = []
    for n, line in enumerate(lines):
        if OLD.search(line) and not any(
            SAYS_OLD.search(near) for near in lines[max(0, n - window) : n + window + 1]
        ):
            found.append(f"{path.relative_to(ROOT)}:{n + 1}: {line.strip()[:100]}")
    return found


def test_the_docs_configs_and_code_use_the_new_names():
    code = [
        p
        for package in ("rollout_actors", "env_actors", "renderer_actors", "scripts")
        for p in (ROOT / package).rglob("*.py")
    ]
    stale = [line for path in code for line in stale_lines(path, window=2)]
    stale += stale_lines(ROOT / "scripts" / "run.example.toml", window=0)
    # README and docs: a paragraph (or table row) naming an old spelling says that it is the old one.
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.split(r"\n\s*\n|\n(?=\|)", page.read_text()):
            if OLD.search(block) and not SAYS_OLD.search(block):
                stale.append(f"{page.name}: {OLD.search(block).group(0)} in {block.strip()[:100]!r}")
    assert not stale, "\n".join(stale)


def test_modules_that_moved_into_folders_import_from_their_old_paths_with_a_warning():
    from rollout_actors.kernel.renamed import MovedModules

    finders = [finder for finder in sys.meta_path if isinstance(finder, MovedModules)]
    assert len(finders) == 1
    moves = finders[0]._moves
    assert "rollout_actors.dispatcher" in moves and "rollout_actors.inference.weights" in moves
    for old, new in moves.items():
        sys.modules.pop(old, None)
        with pytest.warns(DeprecationWarning, match=f"{old} is now {new}"):
            module = importlib.import_module(old)
        moved = importlib.import_module(new)
        public = [name for name in vars(moved) if not name.startswith("_")]
        assert public and all(getattr(module, name) is getattr(moved, name) for name in public), old
        sys.modules.pop(old, None)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("rollout_actors.no_such_module")
    # the old `rollout_actors.rollout` module is now the folder of that name: its names still resolve
    from rollout_actors.rollout import loop

    with pytest.warns(DeprecationWarning, match="rollout_actors.rollout.run_rollout is now"):
        from rollout_actors.rollout import run_rollout
    assert run_rollout is loop.run_rollout
