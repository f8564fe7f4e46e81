"""`rollouts`: the command line, and the `ray job submit` entrypoint.

rollouts run                          # embedded defaults: local Ray, stand-in server, bundled env
rollouts run --base-url http://vllm:8000/v1 --model Qwen/Qwen3-8B --env env_actors.examples.math_env:MathEnv
rollouts run --config run.toml [--print-config]     # every option as a TOML file; flags override it
rollouts report rollouts-20261130-120000.jsonl --png report.png
rollouts pool-python ~/.pools/vf04 verifiers==0.4.0  # an env pool's interpreter (runtime_env py_executable)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, get_args

from rollout_actors.job.run_config import ConfigError, RunConfig, load_run_config, to_toml
from rollout_actors.kernel import DEFAULT_ALLOWED_PREFIXES
from rollout_actors.wire import Ref, Result, ResultKind, RolloutRequest

STATUS_EVERY_S = 5.0  # the plain status line of `--no-progress`

# Flags of `rollouts run`: (flag, dotted config key, type, help). The default shown is the config's.
RUN_FLAGS: list[tuple[str, str, Any, str]] = [
    ("--env", "run.env", str, "environment Ref target, 'package.module:Class'"),
    ("--env-config", "run.env_config", json.loads, "JSON config for the environment Ref"),
    ("--tasks", "run.tasks", int, "number of tasks (task indices 0..N-1)"),
    ("--group-size", "run.group_size", int, "rollouts per task (one group)"),
    ("--max-turns", "run.max_turns", int, "model turns per rollout at most"),
    ("--mode", "run.mode", str, "token ids (token), relayed chat (chat), the env's own agent (agent)"),
    ("--seed", "run.seed", int, "base sampling seed (each rollout of a task adds its index)"),
    ("--timeout", "run.timeout_s", float, "seconds each rollout may take"),
    ("--ray-address", "run.ray_address", str, "join this Ray cluster (default: $RAY_ADDRESS or local)"),
    ("--output", "run.output", str, "JSON-lines results file (default: rollouts-<time>.jsonl)"),
    ("--report-png", "run.report_png", str, "write the run report's plots to this PNG at the end"),
    ("--model", "servers.model", str, "model name at --base-url (default: the bundled model)"),
    ("--api-key-var", "servers.api_key_var", str, "name of the env variable holding the API key"),
    ("--latency", "servers.standin.latency_s", float, "stand-in: fixed latency per model call, s"),
    ("--per-token-latency", "servers.standin.per_token_latency_s", float, "stand-in: s per token"),
    ("--correct-rate", "servers.standin.correct_rate", float, "stand-in: how often the policy is right"),
    ("--tokenizer", "renderer.tokenizer", str, "tokenizer name or path for token mode"),
    ("--max-tokens", "sampling.max_tokens", int, "max tokens per turn"),
    ("--temperature", "sampling.temperature", float, "sampling temperature"),
    ("--workers", "plane.workers", int, "RolloutWorker actors (default: sized from the lanes)"),
]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollouts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a batch of rollouts and write one JSON line per result",
        description="Run groups of rollouts on Ray and write one JSON line per result. With no endpoint, "
        "starts the bundled stand-in inference server (CPU) with the bundled tokenizer. Every option is "
        "also a key of the TOML file given with --config; flags override the file.",
    )
    run.add_argument("--config", default=None, help="TOML file with any of the options below")
    run.add_argument("--print-config", action="store_true", help="print the resolved config as TOML, exit")
    defaults = RunConfig()
    for flag, dotted, kind, text in RUN_FLAGS:
        default = _lookup(defaults, dotted)
        run.add_argument(flag, dest=dotted, type=kind, default=argparse.SUPPRESS, help=f"{text} [{default}]")
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
        default=argparse.SUPPRESS,
        help="OpenAI-compatible base URL, e.g. a vLLM server's /v1 (repeat for several servers)",
    )
    run.add_argument(
        "--concurrency",
        type=int,
        default=argparse.SUPPRESS,
        help=f"rollouts in flight at once in the train lane [{defaults.plane.lanes['train']}]",
    )
    run.add_argument(
        "--allow-ref-prefix",
        action="append",
        default=argparse.SUPPRESS,
        help=f"extra module prefix Refs may name (always allowed: {list(DEFAULT_ALLOWED_PREFIXES)})",
    )
    run.add_argument(
        "--env-package",
        dest="plane.env_pool.env_packages",
        action="append",
        default=argparse.SUPPRESS,
        help="module prefix an adapter (env_actors.adapters) may import as your environment package",
    )
    run.add_argument(
        "--env-runtime-env",
        dest="plane.env_pool.runtime_env",
        type=_runtime_env_arg,
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
    pool_python = sub.add_parser(
        "pool-python",
        help="build an env pool's interpreter (runtime_env py_executable): packages over this one's",
        description="Create a virtualenv at HOME that sees this interpreter's packages (ray, this project) "
        "under its own, install the requirements into it, and print its python: an env pool's "
        "`runtime_env.py_executable` for a stack whose packages clash with the plane's.",
    )
    pool_python.add_argument("home", help="the virtualenv's folder (recreated)")
    pool_python.add_argument("requirements", nargs="*", help="what pip installs there, e.g. verifiers==0.4.0")
    report = sub.add_parser("report", help="summarise a finished run's JSON lines (and plot it)")
    report.add_argument("results", help="the JSON-lines file a run wrote")
    report.add_argument("--png", default=None, help="write the plots to this PNG file")
    return parser


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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "report":
        return report(args.results, args.png)
    if args.command == "pool-python":
        return pool_python(args.home, args.requirements)
    try:
        config = load_run_config(args.config, overrides_from_flags(args))
    except ConfigError as exc:
        print(f"invalid configuration: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_toml(config), end="")
        return 0
    return run(config)


def _runtime_env_arg(text: str) -> dict:
    """`--env-runtime-env`: local folders (`py_modules`, `working_dir`) given relative to where the command
    runs are made absolute here, where they are meant: the pool that uploads them runs elsewhere."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object")

    def local(path: object) -> object:
        return str(Path(path).resolve()) if isinstance(path, str) and Path(path).exists() else path

    if isinstance(value.get("py_modules"), list):
        value["py_modules"] = [local(path) for path in value["py_modules"]]
    if "working_dir" in value:
        value["working_dir"] = local(value["working_dir"])
    return value


