"""Benchmark: long agentic trajectories through the plane. Does a turn cost what it adds?

    python scripts/bench_trajectory.py [--concurrency 64] [--turns 64] [--latency 2] [--tool-words 1450]

C concurrent rollouts of `env_actors.faults.envs:ToolOutputEnv`: every turn the environment answers with a
tool output of ~1.5k tokens, so by turn 64 the context is ~100k tokens. Token mode, the bundled Qwen3
renderer, the stand-in with a fixed latency per model call. Each rollout makes `--turns` + 1 model calls,
so that every measured turn, the 64th included, is followed by the request of the next. The C rollouts
start spread over one model call, as in a steady run: started together they would stay in step, and
each turn's own time would be mostly its wait behind the other C-1 rollouts' turns on two cores.

Measured per turn k, in the rollout workers (`_bench_meter.py`, injected by this script into the Ray
worker processes it starts; nothing of it is in the product):
  own ms       the plane's own time for turn k: from the end of model call k (the answer parsed) to the
               start of model call k+1. Everything but the model call: the completion parsed (renderer),
               the env step, the bridge (renderer), the next request built. Median and p90 over rollouts.
  waiting on   how long turn k waited on each of its remote calls (renderer parse and bridge, env
               step), median over rollouts: which part of the own time grows, if any
  Ray B        bytes of the turn's renderer and env calls, out and back, serialised as Ray does
  HTTP B       bytes of the turn's model-call request and answer; `prompt B` of the request is the prompt
               the inference server needs (the whole context, by nature), `beyond` is everything else
               the turn moved: Ray both ways + the HTTP request minus the prompt + the HTTP answer

CPU per turn by context: every plane process's CPU (all but the stand-in), sampled every 5 s, over the
model turns that ended in each interval, for the first and the last quarter of the turns, and the
stand-in's beside it. On two cores the stand-in shares the CPU with the plane, and its work per call
(parsing and checking the whole prompt, as vLLM's API server does on its own machine) grows with the
context: the wall-clock own time above carries that contention, this figure does not.

The last lines are `plane time per turn at turn 64 / turn 1: r` and the bytes beyond the prompt per turn
at turns 1, 16, 64.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path

import _bench_meter
import ray
from _bench_probe import cpu_by_role, pids_by_role
from _bench_profile import WaveProfiler
from ray import cloudpickle

import rollout_actors
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec, standin_options
from rollout_actors.inference.standin import StandinServer
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RendererConfig, RolloutRequest, SamplingConfig

CODE = Path(rollout_actors.__file__).resolve().parent.parent
ENV_TARGET = "env_actors.faults.envs:ToolOutputEnv"
SHOWN_TURNS = (1, 2, 4, 8, 16, 32, 48, 64)
PROFILED_ROLES = ("driver", "RolloutWorker", "RendererActor", "EnvServer", "EnvPool", "RendererPool")
CPU_SAMPLE_S = 5.0
MIN_TURNS_PER_SAMPLE = 20  # fewer model turns ended in an interval: ramp or tail, not steady
MAX_MODEL_LEN = 262_144  # past the ~100k tokens turn 64 reaches
KV_CACHE_TOKENS = 64 * 2**20  # every rollout's whole context stays cached: no preemption noise


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(
    args: argparse.Namespace, meter_dir: Path
) -> tuple[list[dict], dict[str, float], float, list[tuple[float, dict[str, float]]]]:
    samples: list[tuple[float, dict[str, float]]] = []
    server = StandinServer(
        standin_options(
            ServerSpec(kind="standin", model=BUNDLED_MODEL),
            latency_s=args.latency,
            max_model_len=MAX_MODEL_LEN,
            kv_cache_tokens=KV_CACHE_TOKENS,
        )
    ).start()
    c = args.concurrency
    plane = RolloutPlane(
        PlaneConfig(
            lanes={"train": c},
            allowed_ref_prefixes=("env_actors.faults.",),
            workers=args.workers,
            worker_num_cpus=0.5,
            env_pool={"min_servers": 2, "max_servers": 2, "multiplex": c, "num_cpus": 0.25},
            batch_window_s=args.batch_window,
        )
    )

    def request(i: int, max_turns: int) -> RolloutRequest:
        # One env config for warm-up and wave (a Ref with another config is another env pool).
        config = {"num_tasks": 16, "turns": args.turns + 1, "tool_words": args.tool_words}
        return RolloutRequest(
            env=Ref(target=ENV_TARGET, config=config),
            task_index=i % 16,
            client=ClientConfig(base_url=server.base_url, model=BUNDLED_MODEL),
            sampling=SamplingConfig(max_tokens=args.max_tokens),
            renderer=RendererConfig(multiplex=c),
            max_turns=max_turns,
            timeout_s=3600.0,
        )

    try:
        await plane.start()
        for i in range(4):  # warm-up: env pool, renderer, connections
            await plane.submit(request(i, max_turns=2))
        for _ in range(4):
            warm = await plane.next_result(timeout=300)
            assert warm.ok, warm.error
        for path in meter_dir.glob("*.jsonl"):
            path.unlink()
        cpu_before = cpu_by_role(server.pid)
        profiler = None
        if args.profile:
            roles = pids_by_role(server.pid, PROFILED_ROLES)
            profiler = WaveProfiler(args.profile, roles).start()
        started = time.monotonic()
        sampler = asyncio.ensure_future(sample_cpu(server.pid, samples))
        for i in range(c):  # spread over one model call, as rollouts in a steady run are
            await plane.submit(request(i, max_turns=args.turns + 2))
            await asyncio.sleep(args.latency / c)
        results = [await plane.next_result(timeout=3600) for _ in range(c)]
        wall = time.monotonic() - started
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        cpu = cpu_by_role(server.pid)
        if profiler is not None:
            profiler.stop()
        cpu = {role: cpu[role] - cpu_before.get(role, 0.0) for role in cpu}
        bad = [r for r in results if not r.ok]
        if bad:
            raise RuntimeError(f"{len(bad)} rollouts failed, e.g. {bad[0].kind}: {bad[0].error}")
        result_bytes = statistics.fmean(len(r.model_dump_json()) for r in results)
    finally:
        await plane.close()
        server.close()
    records = [
        json.loads(line) for path in meter_dir.glob("*.jsonl") for line in path.read_text().splitlines()
    ]
    cpu["_wall"] = wall
    return records, cpu, result_bytes, samples


async def sample_cpu(server_pid: int, samples: list[tuple[float, dict[str, float]]]) -> None:
    """CPU by role every `CPU_SAMPLE_S` during the wave (walked in a thread: the driver's loop keeps on)."""
    while True:
        samples.append((time.monotonic(), await asyncio.to_thread(cpu_by_role, server_pid)))
        await asyncio.sleep(CPU_SAMPLE_S)


def cpu_by_context(
    args: argparse.Namespace, records: list[dict], samples: list[tuple[float, dict[str, float]]]
) -> dict[str, tuple[float, float]]:
    """Plane and stand-in CPU per model turn in the early and late turns: each sampling interval's CPU over
    the turns whose model call ended in it, the interval placed at the mean turn of those calls."""
    ends = sorted((call[2], call[0]) for record in records for call in record["calls"])
    times = [ended for ended, _ in ends]
    quarter = args.turns / 4
    spans = {
        f"turns 1-{quarter:.0f}": (1, quarter),
        f"turns {args.turns - quarter + 1:.0f}-{args.turns}": (args.turns - quarter + 1, args.turns),
    }
    totals = {name: [0.0, 0.0, 0] for name in spans}
    for (t0, before), (t1, after) in zip(samples, samples[1:], strict=False):
        in_interval = ends[bisect.bisect_left(times, t0) : bisect.bisect_left(times, t1)]
        turns = [turn for _, turn in in_interval if turn <= args.turns]
        if len(turns) < MIN_TURNS_PER_SAMPLE:
            continue
        mean_turn = statistics.fmean(turns)
        spent = {role: after.get(role, 0.0) - before.get(role, 0.0) for role in after}
        for name, (low, high) in spans.items():
            if low <= mean_turn <= high:
                totals[name][0] += sum(sec for role, sec in spent.items() if role != "stand-in")
                totals[name][1] += spent.get("stand-in", 0.0)
                totals[name][2] += len(turns)
    return {name: (plane / n, standin / n) for name, (plane, standin, n) in totals.items() if n}


def report(
    args: argparse.Namespace,
    records: list[dict],
    cpu: dict[str, float],
    result_bytes: float,
    samples: list[tuple[float, dict[str, float]]],
) -> None:
    own: dict[int, list[float]] = {}
    context: dict[int, list[int]] = {}
    sizes: dict[int, list[dict[str, int]]] = {}
    phases: dict[str, dict[int, list[float]]] = {}
    for record in records:
        calls = sorted(record["calls"])
        for (turn, _, ended, prompt_len), following in zip(calls, calls[1:], strict=False):
            own.setdefault(turn, []).append(following[1] - ended)
            context.setdefault(turn, []).append(prompt_len)
        for turn, bucket in record["bytes"].items():
            sizes.setdefault(int(turn), []).append(bucket)
        for turn, waited in record["phases"].items():
            for what, seconds in waited.items():
                phases.setdefault(what, {}).setdefault(int(turn), []).append(seconds)

    def mean_of(turn: int, field: str) -> float:
        return statistics.fmean(b[field] for b in sizes[turn])

    def beyond(turn: int) -> float:
        return (
            mean_of(turn, "ray_out")
            + mean_of(turn, "ray_in")
            + mean_of(turn, "http_out")
            - mean_of(turn, "prompt")
            + mean_of(turn, "http_in")
        )

    wall = cpu.pop("_wall")
    print(
        f"\n=== {len(records)} rollouts x {args.turns} turns (+1 call), C={args.concurrency}, "
        f"latency {args.latency:g}s, tool output {args.tool_words} words/turn, wall {wall:.1f}s ==="
    )
    print(
        f"{'turn':>5}{'context':>9}{'own ms p50':>12}{'p90':>8}{'Ray B out':>11}{'Ray B in':>10}"
        f"{'HTTP B out':>12}{'prompt B':>10}{'HTTP B in':>11}{'beyond B':>10}"
    )
    for turn in SHOWN_TURNS:
        if turn not in own:
            continue
        print(
            f"{turn:>5}{statistics.fmean(context[turn]):>9.0f}"
            f"{statistics.median(own[turn]) * 1e3:>12.1f}{percentile(own[turn], 0.9) * 1e3:>8.1f}"
            f"{mean_of(turn, 'ray_out'):>11.0f}{mean_of(turn, 'ray_in'):>10.0f}"
            f"{mean_of(turn, 'http_out'):>12.0f}{mean_of(turn, 'prompt'):>10.0f}"
            f"{mean_of(turn, 'http_in'):>11.0f}{beyond(turn):>10.0f}"
        )
    shown_turns = [turn for turn in SHOWN_TURNS if turn in own]
    print(f"{'own ms waiting on, p50':<23}" + "".join(f"{turn:>7}" for turn in shown_turns))
    for what, by_turn in sorted(phases.items()):
        if all(turn in by_turn for turn in shown_turns):  # per-turn calls (not the start's)
            figures = "".join(f"{statistics.median(by_turn[t]) * 1e3:>7.1f}" for t in shown_turns)
            print(f"  {what:<21}{figures}")
    shown = ", ".join(
        f"{role} {sec:.1f}" for role, sec in sorted(cpu.items(), key=lambda kv: -kv[1]) if sec >= 0.05
    )
    plane_cpu = sum(sec for role, sec in cpu.items() if role != "stand-in")
    turns = len(records) * args.turns
    last_gc = {}
    for record in sorted(records, key=lambda r: r["finished"]):
        last_gc[record["gc"]["pid"]] = record["gc"]
    print(
        "rollout workers' full GC collections: "
        + ", ".join(
            f"pid {pid}: {g['gen2']} taking {g['gen2_s']:.2f} s, longest {g['longest_s'] * 1e3:.0f} ms"
            for pid, g in sorted(last_gc.items())
        )
    )
    print(f"CPU seconds of the wave by role: {shown}")
    print(f"plane CPU per turn (all but the stand-in): {plane_cpu / turns * 1e3:.2f} ms")
    print(f"result size (JSON, as it crosses Ray; mean): {result_bytes / 1e3:.0f} kB")
    by_context = cpu_by_context(args, records, samples)
    for name, (plane, standin) in by_context.items():
        print(
            f"CPU per turn, {name} (sampled every {CPU_SAMPLE_S:g} s): plane {plane * 1e3:.1f} ms, "
            f"stand-in {standin * 1e3:.1f} ms"
        )
    if len(by_context) == 2:
        (early, _), (late, _) = by_context.values()
        print(f"plane CPU per turn, late turns / early turns: {late / early:.2f}")
    print()
    ratio = statistics.median(own[args.turns]) / statistics.median(own[1])
    marks = [turn for turn in (1, 16, args.turns) if turn in sizes]
    figures = ", ".join(f"{beyond(turn):.0f}" for turn in marks)
    print(f"bytes per turn beyond the prompt at turns {', '.join(map(str, marks))}: {figures}")
    print(f"plane time per turn at turn {args.turns} / turn 1: {ratio:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--turns", type=int, default=64, help="measured turns per rollout (one more call follows)"
    )
    parser.add_argument("--latency", type=float, default=2.0, help="stand-in seconds per model call")
    parser.add_argument("--tool-words", type=int, default=1450, help="words per tool output (~1.5k tokens)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--batch-window", type=float, default=PlaneConfig().batch_window_s, help="PlaneConfig.batch_window_s"
    )
    parser.add_argument("--profile", default="", help="py-spy the plane's processes during the wave into DIR")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    cloudpickle.register_pickle_by_value(_bench_meter)
    with tempfile.TemporaryDirectory(prefix="bench-meter-") as meter_dir:
        ray.init(
            address="local",
            num_cpus=8,
            include_dashboard=False,
            runtime_env={
                "worker_process_setup_hook": _bench_meter.install,
                # Workers of a job runtime env start elsewhere: they import the code this process does.
                "env_vars": {_bench_meter.DIR_VAR: meter_dir, "PYTHONPATH": str(CODE)},
            },
        )
        try:
            records, cpu, result_bytes, samples = asyncio.run(run(args, Path(meter_dir)))
        finally:
            ray.shutdown()
    report(args, records, cpu, result_bytes, samples)


if __name__ == "__main__":
    main()
