"""Benchmark: what agent mode costs per call against token mode, on the same workload, side by side.

    python scripts/bench_agent.py [--rollouts 48] [--concurrency 16] [--latency 0.3] [--rounds 2]

The workload: the calculator task with two tools (two model calls per rollout), in token mode
(`env_actors.faults.agents:TwoToolCalculatorEnv`, the plane drives the turns and steps the environment) and
in agent mode (`SdkAgentEnv`, an in-process OpenAI-SDK agent on the env server calls the rollout's
endpoint in the worker process). Same prompts, same seeds: the two modes sample the very same tokens (the
agent-mode tests assert it), so every difference below is the plane's, not the model's. The stand-in
answers each call after a fixed `--latency`. Rounds alternate token / agent so drift on a shared machine
falls on both.

Printed per mode: ms per turn (a rollout's wall time over its turns; median and p90), the latency agent
mode adds per call (median per-turn difference), and CPU per turn: every process of this Ray (workers,
env servers, renderers, pools, raylet, GCS; the stand-in excluded) and the rollout worker alone. Beside
them: the HTTP hop alone (an SDK client calling the endpoint, both in this process, answered at once:
latency and CPU per call, both sides), which any interception endpoint pays wherever it lives, and one
Ray actor round trip (a no-op call, median), the least a per-node proxy actor would add to every call on
top of that hop, since it would forward each call to the rollout's worker and back.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from pathlib import Path

import psutil
import ray

import rollout_actors
from env_actors.agent import AgentEndpoint as AgentAccess
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec, standin_options
from rollout_actors.inference.standin import StandinServer
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.rollout.agent.endpoint import AgentEndpoint
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig

CODE = Path(rollout_actors.__file__).resolve().parent.parent
MODES = {
    "token": Ref(target="env_actors.faults.agents:TwoToolCalculatorEnv"),
    "agent": Ref(target="env_actors.faults.agents:SdkAgentEnv"),
}
HEADERS = {"X-Standin-Correct-Rate": "1"}


def tree_cpu(exclude: set[int]) -> float:
    """CPU seconds (user + system) of this process's descendants, less `exclude` and theirs."""
    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.pid in exclude or exclude.intersection(p.pid for p in proc.parents()):
                continue
            times = proc.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.Error:
            pass
    return total


def process_cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


class Echo:
    """A route's handler that answers at once: the HTTP hop alone, without a turn."""

    async def chat_completion(self, body: dict) -> tuple[int, dict]:
        message = {"role": "assistant", "content": "ok"}
        choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
        return 200, {"id": "x", "object": "chat.completion", "created": 0, "model": "m", "choices": [choice]}

    def model_list(self) -> dict:
        return {"object": "list", "data": []}


async def http_hop(samples: int = 300) -> tuple[float, float]:
    """(median ms, CPU ms) per call of an `AsyncOpenAI` client calling the endpoint, both in this process."""
    endpoint = AgentEndpoint()
    grant = await endpoint.register(Echo())
    access = AgentAccess(base_url=grant.base_url, api_key=grant.api_key, model="m")
    client = access.client()
    messages = [{"role": "user", "content": "hi"}]
    try:
        await client.chat.completions.create(model="m", messages=messages)
        times, cpu0 = [], time.process_time()
        for _ in range(samples):
            start = time.perf_counter()
            await client.chat.completions.create(model="m", messages=messages)
            times.append((time.perf_counter() - start) * 1000)
        cpu = (time.process_time() - cpu0) * 1000 / samples
    finally:
        await access.aclose()
        await endpoint.aclose()
    return statistics.median(times), cpu


@ray.remote(num_cpus=0)
class NoOp:
    async def call(self) -> None:
        return None


async def ray_round_trip_ms(samples: int = 300) -> float:
    actor = NoOp.remote()
    await actor.call.remote()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        await actor.call.remote()
        times.append((time.perf_counter() - start) * 1000)
    ray.kill(actor)
    return statistics.median(times)


