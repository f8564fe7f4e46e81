"""Benchmark: the rollout plane vs a single process, one wave of C concurrent multi-turn rollouts.

    python scripts/bench_plane.py [--quick] [--concurrency 512 1024 2048] [--turns 3] [--latency 5]
                                  [--env echo|calculator] [--ways abc] [--env-workers 2]

The same workload three ways, each against its own fresh stand-in server (so its sockets, TIME_WAIT count
and completion cache are its own) with a fixed latency per model call:
  (a) plane   `RolloutPlane` on local Ray: 2 `RolloutWorker`s (0.5 CPU each), shared renderer and env pools
  (b) single  one asyncio process, same renderer / env / model-call code in-process, a client per rollout
  (c) shared  as (b), one `AsyncOpenAI` client shared by every rollout
Every rollout of a wave starts at once (the plane's lane bound is C, so no submit waits).

Workload. Token mode (render, `/v1/completions` with token ids + `return_token_ids`, parse, env step,
bridge). The stand-in's scripted policy gives the bundled calculator env exactly 2 model turns (a tool
call, then the boxed answer, which ends the episode); no header or task changes that. So the default
`--env echo` uses the bundled multi-turn `env_actors.faults.envs:EchoEnv` with `turns=--turns` (healthy:
it answers each turn with a user message and ends after exactly `--turns` turns; the policy writes free
text each turn). `--env calculator` runs `CalculatorEnv` (2 turns, tool schema rendered, tool call parsed).
`ideal` is the measured mean turns per rollout x latency.

Measured (per way):
  wall         first submit -> last result
  threads/RSS  peak, summed over the processes running rollouts (the 2 workers; the process itself for
               b/c), sampled every 0.5 s from a separate probe process
  sock/ro      peak ESTABLISHED sockets at the server / C;  conn/ro: distinct client ports seen / C
  TIME_WAIT    TCP TIME_WAIT sockets on the server's port after the wave (after every client closed)
  turn q1..q4  mean of (rollout wall / its turns) by start-order quartile: all ways measure this the same
               way (plane: the worker's `Result.started_at/finished_at`; env reset and score included)
  call q1..q4  per model call, from asking for the turn (render/bridge included) to the completion;
               plane: its `Turn.timings` (render + model)
  phases       plane: median ms per turn phase and per wait outside the turns (`Result.timings`), and
               the bytes the timings add per turn to the result's JSON
  slow         b/c: calls > 5x latency; plane: rollouts whose wall/turns > 5x latency

The last three lines: `plane CPU per turn / single-process at C=2048` (CPU of every plane process but the
stand-in per turn, over the single process's own CPU per turn), `plane/ideal at C=1024`, and
`plane/single-process at C=2048: <wall (a) / wall (b)>`. With `--repeat N` the ways run N times at each C,
in alternating order (ab, ba, ab, ...), each pair compared on its own, and these lines give the medians:
the single process's own CPU per turn moves by a third from run to run on a shared machine, and one pair
is one draw of it. `--profile` is for where the CPU goes, not for the ratio: py-spy's sampling raises the
single process's CPU per turn more than the plane's.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from _bench_probe import Probe, ProbeSample, cpu_by_role, pids_by_role, time_wait_count
from _bench_profile import WaveProfiler
from _bench_single_process import SingleProcessWorkload, run_wave
from _bench_wave import cpu_diff, grow_renderer_pool, run_on_local_ray

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec, standin_options
from rollout_actors.inference.standin import StandinServer
from rollout_actors.kernel.collector import settle
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.timings import TURN_PHASES, WAIT_PHASES, phase_name
from rollout_actors.wire import ClientConfig, Ref, RendererConfig, RolloutRequest, SamplingConfig

ENVS = {
    "echo": ("env_actors.faults.envs:EchoEnv", lambda turns: {"num_tasks": 64, "turns": turns}),
    "calculator": (
        "env_actors.examples.calculator_env:CalculatorEnv",
        lambda turns: {"num_tasks": 300, "max_turns": max(turns, 2)},
    ),
}
WARMUP_ROLLOUTS = 4  # starts the plane's env pool and first renderer before the timed wave (then the
# renderer pool is grown to the wave's size: `grow_renderer_pool`)
MAX_TOKENS = 256  # the scripted policy writes < 150 tokens a turn; nothing is cut
SLOW_FACTOR = 5.0
PROFILED_ROLES = ("driver", "RolloutWorker", "RendererActor", "EnvServer", "EnvPool", "RendererPool")
WAYS = {"a": "plane", "b": "single/client-per-rollout", "c": "single/shared-client"}


@dataclass
class WayResult:
    way: str
    wall_s: float
    turns: list[int]
    per_turn: list[float]
    """Rollout wall / turns, in start order."""
    calls: list[list[float]] | None
    """Per model call seconds, per rollout in start order (b/c only)."""
    failures: int
    probe: ProbeSample
    time_wait: int
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds the wave cost, by role (`cpu_by_role`, after minus before)."""
    notes: dict[str, Any] = field(default_factory=dict)


