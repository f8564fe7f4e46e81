"""Benchmark: load-aware concurrency (the controller) against fixed lane limits, on a server whose KV cache
is finite.

    python scripts/bench_concurrency.py [--quick] [--limits 4,8,16,32,64,128] [--phase-s 30]
                                        [--kv-tokens 8192] [--latency 2.0]

Setup: a local Ray, one bundled stand-in server with a KV cache of `--kv-tokens` tokens (a model call of
the bundled calculator environment holds ~300: prompt + completion; a call that does not fit waits in the
server's queue, as on vLLM), `--latency` seconds per model call, and one plane. A feeder keeps the train
lane full of calculator rollouts (two model turns each) for the whole run.

Phases, side by side in one run (the lane drained between them):
  fixed N     the train lane's limit set to N, for each of `--limits`
  controller  the lane starts at the smallest limit and `ConcurrencyController` steers it from the server's
              `/metrics` (`vllm:kv_cache_usage_perc`, `vllm:num_requests_waiting`)
Each phase runs `--phase-s` seconds after a warm-up of a fifth of that; only the measured part counts:
  rollouts/s  rollouts finished `ok` per second
  kv>0.9      fraction of the time the server's KV usage was above 0.9 (polled every 0.25 s): the zone where
              vLLM starts preempting running requests (this stand-in queues them instead, so over-commit
              costs it latency, not throughput)
  waiting     mean requests waiting in the server's queue
  limit       the lane limit (for the controller: at the end of the phase, and its moves)

The last lines: controller throughput over the best and the worst fixed limit, and the time above 0.9 KV
usage of the controller and of the best fixed limit.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from dataclasses import dataclass, field

import ray

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.concurrency import ConcurrencyConfig, ConcurrencyController
from rollout_actors.config import PlaneConfig
from rollout_actors.inference.load import LoadReader
from rollout_actors.inference.standin.launch import StandinOptions, StandinServer
from rollout_actors.plane import RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

ENV = Ref("env_actors.examples.calculator_env:CalculatorEnv")
POLL_S = 0.25
DRAIN_TIMEOUT_S = 180.0


@dataclass
class Phase:
    name: str
    ok: int = 0
    failed: int = 0
    kv: list[float] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    seconds: float = 0.0
    limit: str = ""

    @property
    def rate(self) -> float:
        return self.ok / self.seconds if self.seconds else 0.0

    @property
    def above(self) -> float:
        return sum(1 for k in self.kv if k > 0.9) / len(self.kv) if self.kv else 0.0


class Bench:
    def __init__(self, plane: RolloutPlane, server: StandinServer, args: argparse.Namespace) -> None:
        self.plane, self.server, self.args = plane, server, args
        self.client = ClientConfig(model=BUNDLED_MODEL, headers={"X-Standin-Latency": str(args.latency)})
        self.reader = LoadReader()
        self.counter = 0
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

    async def collect(self) -> None:
        while True:
            result = await self.plane.next_result()
            if self.phase is not None:
                if result.kind == "ok":
                    self.phase.ok += 1
                else:
                    self.phase.failed += 1

    async def poll(self) -> None:
        while True:
            load = await self.reader.read(self.server.base_url)
            if self.phase is not None:
                self.phase.kv.append(load.kv_cache_usage)
                self.phase.waiting.append(load.waiting)
            await asyncio.sleep(POLL_S)

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
        started = time.perf_counter()
        self.phase = phase
        await asyncio.sleep(self.args.phase_s)
        self.phase = None
        phase.seconds = time.perf_counter() - started
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
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while lane.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        return phase


async def main(args: argparse.Namespace) -> None:
    limits = [int(x) for x in args.limits.split(",")]
    options = StandinOptions(kv_cache_tokens=args.kv_tokens)
    with StandinServer(options) as server:
        config = PlaneConfig(
            lanes={"train": max(limits), "eval": 1},
            endpoints=[server.base_url],
            rollouts_per_worker=4096,
        )
        async with RolloutPlane(config) as plane:
            bench = Bench(plane, server, args)
            background = [asyncio.create_task(bench.collect()), asyncio.create_task(bench.poll())]
            phases = [await bench.run_phase(f"fixed {n}", n) for n in limits]
            steer = ConcurrencyConfig(min_limit=min(limits), max_limit=4 * max(limits), interval_s=0.5)
            controller = ConcurrencyController(plane, steer, LoadReader())
            phases.append(await bench.run_phase("controller", min(limits), controller))
            for task in background:
                task.cancel()
            await bench.reader.aclose()
            await controller.aclose()
    print(f"{'phase':<12} {'rollouts/s':>10} {'kv>0.9':>7} {'waiting':>8} {'failed':>6}  limit")
    for p in phases:
        waiting = statistics.fmean(p.waiting) if p.waiting else 0.0
        print(f"{p.name:<12} {p.rate:>10.2f} {p.above:>7.0%} {waiting:>8.1f} {p.failed:>6}  {p.limit}")
    fixed, steered = phases[:-1], phases[-1]
    best, worst = max(fixed, key=lambda p: p.rate), min(fixed, key=lambda p: p.rate)
    print(f"controller / worst fixed ({worst.name}) throughput: {steered.rate / worst.rate:.2f}")
    print(
        f"time above 0.9 KV usage: controller {steered.above:.0%}, best fixed ({best.name}) {best.above:.0%}"
    )
    print(f"controller / best fixed ({best.name}) throughput: {steered.rate / best.rate:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="15 s phases, limits 4,16,64")
    parser.add_argument("--limits", default="4,8,16,32,64,128")
    parser.add_argument("--phase-s", type=float, default=30.0)
    parser.add_argument("--kv-tokens", type=int, default=8192)
    parser.add_argument("--latency", type=float, default=2.0)
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
