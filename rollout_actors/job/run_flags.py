"""The flags of `rollouts run`, and every check on them that can be made before Ray starts.

    parser = OneLineParser(prog="rollouts run")
    add_run_arguments(parser)
    args = parser.parse_args(["--env", "my_env:MyEnv", "--allow-ref-prefix", "my_env"])
    config = resolve(args)    # RunConfig, or FlagError naming the flag the user typed

A mistake is reported once, in one line that names the flag (`--env guess_env.GuessEnv: ...`), with exit
status 2 as argparse does, and before anything starts: a run that would fail every rollout the same way
(a Ref outside the allowlist, an environment that cannot be imported, an agent environment outside agent
mode, a base URL without a scheme) never starts Ray, a stand-in or a pool to find out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NoReturn, get_args

from pydantic import ValidationError

from rollout_actors.job.run_config import ConfigError, RunConfig, load_run_config
from rollout_actors.kernel import DEFAULT_ALLOWED_PREFIXES, Ref, RefResolver
from rollout_actors.wire import CallerError, ClientConfig, RolloutMode


class FlagError(ValueError):
    """A flag (or config key) that cannot work: `str()` is the one line the command prints."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (not the 20-line usage of `run` above it), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"not JSON ({exc.msg} at column {exc.colno}): {text[:80]!r}"
        ) from None


