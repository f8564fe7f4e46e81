"""Benchmark: load-aware concurrency (the controller) against fixed lane limits, on a server whose KV cache
is finite.

    python scripts/bench_concurrency.py [--quick] [--limits 4,8,16,32,64,128] [--phase-s 30]
                                        [--kv-tokens 4096] [--latency 0.3] [--per-token 0.1]
                                        [--prefill 0.001]

Setup: a local Ray, one bundled stand-in server with a KV cache of `--kv-tokens` tokens in blocks of 16
(a model call of the bundled calculator environment holds ~300: prompt + completion) that behaves like
vLLM v1's under pressure (`standin.engine`): a call is admitted when its prompt's blocks are free, takes a
block each time its sampled tokens fill one, and when none is free the newest running call is preempted
and later recomputes its prompt and what it had sampled. Each call takes `--latency` seconds plus
`--per-token` per sampled token; computing uncached prompt tokens (recomputes included) takes `--prefill`
seconds each on a lane all calls share. One plane; a feeder keeps the train lane full of calculator
rollouts (two model turns each) for the whole run.

Phases, side by side in one run (the lane drained between them):
  fixed N     the train lane's limit set to N, for each of `--limits`
  controller  the lane starts at the smallest limit and `ConcurrencyController` steers it from the server's
              `/metrics` (`vllm:kv_cache_usage_perc`, `vllm:num_requests_waiting`, `vllm:num_preemptions_total`)
Each phase runs `--phase-s` seconds after a warm-up of a fifth of that; only the measured part counts:
  rollouts/s  rollouts finished `ok` per second
  p99 s       99th percentile of a rollout's latency, from the lane admitting it to its result
  preempt     preemptions the server counted (`vllm:num_preemptions`)
  kv>0.9      fraction of the time the server's KV usage was above 0.9 (polled every 0.25 s)
  waiting     mean requests waiting in the server's queue (preempted ones included)
  limit       the lane limit (for the controller: at the end of the phase, and its moves)

The last lines: controller throughput over the best and the worst fixed limit, and the time above 0.9 KV
usage and the preemptions of the controller and of the best fixed limit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import time
from dataclasses import dataclass, field

import ray

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases use httpx
    import httpx

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.load import LoadReader
from rollout_actors.inference.standin.launch import StandinOptions, StandinServer
from rollout_actors.plane import RolloutPlane
from rollout_actors.plane.concurrency import ConcurrencyConfig, ConcurrencyController
from rollout_actors.plane.config import PlaneConfig
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

ENV = Ref("env_actors.examples.calculator_env:CalculatorEnv")
POLL_S = 0.25
DRAIN_TIMEOUT_S = 180.0
_SERIES = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})? (\S+)$", re.M)
_REQUESTS = re.compile(r"^standin_requests_total\{[^}]*\} (\S+)$", re.M)


@dataclass
class Phase:
    name: str
    ok: int = 0
    failed: int = 0
    kv: list[float] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    seconds: float = 0.0
    limit: str = ""
    preemptions: int = 0
    latencies: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    @property
    def p99(self) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else 0.0

    @property
    def above(self) -> float:
        return sum(1 for k in self.kv if k > 0.9) / len(self.kv) if self.kv else 0.0


class Bench:
    def __init__(self, plane: RolloutPlane, server: StandinServer, args: argparse.Namespace) -> None:
        self.plane, self.server, self.args = plane, server, args
        headers = {"X-Standin-Latency": str(args.latency), "X-Standin-Per-Token-Latency": str(args.per_token)}
        self.client = ClientConfig(model=BUNDLED_MODEL, headers=headers)
        self.reader = LoadReader()
        self.counter = 0
        self.admitted: dict[str, float] = {}
        """Request id -> when the lane let it in (its `submit` returned)."""
        self.phase: Phase | None = None
        """The phase being measured; None during warm-ups and drains."""

    async def feed(self, stop: asyncio.Event) -> None:
        """Keep the train lane full: `submit` waits while it is."""
        while not stop.is_set():
            self.counter += 1
            request = RolloutRequest(
                env=ENV,
                task_index=self.counter % 300,
                client=self.client,
                sampling=SamplingConfig(max_tokens=128, seed=self.counter),
            )
            await self.plane.submit(request)
            self.admitted[request.request_id] = time.perf_counter()

    async def collect(self) -> None:
        while True:
            result = await self.plane.next_result()
            admitted = self.admitted.pop(result.request_id, None)
            if self.phase is not None:
                if result.kind == "ok":
                    self.phase.ok += 1
                    if admitted is not None:
                        self.phase.latencies.append(time.perf_counter() - admitted)
                else:
                    self.phase.failed += 1

    async def poll(self) -> None:
        while True:
            load = await self.reader.read(self.server.base_url)
            if self.phase is not None:
                self.phase.kv.append(load.kv_cache_usage)
                self.phase.waiting.append(load.waiting)
            await asyncio.sleep(POLL_S)

    async def warm_up(self) -> None:
        """Until the plane's pools are up and rollouts come back, so the first phase measures serving."""
        warm = Phase("warm-up")
        self.phase = warm
        await self.plane.set_limit("train", 8)
        stop = asyncio.Event()
        feeder = asyncio.create_task(self.feed(stop))
        while warm.ok < 16:
            await asyncio.sleep(0.5)
        self.phase = None
        stop.set()
        await self.plane.cancel_all()
        feeder.cancel()
        await self.drained()

    async def drained(self) -> None:
        """Until the lane is empty and the server idle: the stand-in, unlike vLLM, finishes a call whose
        client went away, and the next phase must not start on the last one's queue."""
        lane = self.plane.lanes.get("train")
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while time.monotonic() < deadline:
            load = await self.reader.read(self.server.base_url)
            if lane.in_flight == 0 and load.running == 0 and load.waiting == 0:
                break
            await asyncio.sleep(0.2)

    async def call_sizes(self) -> str:
        """What a model call of this workload held, from the server's counters."""
        async with httpx.AsyncClient(timeout=10, trust_env=False) as http:
            text = (await http.get(f"{self.server.url}/metrics")).text
        series = {name: float(value) for name, value in _SERIES.findall(text)}
        calls = sum(float(v) for v in _REQUESTS.findall(text)) or 1.0
        hits, queries = series["vllm:prefix_cache_hits_total"], series["vllm:prefix_cache_queries_total"]
        return (
            f"{calls:.0f} model calls: {series['vllm:prompt_tokens_total'] / calls:.0f} prompt + "
            f"{series['vllm:generation_tokens_total'] / calls:.0f} completion tokens on average; "
            f"prefix-cache hit rate {hits / max(queries, 1.0):.2f}"
        )

    async def preemptions(self) -> int:
        return (await self.reader.read(self.server.base_url)).preemptions

    async def run_phase(
        self, name: str, limit: int, controller: ConcurrencyController | None = None
    ) -> Phase:
        lane = self.plane.lanes.get("train")
        await self.plane.set_limit("train", limit)
        stop = asyncio.Event()
        feeder = asyncio.create_task(self.feed(stop))
        steering = asyncio.create_task(controller.run()) if controller is not None else None
        await asyncio.sleep(self.args.phase_s / 5)  # warm-up: the lane fills, the controller starts moving
        phase = Phase(name)
        preempted = await self.preemptions()
        started = time.perf_counter()
        self.phase = phase
        await asyncio.sleep(self.args.phase_s)
        self.phase = None
        phase.seconds = time.perf_counter() - started
        phase.preemptions = await self.preemptions() - preempted
        if steering is not None:
            steering.cancel()
            assert controller is not None
            moves = " ".join(f"{k}={v}" for k, v in sorted(controller.actions.items()))
            phase.limit = f"{lane.limit} ({moves}, overload cancels {controller.cancelled})"
        else:
            phase.limit = str(limit)
        stop.set()
        await self.plane.cancel_all()  # the feeder's waiting submit, if any, answers at once
        feeder.cancel()
        await self.drained()
        return phase