def cpu_per_turn(r: WayResult) -> float:
    """CPU seconds per turn of the processes doing the way's own work: for the plane every process of its
    cluster but the stand-in (workers, renderers, env servers, pools, Ray's daemons, the driver); for a
    single process, that process (the idle Ray cluster beside it is not its cost)."""
    if r.way == "a":
        own = sum(sec for role, sec in r.cpu.items() if role != "stand-in")
    else:
        own = r.cpu.get("driver", 0.0)
    turns = sum(r.turns)
    return own / turns if turns else math.nan


def _quartiles(values: list[float]) -> list[float]:
    n = len(values)
    cuts = [round(n * k / 4) for k in range(5)]
    return [
        statistics.fmean(values[cuts[k] : cuts[k + 1]]) if cuts[k + 1] > cuts[k] else math.nan
        for k in range(4)
    ]


def _client(server: StandinServer) -> ClientConfig:
    return ClientConfig(base_url=server.base_url, model=BUNDLED_MODEL)


async def run_single(args: argparse.Namespace, c: int, way: str, server: StandinServer) -> WayResult:
    target, config = ENVS[args.env]
    workload = SingleProcessWorkload(
        client=_client(server),
        sampling=SamplingConfig(max_tokens=MAX_TOKENS),
        env_target=target,
        env_config=config(args.turns),
        max_turns=args.max_turns,
    )
    await workload.load()
    if args.settle_single:  # like-for-like with the plane's actors (`kernel.collector`); process-wide
        settle()

    time_wait_before = time_wait_count(server.port)  # the launcher's /health polls
    probe = Probe(server.pid, server.port, [os.getpid()]).start()
    await asyncio.sleep(0.6)  # the probe's first sample: the idle baseline
    cpu_before = cpu_by_role(server.pid)
    profiler = (
        WaveProfiler(f"{args.profile}/c{c}-{way}", {way: [os.getpid()]}).start() if args.profile else None
    )
    wall, timings = await run_wave(workload, c, per_rollout_client=(way == "b"))
    cpu = cpu_diff(cpu_before, cpu_by_role(server.pid))
    sample = probe.stop()
    if profiler is not None:
        profiler.stop()
    return WayResult(
        way=way,
        wall_s=wall,
        turns=[len(t.calls) for t in timings],
        per_turn=[(t.finished - t.started) / max(1, len(t.calls)) for t in timings],
        calls=[t.calls for t in timings],
        failures=sum(not t.ok for t in timings),
        probe=sample,
        time_wait=time_wait_count(server.port) - time_wait_before,
        cpu=cpu,
        notes={
            "errors": sorted({t.error for t in timings if not t.ok})[:3],
            "collector": "settled" if args.settle_single else "CPython defaults",
        },
    )


