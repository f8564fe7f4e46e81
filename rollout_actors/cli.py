"""`rollouts`: the command line, and the `ray job submit` entrypoint.

rollouts run                          # embedded defaults: local Ray, stand-in server, bundled env
rollouts run --base-url http://vllm:8000/v1 --model Qwen/Qwen3-8B --env env_actors.examples.math_env:MathEnv
rollouts run --config run.toml [--print-config]     # every option as a TOML file; flags override it
rollouts report rollouts-20261130-120000.jsonl --png report.png
rollouts show rollouts-20261130-120000.jsonl -n 1 [--kind env]      # rollouts, turn by turn
rollouts export rollouts-20261130-120000.jsonl --samples samples.parquet   # trainer samples
rollouts pool-python ~/.pools/vf04 verifiers==0.4.0  # an env pool's interpreter (runtime_env py_executable)
rollouts serve-env --address tcp://0.0.0.0:5555 --taskset my-taskset --py-executable /opt/vf04/bin/python
rollouts serve-standin --port 8000    # the bundled CPU inference server alone, until Ctrl-C

Each subcommand's flags and body live in `rollout_actors/job/` (`run_flags`, `run_batch`, `report`,
`export`, `serve_standin`); this module only wires them.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from rollout_actors.job import serve_standin
from rollout_actors.job.run_config import to_toml
from rollout_actors.job.run_flags import (
    FlagError,
    OneLineParser,
    add_run_arguments,
    overrides_from_flags,
    resolve,
)
from rollout_actors.serve_env import command as serve_env_command

__all__ = ["main", "overrides_from_flags"]


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="rollouts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a batch of rollouts and write one JSON line per result",
        description="Run groups of rollouts on Ray and write one JSON line per result. With no endpoint, "
        "starts the bundled stand-in inference server (CPU) with the bundled tokenizer. Every option is "
        "also a key of the TOML file given with --config; flags override the file. Flags are checked "
        "before anything starts; a mistake is one line naming the flag, exit status 2.",
    )
    add_run_arguments(run)
    pool_python = sub.add_parser(
        "pool-python",
        help="build an env pool's interpreter (runtime_env py_executable): packages over this one's",
        description="Create a virtualenv at HOME that sees this interpreter's packages (ray, this project) "
        "under its own, install the requirements into it, and print its python: an env pool's "
        "`runtime_env.py_executable` for a stack whose packages clash with the plane's.",
    )
    pool_python.add_argument("home", help="the virtualenv's folder (recreated)")
    pool_python.add_argument("requirements", nargs="*", help="what pip installs there, e.g. verifiers==0.4.0")
    serve_env_command.add_parser(sub)
    report = sub.add_parser("report", help="summarise a finished run's JSON lines (and plot it)")
    report.add_argument("results", help="the JSON-lines file a run wrote")
    report.add_argument("--png", default=None, metavar="FILE", help="write the plots to this PNG file")
    export = sub.add_parser(
        "export",
        help="write a finished run's trainer samples (token ids, loss mask, logprobs, ...) to a file",
        description="Write one trainer sample per branch of each kept rollout of a run: token ids, loss "
        "mask, logprobs, the policy version of each token, reward, group and request ids. Only `ok` "
        "rollouts by default; --use KIND=train|mask|drop decides other kinds.",
    )
    export.add_argument("results", help="the JSON-lines file a run wrote")
    export.add_argument("--samples", required=True, metavar="FILE", help="FILE.jsonl or FILE.parquet")
    export.add_argument("--use", action="append", metavar="KIND=USE", help="e.g. cancelled=mask (repeatable)")
    show = sub.add_parser("show", help="print rollouts of a finished run, turn by turn")
    show.add_argument("results", help="the JSON-lines file a run wrote")
    show.add_argument("-n", type=int, default=1, metavar="COUNT", help="how many rollouts (default 1)")
    show.add_argument("--kind", default=None, metavar="KIND", help="only rollouts of this kind (e.g. env)")
    standin = sub.add_parser(
        "serve-standin",
        help="serve the bundled CPU stand-in inference server until Ctrl-C",
        description="Serve the bundled CPU stand-in inference server (vLLM's OpenAI-compatible wire format) "
        "on its own: it prints the base URL and the model name to use, then serves until Ctrl-C.",
    )
    serve_standin.add_arguments(standin)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "report":
        return report(args.results, args.png)
    if args.command in ("export", "show"):
        return export_or_show(args)
    if args.command == "pool-python":
        return pool_python(args.home, args.requirements)
    if args.command == "serve-standin":
        return serve_standin.serve(args)
    if args.command == "serve-env":
        return serve_env_command.serve_env(args)
    try:
        config = resolve(args)
    except FlagError as exc:
        print(f"rollouts run: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        print(to_toml(config), end="")
        return 0
    from rollout_actors.job.run_batch import run

    return run(config)


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


def export_or_show(args: argparse.Namespace) -> int:
    from rollout_actors.job.export import ExportError, export_samples, parse_use, show

    try:
        if args.command == "show":
            print("\n".join(show(args.results, args.n, args.kind)))
        else:
            read, written = export_samples(args.results, args.samples, parse_use(args.use))
            print(f"samples: {written} from {read} rollouts -> {Path(args.samples).resolve()}")
    except (ExportError, OSError) as exc:
        print(f"rollouts {args.command}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
