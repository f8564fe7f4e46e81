"""Benchmark: how long `publish_policy` blocks its caller, and what publication costs rollout throughput.

    python scripts/bench_publish.py [--quick] [--sizes 16,64,256] [--servers 2] [--inflight 64]
                                    [--window 5] [--gap 0] [--min-during 150] [--latency-s 0.05]

Setup: a local Ray, `--servers` stand-in servers (`--latency-s` per model call) and a `RolloutPlane` over
them (2 workers, one env pool), its policy storage in a temporary directory. A driver-side loop keeps
`--inflight` real plane rollouts in flight all run long, on the same event loop as the publishing caller,
as a trainer's would be: token mode, the bundled `CalculatorEnv` (always two model turns, a tool call then
the answer, so a rollout is the same work under any policy); each result that arrives is recorded with its
arrival time and a new rollout is submitted. Nothing is timed before 3 x `--inflight` results arrived.

Per adapter size (MiB of float32 LoRA weights: rank 64, 32 tensors), in order:
  cold   one publication of a fresh adapter of that size (capture into fresh memory), reported apart;
         the first size's also builds the plane's publisher (its writer thread and HTTP client)
  idle   `--window` s without publication
  pubs   publications one after another: publish, wait until every server loaded it and the plane
         switched, publish the next version (the same arrays updated in place, as a trainer's are),
         paced by `--gap` and the retention rule below; for at least `--window` s and until
         `--min-during` rollouts completed inside publications (at most 6 windows)
  idle   `--window` s without publication again: idle before and after, so a drift of the shared
         machine's load does not read as an effect of publication

Columns:
  blocked        seconds inside `await plane.publish_policy(...)` (a memcpy; nothing with --donate); median
  total          from calling `publish_policy` until `handle.wait()` returned; median of `pubs`
  blocked/total  median of the per-publication ratios (min and max below the table)
  ro/s idle      rollouts completed per second over both idle windows
  ro/s during    rollouts completed inside publications ([start, start + total] of each) over the summed
                 length of those intervals. One publication lasts tens to hundreds of ms, a handful of
                 completions, so every publication of the phase counts; `n during` is how many completions
                 the rate rests on (relative noise at least 1/sqrt(n)). Work a publication slowed down but
                 that finished after it is not in it: `ro/s phase` is the whole `pubs` phase, waits included.
  failures       results that were not `ok`, from the cold publication to the end of the second idle window

Retention: the plane's publisher keeps the newest 4 adapters loaded, and an older one for as long as a
rollout in flight uses it, so publications go back to back here with nothing waiting for rollouts to drain;
a rollout failing with 404 for its adapter would show in `failures`.

In-flight rollouts keep their policy: every `ok` rollout that started before some publication began and
finished after it switched must report `policy_version_start` = the version active when the plane stamped
it and `policy_version_end` >= the newer one. The stamp falls between the driver's submit and the worker's
`started_at` (one machine, one clock); rollouts for which that span overlaps a publication are not checked.

Target: blocked / total < 0.10. The last line is `publish caller-blocked/total at 64MiB: <ratio>`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import ray
from _bench_load import RESULT_TIMEOUT_S, Finished, SteadyLoad

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec, standin_options
from rollout_actors.inference.standin import StandinServer
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.policy.lora import LoraAdapter, lora_config

RANK = 64
TENSORS = 32  # 8 layers x (q, v) x (A, B): enough tensors that per-tensor overhead shows, if any
PUBLISH_TIMEOUT_S = 300.0
MAX_PHASE_WINDOWS = 6  # a publication phase may run this many windows to reach `--min-during`
WARMUP_ROLLOUTS = 3  # x `--inflight` results before anything is timed: pools, renderers, connections warm


def make_adapter(mib: int, seed: int) -> LoraAdapter:
    width = mib * 2**20 // (TENSORS * RANK * 4)
    rng = np.random.default_rng(seed)
    tensors = {
        f"base_model.model.layers.{i // 4}.self_attn.{('q', 'v')[i // 2 % 2]}_proj.lora_{'AB'[i % 2]}.weight": (
            rng.standard_normal((RANK, width), dtype=np.float32)
        )
        for i in range(TENSORS)
    }
    return LoraAdapter(tensors, lora_config(RANK, 2 * RANK, ["q_proj", "v_proj"], BUNDLED_MODEL))


@dataclass
class Publication:
    version: int
    start: float
    """Monotonic, just before `publish_policy`."""
    blocked: float
    """Seconds inside `await plane.publish_policy(...)`."""
    total: float
    """Seconds from `start` until `handle.wait()` returned: written, loaded everywhere, switched."""
    start_wall: float
    end_wall: float
    """Wall times of the same two instants, to compare with the workers' `started_at`/`finished_at`."""

    @property
    def end(self) -> float:
        return self.start + self.total


@dataclass
class SizeRow:
    mib: int
    cold: Publication
    pubs: list[Publication]
    idle_rate: float
    during_rate: float
    during_n: int
    phase_rate: float
    failures: int