def _json_object(text: str) -> dict[str, Any]:
    value = _json_value(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object, like '{{\"key\": 1}}', not {text[:80]!r}")
    return value


def _runtime_env(text: str) -> dict[str, Any]:
    """`--env-runtime-env`: local folders (`py_modules`, `working_dir`) given relative to where the command
    runs are made absolute here, where they are meant: the pool that uploads them runs elsewhere."""
    value = _json_object(text)

    def local(path: object) -> object:
        return str(Path(path).resolve()) if isinstance(path, str) and Path(path).exists() else path

    if isinstance(value.get("py_modules"), list):
        value["py_modules"] = [local(path) for path in value["py_modules"]]
    if "working_dir" in value:
        value["working_dir"] = local(value["working_dir"])
    return value


# Flags of `rollouts run`: (flag, dotted config key, type, metavar, help). The default shown is the config's.
RUN_FLAGS: list[tuple[str, str, Any, str, str]] = [
    ("--env", "run.env", str, "MODULE:CLASS", "environment Ref target, 'package.module:Class'"),
    ("--env-config", "run.env_config", _json_object, "JSON", "JSON config for the environment Ref"),
    ("--tasks", "run.tasks", int, "N", "number of tasks (task indices 0..N-1)"),
    ("--group-size", "run.group_size", int, "N", "rollouts per task (one group)"),
    ("--max-turns", "run.max_turns", int, "N", "model turns per rollout at most"),
    ("--seed", "run.seed", int, "N", "base sampling seed (each rollout of a task adds its index)"),
    ("--timeout", "run.timeout_s", float, "SECONDS", "seconds each rollout may take"),
    (
        "--ray-address",
        "run.ray_address",
        str,
        "ADDRESS",
        "join this Ray cluster (default: $RAY_ADDRESS or local)",
    ),
    ("--output", "run.output", str, "FILE", "JSON-lines results file (default: rollouts-<time>.jsonl)"),
    ("--report-png", "run.report_png", str, "FILE", "write the run report's plots to this PNG at the end"),
    (
        "--max-failed-fraction",
        "run.max_failed_fraction",
        float,
        "FRACTION",
        "exit 1 when more than this share of rollouts failed (cancelled ones do not count)",
    ),
    ("--model", "servers.model", str, "NAME", "model name at --base-url (default: the bundled model)"),
    ("--api-key-var", "servers.api_key_var", str, "VAR", "name of the env variable holding the API key"),
    ("--latency", "servers.standin.latency_s", float, "SECONDS", "stand-in: fixed latency per model call"),
    ("--per-token-latency", "servers.standin.per_token_latency_s", float, "SECONDS", "stand-in: per token"),
    ("--correct-rate", "servers.standin.correct_rate", float, "P", "stand-in: how often the policy is right"),
    ("--tokenizer", "renderer.tokenizer", str, "NAME", "tokenizer name or path for token mode"),
    ("--renderer-family", "renderer.family", str, "FAMILY", "renderer (qwen3, llama-3, default, ...; auto)"),
    ("--max-tokens", "sampling.max_tokens", int, "N", "max tokens per turn"),
    ("--temperature", "sampling.temperature", float, "T", "sampling temperature"),
    ("--top-p", "sampling.top_p", float, "P", "nucleus sampling: keep the top tokens of this mass"),
    ("--workers", "plane.workers", int, "N", "RolloutWorker actors (default: sized from the lanes)"),
]
FLAG_OF = {dotted: flag for flag, dotted, *_ in RUN_FLAGS} | {
    "servers.endpoints": "--base-url",
    "plane.lanes": "--concurrency",
    "plane.allowed_ref_prefixes": "--allow-ref-prefix",
    "plane.env_pool.env_packages": "--env-package",
    "plane.env_pool.runtime_env": "--env-runtime-env",
    "run.mode": "--mode",
    "renderer.template_kwargs": "--enable-thinking",
}
"""Config path -> the flag that sets it: an error about a key names the flag, where there is one."""


def add_run_arguments(run: argparse.ArgumentParser) -> None:
    run.add_argument("--config", default=None, metavar="FILE", help="TOML file with any of the options below")
    run.add_argument("--print-config", action="store_true", help="print the resolved config as TOML, exit")
    defaults = RunConfig()
    for flag, dotted, kind, metavar, text in RUN_FLAGS:
        default = _lookup(defaults, dotted)
        run.add_argument(
            flag,
            dest=dotted,
            type=kind,
            metavar=metavar,
            default=argparse.SUPPRESS,
            help=f"{text} [{default}]",
        )
    run.add_argument(
        "--mode",
        dest="run.mode",
        choices=get_args(RolloutMode),
        default=argparse.SUPPRESS,
        help=f"token ids (token), relayed chat (chat), the env's own agent (agent) [{defaults.run.mode}]",
    )
    run.add_argument(  # the old name of --timeout, kept working (hidden) for a while
        "--deadline",
        dest="run.timeout_s",
        type=float,
        action=_RenamedFlag,
        new="--timeout",
        help=argparse.SUPPRESS,
    )
    run.add_argument(
        "--base-url",
        dest="servers.endpoints",
        action="append",
        metavar="URL",
        default=argparse.SUPPRESS,
        help="OpenAI-compatible base URL, e.g. http://localhost:8000/v1 (repeat for several servers; "
        "none: start the bundled stand-in)",
    )
    run.add_argument(
        "--enable-thinking",
        dest="renderer.template_kwargs.enable_thinking",
        action=argparse.BooleanOptionalAction,
        default=argparse.SUPPRESS,
        help="chat-template enable_thinking, token and agent mode [the template's own]",
    )
    run.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        default=argparse.SUPPRESS,
        help=f"rollouts in flight at once in the train lane [{defaults.plane.lanes['train']}]",
    )
    run.add_argument(
        "--allow-ref-prefix",
        action="append",
        metavar="PREFIX",
        default=argparse.SUPPRESS,
        help=f"extra module prefix Refs may name (always allowed: {list(DEFAULT_ALLOWED_PREFIXES)})",
    )
    run.add_argument(
        "--env-package",
        dest="plane.env_pool.env_packages",
        action="append",
        metavar="PREFIX",
        default=argparse.SUPPRESS,
        help="module prefix an adapter (env_actors.adapters) may import as your environment package",
    )
    run.add_argument(
        "--env-runtime-env",
        dest="plane.env_pool.runtime_env",
        type=_runtime_env,
        metavar="JSON",
        default=argparse.SUPPRESS,
        help="JSON: the env pool's own packages (pip, py_executable, working_dir, py_modules, env_vars)",
    )
    run.add_argument(
        "--messages",
        dest="run.messages",
        action="store_true",
        default=argparse.SUPPRESS,
        help="also write each conversation as chat messages (the lines grow by their text)",
    )
    run.add_argument(
        "--no-progress",
        dest="run.progress",
        action="store_false",
        default=argparse.SUPPRESS,
        help="no progress bar: a plain status line every few seconds (e.g. under ray job submit)",
    )


