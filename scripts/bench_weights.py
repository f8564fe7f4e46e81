"""Benchmark: full-weight updates under a steady rollout load, without dropping a rollout or a token.

    python scripts/bench_weights.py [--quick] [--inflight 32] [--updates 3] [--servers 2]

Keeps `--inflight` calculator rollouts (token mode, two model turns each) in flight against stand-in
servers started with the flags `ServerSpec` gives vLLM, and every `--interval` seconds calls
`await plane.update_weights(update_info, version)`: every server pauses in keep mode, takes the new
weights through vLLM's weight-update routes, and resumes. Per update it prints

  blocked    seconds the caller spent in `update_weights`
  paused     the pause window (first pause sent -> last server resumed)
  spanning   rollouts that started before the update and finished after it
  straddled  turns whose sampling the update landed in (they record where: `Turn.version_changes`)

then the totals: rollouts, failures (must be 0), turns checked token-exact (a straddling turn's tokens
after the change are exactly what the new weights sample from the prompt plus the tokens before it), and
one straddling rollout's per-turn versions, which must show both versions.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import openai
import ray

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec, standin_options
from rollout_actors.inference.standin import StandinServer
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.samples import turn_prompts
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig

CALCULATOR = Ref(target="env_actors.examples.calculator_env:CalculatorEnv", config={"num_tasks": 300})
MAX_TOKENS = 256
SEED = 5
RESULT_TIMEOUT_S = 120.0
CHECKED_TURNS = 8  # resampling every straddling turn would load the servers the benchmark measures


class Load:
    """`inflight` rollouts kept in the plane; every result kept with when it arrived."""

    def __init__(self, plane: RolloutPlane, url: str, inflight: int) -> None:
        self.plane, self.url, self.inflight = plane, url, inflight
        self.results: list[tuple[float, Result]] = []
        self._open = 0
        self._stopping = False
        self._count = 0

    async def _submit(self) -> None:
        self._count += 1
        client = ClientConfig(base_url=self.url, model=BUNDLED_MODEL)
        sampling = SamplingConfig(max_tokens=MAX_TOKENS, seed=SEED)
        await self.plane.submit(
            RolloutRequest(env=CALCULATOR, task_index=self._count % 300, client=client, sampling=sampling)
        )
        self._open += 1

    async def run(self) -> None:
        for _ in range(self.inflight):
            await self._submit()
            await asyncio.sleep(1.0 / self.inflight)
        while self._open:
            result = await self.plane.next_result(timeout=RESULT_TIMEOUT_S)
            self._open -= 1
            self.results.append((time.monotonic(), result))
            if not self._stopping:
                await self._submit()

    def stop(self) -> None:
        self._stopping = True


async def resample(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0) as client:
        response = await client.completions.create(
            model=BUNDLED_MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            seed=SEED,
            extra_body={"return_token_ids": True},
        )
    return response.choices[0].model_extra["token_ids"]


async def bench(args: argparse.Namespace, urls: list[str]) -> None:
    config = PlaneConfig(
        lanes={"train": args.inflight + 8, "eval": 1}, workers=1, worker_num_cpus=0.5, endpoints=urls
    )
    async with RolloutPlane(config) as plane:
        load = Load(plane, urls[0], args.inflight)
        runner = asyncio.create_task(load.run())
        await asyncio.sleep(args.warmup)
        updates = []
        # NCCL's payloads (vLLM 0.33): the stand-in checks them as vLLM's transfer engine does.
        await plane.init_weight_transfer(
            {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
        )
        info = {
            "names": ["model.layers.0.mlp.down_proj.weight"],
            "dtype_names": ["bfloat16"],
            "shapes": [[8, 8]],
        }
        for version in range(1, args.updates + 1):
            started = time.time()
            report = await plane.update_weights(info, version)
            updates.append((started, time.time(), report))
            await asyncio.sleep(args.interval)
        load.stop()
        await runner
        results = [result for _, result in load.results]

        print(f"{'update':>6} {'blocked s':>10} {'paused s':>9} {'spanning':>9} {'straddled':>10}")
        for (start, end, report), version in zip(updates, range(1, args.updates + 1), strict=True):
            spanning = sum(1 for r in results if (r.started_at or end) < start and (r.finished_at or 0) > end)
            straddled = sum(
                1 for r in results for t in r.turns if any(c.version == version for c in t.version_changes)
            )
            print(f"{version:>6} {end - start:>10.3f} {report.paused_s:>9.3f} {spanning:>9} {straddled:>10}")

        failed = [r for r in results if r.kind != "ok"]
        straddling = [(r, t) for r in results for t in r.turns if t.version_changes]
        checked = exact = 0
        # The servers now hold the last version: only a turn that changed to it can be resampled.
        last = [(r, t) for r, t in straddling if [c.version for c in t.version_changes] == [args.updates]]
        for result, turn in last[:CHECKED_TURNS]:
            prompt = turn_prompts(result)[result.turns.index(turn)]
            change = turn.version_changes[0]
            checked += 1
            tail = await resample(urls[0], prompt + turn.completion_ids[: change.at], MAX_TOKENS - change.at)
            exact += tail == turn.completion_ids[change.at :]
        turns = [t for r in results for t in r.turns]
        print(f"rollouts: {len(results)}   failed: {len(failed)}   turns: {len(turns)}")
        print(f"blocked s (median): {statistics.median(end - start for start, end, _ in updates):.3f}")
        if failed:
            print("first failure:", failed[0].error)
        if straddling:
            example = straddling[0][0]
            versions = [
                (t.policy_version, [(c.at, c.version) for c in t.version_changes]) for t in example.turns
            ]
            print(f"a straddling rollout, per turn (version, changes): {versions}")
        print(f"straddling turns token-exact: {exact}/{checked}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 in flight, 2 updates")
    parser.add_argument("--inflight", type=int, default=32)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between updates")
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--servers", type=int, default=2)
    parser.add_argument("--per-token-latency-s", type=float, default=0.01)
    args = parser.parse_args()
    if args.quick:
        args.inflight, args.updates = 16, 2
    spec = ServerSpec(kind="standin", model=BUNDLED_MODEL)
    options = standin_options(spec, latency_s=0.05, per_token_latency_s=args.per_token_latency_s)
    servers = [StandinServer(options).start(wait=False) for _ in range(args.servers)]
    try:
        urls = [server.wait_ready().base_url for server in servers]
        ray.init(num_cpus=4, include_dashboard=False, configure_logging=False, log_to_driver=False)
        asyncio.run(bench(args, urls))
    finally:
        for server in servers:
            server.close()
        ray.shutdown()


if __name__ == "__main__":
    main()
