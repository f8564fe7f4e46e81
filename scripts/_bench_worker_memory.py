"""Memory per in-flight rollout inside a `RolloutWorker`: one worker, `-n` rollouts of
`bench_long_waits.py`'s workload, and a heap probe (`_bench_heap.py`) in every Ray process.

    PYTHONPATH=$PWD flock /tmp/ray-run.lock timeout 600 python scripts/_bench_worker_memory.py [-n 2048] [--frames 0]

Half-way through the first model call it prints each plane process's RSS added per in-flight rollout and
the lines that allocated most per rollout (tracemalloc, started at the wave's start); `--frames 0`: no
tracemalloc, pymalloc blocks and gc-tracked objects by type per rollout instead.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import tempfile

import _bench_heap
from _bench_wave import run_on_local_ray
from bench_long_waits import _request
from ray import cloudpickle

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec, standin_options
from rollout_actors.inference.standin import StandinServer
from rollout_actors.plane import PlaneConfig, RolloutPlane


async def main(args: argparse.Namespace, folder: str) -> None:
    server = StandinServer(
        standin_options(ServerSpec(kind="standin", model=BUNDLED_MODEL), latency_s=args.latency),
        ready_timeout_s=600,
    ).start()
    args.multiplex = args.n
    plane = RolloutPlane(
        PlaneConfig(
            lanes={"train": args.n, "eval": 1},
            workers=1,
            worker_num_cpus=0.5,
            env_pool={"min_servers": 1, "max_servers": 1, "multiplex": args.n, "num_cpus": 0.25},
        )
    )
    try:
        await plane.start()
        for i in range(4):
            await plane.submit(_request(args, server, i, warm=True))
        for _ in range(4):
            assert (await plane.next_result(timeout=300)).ok
        open(os.path.join(folder, "base"), "w").close()
        await asyncio.sleep(3)
        for i in range(args.n):
            await plane.submit(_request(args, server, i))
        await asyncio.sleep(args.latency / 2)
        with open(os.path.join(folder, "snap"), "w") as f:
            f.write(str(args.n))
        kinds: dict[str, int] = {}
        for _ in range(args.n):
            r = await plane.next_result(timeout=600)
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        print("kinds:", kinds)
    finally:
        await plane.close()
        server.close()
    for path in sorted(glob.glob(os.path.join(folder, "*.txt"))):
        print(open(path).read()[: args.chars])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=2048)
    parser.add_argument("--latency", type=float, default=20.0)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--step-wait", type=float, default=5.0)
    parser.add_argument("--frames", type=int, default=1)
    parser.add_argument("--chars", type=int, default=6000)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="heap-")
    cloudpickle.register_pickle_by_value(_bench_heap)
    code = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {_bench_heap.DIR_VAR: folder, "BENCH_HEAP_FRAMES": str(args.frames), "PYTHONPATH": code}
    try:
        run_on_local_ray(
            main(args, folder),
            runtime_env={"worker_process_setup_hook": _bench_heap.install, "env_vars": env},
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