def pool_python(home: str, requirements: list[str]) -> int:
    from env_actors.pool_python import PoolPythonError, build_pool_python

    try:
        print(build_pool_python(home, requirements))
    except PoolPythonError as exc:
        print(f"rollouts pool-python: {exc}", file=sys.stderr)
        return 1
    return 0


def report(path: str, png: str | None) -> int:
    from rollout_actors.job.report import format_summary, read_results, summarize
    from rollout_actors.job.report_png import write_png

    results = read_results(path)
    print(format_summary(summarize(results)))
    if png:
        print(f"plots: {write_png(results, png)}")
    return 0


def _init_ray(address: str | None) -> None:
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # Embedded means our own: `address="local"` never joins a cluster someone's `ray start` left on the
        # machine (join one with --ray-address auto). Rollout, renderer and env actors mostly wait: logical
        # CPUs above the physical count let them pack.
        ray.init(
            address="local",
            num_cpus=max(4, 2 * (os.cpu_count() or 2)),
            include_dashboard=False,
            log_to_driver=False,
        )


def run(config: RunConfig) -> int:
    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.inference.server_actor import ServerSpec, standin_options
    from rollout_actors.inference.standin import StandinServer

    job, servers = config.run, config.servers
    output = Path(job.output or f"rollouts-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    with ExitStack() as stack:
        endpoints, model = list(servers.endpoints), servers.model
        server = None
        if not endpoints:
            settings = servers.standin
            # Launched now, waited for once Ray is up: its tokenizer loads while Ray starts (seconds each).
            server = StandinServer(
                standin_options(  # the flags a production vLLM gets: parsers, LoRA, weight updates
                    ServerSpec(kind="standin", model=BUNDLED_MODEL),
                    latency_s=settings.latency_s,
                    per_token_latency_s=settings.per_token_latency_s,
                    correct_rate=settings.correct_rate,
                    seed=job.seed,
                )
            ).start(wait=False)
            stack.callback(server.close)
            model = model or BUNDLED_MODEL
        if model is None:
            print("servers.model (--model) is required with an endpoint", file=sys.stderr)
            return 2
        _init_ray(job.ray_address)
        try:
            if server is not None:
                endpoints = [server.wait_ready().base_url]
                print(f"stand-in inference server at {server.base_url}", file=sys.stderr)
            return asyncio.run(_run_plane(config, endpoints, model, output))
        finally:
            import ray

            ray.shutdown()


async def _run_plane(config: RunConfig, endpoints: list[str], model: str, output: Path) -> int:
    from rollout_actors.plane.facade import RolloutPlane

    job = config.run
    total = job.tasks * job.group_size
    plane_config = config.plane
    if len(endpoints) > 1:
        plane_config = plane_config.model_copy(update={"endpoints": endpoints})
    template = RolloutRequest(
        env=Ref(job.env, job.env_config),
        client=config.client_config(endpoints[0], model),
        sampling=config.sampling,
        mode=job.mode,
        renderer=config.renderer,
        max_turns=job.max_turns,
        timeout_s=job.timeout_s,
        return_messages=job.messages,
    )
    results: list[Result] = []
    started = time.perf_counter()
    async with RolloutPlane(plane_config) as plane:

        async def feed() -> None:
            for index in range(job.tasks):
                seed = job.seed + index * job.group_size
                request = template.model_copy(
                    update={
                        "task_index": index,
                        "sampling": config.sampling.model_copy(update={"seed": seed}),
                    }
                )
                handle = await plane.submit_group(request, job.group_size)
                await handle.admitted()  # back-pressure: the next group waits while the lane is full

        feeder = asyncio.create_task(feed())
        status = _Status(plane, total, started, live=job.progress)
        with output.open("w") as sink, status:
            for _ in range(job.tasks):
                # The plane answers every request within its deadline plus grace; past that, fail loudly.
                group = await plane.next_group(timeout=job.timeout_s + plane_config.answer_grace_s + 60)
                for result in group.results:
                    results.append(result)
                    # Defaults left out: each line reads back whole with `Result.model_validate_json`.
                    sink.write(result.model_dump_json(exclude_defaults=True) + "\n")
                status.update(results)
        await feeder
    elapsed = time.perf_counter() - started
    _print_summary(results, elapsed, output)
    from rollout_actors.job.report import format_timings, read_results
    from rollout_actors.job.timeline import timeline

    print("\n".join(format_timings(timeline(read_results(output)))))  # where the time went
    if job.report_png:
        from rollout_actors.job.report_png import write_png

        print(f"plots: {write_png(read_results(output), job.report_png)}")
    return 0 if any(r.kind == "ok" for r in results) else 1


class _Status:
    """Done / in flight / failed by kind and rollouts/s: a live bar, or a plain line every few seconds."""

    def __init__(self, plane: Any, total: int, started: float, live: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._plane, self._total, self._started, self._live = plane, total, started, live
        self._last_line = 0.0
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            disable=not live,
            transient=False,
        )
        self._task = self._progress.add_task("rollouts", total=total)

    def __enter__(self) -> _Status:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def line(self, results: list[Result]) -> str:
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        in_flight = sum(lane.in_flight for lane in self._plane.lanes.snapshot().values())
        failed = Counter(r.kind for r in results if r.kind != "ok")
        kinds = " ".join(f"{k}={v}" for k, v in sorted(failed.items())) or "none"
        return (
            f"done {len(results)}/{self._total}  in flight {in_flight}  failed: {kinds}  "
            f"{len(results) / elapsed:.1f} rollouts/s"
        )

    def update(self, results: list[Result]) -> None:
        now = time.perf_counter()
        if self._live:
            self._progress.update(self._task, advance=1, description=self.line(results))
        elif now - self._last_line >= STATUS_EVERY_S or len(results) == self._total:
            self._last_line = now
            print(self.line(results), flush=True)


def summarize(results: list[Result], elapsed: float) -> dict[str, Any]:
    counts = Counter(r.kind for r in results)
    rewards = [r.reward for r in results if r.reward is not None]
    turns = sum(len(r.turns) for r in results)
    return {
        "rollouts": len(results),
        "kinds": dict(counts),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        "rollouts_per_s": len(results) / elapsed if elapsed > 0 else 0.0,
        "turns_per_s": turns / elapsed if elapsed > 0 else 0.0,
        "elapsed_s": elapsed,
    }


def _print_summary(results: list[Result], elapsed: float, output: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    summary = summarize(results, elapsed)
    table = Table(title=f"{summary['rollouts']} rollouts in {elapsed:.1f} s -> {output}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for kind in get_args(ResultKind):
        table.add_row(f"kind={kind}", str(summary["kinds"].get(kind, 0)))
    mean = summary["mean_reward"]
    table.add_row("mean reward", "n/a" if mean is None else f"{mean:.3f}")
    table.add_row("rollouts/s", f"{summary['rollouts_per_s']:.2f}")
    table.add_row("turns/s", f"{summary['turns_per_s']:.2f}")
    Console().print(table)
    failures = [r for r in results if r.error is not None and r.kind != "cancelled"]
    if failures:
        first = failures[0].error
        assert first is not None
        print(f"first failure: {failures[0].kind} {first.type}: {first.message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
