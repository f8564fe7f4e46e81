"""Benchmark: how long does `publish` block its caller, and what does publication cost the servers' traffic?

    python scripts/bench_publish.py [--sizes 16,64,256] [--servers 2] [--concurrency 32] [--window 3]

For each adapter size (MiB of float32 LoRA weights) it measures, side by side in one run:
  blocked   time the caller spends inside `await publisher.publish(...)` (the capture: a memcpy)
  total     time until every stand-in server has loaded the adapter and `current()` switched
  rps       stand-in request throughput (chat completions from `--concurrency` clients over all servers)
            during the publication vs. over a window without one, measured back to back.

Rollout throughput during publication needs the RolloutPlane; until the plane's `publish_policy` is wired
this measures the servers' request throughput instead (a rollout is a sequence of such requests), with
the load generator on the same event loop as the publisher, as the plane's would be.
Target: blocked / total < 0.10. The last line is `publish caller-blocked/total at 64MiB: <ratio>`.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time

import numpy as np

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.launch import StandinOptions, StandinServer
from rollout_actors.lora import LoraAdapter, lora_config
from rollout_actors.publish import PolicyPublisher

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

RANK = 64
TENSORS = 32  # 8 layers x (q, v) x (A, B): enough tensors that per-tensor overhead shows, if any
REQUEST = {"model": BUNDLED_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}


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


class Load:
    """`concurrency` clients sending chat completions round-robin over the servers; counts answers."""

    def __init__(self, urls: list[str], concurrency: int):
        self.urls = urls
        self.concurrency = concurrency
        self.done: list[float] = []
        """Completion times (monotonic)."""

    async def run(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=30, limits=limits, trust_env=False) as client:

            async def one(index: int) -> None:
                while not stop.is_set():
                    url = self.urls[index % len(self.urls)]
                    response = await client.post(f"{url}/chat/completions", json=REQUEST)
                    response.raise_for_status()
                    self.done.append(time.monotonic())
                    index += 1

            await asyncio.gather(*(one(i) for i in range(self.concurrency)))

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t <= end for t in self.done) / (end - start)


async def measure(urls: list[str], sizes: list[int], concurrency: int, window: float) -> list[dict]:
    storage = tempfile.mkdtemp(prefix="bench-publish-")
    publisher = PolicyPublisher(urls, storage, load_timeout=60, retries=1, retain=2)
    # retain=2: old adapters are unloaded and deleted as the run goes, as in training.
    load, stop = Load(urls, concurrency), asyncio.Event()
    traffic = asyncio.create_task(load.run(stop))
    rows = []
    try:
        await asyncio.sleep(1.0)  # connections open, servers warm
        version = 0
        for mib in sizes:
            # A training run publishes the same shapes every step: the first publication of a size
            # (cold: fresh capture memory) is reported apart from the steady state (the next one).
            cold = make_adapter(mib, seed=version)
            version += 1
            cold_handle = await publisher.publish(cold, version)
            await cold_handle.wait(timeout=600)
            del cold
            adapter = make_adapter(mib, seed=version)
            version += 1
            idle_start = time.monotonic()
            await asyncio.sleep(window)
            idle_rps = load.rate(idle_start, time.monotonic())
            started = time.monotonic()
            handle = await publisher.publish(adapter, version)
            blocked = time.monotonic() - started
            await handle.wait(timeout=600)
            total = time.monotonic() - started
            during = load.rate(started, started + total)
            rows.append(
                dict(
                    mib=mib,
                    cold=cold_handle.blocked_s,
                    blocked=blocked,
                    total=total,
                    idle=idle_rps,
                    during=during,
                )
            )
            del adapter
    finally:
        stop.set()
        await asyncio.wait_for(traffic, 60)
        await publisher.aclose()
        shutil.rmtree(storage, ignore_errors=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="16,64,256", help="adapter sizes in MiB")
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--window", type=float, default=3.0, help="seconds of traffic without publication")
    parser.add_argument("--latency-s", type=float, default=0.02, help="stand-in latency per request")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]

    servers = [StandinServer(StandinOptions(latency_s=args.latency_s)) for _ in range(args.servers)]
    try:
        for server in servers:
            server.start()
        rows = asyncio.run(measure([s.base_url for s in servers], sizes, args.concurrency, args.window))
    finally:
        for server in servers:
            server.stop()

    print(
        f"{args.servers} stand-in servers, {args.concurrency} concurrent clients, LoRA rank {RANK}, float32"
    )
    print("rps = stand-in chat completions/s (the plane is not wired yet: request, not rollout, throughput)")
    print("blocked cold = first publication of that size (fresh capture memory); the rest: the next one")
    header = f"{'size':>8} {'blocked cold ms':>16} {'blocked ms':>11} {'total ms':>9} {'blocked/total':>14} "
    print(header + f"{'rps idle':>9} {'rps during':>11} {'during/idle':>12}")
    for r in rows:
        print(
            f"{r['mib']:>5}MiB {r['cold'] * 1e3:>16.1f} {r['blocked'] * 1e3:>11.1f} {r['total'] * 1e3:>9.1f} "
            f"{r['blocked'] / r['total']:>14.3f} {r['idle']:>9.1f} {r['during']:>11.1f} "
            f"{r['during'] / r['idle']:>12.2f}"
        )
    at64 = next((r for r in rows if r["mib"] == 64), None)
    if at64 is not None:
        print(f"publish caller-blocked/total at 64MiB: {at64['blocked'] / at64['total']:.3f}")


if __name__ == "__main__":
    main()
