"""Benchmark: what one driver sustains, and what a rollout's fixed part costs the plane (issue #47 items 1-2).

    python scripts/bench_driver.py [--quick] [--rollouts 8192] [--concurrency 2048] [--modes single g8 g16]
                                   [--skip-real] [--profile DIR]

Two parts, on one private local Ray (`_bench_wave.run_on_local_ray`):

1. The driver alone. `RolloutPlane` with its usual workers and pools, whose workers answer at once
   (`_bench_instant`: no env session, no renderer, no model call; the worker still decodes the dispatch,
   looks its pools up and encodes its `Result`). `--rollouts` rollouts, at most `--concurrency` in flight
   (the lane's bound), submitted one by one (`single`: `submit`, results read by `next_result` beside it) or
   in groups (`g8`, `g16`: `submit_group`, each group awaited). Printed per mode: rollouts/s, the driver's
   CPU per rollout (`time.process_time` of this process around submission and collection: Python and
   Ray's own threads in it), and the CPU of every other plane process per rollout.
2. The real path, side by side with one process (`bench_plane.run_way`, ways b then a): one-turn rollouts
   (`EchoEnv` with `turns=1`), the stand-in at zero latency, `--concurrency` at once. The plane's CPU per
   rollout of every process but the stand-in is a rollout's fixed cost in the plane (its one turn
   included, as in the single process's figure beside it).

The last two lines: `fixed cost per rollout (ms)` (part 2, the plane) and `driver CPU per rollout (ms)`
(part 1, groups of 8, or the first mode run). Compare runs only as ratios measured in one run: other work
on a shared machine moves both.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass

import _bench_instant
from _bench_probe import cpu_by_role
from _bench_profile import WaveProfiler
from _bench_wave import cpu_diff, run_on_local_ray
from bench_plane import ENVS, cpu_per_turn, run_way
from ray import cloudpickle

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

CODE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WARMUP = 64  # rollouts before the first timed mode: the env pool, the first renderer, the workers' lookups
NO_SERVER = "http://127.0.0.1:9/v1"  # never called: an instant worker answers before any model call
COLLECT_TIMEOUT_S = 600.0


@dataclass
class DriverRun:
    mode: str
    rollouts: int
    wall_s: float
    driver_cpu_s: float
    others_cpu_s: float
    ok: int

    @property
    def per_s(self) -> float:
        return self.rollouts / self.wall_s

    @property
    def driver_ms(self) -> float:
        return self.driver_cpu_s / self.rollouts * 1e3

    @property
    def others_ms(self) -> float:
        return self.others_cpu_s / self.rollouts * 1e3


def _request(i: int) -> RolloutRequest:
    target, config = ENVS["echo"]
    return RolloutRequest(
        env=Ref(target=target, config=config(1)),
        task_index=i % 64,
        client=ClientConfig(base_url=NO_SERVER, model=BUNDLED_MODEL),
        sampling=SamplingConfig(max_tokens=16),
        max_turns=2,
        metadata=_bench_instant.INSTANT,
    )


async def _singles(plane: RolloutPlane, n: int) -> int:
    async def collect() -> int:
        return sum([(await plane.next_result(timeout=COLLECT_TIMEOUT_S)).ok for _ in range(n)])

    collector = asyncio.ensure_future(collect())
    for i in range(n):
        await plane.submit(_request(i))
    return await collector


async def _groups(plane: RolloutPlane, n: int, size: int) -> int:
    handles = [await plane.submit_group(_request(i), n=size) for i in range(n // size)]
    groups = [await handle.wait(timeout=COLLECT_TIMEOUT_S) for handle in handles]
    return sum(len(group.ok) for group in groups)


async def run_mode(plane: RolloutPlane, mode: str, n: int, profile: str) -> DriverRun:
    size = 0 if mode == "single" else int(mode.removeprefix("g"))
    n = n if size == 0 else n - n % size
    others_before = cpu_by_role(-1)
    profiler = WaveProfiler(f"{profile}/{mode}", {"driver": [os.getpid()]}).start() if profile else None
    cpu_before, started = time.process_time(), time.monotonic()
    ok = await (_singles(plane, n) if size == 0 else _groups(plane, n, size))
    wall, cpu = time.monotonic() - started, time.process_time() - cpu_before
    if profiler is not None:
        profiler.stop()
    others = cpu_diff(others_before, cpu_by_role(-1))
    others.pop("driver", None)
    return DriverRun(mode, n, wall, cpu, sum(others.values()), ok)


async def driver_part(args: argparse.Namespace) -> list[DriverRun]:
    plane = RolloutPlane(
        PlaneConfig(
            lanes={"train": args.concurrency, "eval": 1},
            allowed_ref_prefixes=("env_actors.faults.",),
            workers=args.workers,
            worker_num_cpus=0.5,
            env_pool={"min_servers": 1, "max_servers": 1, "num_cpus": 0.25},
        )
    )
    runs = []
    async with plane:
        await _singles(plane, WARMUP)
        for mode in args.modes:
            runs.append(run := await run_mode(plane, mode, args.rollouts, args.profile))
            print(
                f"{mode:<8}{run.rollouts:>9}{run.ok:>7}{run.wall_s:>9.2f}{run.per_s:>10.0f}"
                f"{run.driver_ms:>12.3f}{run.others_ms:>12.3f}",
                flush=True,
            )
    return runs


async def main_async(args: argparse.Namespace) -> None:
    print(
        f"== the driver alone: workers answer at once; {args.rollouts} rollouts, <= {args.concurrency} in flight"
    )
    print(f"{'mode':<8}{'rollouts':>9}{'ok':>7}{'wall s':>9}{'per s':>10}{'driver ms':>12}{'others ms':>12}")
    runs = await driver_part(args)
    fixed = None
    if not args.skip_real:
        c = args.concurrency
        print(f"\n== the real path: one-turn rollouts, stand-in at 0 s, C={c}, side by side with one process")
        real = argparse.Namespace(
            env="echo", turns=1, max_turns=2, latency=0.0, workers=args.workers, worker_num_cpus=0.5,
            env_workers=2, renderers=2, renderer_multiplex=0, profile="", settle_single=False,
        )  # fmt: skip
        single = await run_way(real, c, "b")
        plane = await run_way(real, c, "a")
        for name, way in (("one process", single), ("plane", plane)):
            roles = ", ".join(
                f"{role} {sec / c * 1e3:.2f}" for role, sec in sorted(way.cpu.items(), key=lambda kv: -kv[1])
            )
            print(
                f"{name:<12} wall {way.wall_s:6.2f} s  fail {way.failures}  CPU per rollout "
                f"{cpu_per_turn(way) * sum(way.turns) / c * 1e3:.2f} ms ({roles})"
            )
        fixed = cpu_per_turn(plane) * sum(plane.turns) / c * 1e3
        single_ms = cpu_per_turn(single) * sum(single.turns) / c * 1e3
        print(f"plane / one process, CPU per rollout: {fixed / single_ms:.2f}")
        print(
            f"driver CPU per rollout, real path, single submits (ms): {plane.cpu.get('driver', 0) / c * 1e3:.3f}"
        )
    headline = next((r for r in runs if r.mode == "g8"), runs[0] if runs else None)
    print()
    print(f"fixed cost per rollout (ms): {f'{fixed:.2f}' if fixed is not None else 'n/a'}")
    print(f"driver CPU per rollout (ms): {f'{headline.driver_ms:.3f}' if headline else 'n/a'}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="2,048 rollouts, C=512")
    parser.add_argument("--rollouts", type=int, default=8192)
    parser.add_argument("--concurrency", type=int, default=2048)
    parser.add_argument("--modes", nargs="+", default=["single", "g8", "g16"])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--skip-real", action="store_true", help="part 1 only")
    parser.add_argument("--profile", default="", help="py-spy the driver during each mode into DIR")
    args = parser.parse_args()
    if args.quick:
        args.rollouts, args.concurrency = 2048, 512
    return args


def main() -> None:
    cloudpickle.register_pickle_by_value(_bench_instant)
    setup = {"worker_process_setup_hook": _bench_instant.install, "env_vars": {"PYTHONPATH": CODE}}
    run_on_local_ray(main_async(parse_args()), runtime_env=setup)


if __name__ == "__main__":
    main()
