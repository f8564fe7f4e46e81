"""Benchmark: one driver on the head of a many-node Ray cluster (issue #47 item 3), simulated on one machine.

    python scripts/bench_multinode.py [--nodes 4] [--rollouts 16384] [--concurrency 1024] [--group-size 8]

A `ray.cluster_utils.Cluster` of a head (the driver, the stand-in, the plane's pools) and `--nodes` worker
nodes, each its own raylet with its own logical CPUs, as `scripts/chaos.py` and the node-loss tests build
one. One `RolloutPlane` (a rollout worker per worker node) runs `--rollouts` one-turn rollouts (the echo
environment, the stand-in at zero latency) submitted as groups, at most `--concurrency` in flight, in
waves of 4,096. Printed per wave and for the run: rollouts/s, the driver's CPU per rollout
(`time.process_time`: Python and Ray's threads in this process), and the resident memory of the head's
GCS (`gcs_server`), whose growth per 10k rollouts is what a long run pays.

On one 2-core machine every node shares the same two cores, so rollouts/s is the machine's, not a
cluster's: the figures that carry over are the driver's CPU per rollout and the GCS's growth.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time

import psutil
import ray
from bench_plane import ENVS
from chaos import start_cluster

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec
from rollout_actors.inference.server_set import InferenceServerSet
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

WAVE = 4096
NODE_CPUS = 2  # logical, per worker node: a rollout worker and room for what the plane spreads there
DEADLINE_S = 1800.0


def gcs_rss_mb(temp_dir: str) -> float:
    """Resident memory of this cluster's GCS (the head's `gcs_server`, logging under `temp_dir`), in MiB."""
    for process in psutil.process_iter(["name", "cmdline"]):
        args = process.info["cmdline"] or ()
        if process.info["name"] == "gcs_server" and any(a.startswith(f"--log_dir={temp_dir}") for a in args):
            return process.memory_info().rss / 2**20
    return float("nan")


def request(i: int) -> RolloutRequest:
    target, config = ENVS["echo"]
    return RolloutRequest(
        env=Ref(target=target, config=config(1)),
        task_index=i % 64,
        client=ClientConfig(model=BUNDLED_MODEL),  # the plane routes to its servers
        sampling=SamplingConfig(max_tokens=16),
        max_turns=2,
    )


async def wave(plane: RolloutPlane, n: int, size: int, limit: asyncio.Semaphore) -> int:
    async def group(i: int) -> int:
        async with limit:
            handle = await plane.submit_group(request(i), n=size)
            return len((await handle.wait(timeout=DEADLINE_S)).ok)

    return sum(await asyncio.gather(*(group(i) for i in range(n // size))))


async def main_async(args: argparse.Namespace, cluster, temp_dir: str) -> None:
    spec = ServerSpec(kind="standin", model=BUNDLED_MODEL, num_cpus=0.5, standin={"latency_s": 0.0})
    servers = InferenceServerSet(spec, replicas=1, probe_interval_s=2.0)
    await servers.start()
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=NODE_CPUS, object_store_memory=150 * 2**20)
    cluster.wait_for_nodes()
    config = PlaneConfig(
        lanes={"train": args.concurrency, "eval": 1},
        allowed_ref_prefixes=("env_actors.faults.",),
        workers=args.nodes,
        worker_num_cpus=1.0,
        env_pool={"min_servers": 2, "max_servers": 2, "num_cpus": 0.25},
        fit_cpus=False,
    )
    limit = asyncio.Semaphore(max(1, args.concurrency // args.group_size))
    print(
        f"cluster: head + {args.nodes} worker nodes ({NODE_CPUS} CPUs each); stand-in {servers.endpoints()}",
        flush=True,
    )
    try:
        async with RolloutPlane(config, servers=servers) as plane:
            await wave(plane, 256, args.group_size, limit)  # warm: pools, renderer, workers
            rss_start = gcs_rss_mb(temp_dir)
            print(
                f"{'wave':>5}{'rollouts':>10}{'ok':>8}{'per s':>9}{'driver ms':>11}{'GCS MiB':>9}", flush=True
            )
            total_ok = total_n = 0
            cpu0, t0 = time.process_time(), time.monotonic()
            for index in range(max(1, args.rollouts // WAVE)):
                n = min(WAVE, args.rollouts)
                cpu, started = time.process_time(), time.monotonic()
                ok = await wave(plane, n, args.group_size, limit)
                wall, cpu = time.monotonic() - started, time.process_time() - cpu
                total_ok, total_n = total_ok + ok, total_n + n
                print(
                    f"{index:>5}{n:>10}{ok:>8}{n / wall:>9.0f}{cpu / n * 1e3:>11.3f}{gcs_rss_mb(temp_dir):>9.1f}",
                    flush=True,
                )
            wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
            rss_end = gcs_rss_mb(temp_dir)
    finally:
        await servers.aclose()
    print()
    print(f"rollouts: {total_n} ({total_ok} ok) in {wall:.1f} s: {total_n / wall:.0f}/s on this machine")
    print(
        f"GCS RSS: {rss_start:.1f} -> {rss_end:.1f} MiB ({(rss_end - rss_start) / total_n * 1e4:+.1f} per 10k)"
    )
    print(f"driver CPU per rollout (ms): {cpu / total_n * 1e3:.3f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rollouts", type=int, default=16384)
    parser.add_argument("--concurrency", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=8)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.ERROR)
    temp_dir = tempfile.mkdtemp(prefix="multinode-ray-", dir="/tmp")
    cluster = start_cluster(temp_dir)
    try:
        ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
        asyncio.run(main_async(args, cluster, temp_dir))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