async def run_plane(args: argparse.Namespace, c: int, server: StandinServer) -> WayResult:
    target, config = ENVS[args.env]
    env_workers = args.env_workers
    # The renderer pool grows one renderer per `multiplex` concurrent leases. A render call is far below a
    # millisecond, so more renderers than cores only add processes to start and schedule.
    renderer_multiplex = args.renderer_multiplex or math.ceil(c / args.renderers)
    plane = RolloutPlane(
        PlaneConfig(
            lanes={"train": c, "eval": 1},
            allowed_ref_prefixes=("env_actors.examples.", "env_actors.faults."),
            workers=args.workers,
            worker_num_cpus=args.worker_num_cpus,
            env_pool={
                "min_servers": env_workers,
                "max_servers": env_workers,
                "multiplex": max(64, math.ceil(c / env_workers)),
                "num_cpus": 0.25,
            },
        )
    )

    def request(i: int) -> RolloutRequest:
        return RolloutRequest(
            env=Ref(target=target, config=config(args.turns)),
            task_index=i % 64,
            client=_client(server),
            sampling=SamplingConfig(max_tokens=MAX_TOKENS),
            renderer=RendererConfig(multiplex=renderer_multiplex),
            max_turns=args.max_turns,
        )

    await plane.start()
    try:
        for i in range(WARMUP_ROLLOUTS):
            await plane.submit(request(i))
        warm = [await plane.next_result(timeout=300) for _ in range(WARMUP_ROLLOUTS)]
        await grow_renderer_pool(plane, _client(server).model, renderer_multiplex, c)
        workers = [ray.get_actor(w.name) for w in plane.stats().workers]
        before = await asyncio.gather(*(w.debug_resources.remote(server.port) for w in workers))
        time_wait_before = time_wait_count(server.port)
        probe = Probe(server.pid, server.port, [r["pid"] for r in before]).start()
        await asyncio.sleep(0.6)
        order: dict[str, int] = {}
        cpu_before = cpu_by_role(server.pid)
        profiler = None
        if args.profile:
            roles = pids_by_role(server.pid, PROFILED_ROLES)
            profiler = WaveProfiler(f"{args.profile}/c{c}-a", roles).start()
        started, started_wall = time.monotonic(), time.time()
        for i in range(c):
            order[await plane.submit(request(i))] = i
        submitted_s = time.monotonic() - started
        results = [
            await plane.next_result(timeout=args.latency * args.max_turns * 20 + 300) for _ in range(c)
        ]
        wall = time.monotonic() - started
        ended_wall = time.time()
        cpu = cpu_diff(cpu_before, cpu_by_role(server.pid))
        sample = probe.stop()
        if profiler is not None:
            profiler.stop()
        after = await asyncio.gather(*(w.debug_resources.remote(server.port) for w in workers))
        time_wait = time_wait_count(server.port) - time_wait_before
        stats = plane.stats()
    finally:
        await plane.close()
    results.sort(key=lambda r: order[r.request_id])
    batches = _batches_diff(before, after)
    return WayResult(
        way="a",
        wall_s=wall,
        turns=[len(r.turns) for r in results],
        per_turn=[((r.finished_at or 0) - (r.started_at or 0)) / max(1, len(r.turns)) for r in results],
        calls=[[t.timings.render_s + t.timings.model_s for t in r.turns] for r in results],
        failures=sum(not r.ok for r in results),
        probe=sample,
        time_wait=time_wait,
        cpu=cpu,
        notes={
            "warmup_ok": sum(r.ok for r in warm),
            "open_clients_after": sum(r["open_clients"] for r in after),
            "worker_conns_after": sum(r["connections"] for r in after),
            "redispatched": stats.redispatched,
            "batches (calls, items/call)": batches,
            # One `run` per rollout, plus the workers' batched renderer and env calls (their setup,
            # turns and teardown), shared among the rollouts of a batch; not counted: a renderer's one
            # `ready` per worker, and background calls (heartbeats, the pools' own supervision).
            "Ray calls per rollout": round(1 + sum(calls for calls, _ in batches.values()) / c, 2),
            "worker GC (collections, s, full, s, middle, s, freed)": [
                _collected(a, b) for a, b in zip(after, before, strict=True)
            ],
            # Where the wall goes beyond the rollouts themselves (worker clocks; one machine, one clock):
            "submitted_s": round(submitted_s, 2),
            "first_start_s": round(min(r.started_at or 0 for r in results) - started_wall, 2),
            "last_start_s": round(max(r.started_at or 0 for r in results) - started_wall, 2),
            "after_last_finish_s": round(ended_wall - max(r.finished_at or 0 for r in results), 2),
            "phases (median ms)": _phase_medians(results),
            "timings B/turn": _timings_bytes(results),
            "errors": sorted(
                {f"{r.kind}: {r.error.type}: {r.error.message[:120]}" for r in results if r.error}
            )[:3],
        },
    )


def _phase_medians(results: list[Any]) -> dict[str, float]:
    turns = [t.timings for r in results for t in r.turns]
    medians = {phase_name(p): statistics.median(getattr(t, p) for t in turns) for p in TURN_PHASES if turns}
    medians |= {phase_name(w): statistics.median(getattr(r.timings, w) for r in results) for w in WAIT_PHASES}
    return {k: round(v * 1e3, 2) for k, v in medians.items() if v}


def _timings_bytes(results: list[Any]) -> float:
    """JSON bytes `Turn.timings` and `Result.timings` add per turn (the result as a worker sends it)."""
    bare = {"timings": True, "turns": {"__all__": {"timings"}}}
    added = sum(len(r.model_dump_json()) - len(r.model_dump_json(exclude=bare)) for r in results)
    return round(added / max(1, sum(len(r.turns) for r in results)), 1)


