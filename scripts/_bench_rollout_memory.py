"""Memory per in-flight rollout, Ray-free: where a waiting rollout's bytes go.

    PYTHONPATH=$PWD flock /tmp/ray-run.lock timeout 600 \
        python scripts/_bench_rollout_memory.py [--what call|single] [-n 2048] [--latency 20] [--trace]

Starts a stand-in with a fixed `--latency` (a subprocess) and, in this one process, starts `-n` at once of:
- `call`:   what a rollout holds on the wire while its model call is awaited: its own client
            (`build_client`) and one `complete_tokens` of the bench's first prompt (rendered once here);
- `single`: the whole rollout of `_bench_single_process` (the same renderer code inline, `SandboxEnv`).
Half-way through the first model call's latency it reads this process's RSS (and, with `--trace`, a
tracemalloc snapshot grouped by line): the bytes per in-flight rollout, over the process before the wave.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import time
import tracemalloc

import psutil
from _bench_single_process import SingleProcessWorkload, long_wait_workload, run_wave

from rollout_actors.rollout.client import build_client
from rollout_actors.rollout.model_call import PromptJson, complete_tokens

MAX_TOKENS = 256  # as bench_long_waits.py


def _rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


async def _calls(workload: SingleProcessWorkload, n: int) -> None:
    assert workload.renderer is not None
    env = workload.env
    reset = await env.reset(env.task(0))
    prompt = list(workload.renderer.start(list(reset.messages), reset.tools or None).prompt_ids)
    print(f"prompt: {len(prompt)} ids")

    async def one(i: int) -> None:
        client = build_client(workload.client, session_id=f"mem-{i}")
        try:
            await complete_tokens(
                client,
                workload.client.model,
                list(prompt),
                workload.sampling,
                timeout_s=workload.client.total_call_timeout_s,
                prompt_json=PromptJson(),
            )
        finally:
            await client.close()

    await asyncio.gather(*(one(i) for i in range(n)))


async def main(args: argparse.Namespace) -> None:
    async with long_wait_workload(args.latency, 3, 5.0, MAX_TOKENS) as (_, workload):
        # One rollout first: every lazy import, cache and pool is warm before the baseline.
        if args.what == "call":
            await _calls(workload, 1)
        gc.collect()
        if args.trace:
            tracemalloc.start(args.frames)
        before, traced_before = _rss(), tracemalloc.get_traced_memory()[0] if args.trace else 0
        snap_before = tracemalloc.take_snapshot() if args.trace else None
        started = time.monotonic()
        if args.what == "call":
            wave = asyncio.ensure_future(_calls(workload, args.n))
        else:
            wave = asyncio.ensure_future(run_wave(workload, args.n, per_rollout_client=True))
        await asyncio.sleep(args.latency / 2)
        at_wait = _rss()
        print(
            f"{args.what}: n={args.n} rss before {before / 2**20:.1f} MiB, at the wait {at_wait / 2**20:.1f} MiB"
        )
        print(f"  RSS per in-flight rollout: {(at_wait - before) / args.n / 1024:.1f} KB")
        if args.trace:
            traced = tracemalloc.get_traced_memory()[0] - traced_before
            print(f"  traced (Python allocations) per rollout: {traced / args.n / 1024:.1f} KB")
            snap = tracemalloc.take_snapshot()
            assert snap_before is not None
            for stat in snap.compare_to(snap_before, "lineno" if args.frames == 1 else "traceback")[
                : args.top
            ]:
                if stat.size_diff <= 0:
                    continue
                print(
                    f"  {stat.size_diff / args.n:8.0f} B/rollout {stat.count_diff / args.n:6.1f} blocks",
                    end="",
                )
                for frame in stat.traceback.format()[-2 * args.frames :: 2]:
                    print(f"  {frame.strip()}")
            tracemalloc.stop()
        await wave
        print(f"  wave took {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--what", choices=("call", "single"), default="call")
    parser.add_argument("-n", type=int, default=2048)
    parser.add_argument("--latency", type=float, default=20.0)
    parser.add_argument("--trace", action="store_true")
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--top", type=int, default=25)
    asyncio.run(main(parser.parse_args()))