class Bench:
    def __init__(
        self, plane: RolloutPlane, load: SteadyLoad, traffic: asyncio.Task[None], args: argparse.Namespace
    ):
        self.plane = plane
        self.load = load
        self.traffic = traffic
        self.args = args
        self.publications: list[Publication] = []
        self.version = 0

    async def hold(self, seconds: float) -> None:
        """Sleep, but fail at once if the load loop died (a measurement without load means nothing)."""
        await asyncio.wait({self.traffic}, timeout=seconds)
        if self.traffic.done():
            self.traffic.result()
            raise RuntimeError("the load loop stopped early")

    def enough(self, pubs: list[Publication], elapsed: float) -> bool:
        """At least a window, and enough completions inside publications for the rate to mean something."""
        if elapsed >= MAX_PHASE_WINDOWS * self.args.window:
            return True
        during = sum(self.load.count(p.start, p.end) for p in pubs)
        return elapsed >= self.args.window and during >= self.args.min_during

    async def publish(self, adapter: LoraAdapter) -> Publication:
        self.version += 1
        start_wall, start = time.time(), time.monotonic()
        handle = await self.plane.publish_policy(adapter, self.version, donate=self.args.donate)
        blocked = time.monotonic() - start
        await handle.wait(timeout=PUBLISH_TIMEOUT_S)
        total = time.monotonic() - start
        pub = Publication(self.version, start, blocked, total, start_wall, time.time())
        self.publications.append(pub)
        return pub

    async def size(self, mib: int) -> SizeRow:
        window = self.args.window
        adapter = make_adapter(mib, seed=mib)
        phase_start = time.monotonic()
        cold = await self.publish(adapter)
        idle_a = time.monotonic()
        await self.hold(window)
        pubs_start = time.monotonic()
        pubs: list[Publication] = []
        while not pubs or not self.enough(pubs, time.monotonic() - pubs_start):
            if self.args.donate:  # the trainer's `tensor.cpu()`: fresh arrays every step, handed over
                adapter = LoraAdapter({k: a.copy() for k, a in adapter.tensors.items()}, adapter.config)
            for array in adapter.tensors.values():  # the trainer's step: new values
                array[0, 0] += 1.0
            pubs.append(await self.publish(adapter))
            await self.hold(self.args.gap)
        idle_b = time.monotonic()
        await self.hold(window)
        end = time.monotonic()
        idle_n = self.load.count(idle_a, pubs_start) + self.load.count(idle_b, end)
        during_n = sum(self.load.count(p.start, p.end) for p in pubs)
        return SizeRow(
            mib=mib,
            cold=cold,
            pubs=pubs,
            idle_rate=idle_n / ((pubs_start - idle_a) + (end - idle_b)),
            during_rate=during_n / sum(p.total for p in pubs),
            during_n=during_n,
            phase_rate=self.load.count(pubs_start, idle_b) / (idle_b - pubs_start),
            failures=self.load.count(phase_start, end, failed=True),
        )


def check_versions(finished: list[Finished], publications: list[Publication]) -> tuple[int, list[str]]:
    """Rollouts in flight across a whole publication: how many were checked, and the violations."""
    intervals = [(p.start_wall, p.end_wall, p) for p in sorted(publications, key=lambda p: p.start_wall)]

    def stamped_version(f: Finished) -> tuple[bool, int | None]:
        # The stamp happened in [submitted_wall, started_at]; known only if no publication overlaps that.
        if any(a <= f.started_at and f.submitted_wall <= b for a, b, _ in intervals):
            return False, None
        active = None
        for _, b, p in intervals:
            if b < f.submitted_wall:
                active = p.version
        return True, active

    checked, violations = 0, []
    for f in finished:
        spanned = [p.version for a, b, p in intervals if f.started_at < a and b < f.finished_at]
        known, expected = stamped_version(f)
        if f.ok and spanned and known:
            checked += 1
            if f.version_start != expected or (f.version_end or 0) < max(spanned):
                violations.append(f"start {f.version_start} (expected {expected}), end {f.version_end}")
    return checked, violations


async def measure(args: argparse.Namespace, urls: list[str], storage: str) -> tuple[list[SizeRow], Bench]:
    plane = RolloutPlane(
        PlaneConfig(
            lanes={"train": args.inflight, "eval": 1},
            workers=2,
            worker_num_cpus=0.5,
            env_pool={
                "min_servers": 1,
                "max_servers": 1,
                "multiplex": max(64, args.inflight),
                "num_cpus": 0.25,
            },
            endpoints=urls,
            policy_storage_dir=storage,
        )
    )
    await plane.start()
    load = SteadyLoad(plane, urls, args.inflight)
    traffic = asyncio.create_task(load.run())
    bench = Bench(plane, load, traffic, args)
    rows = []
    try:
        while len(load.finished) < WARMUP_ROLLOUTS * args.inflight:
            await bench.hold(0.2)
        for mib in args.sizes:
            rows.append(await bench.size(mib))
    finally:
        load.stop()
        try:
            await asyncio.wait_for(traffic, RESULT_TIMEOUT_S)
        finally:
            await plane.close()
    return rows, bench


