"""Benchmark: the driver's cost of a lane as the queue behind it grows.

    python scripts/bench_lanes.py [--limit 1024] [--queued 8192 16384 65536]

An orchestrator may submit far more rollouts than a lane admits (prime-rl queues a whole step's groups):
every submit past the bound waits in the lane. N tasks each take a slot, hold it 0-10 ms, give it back;
the figure is the driver CPU per rollout. A lane that wakes one waiter per release costs the same per
rollout at any depth (the ratio line stays near 1); one that wakes every waiter per release grows with
the queue.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

from rollout_actors.plane.lanes import Lane


async def wave(limit: int, queued: int) -> float:
    """CPU seconds per rollout for `queued` rollouts through one lane of `limit`."""
    lane, rnd = Lane("train", limit), random.Random(0)

    async def rollout() -> None:
        await lane.acquire()
        try:
            await asyncio.sleep(rnd.random() * 0.01)
        finally:
            await lane.release()

    started = time.process_time()
    await asyncio.gather(*(rollout() for _ in range(queued)))
    assert lane.peak == limit and lane.in_flight == 0
    return (time.process_time() - started) / queued


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=int, default=1024)
    parser.add_argument("--queued", type=int, nargs="+", default=[8192, 16384, 65536])
    args = parser.parse_args()
    per_rollout = {n: asyncio.run(wave(args.limit, n)) for n in args.queued}
    for n, cpu in per_rollout.items():
        print(f"limit {args.limit}, {n} rollouts: {cpu * 1e6:.1f} us of CPU per rollout")
    low, high = min(per_rollout), max(per_rollout)
    print(f"CPU per rollout at {high} / at {low} queued: {per_rollout[high] / per_rollout[low]:.2f}")


if __name__ == "__main__":
    main()