def _collected(after: dict, before: dict) -> tuple[int, float, int, float, int, float, int]:
    """Garbage collections a worker ran during the wave and their seconds, then the full ones among them
    and their seconds, the middle ones and theirs, and the objects they freed (`kernel.collector`)."""
    a, b = after["collector"], before["collector"]
    return (
        a["collections"] - b["collections"],
        round(a["seconds"] - b["seconds"], 2),
        a.get("full", 0) - b.get("full", 0),
        round(a.get("full_seconds", 0.0) - b.get("full_seconds", 0.0), 2),
        a.get("middle", 0) - b.get("middle", 0),
        round(a.get("middle_seconds", 0.0) - b.get("middle_seconds", 0.0), 2),
        a.get("collected", 0) - b.get("collected", 0),
    )


def _batches_diff(before: list[dict], after: list[dict]) -> dict[str, tuple[int, float]]:
    """Batched actor calls the workers sent during the wave, by kind: (calls, mean items per call)."""
    out = {}
    for name in sorted({name for answer in after for name in answer["batches"]}):
        calls = items = 0
        for b, a in zip(before, after, strict=True):
            calls += a["batches"].get(name, (0, 0))[0] - b["batches"].get(name, (0, 0))[0]
            items += a["batches"].get(name, (0, 0))[1] - b["batches"].get(name, (0, 0))[1]
        out[name] = (calls, round(items / calls, 1) if calls else 0.0)
    return out


async def run_way(args: argparse.Namespace, c: int, way: str) -> WayResult:
    server = StandinServer(
        standin_options(ServerSpec(kind="standin", model=BUNDLED_MODEL), latency_s=args.latency)
    ).start()
    try:
        if way == "a":
            return await run_plane(args, c, server)
        return await run_single(args, c, way, server)
    finally:
        server.close()


def print_table(args: argparse.Namespace, c: int, results: dict[str, WayResult]) -> None:
    latency = args.latency
    print(f"\n=== C={c}  env={args.env}  turns={args.turns}  latency={latency:g}s/turn ===")
    by = results.get
    base_b, base_c = by("b"), by("c")
    header = (
        f"{'way':<28}{'wall s':>8}{'/(b)':>7}{'/(c)':>7}{'/ideal':>8}{'turns':>7}{'fail':>6}"
        f"{'thr':>6}{'RSS MB':>8}{'sock/ro':>9}{'conn/ro':>9}{'TW':>7}"
    )
    print(header)
    for key in "abc":
        r = by(key)
        if r is None:
            continue
        turns = statistics.fmean(r.turns) if r.turns else 0.0
        ideal = turns * latency
        ratio_b = f"{r.wall_s / base_b.wall_s:.2f}" if base_b else "-"
        ratio_c = f"{r.wall_s / base_c.wall_s:.2f}" if base_c else "-"
        print(
            f"({key}) {WAYS[key]:<24}{r.wall_s:>8.2f}{ratio_b:>7}{ratio_c:>7}"
            f"{r.wall_s / ideal if ideal else math.nan:>8.2f}{turns:>7.2f}{r.failures:>6}"
            f"{r.probe.peak_threads:>6}{r.probe.peak_rss / 2**20:>8.0f}"
            f"{r.probe.peak_server_sockets / c:>9.2f}{len(r.probe.client_ports) / c:>9.2f}{r.time_wait:>7}"
        )
    print(f"{'quartiles by start order':<28}{'q1':>8}{'q2':>8}{'q3':>8}{'q4':>8}{'q1/q4':>8}{'slow':>7}")
    for key in "abc":
        r = by(key)
        if r is None:
            continue
        q = _quartiles(r.per_turn)
        slow = sum(p > SLOW_FACTOR * latency for p in r.per_turn)
        print(
            f"({key}) turn (wall/turns){'':<9}"
            + "".join(f"{x:>8.3f}" for x in q)
            + f"{q[0] / q[3]:>8.2f}{slow:>7}"
        )
        if r.calls is not None:
            q = _quartiles([statistics.fmean(calls) if calls else math.nan for calls in r.calls])
            slow = sum(x > SLOW_FACTOR * latency for calls in r.calls for x in calls)
            print(
                f"({key}) model call{'':<17}"
                + "".join(f"{x:>8.3f}" for x in q)
                + f"{q[0] / q[3]:>8.2f}{slow:>7}"
            )
    print("CPU seconds of the wave by role (ms per rollout in brackets):")
    for key in "abc":
        r = by(key)
        if r is None or not r.cpu:
            continue
        parts = sorted(r.cpu.items(), key=lambda kv: -kv[1])
        total = sum(r.cpu.values())
        shown = ", ".join(f"{role} {sec:.1f}" for role, sec in parts if sec >= 0.05)
        print(f"({key}) total {total:.1f} s [{total / c * 1e3:.1f} ms]: {shown}")
        turns = sum(r.turns)
        if key == "a" and turns:  # where the plane's CPU per turn goes, beside the single process's
            per_turn = ", ".join(f"{role} {sec / turns * 1e3:.2f}" for role, sec in parts if sec >= 0.05)
            print(f"({key}) ms per turn by role: {per_turn}")
        print(
            f"({key}) own CPU per turn (all but the stand-in{'' if key == 'a' else ': the process'}): "
            f"{cpu_per_turn(r) * 1e3:.2f} ms"
        )
    if by("a") and by("b") and by("a").cpu and by("b").cpu:
        print(f"plane CPU per turn / single-process: {cpu_per_turn(by('a')) / cpu_per_turn(by('b')):.2f}")
    for key in "abc":
        r = by(key)
        if r is not None and any(r.notes.values()):
            print(f"({key}) notes: {r.notes}")