async def wave(
    plane: RolloutPlane, server: StandinServer, mode: str, count: int, offset: int
) -> list[Result]:
    for i in range(count):
        await plane.submit(
            RolloutRequest(
                env=MODES[mode],
                mode=mode,
                task_index=(offset + i) % 300,
                client=ClientConfig(base_url=server.base_url, model=BUNDLED_MODEL, headers=HEADERS),
                sampling=SamplingConfig(max_tokens=200, seed=offset + i),
            )
        )
    return [await plane.next_result(timeout=600) for _ in range(count)]


def per_turn_ms(results: list[Result]) -> list[float]:
    return [
        (r.finished_at - r.started_at) * 1000 / len(r.turns)
        for r in results
        if r.ok and r.turns and r.finished_at and r.started_at
    ]


async def run(args: argparse.Namespace) -> None:
    server = StandinServer(
        standin_options(ServerSpec(kind="standin", model=BUNDLED_MODEL), latency_s=args.latency)
    )
    server.start()
    plane = RolloutPlane(
        PlaneConfig(
            lanes={"train": args.concurrency},
            allowed_ref_prefixes=("env_actors.faults.",),
            workers=1,
            worker_num_cpus=0.5,
            env_pool={"num_cpus": 0.25, "multiplex": args.concurrency},
        )
    )
    try:
        async with plane:
            for mode in MODES:  # warm-up: pools started, renderers loaded, endpoint listening
                results = await wave(plane, server, mode, 4, 10_000)
                bad = [r.error for r in results if not r.ok]
                assert not bad, bad
            worker = plane._workers.live()[0].handle
            worker_pid = (await worker.debug_resources.remote())["pid"]
            exclude = {server.pid} if getattr(server, "pid", None) else set()
            rows: dict[str, dict[str, list[float]]] = {
                m: {"turn_ms": [], "cpu": [], "wcpu": []} for m in MODES
            }
            for round_ in range(args.rounds):
                for mode in MODES:
                    cpu0, w0 = tree_cpu(exclude), process_cpu(worker_pid)
                    results = await wave(plane, server, mode, args.rollouts, round_ * args.rollouts)
                    cpu1, w1 = tree_cpu(exclude), process_cpu(worker_pid)
                    failed = [r.error for r in results if not r.ok]
                    assert not failed, failed[:3]
                    turns = sum(len(r.turns) for r in results)
                    rows[mode]["turn_ms"] += per_turn_ms(results)
                    rows[mode]["cpu"].append((cpu1 - cpu0) * 1000 / turns)
                    rows[mode]["wcpu"].append((w1 - w0) * 1000 / turns)
            hop = await ray_round_trip_ms()
            http_ms, http_cpu = await http_hop()
    finally:
        server.close()
    print(
        f"\n{args.rollouts} rollouts x {args.rounds} rounds per mode, {args.concurrency} concurrent, "
        f"model latency {args.latency:g} s; 2 model calls per rollout"
    )
    print(f"{'mode':6} {'ms/turn p50':>12} {'p90':>8} {'CPU ms/turn (plane)':>20} {'(worker)':>9}")
    for mode, row in rows.items():
        ordered = sorted(row["turn_ms"])
        p90 = ordered[int(0.9 * (len(ordered) - 1))]
        print(
            f"{mode:6} {statistics.median(ordered):12.1f} {p90:8.1f} "
            f"{statistics.median(row['cpu']):20.2f} {statistics.median(row['wcpu']):9.2f}"
        )
    added = statistics.median(rows["agent"]["turn_ms"]) - statistics.median(rows["token"]["turn_ms"])
    cpu_ratio = statistics.median(rows["agent"]["cpu"]) / statistics.median(rows["token"]["cpu"])
    print(f"agent mode adds {added:.1f} ms per call (median per-turn difference)")
    print(f"agent / token CPU per turn (plane): {cpu_ratio:.2f}")
    print(
        f"the HTTP hop alone (SDK client -> endpoint -> answer, one process): {http_ms:.2f} ms, "
        f"{http_cpu:.2f} ms CPU per call"
    )
    print(f"one Ray actor round trip (what a proxy actor would add per call, at least): {hop:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--latency", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(CODE)}},
    )
    try:
        asyncio.run(run(args))
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