def print_report(args: argparse.Namespace, rows: list[SizeRow], bench: Bench) -> None:
    finished = bench.load.finished
    print(
        f"{args.servers} stand-in servers ({args.latency_s:g} s per model call), {args.inflight} calculator "
        f"rollouts in flight (2 model turns each), LoRA rank {RANK}, float32, window {args.window:g} s, "
        f"gap {args.gap:g} s, capture: {'donated (fresh arrays handed over)' if args.donate else 'copy'}"
    )
    print(
        "blocked cold = first publication of that size (fresh capture memory; the first size's also builds "
        "the plane's publisher); blocked, total: medians over the phase's publications"
    )
    header = (
        f"{'size':>8} {'pubs':>5} {'blocked cold ms':>16} {'blocked ms':>11} {'total ms':>9} "
        f"{'blocked/total':>14} {'ro/s idle':>10} {'ro/s during':>12} {'n during':>9} {'during/idle':>12} "
        f"{'ro/s phase':>11} {'failures':>9}"
    )
    print(header)
    for r in rows:
        print(
            f"{r.mib:>5}MiB {len(r.pubs):>5} {r.cold.blocked * 1e3:>16.1f} "
            f"{statistics.median(p.blocked for p in r.pubs) * 1e3:>11.1f} "
            f"{statistics.median(p.total for p in r.pubs) * 1e3:>9.1f} {ratio(r):>14.3f} "
            f"{r.idle_rate:>10.1f} {r.during_rate:>12.1f} {r.during_n:>9} {r.during_rate / r.idle_rate:>12.2f} "
            f"{r.phase_rate:>11.1f} {r.failures:>9}"
        )
    for r in rows:
        ratios = [p.blocked / p.total for p in r.pubs]
        print(
            f"  {r.mib}MiB: cold total {r.cold.total * 1e3:.0f} ms; blocked/total min {min(ratios):.3f} "
            f"max {max(ratios):.3f}; total ms min {min(p.total for p in r.pubs) * 1e3:.0f} "
            f"max {max(p.total for p in r.pubs) * 1e3:.0f}"
        )
    failed = [f for f in finished if not f.ok]
    print(f"rollouts completed: {len(finished)}, failures: {len(failed)}")
    for error in sorted({f.error or "" for f in failed})[:3]:
        print(f"  failure: {error[:300]}")
    checked, violations = check_versions(finished, bench.publications)
    print(
        f"in flight across a publication (started before it began, finished after it switched): {checked} "
        f"rollouts; kept the version they were stamped with: {checked - len(violations)}; "
        f"violations: {len(violations)}"
    )
    for violation in violations[:3]:
        print(f"  violation: {violation}")
    at64 = next((r for r in rows if r.mib == 64), None)
    print(f"publish caller-blocked/total at 64MiB: {f'{ratio(at64):.3f}' if at64 else 'n/a'}")


def ratio(row: SizeRow) -> float:
    return statistics.median(p.blocked / p.total for p in row.pubs)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="16 MiB only, 1.5 s windows: well under a minute"
    )
    parser.add_argument("--sizes", default="16,64,256", help="adapter sizes in MiB")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--inflight", type=int, default=64, help="rollouts kept in flight")
    parser.add_argument(
        "--window", type=float, default=5.0, help="seconds per idle and per publication phase"
    )
    parser.add_argument("--gap", type=float, default=0.0, help="pause between publications of a phase")
    parser.add_argument(
        "--donate", action="store_true", help="publish_policy(..., donate=True): fresh arrays handed over"
    )
    parser.add_argument(
        "--min-during", type=int, default=150, help="completions inside publications a phase aims for"
    )
    parser.add_argument("--latency-s", type=float, default=0.05, help="stand-in latency per model call")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.window, args.min_during = "16", 1.5, 30
    args.sizes = [int(s) for s in args.sizes.split(",")]
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    servers = [
        StandinServer(
            standin_options(ServerSpec(kind="standin", model=BUNDLED_MODEL), latency_s=args.latency_s)
        )
        for _ in range(args.servers)
    ]
    storage = tempfile.mkdtemp(prefix="bench-publish-")
    try:
        for server in servers:  # they load their tokenizer while Ray starts
            server.start(wait=False)
        ray.init(num_cpus=8, include_dashboard=False)
        for server in servers:
            server.wait_ready()
        rows, bench = asyncio.run(measure(args, [s.base_url for s in servers], storage))
    finally:
        ray.shutdown()
        for server in servers:
            server.close()
        shutil.rmtree(storage, ignore_errors=True)
    print_report(args, rows, bench)


if __name__ == "__main__":
    main()