async def main_async(args: argparse.Namespace) -> None:
    ratio_2048: float | None = None
    cpu_2048: float | None = None
    ideal_1024: float | None = None
    for c in args.concurrency:
        cpu_ratios, wall_ratios, ideals = [], [], []
        for repeat in range(args.repeat):
            results: dict[str, WayResult] = {}
            for way in args.ways if repeat % 2 == 0 else args.ways[::-1]:  # alternate: no way always first
                results[way] = await run_way(args, c, way)
            print_table(args, c, results)
            plane, single = results.get("a"), results.get("b")
            if plane and single:
                cpu_ratios.append(cpu_per_turn(plane) / cpu_per_turn(single))
                wall_ratios.append(plane.wall_s / single.wall_s)
            if plane and plane.turns:
                ideals.append(plane.wall_s / (statistics.fmean(plane.turns) * args.latency))
        if args.repeat > 1 and cpu_ratios:
            each = ", ".join(f"{r:.2f}" for r in cpu_ratios)
            print(
                f"C={c}: plane CPU per turn / single-process, each repeat: {each}; median {_fmt(_median(cpu_ratios))}"
            )
        if c == 2048:
            cpu_2048, ratio_2048 = _median(cpu_ratios), _median(wall_ratios)
        if c == 1024:
            ideal_1024 = _median(ideals)
    print()
    print(f"plane CPU per turn / single-process at C=2048: {_fmt(cpu_2048)}")
    print(f"plane/ideal at C=1024: {_fmt(ideal_1024)}")
    print(f"plane/single-process at C=2048: {_fmt(ratio_2048)}")


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(ratio: float | None) -> str:
    return f"{ratio:.2f}" if ratio is not None else "n/a"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="C=128, 1 s latency: under a minute")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--turns", type=int, default=3, help="turns per rollout (echo env)")
    parser.add_argument("--latency", type=float, default=5.0, help="stand-in seconds per model call")
    parser.add_argument("--env", choices=sorted(ENVS), default="echo")
    parser.add_argument("--ways", default="bca", help="which ways to run, in order: subset of 'abc'")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--worker-num-cpus", type=float, default=0.5)
    parser.add_argument("--env-workers", type=int, default=2)
    parser.add_argument("--renderers", type=int, default=2, help="renderers the pool grows to (one per core)")
    parser.add_argument("--renderer-multiplex", type=int, default=0, help="overrides --renderers")
    parser.add_argument(
        "--settle-single",
        action="store_true",
        help="settle this process's garbage collector as the plane's actors do, before the single-process "
        "ways (process-wide and for good: run them after the plane, e.g. --ways ab)",
    )
    parser.add_argument(
        "--profile", default="", help="py-spy the plane's processes during each wave into DIR"
    )
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run the ways this many times at each C, in alternating order; the last lines give medians",
    )
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.latency = [128], 1.0
    args.max_turns = args.turns + 1  # the env ends the episode; this only guards against a runaway loop
    return args


def main() -> None:
    run_on_local_ray(main_async(parse_args()))


if __name__ == "__main__":
    main()
