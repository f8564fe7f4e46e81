"""A real run to read the report of: the plane on local Ray against the stand-in, with a fault injected and a
full-weight update halfway, written as JSON lines and drawn.

    python scripts/report_demo.py [--tasks 48] [--group-size 4] [--concurrency 64] [--latency 0.2]
                                  [--fault-rate 0.05] [--kv-cache-tokens 16000] [--output demo.jsonl]
                                  [--png demo.png]

The stand-in corrupts `--fault-rate` of the model calls (`model` results), holds a KV budget that makes some
calls queue (its queue time is reported per call, as vLLM's `--enable-per-request-metrics`), and the plane
updates the weights (keep mode) once half the groups are answered, so the off-policy panel has a lag to
show. Every rollout starts cold: the env pool and the renderer's tokenizer load while the first wave waits. It prints the
report's summary (`rollouts report`) and writes the PNG: look at it.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import ray

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec, standin_options
from rollout_actors.inference.standin import StandinServer
from rollout_actors.job.report import format_summary, read_results, summarize
from rollout_actors.job.report_png import write_png
from rollout_actors.job.run_config import DEFAULT_ENV
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig


async def run(args: argparse.Namespace, url: str) -> None:
    config = PlaneConfig(
        lanes={"train": args.concurrency, "eval": 1}, workers=2, worker_num_cpus=0.25, endpoints=[url]
    )
    headers = {"X-Standin-Latency": str(args.latency)}
    if args.fault_rate > 0:
        headers |= {"X-Standin-Fault": "malformed", "X-Standin-Fault-Rate": str(args.fault_rate)}
    template = RolloutRequest(
        env=Ref(DEFAULT_ENV),
        client=ClientConfig(base_url=url, model=BUNDLED_MODEL, headers=headers),
        sampling=SamplingConfig(max_tokens=200),
        max_turns=4,
        timeout_s=300,
    )
    output = Path(args.output)
    async with RolloutPlane(config) as plane:

        async def feed() -> None:
            for index in range(args.tasks):
                request = template.model_copy(
                    update={"task_index": index, "sampling": SamplingConfig(max_tokens=200, seed=index * 100)}
                )
                await (await plane.submit_group(request, args.group_size)).admitted()

        feeder = asyncio.create_task(feed())
        with output.open("w") as sink:
            for answered in range(args.tasks):
                if answered == args.tasks // 2:
                    started = time.monotonic()
                    await plane.update_weights({"names": ["model.layers.0.mlp.down_proj.weight"]}, 1)
                    print(
                        f"weights updated to v1 after {answered} groups ({time.monotonic() - started:.2f} s)"
                    )
                group = await plane.next_group(timeout=600)
                for result in group.results:
                    sink.write(result.model_dump_json(exclude_defaults=True) + "\n")
        await feeder
    results = read_results(output)
    print(format_summary(summarize(results)))
    print(f"plots: {write_png(results, args.png)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", type=int, default=48)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--latency", type=float, default=0.2, help="stand-in seconds per model call")
    parser.add_argument("--fault-rate", type=float, default=0.05, help="model calls the stand-in corrupts")
    parser.add_argument(
        "--kv-cache-tokens", type=int, default=16_000, help="stand-in KV budget: calls past it queue"
    )
    parser.add_argument("--output", default="report-demo.jsonl")
    parser.add_argument("--png", default="report-demo.png")
    args = parser.parse_args()
    options = standin_options(
        ServerSpec(kind="standin", model=BUNDLED_MODEL),
        per_token_latency_s=0.002,
        kv_cache_tokens=args.kv_cache_tokens,
    )
    with StandinServer(options) as server:
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            asyncio.run(run(args, server.base_url))
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
