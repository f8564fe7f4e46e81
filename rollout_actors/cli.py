"""`rollouts`: the command line, and the `ray job submit` entrypoint.

rollouts run                          # embedded defaults: local Ray, stand-in server, bundled env
rollouts run --base-url http://vllm:8000/v1 --model Qwen/Qwen3-8B --env env_actors.examples.math_env:MathEnv
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
from typing import Any

from rollout_actors.wire import ClientConfig, Ref, RendererConfig, Result, RolloutRequest, SamplingConfig

DEFAULT_ENV = "env_actors.examples.calculator_env:CalculatorEnv"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollouts", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser(
        "run",
        help="run a batch of rollouts and write one JSON line per result",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run groups of rollouts on Ray and write one JSON line per result. With no --base-url, "
        "starts the bundled stand-in inference server (CPU) with the bundled tokenizer.",
    )
    env = run.add_argument_group("environment")
    env.add_argument("--env", default=DEFAULT_ENV, help="environment Ref target, 'package.module:Class'")
    env.add_argument("--env-config", default="{}", help="JSON config for the environment Ref")
    env.add_argument("--tasks", type=int, default=64, help="number of tasks (task indices 0..N-1)")
    env.add_argument("--group-size", type=int, default=4, help="rollouts per task (one group)")
    env.add_argument("--max-turns", type=int, default=4, help="model turns per rollout at most")
    env.add_argument(
        "--allow-ref-prefix",
        action="append",
        default=[],
        help="extra module prefix Refs may name (the project's own packages are always allowed)",
    )
    model = run.add_argument_group("model endpoint")
    model.add_argument(
        "--base-url", default=None, help="OpenAI-compatible base URL (e.g. a vLLM server's /v1)"
    )
    model.add_argument("--model", default=None, help="model name at --base-url (default: the bundled model)")
    model.add_argument("--api-key-var", default=None, help="name of the env variable holding the API key")
    model.add_argument("--mode", choices=["token", "chat"], default="token", help="token ids or relayed chat")
    model.add_argument("--tokenizer", default=None, help="tokenizer name or path for token mode")
    model.add_argument("--max-tokens", type=int, default=256, help="max tokens per turn")
    model.add_argument("--temperature", type=float, default=1.0)
    model.add_argument("--seed", type=int, default=0, help="base sampling seed (each rollout adds its index)")
    standin = run.add_argument_group("stand-in server (only without --base-url)")
    standin.add_argument("--latency", type=float, default=0.05, help="fixed latency per model call, seconds")
    standin.add_argument(
        "--per-token-latency", type=float, default=0.0005, help="seconds per completion token"
    )
    standin.add_argument(
        "--correct-rate", type=float, default=0.7, help="how often the scripted policy is right"
    )
    plane = run.add_argument_group("plane")
    plane.add_argument("--concurrency", type=int, default=64, help="rollouts in flight at once (train lane)")
    plane.add_argument("--workers", type=int, default=None, help="RolloutWorker actors (default: sized)")
    plane.add_argument("--deadline", type=float, default=600.0, help="per-rollout deadline, seconds")
    plane.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: $RAY_ADDRESS or local)"
    )
    out = run.add_argument_group("output")
    out.add_argument(
        "--output", default=None, help="JSON-lines file for results (default: rollouts-<time>.jsonl)"
    )
    out.add_argument("--no-progress", action="store_true", help="no progress bar (e.g. under ray job submit)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "run":
        return run(args)
    return 2


def _init_ray(address: str | None) -> None:
    import ray

    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:
        # Rollout, renderer and env actors mostly wait: logical CPUs above the physical count let them pack.
        ray.init(num_cpus=max(4, 2 * (os.cpu_count() or 2)), include_dashboard=False, log_to_driver=False)


def run(args: argparse.Namespace) -> int:
    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.inference.launch import StandinOptions, StandinServer

    output = Path(args.output or f"rollouts-{time.strftime('%Y%m%d-%H%M%S')}.jsonl")
    with ExitStack() as stack:
        base_url, model_name = args.base_url, args.model
        if base_url is None:
            server = stack.enter_context(
                StandinServer(
                    StandinOptions(
                        latency_s=args.latency,
                        per_token_latency_s=args.per_token_latency,
                        correct_rate=args.correct_rate,
                        seed=args.seed,
                    )
                )
            )
            base_url, model_name = server.base_url, model_name or BUNDLED_MODEL
            print(f"stand-in inference server at {base_url}", file=sys.stderr)
        if model_name is None:
            print("--model is required with --base-url", file=sys.stderr)
            return 2
        _init_ray(args.ray_address)
        try:
            return asyncio.run(_run_plane(args, base_url, model_name, output))
        finally:
            import ray

            ray.shutdown()


async def _run_plane(args: argparse.Namespace, base_url: str, model: str, output: Path) -> int:
    from rollout_actors.plane import PlaneConfig, RolloutPlane
    from rollout_actors.wire import DEFAULT_ALLOWED_PREFIXES

    total = args.tasks * args.group_size
    config = PlaneConfig(
        lanes={"train": args.concurrency, "eval": max(1, args.concurrency // 4)},
        workers=args.workers,
        allowed_ref_prefixes=DEFAULT_ALLOWED_PREFIXES + tuple(args.allow_ref_prefix),
    )
    template = dict(
        env=Ref(target=args.env, config=json.loads(args.env_config)),
        client=ClientConfig(base_url=base_url, model=model, api_key_var=args.api_key_var),
        sampling=SamplingConfig(max_tokens=args.max_tokens, temperature=args.temperature),
        mode=args.mode,
        renderer=RendererConfig(tokenizer=args.tokenizer),
        max_turns=args.max_turns,
        deadline_s=args.deadline,
    )
    results: list[Result] = []
    started = time.perf_counter()
    async with RolloutPlane(config) as plane:
        progress = _progress(total, disabled=args.no_progress)

        async def feed() -> None:
            for index in range(args.tasks):
                seed = args.seed + index * args.group_size
                request = RolloutRequest(
                    task_index=index,
                    **{**template, "sampling": template["sampling"].model_copy(update={"seed": seed})},
                )
                await plane.submit_group(request, args.group_size)

        feeder = asyncio.create_task(feed())
        with output.open("w") as sink, progress:
            task = progress.add_task("rollouts", total=total)
            while len(results) < total:
                # The plane answers every request within its deadline plus grace; past that, fail loudly.
                result = await plane.next_result(timeout=args.deadline + config.answer_grace_s + 60)
                results.append(result)
                sink.write(result.model_dump_json() + "\n")
                progress.update(task, advance=1, description=f"rollouts ({_kinds_line(results)})")
        await feeder
    elapsed = time.perf_counter() - started
    _print_summary(results, elapsed, output)
    return 0 if any(r.kind == "ok" for r in results) else 1


def _progress(total: int, disabled: bool) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        disable=disabled,
        transient=False,
    )


def _kinds_line(results: list[Result]) -> str:
    counts = Counter(r.kind for r in results)
    return " ".join(f"{k}={v}" for k, v in sorted(counts.items()))


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
    for kind in ("ok", "model", "infrastructure", "caller", "cancelled"):
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