class _RenamedFlag(argparse.Action):
    """A flag's old spelling: still sets the new flag's key, and says so on stderr."""

    def __init__(self, *args: Any, new: str, **kwargs: Any) -> None:
        kwargs["default"] = argparse.SUPPRESS  # unset unless given, like every flag of `run`
        super().__init__(*args, **kwargs)
        self.new = new

    def __call__(self, parser: Any, namespace: Any, values: Any, option: str | None = None) -> None:
        print(f"rollouts: {option} is now {self.new} (the old name will go)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _lookup(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


def overrides_from_flags(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted config keys for every flag given on the command line (none for flags left out)."""
    given = {k: v for k, v in vars(args).items() if "." in k}
    if hasattr(args, "concurrency"):
        given["plane.lanes"] = {"train": args.concurrency, "eval": max(1, args.concurrency // 4)}
    if hasattr(args, "allow_ref_prefix"):
        given["plane.allowed_ref_prefixes"] = [*DEFAULT_ALLOWED_PREFIXES, *args.allow_ref_prefix]
    return given


def resolve(args: argparse.Namespace) -> RunConfig:
    """The run's configuration from `--config` and the flags, checked as far as it can be without Ray.
    Raises `FlagError` naming the flag (or, for a key no flag sets, the config path)."""
    overrides = overrides_from_flags(args)
    try:
        config = load_run_config(args.config, overrides)
    except ConfigError as exc:
        if not exc.problems:
            raise FlagError("--config", str(exc)) from None
        (where, message), *more = [
            (_where(path, overrides, args.config), text) for path, text in exc.problems
        ]
        raise FlagError(where, message + "".join(f"; {w}: {m}" for w, m in more)) from None
    check(config)
    return config


def _where(path: str, overrides: dict[str, Any], file: str | None) -> str:
    """The flag the user typed for a bad config key, else the key's path in the file."""
    given = [p for p in _parents(path) if p in overrides and p in FLAG_OF]
    return FLAG_OF[given[0]] if given else f"{file}: {path}" if file else path


def _parents(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[:n]) for n in range(len(parts), 0, -1)]


def check(config: RunConfig) -> None:
    """What would fail every rollout of the run the same way, found before Ray starts."""
    job, servers = config.run, config.servers
    try:
        Ref(job.env, job.env_config)
    except ValidationError:
        raise FlagError(
            f"--env {job.env}", "must look like 'package.module:Class' (a colon before the class)"
        ) from None
    try:
        RefResolver(config.plane.allowed_ref_prefixes).check_allowed(job.env)
    except CallerError:
        module = job.env.partition(":")[0]
        raise FlagError(
            f"--env {job.env}", f"module {module!r} is not allowed; allow it with --allow-ref-prefix {module}"
        ) from None
    for url in servers.endpoints:
        try:
            ClientConfig(base_url=url, model="m")
        except ValidationError:
            raise FlagError(
                f"--base-url {url}", "must be an http(s) URL with a host, like http://localhost:8000/v1"
            ) from None
    if servers.endpoints and not servers.model:
        raise FlagError("--model", "required with --base-url: the name the server serves (GET <url>/models)")
    for flag, file in (("--output", job.output), ("--report-png", job.report_png)):
        if file is not None and not Path(file).resolve().parent.is_dir():
            raise FlagError(
                f"{flag} {file}", f"no folder {str(Path(file).resolve().parent)!r} to write it in"
            )
    _check_environment(config)


def _check_environment(config: RunConfig) -> None:
    """Import the environment class here, as its pool will, and match it with `--mode`. Skipped when the
    pool brings its own packages (`--env-runtime-env`): the class may exist only there."""
    from env_actors.agent import AgentEnvironment

    job, plane = config.run, config.plane
    pool = plane.env_pools.get(job.env, plane.env_pool)
    if pool.runtime_env is not None:
        return
    try:
        env_class = RefResolver(pool.allowed_ref_prefixes or plane.allowed_ref_prefixes).load(
            job.env, "environment"
        )
    except CallerError as exc:
        raise FlagError(f"--env {job.env}", str(exc).removeprefix(f"Ref {job.env!r}").lstrip(": ")) from None
    agent = isinstance(env_class, type) and issubclass(env_class, AgentEnvironment)
    if agent and job.mode != "agent":
        raise FlagError(
            f"--env {job.env}", "is an agent environment (it runs its own agent): add --mode agent"
        )
    if job.mode == "agent" and not agent:
        raise FlagError("--mode agent", f"{job.env} is not an agent environment (an AgentEnvironment)")
