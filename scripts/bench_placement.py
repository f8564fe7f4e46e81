"""Benchmark: prefix-cache-aware placement of GRPO groups against least-loaded and session-sticky (hashed)
placement, and one server with an unbounded cache as the reference.

    python scripts/bench_placement.py [--quick] [--servers 4] [--groups 32] [--group-size 8]
                                      [--prompt-tokens 2048] [--lane 64] [--kv-tokens 131072]
                                      [--latency 0.2] [--per-token 0.02] [--max-tokens 64] [--prefill 5e-5]

Setup: a local Ray, `--servers` bundled stand-in servers (real HTTP, vLLM's prefix cache: hashes of full
16-token blocks chained from the prompt's start, a KV budget of `--kv-tokens` with LRU eviction of blocks no
running request holds, `standin.kv`), real renderers with the bundled tokenizer, `MathEnv` with a question
of about `--prompt-tokens` tokens per group (distinct text per group and per phase). Uncached prompt
tokens cost `--prefill` seconds each on a lane a server's prefills share; a call then takes `--latency`
plus `--per-token` per sampled token. Each phase is a plane of its own with `--lane` rollouts in flight;
`--groups` groups of `--group-size` are submitted at once and the phase ends when every group is complete.
A warm-up group per phase (not counted) loads the plane's pools and renderers first.

Phases, side by side in one run:
  least_loaded  each rollout to the server with the fewest in flight (the plane's placement before
                `rollout_actors.plane.placement`; a rollout keeps its server for all its turns)
  hashed        the group's prefix key hashed to a server, whatever its load (session-sticky)
  prefix        the default: where the key was placed, unless that server is past the load bound
  reference     the same workload on one server whose cache never evicts (`--kv-tokens` x 64: it never fills in this run)

Columns:
  hit rate     prefix-cache hits / queries (tokens) over the phase, from the servers' `/metrics`
               (`vllm:prefix_cache_hits_total`, `vllm:prefix_cache_queries_total`)
  max/mean     the busiest server's time-mean of requests running + waiting (polled every 0.2 s) over the
               mean across servers
  served       requests per server, max over mean
  prefill      prompt tokens computed (queries - hits), in thousands
  wall s       from submitting the groups to the last one complete

The last three lines: prefix's hit rate over the reference's (target >= 0.9), prefix's max/mean (<= 1.25),
prefix's wall over least-loaded's (<= 1.0). The machine may be shared: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
import statistics
import time
from dataclasses import dataclass, field

import ray

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases use httpx
    import httpx

from renderer_actors.tokenizer import BUNDLED_MODEL, load_tokenizer
from rollout_actors.inference.standin.launch import StandinOptions, StandinServer
from rollout_actors.plane import RolloutPlane
from rollout_actors.plane.config import PlaneConfig
from rollout_actors.plane.placement import PlacementConfig, Strategy
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

ENV = Ref("env_actors.examples.math_env:MathEnv")
POLL_S = 0.2
PHASE_TIMEOUT_S = 1800.0
STARTUP_S = 900.0  # five servers loading their tokenizer at once on a busy machine
TEMPLATE_TOKENS = 40  # system prompt, instruction and chat template around the question (measured: ~35)
WORDS = (
    "river stone market ledger copper lantern harbor orchard meadow signal bridge canvas timber quarry "
    "falcon garden pillar thunder velvet whisper crystal compass anchor beacon cobalt harvest island "
    "journey kettle lattice marble needle oyster pepper quiver ribbon saddle tablet umbrella valley "
    "wagon yellow zenith amber breeze candle dancer ember fabric glacier hollow ivory jasmine kernel"
).split()
_SERIES = re.compile(r"^(vllm:[a-z_]+|standin_requests_total)(?:\{[^}]*\})? (\S+)$", re.M)


@dataclass
class Phase:
    name: str
    servers: list[str]
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    hits: float = 0.0
    queries: float = 0.0
    served: list[float] = field(default_factory=list)
    busy: dict[str, list[float]] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def max_over_mean(self) -> float:
        means = [statistics.fmean(samples) for samples in self.busy.values() if samples]
        return max(means) / statistics.fmean(means) if means and statistics.fmean(means) > 0 else 1.0

    @property
    def served_ratio(self) -> float:
        return max(self.served) / statistics.fmean(self.served) if self.served and any(self.served) else 1.0


def questions(tokenizer, count: int, tokens: int, seed: int) -> list[str]:
    """`count` distinct texts of about `tokens` tokens each."""
    rng = random.Random(seed)
    texts = []
    for index in range(count):
        words = [rng.choice(WORDS) for _ in range(tokens * 2)]
        ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[: max(16, tokens - TEMPLATE_TOKENS)]
        texts.append(f"Document {seed}-{index}: {tokenizer.decode(ids)}\nHow many words above are 'river'?")
    return texts


async def scrape(client: httpx.AsyncClient, server: StandinServer) -> dict[str, float]:
    response = await client.get(f"{server.url}/metrics")
    response.raise_for_status()
    totals: dict[str, float] = {}
    for name, value in _SERIES.findall(response.text):
        totals[name] = totals.get(name, 0.0) + float(value)
    return totals


async def run_phase(
    name: str, strategy: Strategy, servers: list[StandinServer], texts: list[str], args: argparse.Namespace
) -> Phase:
    phase = Phase(name, [s.base_url for s in servers])
    headers = {"X-Standin-Latency": str(args.latency), "X-Standin-Per-Token-Latency": str(args.per_token)}
    client = ClientConfig(model=BUNDLED_MODEL, headers=headers)

    def group_request(text: str, seed: int) -> RolloutRequest:
        return RolloutRequest(
            env=ENV,
            task={"question": text, "answer": 0},
            client=client,
            sampling=SamplingConfig(max_tokens=args.max_tokens, seed=seed),
        )

    config = PlaneConfig(
        lanes={"train": args.lane},
        endpoints=phase.servers,
        placement=PlacementConfig(strategy=strategy),
        rollouts_per_worker=max(64, args.lane // 2),
    )
    async with RolloutPlane(config) as plane, httpx.AsyncClient(timeout=10.0) as http:
        warm = await plane.submit_group(group_request(f"warm-up {name}", 0), n=args.group_size)
        await asyncio.wait_for(warm.wait(), PHASE_TIMEOUT_S)
        before = [await scrape(http, s) for s in servers]
        phase.busy = {s.base_url: [] for s in servers}
        stop = asyncio.Event()

        async def poll() -> None:
            while not stop.is_set():
                for server in servers:
                    totals = await scrape(http, server)
                    busy = totals.get("vllm:num_requests_running", 0) + totals.get(
                        "vllm:num_requests_waiting", 0
                    )
                    phase.busy[server.base_url].append(busy)
                await asyncio.sleep(POLL_S)

        poller = asyncio.create_task(poll())
        started = time.perf_counter()
        handles = [
            await plane.submit_group(group_request(text, 1000 * g), n=args.group_size)
            for g, text in enumerate(texts)
        ]
        groups = [await asyncio.wait_for(h.wait(), PHASE_TIMEOUT_S) for h in handles]
        phase.wall_s = time.perf_counter() - started
        stop.set()
        await poller
        after = [await scrape(http, s) for s in servers]
    for b, a in zip(before, after, strict=True):
        phase.hits += a.get("vllm:prefix_cache_hits_total", 0) - b.get("vllm:prefix_cache_hits_total", 0)
        phase.queries += a.get("vllm:prefix_cache_queries_total", 0) - b.get(
            "vllm:prefix_cache_queries_total", 0
        )
        phase.served.append(a.get("standin_requests_total", 0) - b.get("standin_requests_total", 0))
    for group in groups:
        for result in group.results:
            if result.kind == "ok":
                phase.ok += 1
            else:
                phase.failed.append(f"{result.kind}: {result.error.message[:120] if result.error else ''}")
    return phase


def row(phase: Phase) -> str:
    spread = len(phase.servers) > 1
    return (
        f"{phase.name:<13}{phase.hit_rate:>9.3f}"
        f"{(f'{phase.max_over_mean:.2f}' if spread else '-'):>10}"
        f"{(f'{phase.served_ratio:.2f}' if spread else '-'):>8}"
        f"{(phase.queries - phase.hits) / 1000:>10.1f}{phase.wall_s:>9.1f}{phase.ok:>6}{len(phase.failed):>7}"
    )


async def main(args: argparse.Namespace) -> None:
    tokenizer = load_tokenizer()
    options = StandinOptions(kv_cache_tokens=args.kv_tokens, prefill_token_latency_s=args.prefill)
    unbounded = StandinOptions(kv_cache_tokens=args.kv_tokens * 64, prefill_token_latency_s=args.prefill)
    launched = [
        StandinServer(options, ready_timeout_s=STARTUP_S).start(wait=False) for _ in range(args.servers)
    ]
    launched.append(StandinServer(unbounded, ready_timeout_s=STARTUP_S).start(wait=False))
    try:
        for server in launched:
            server.wait_ready()
        servers, reference = launched[:-1], launched[-1]
        print(
            f"{args.servers} stand-ins x {args.kv_tokens} KV tokens, {args.groups} groups of {args.group_size}, "
            f"~{args.prompt_tokens}-token prompts, {args.lane} in flight, prefill {args.prefill:g} s/token, "
            f"call {args.latency:g} s + {args.per_token:g} s/token x <= {args.max_tokens}",
            flush=True,
        )
        print(
            f"{'placement':<13}{'hit rate':>9}{'max/mean':>10}{'served':>8}{'prefill k':>10}{'wall s':>9}"
            f"{'ok':>6}{'failed':>7}",
            flush=True,
        )
        phases: dict[str, Phase] = {}
        plan: dict[str, tuple[Strategy, list[StandinServer]]] = {
            "least_loaded": ("least_loaded", servers),
            "hashed": ("hashed", servers),
            "prefix": ("prefix", servers),
            "reference": ("least_loaded", [reference]),
        }
        for seed, name in enumerate(args.phases.split(","), start=1):
            strategy, targets = plan[name]
            texts = questions(tokenizer, args.groups, args.prompt_tokens, seed)
            phases[name] = await run_phase(name, strategy, targets, texts, args)
            print(row(phases[name]), flush=True)
            for line in phases[name].failed[:3]:
                print(f"  {line}", flush=True)
    finally:
        for server in launched:
            server.close()
    prefix, least, ref = phases["prefix"], phases["least_loaded"], phases["reference"]
    print(f"prefix hit rate / one unbounded server's: {prefix.hit_rate / ref.hit_rate:.3f} (target >= 0.9)")
    print(f"prefix max/mean load: {prefix.max_over_mean:.2f} (target <= 1.25)")
    print(f"prefix wall / least-loaded wall: {prefix.wall_s / least.wall_s:.2f} (target <= 1.0)")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="8 groups, 32 in flight")
    parser.add_argument(
        "--phases",
        default="least_loaded,hashed,prefix,reference",
        help="which phases, in this order (the last lines need prefix, least_loaded and reference)",
    )
    parser.add_argument("--servers", type=int, default=4)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--lane", type=int, default=64)
    parser.add_argument("--kv-tokens", type=int, default=131_072)
    parser.add_argument("--latency", type=float, default=0.2)
    parser.add_argument("--per-token", type=float, default=0.02)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prefill", type=float, default=5e-5)  # a 2k prompt in 0.1 s
    args = parser.parse_args(argv)
    if args.quick:
        args.groups, args.lane = 8, 32
    return args


def start_ray(attempts: int = 3) -> None:
    """A private local Ray, never someone else's cluster. Ray gives its raylet 30 s to register, which a
    niced start on a busy machine can miss: try again."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
            return
        except Exception:
            ray.shutdown()
            if attempt == attempts:
                raise


if __name__ == "__main__":
    arguments = parse()
    start_ray()
    try:
        asyncio.run(main(arguments))
    finally:
        ray.shutdown()