async def main(args: argparse.Namespace) -> None:
    limits = [int(x) for x in args.limits.split(",")]
    options = StandinOptions(kv_cache_tokens=args.kv_tokens, prefill_token_latency_s=args.prefill)
    with StandinServer(options) as server:
        config = PlaneConfig(
            lanes={"train": max(limits), "eval": 1},
            endpoints=[server.base_url],
            rollouts_per_worker=4096,
        )
        async with RolloutPlane(config) as plane:
            bench = Bench(plane, server, args)
            background = [asyncio.create_task(bench.collect()), asyncio.create_task(bench.poll())]
            await bench.warm_up()
            phases = [await bench.run_phase(f"fixed {n}", n) for n in limits]
            steer = ConcurrencyConfig(min_limit=min(limits), max_limit=4 * max(limits), interval_s=0.5)
            controller = ConcurrencyController(plane, steer, LoadReader())
            phases.append(await bench.run_phase("controller", min(limits), controller))
            for task in background:
                task.cancel()
            sizes = await bench.call_sizes()
            await bench.reader.aclose()
            await controller.aclose()
    print(f"(one shared machine; figures are ratios within this run) {sizes}")
    print(
        f"{'phase':<12} {'rollouts/s':>10} {'p99 s':>7} {'preempt':>8} {'kv>0.9':>7} {'waiting':>8} "
        f"{'failed':>6}  limit"
    )
    for p in phases:
        waiting = statistics.fmean(p.waiting) if p.waiting else 0.0
        print(
            f"{p.name:<12} {p.rate:>10.2f} {p.p99:>7.1f} {p.preemptions:>8} {p.above:>7.0%} {waiting:>8.1f} "
            f"{p.failed:>6}  {p.limit}"
        )
    fixed, steered = phases[:-1], phases[-1]
    best, worst = max(fixed, key=lambda p: p.rate), min(fixed, key=lambda p: p.rate)
    print(f"controller / worst fixed ({worst.name}) throughput: {steered.rate / max(worst.rate, 1e-9):.2f}")
    print(
        f"time above 0.9 KV usage: controller {steered.above:.0%}, best fixed ({best.name}) {best.above:.0%}"
    )
    print(f"preemptions: controller {steered.preemptions}, best fixed ({best.name}) {best.preemptions}")
    print(f"p99 rollout latency: controller {steered.p99:.1f} s, best fixed ({best.name}) {best.p99:.1f} s")
    print(f"controller / best fixed ({best.name}) throughput: {steered.rate / max(best.rate, 1e-9):.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="15 s phases, limits 4,16,64")
    parser.add_argument("--limits", default="4,8,16,32,64,128")
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--kv-tokens", type=int, default=4096)
    parser.add_argument("--latency", type=float, default=0.3, help="seconds per model call")
    parser.add_argument("--per-token", type=float, default=0.1, help="seconds per sampled token")
    parser.add_argument("--prefill", type=float, default=0.001, help="seconds per uncached prompt token")
    arguments = parser.parse_args()
    if arguments.quick:
        arguments.phase_s, arguments.limits = 15.0, "4,16,64"
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
    else:  # a private local Ray, never someone else's running cluster
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(main(arguments))
    finally:
        ray.shutdown()
