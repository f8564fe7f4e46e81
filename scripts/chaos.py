"""Chaos: R rollouts through the plane on a multi-node Ray cluster on this machine, under seeded kills.

    python scripts/chaos.py [--rollouts 2000] [--group-size 4] [--concurrency 256] [--seed 0]
                            [--latency 0.5] [--hang-timeout 10] [--quick] [--no-baseline]

The cluster (`ray.cluster_utils.Cluster`, its own temp dir, so no other `ray.init()` on the machine joins
it) has a head node that holds only the two stand-in inference servers (an `InferenceServerSet` with
`kind="standin"`, started before any other node exists) and three worker nodes for the plane's rollout
workers (SPREAD), env servers and renderers. The workload is the bundled multi-turn tool environment
(`CalculatorEnv`: a calculator tool call, then the boxed answer) in token mode, submitted as groups.

The same workload runs twice on the same cluster, each time on a fresh plane: once without kills (the
baseline) and once under a kill schedule drawn from `--seed` over the middle of the baseline's length:
SIGKILL of 2 rollout workers, 2 env servers and 2 renderers; SIGSTOP of a rollout worker for
hang_timeout_s + 5 s; SIGKILL of one stand-in (its server set replaces it); and a whole worker node
removed (`cluster.remove_node`), chosen among those that hold a rollout worker and none of the plane's
pool actors (losing those is issue 17's business, not this run's).

It prints kills by kind, results by kind (and failure type), the poison rows (when each was answered, what
each dispatch lost), re-dispatches, quarantines, duplicates dropped, restarts
against their budgets, p50/p99/max latency (submission to answer) with and without kills, the env
sessions and renderer slots still held 10 s after the last result, the targets met or missed, and as
its last line `answered exactly once: n/R`. Every rollout is healthy, so a target is that none answers
`env`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import ray
import ray._private.utils as ray_utils
from ray.cluster_utils import Cluster

from env_actors.config import EnvPoolConfig
from renderer_actors.config import RendererPoolConfig, RendererPoolStats
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec
from rollout_actors.inference.server_set import InferenceServerSet
from rollout_actors.kernel.supervision import RestartIntensity
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.plane.stats import PlaneStats
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig

CALC = Ref(target="env_actors.examples.calculator_env:CalculatorEnv")
WORKER_NODES = 3
WORKERS = 4  # rollout workers, spread over the worker nodes
WORKER_NODE_CPUS = 4  # logical: the actors mostly wait; the machine has two real cores
HELD_CHECK_AFTER_S = 10.0
RUN_DEADLINE_S = 1800.0  # a run that has not answered everything by then is a failure, not a wait
RESTARTS = RestartIntensity(max_restarts=6, window_s=60.0)
"""The env servers' and the renderers' budgets: the schedule kills two of each, the node it removes may
hold more, and growth draws on the same budget (docs/design.md contract 9). The run measures recovery; a spent
budget has tests of its own (`test_env_pool`, `test_renderer_pool`)."""


def spent_losses(result: Result) -> bool:
    """The result answers a request whose dispatches each lost a part of ours (the re-dispatch budget
    spent, or a poison request): read from its typed failure, not its message."""
    error = result.error
    return error is not None and bool(error.losses) and len(error.losses) == result.attempts


KILLS = [
    "worker SIGKILL",
    "worker SIGKILL",
    "env server SIGKILL",
    "env server SIGKILL",
    "renderer SIGKILL",
    "renderer SIGKILL",
    "worker SIGSTOP",
    "stand-in SIGKILL",
    "node removed",
]


@dataclass
class RunOutcome:
    wall_s: float
    started_at: float
    """When it began (wall clock), for the times of the rows it reports."""
    latencies: list[float]
    results: dict[str, list[Result]]
    """request id -> every result that reached the caller for it (exactly one, if all is well)."""
    stats: PlaneStats | None
    env_pool: Any
    renderer_pool: RendererPoolStats | None
    held: dict[str, int] = field(default_factory=dict)
    kills: list[tuple[float, str, str]] = field(default_factory=list)
    """(seconds into the run, kind, what exactly)."""
    standin_in_flight: int = 0
    """Rollouts pinned to the stand-in when it was killed."""


# ------------------------------------------------------------------------------------------ cluster


def start_cluster(temp_dir: str) -> Cluster:
    """A head node only (the stand-ins go there); worker nodes are added by `add_worker_nodes`."""
    original = ray_utils.write_ray_address
    # The cluster would record its address in /tmp/ray, where every plain `ray.init()` on this machine
    # (other people's test runs) would find and join it. Keep it in this run's own temp dir.
    ray_utils.write_ray_address = lambda address, _=None: original(address, temp_dir)
    try:
        return Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 1,
                "temp_dir": temp_dir,
                "include_dashboard": False,
                "object_store_memory": 200 * 1024 * 1024,
            },
        )
    finally:
        ray_utils.write_ray_address = original


def add_worker_nodes(cluster: Cluster) -> None:
    for _ in range(WORKER_NODES):
        cluster.add_node(num_cpus=WORKER_NODE_CPUS, object_store_memory=150 * 1024 * 1024)
    cluster.wait_for_nodes()


def actors_by_node() -> dict[str, list[str]]:
    """Node id -> class names of the live actors on it (from the GCS: no dashboard needed)."""
    placed: dict[str, list[str]] = defaultdict(list)
    for info in ray._private.state.actors().values():
        if info.get("State") == "ALIVE":
            placed[info["Address"]["NodeID"]].append(info.get("ActorClassName", "?"))
    return placed


# ------------------------------------------------------------------------------------------ running


def plane_config(args: argparse.Namespace) -> PlaneConfig:
    return PlaneConfig(
        lanes={"train": args.concurrency, "eval": 1},
        workers=WORKERS,
        # Sized with half again the even share: a survivor absorbs some of a lost worker's rollouts, and
        # the rest wait for its replacement instead of piling onto one worker (which the next kill takes).
        rollouts_per_worker=max(1, args.concurrency * 3 // (2 * WORKERS)),
        worker_num_cpus=0.5,
        hang_timeout_s=args.hang_timeout,
        probe_interval_s=1.0,
        max_dispatches=3,
        env_pool=EnvPoolConfig(
            min_servers=3,
            max_servers=6,
            num_cpus=0.25,
            hang_timeout_s=args.hang_timeout,
            restart=RESTARTS,
        ),
        renderer_pool=RendererPoolConfig(restart=RESTARTS),
    )


def request(args: argparse.Namespace, group: int) -> RolloutRequest:
    return RolloutRequest(
        env=CALC,
        task_index=group % 300,
        client=ClientConfig(model=BUNDLED_MODEL),
        sampling=SamplingConfig(max_tokens=128, seed=args.seed * 100_000 + group * args.group_size),
        mode="token",
        timeout_s=600.0,
    )


async def run(args: argparse.Namespace, servers: InferenceServerSet, chaos: Chaos | None) -> RunOutcome:
    async with RolloutPlane(plane_config(args), servers=servers) as plane:
        groups = args.rollouts // args.group_size
        latencies: list[float] = []
        results: dict[str, list[Result]] = defaultdict(list)

        async def consume(handle: Any, submitted: float) -> None:
            async for result in handle:
                latencies.append(time.monotonic() - submitted)
                results[result.request_id].append(result)

        started, started_at = time.monotonic(), time.time()
        consumers = []
        schedule = asyncio.ensure_future(chaos(plane, started)) if chaos is not None else None
        for group in range(groups):
            submitted = time.monotonic()
            handle = await plane.submit_group(request(args, group), n=args.group_size)
            consumers.append(asyncio.ensure_future(consume(handle, submitted)))
        await asyncio.wait_for(asyncio.gather(*consumers), RUN_DEADLINE_S)
        wall = time.monotonic() - started
        outcome = RunOutcome(
            wall_s=wall,
            started_at=started_at,
            latencies=latencies,
            results=results,
            stats=None,
            env_pool=None,
            renderer_pool=None,
        )
        if schedule is not None and chaos is not None:
            await schedule
            outcome.kills, outcome.standin_in_flight = chaos.kills, chaos.standin_in_flight
        await asyncio.sleep(HELD_CHECK_AFTER_S)  # then nothing may be held any more
        outcome.held = await held(plane)
        outcome.stats = plane.stats()
        outcome.env_pool = await ray.get_actor(plane.names.env_pool(CALC)).stats.remote()
        outcome.renderer_pool = await ray.get_actor(plane.names.renderer_pool).stats.remote()
    return outcome


async def held(plane: RolloutPlane) -> dict[str, int]:
    """Env sessions (by the pool's count and by its servers') and renderer slots the plane still holds."""
    stats = await ray.get_actor(plane.names.env_pool(CALC)).stats.remote()
    on_servers = 0
    for server in stats.servers:
        with contextlib.suppress(Exception):
            health = await asyncio.wait_for(ray.get_actor(server.name).health.remote(), 10)
            on_servers += health.sessions
    renderer = await ray.get_actor(plane.names.renderer_pool).stats.remote()
    return {
        "env sessions (pool)": stats.sessions,
        "env sessions (servers)": on_servers,
        "renderer slots": renderer.slots,
    }


# -------------------------------------------------------------------------------------------- chaos


class Chaos:
    """The seeded kill schedule of one run. Targets are chosen when each kill fires, among the live."""

    def __init__(
        self, args: argparse.Namespace, cluster: Cluster, servers: InferenceServerSet, span_s: float
    ):
        self.args, self.cluster, self.servers = args, cluster, servers
        self.rng = random.Random(args.seed)
        # One kill per slot of the middle of the run, at a random point of its slot: spread, seeded.
        start, width = 0.1 * span_s, 0.7 * span_s / len(KILLS)
        times = [start + (i + self.rng.random()) * width for i in range(len(KILLS))]
        kinds = list(KILLS)
        self.rng.shuffle(kinds)
        self.schedule = list(zip(times, kinds, strict=True))
        self.kills: list[tuple[float, str, str]] = []
        self.standin_in_flight = 0
        self._stopped: list[asyncio.Task[None]] = []

    async def __call__(self, plane: RolloutPlane, started: float) -> None:
        for at, kind in self.schedule:
            await asyncio.sleep(max(0.0, started + at - time.monotonic()))
            try:
                what = await KILL_KINDS[kind](self, plane)
            except Exception as exc:  # a target that vanished meanwhile: say so, go on
                what = f"not done: {type(exc).__name__}: {exc}"
            self.kills.append((time.monotonic() - started, kind, what))
            print(f"  {time.monotonic() - started:6.1f} s  {kind:<18} {what}", flush=True)
        await asyncio.gather(*self._stopped)

    async def _worker_pid(self, plane: RolloutPlane) -> tuple[Any, int]:
        """A live worker and its pid (one killed a moment ago may still be listed: try another)."""
        candidates = list(plane._workers.live())
        self.rng.shuffle(candidates)
        for slot in candidates:
            with contextlib.suppress(Exception):
                info = await asyncio.wait_for(slot.handle.ping.remote(), 10)
                return slot, info.pid
        raise RuntimeError("no rollout worker answered")

    async def kill_worker(self, plane: RolloutPlane) -> str:
        slot, pid = await self._worker_pid(plane)
        held = slot.in_flight
        os.kill(pid, signal.SIGKILL)
        return f"{slot.name} (pid {pid}) with {held} rollouts"

    async def stop_worker(self, plane: RolloutPlane) -> str:
        slot, pid = await self._worker_pid(plane)
        held = slot.in_flight
        os.kill(pid, signal.SIGSTOP)
        frozen_s = self.args.hang_timeout + 5.0

        async def thaw() -> None:
            await asyncio.sleep(frozen_s)
            with contextlib.suppress(ProcessLookupError):  # the plane killed it as wedged: as it should
                os.kill(pid, signal.SIGCONT)
            print(
                f"           worker SIGSTOP      {slot.name}: {slot.gone.result()[0] if slot.gone.done() else 'still judged alive'}",
                flush=True,
            )

        self._stopped.append(asyncio.ensure_future(thaw()))
        return f"{slot.name} (pid {pid}) with {held} rollouts, for {frozen_s:g} s"

    async def kill_env_server(self, plane: RolloutPlane) -> str:
        stats = await ray.get_actor(plane.names.env_pool(CALC)).stats.remote()
        candidates = [w for w in stats.servers if w.state == "ready" and w.pid]
        self.rng.shuffle(candidates)
        for server in candidates:  # one lost a moment ago (its node) may still be listed
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.pid, signal.SIGKILL)
                return f"{server.name.rsplit('.', 1)[-1]} (pid {server.pid}) with {server.sessions} sessions"
        raise RuntimeError("no live env server")

    async def kill_renderer(self, plane: RolloutPlane) -> str:
        pool = ray.get_actor(plane.names.renderer_pool)
        for _ in range(50):  # the first renderer starts with the first token-mode rollout
            keys = (await pool.stats.remote()).keys
            if keys:
                break
            await asyncio.sleep(0.2)
        else:
            raise RuntimeError("no renderer started yet")
        key_json = next(iter(keys))
        slot = await pool.acquire.remote(key_json)
        try:
            pid = (await asyncio.wait_for(slot.renderer.health.remote(), 10)).pid
        finally:
            await pool.release.remote(slot.slot_id)
        os.kill(pid, signal.SIGKILL)
        return f"{slot.renderer_id} (pid {pid})"

    async def kill_standin(self, plane: RolloutPlane) -> str:
        status = self.rng.choice([s for s in self.servers.status() if s.state == "ready" and s.pid])
        self.standin_in_flight = plane._endpoint_load[status.url]
        os.killpg(status.pid, signal.SIGKILL)
        return f"{status.url} (pid {status.pid}) with {self.standin_in_flight} rollouts pinned to it"

    async def remove_node(self, plane: RolloutPlane) -> str:
        placed = actors_by_node()
        pools = {"RendererPool", "EnvPool", "InferenceServer"}
        nodes = [n for n in self.cluster.worker_nodes if "RolloutWorker" in placed.get(n.node_id, [])]
        safe = [n for n in nodes if not pools & set(placed.get(n.node_id, []))]
        node = self.rng.choice(safe or nodes)
        on_it = Counter(placed.get(node.node_id, []))
        self.cluster.remove_node(node, allow_graceful=False)
        note = "" if safe else " (every such node held a pool actor: removed one anyway)"
        return f"node {node.node_id[:8]} with {dict(on_it)}{note}"


KILL_KINDS: dict[str, Callable[[Chaos, RolloutPlane], Awaitable[str]]] = {
    "worker SIGKILL": Chaos.kill_worker,
    "worker SIGSTOP": Chaos.stop_worker,
    "env server SIGKILL": Chaos.kill_env_server,
    "renderer SIGKILL": Chaos.kill_renderer,
    "stand-in SIGKILL": Chaos.kill_standin,
    "node removed": Chaos.remove_node,
}


# ------------------------------------------------------------------------------------------- report


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(
    args: argparse.Namespace, base: RunOutcome | None, chaos: RunOutcome, servers: InferenceServerSet
) -> None:
    R = args.rollouts
    final = [answers[0] for answers in chaos.results.values() if answers]
    print("\nkills by kind")
    for kind, count in Counter(
        kind for _, kind, what in chaos.kills if not what.startswith("not done")
    ).items():
        print(f"  {kind:<20} {count}")
    print("\nresults by kind (chaos run)")
    by_kind = Counter(r.kind for r in final)
    by_type = Counter((r.kind, r.error.type if r.error else "-") for r in final if r.kind != "ok")
    for kind, count in sorted(by_kind.items()):
        print(f"  {kind:<16} {count}")
    examples = {(r.kind, r.error.type): r.error.message for r in final if r.error is not None}
    for (kind, type_), count in sorted(by_type.items()):
        print(f"    {kind}/{type_:<28} {count:>5}   e.g. {examples[kind, type_][:150]}")
    spent = [r for r in final if spent_losses(r)]
    if spent:
        print("  re-dispatch budget spent (or poison), by what each dispatch lost:")
        paths = Counter(
            " -> ".join(f"{loss.part} {loss.how}" for loss in r.error.losses) for r in spent if r.error
        )
        for path, count in paths.most_common():
            print(f"    {count:>5}  {path}")
    poison = [r for r in final if r.error is not None and r.error.fault == "poison"]
    if poison:
        print("  poison rows (answered at, s into the run; what each dispatch lost):")
        for r in sorted(poison, key=lambda r: r.finished_at or 0.0):
            at = (r.finished_at or chaos.started_at) - chaos.started_at
            chain = " -> ".join(f"{loss.describe()} (culprit {loss.culprit})" for loss in r.error.losses)
            print(f"    {at:7.1f} s  {r.kind:<15} {chain}")
    attempts = Counter(r.attempts for r in final)
    stats = chaos.stats
    assert stats is not None  # the run records them before it returns
    print("\nre-dispatches and duplicates")
    print(
        f"  re-dispatched          {stats.redispatched}  (results by attempts: {dict(sorted(attempts.items()))})"
    )
    print(f"  duplicates dropped     {stats.duplicates_dropped}")
    quarantined = stats.counters.get("quarantined", 0)
    print(f"  quarantined            {quarantined}  (dispatched alone on an env server of its own)")
    print(f"  rollout workers lost   {stats.workers_lost}")
    pool = chaos.env_pool
    print("\nrestarts vs budget")
    print(
        f"  env servers            {pool.deaths} deaths, {pool.spawns} spawns ({pool.spawn_failures} failed), "
        f"{pool.restarts_left} of {RESTARTS.max_restarts} restarts left in {RESTARTS.window_s:g} s, "
        f"{pool.budget_denials} denials"
    )
    rp = chaos.renderer_pool
    replaced, spawned = (rp.replaced, rp.spawned) if rp is not None else (0, 0)
    print(
        f"  renderers              {replaced} replaced, {spawned} spawned "
        f"(budget {RESTARTS.max_restarts} in {RESTARTS.window_s:g} s, growth included)"
    )
    print(
        f"  inference servers      {servers.restarts} restarted (budget {servers.supervisor.budget.intensity.max_restarts} in {servers.supervisor.budget.intensity.window_s:g} s)"
    )
    print("\nlatency, submission to answer (s)      p50      p99      max     wall")
    rows = ([("without kills", base)] if base is not None else []) + [("with kills", chaos)]
    for name, outcome in rows:
        lat = outcome.latencies
        print(
            f"  {name:<34} {pct(lat, 0.5):8.1f} {pct(lat, 0.99):8.1f} {max(lat):8.1f} {outcome.wall_s:8.1f}"
        )
    print(f"\nheld {HELD_CHECK_AFTER_S:g} s after the last result (chaos run)")
    for what, count in chaos.held.items():
        print(f"  {what:<24} {count}")

    once = sum(1 for answers in chaos.results.values() if len(answers) == 1)
    model = by_kind.get("model", 0)
    budget_spent = len(spent)
    other = len(final) - by_kind.get("ok", 0) - model - budget_spent
    print("\ntargets")
    print(f"  {'met ' if once == R else 'MISS'} every request answered exactly once: {once}/{R}")
    print(
        f"  {'met ' if other == 0 else 'MISS'} ok unless its server died or a budget was spent: "
        f"{by_kind.get('ok', 0)} ok, {model} model (the killed stand-in had {chaos.standin_in_flight} "
        f"in flight), {budget_spent} re-dispatch budget spent, {other} other"
    )
    # Every rollout is healthy (the calculator environment): `env` would be a trainer masking our kills
    # as the environment's bug (docs/design.md contract 5: a death nobody was named for never makes poison).
    env_kind = by_kind.get("env", 0)
    print(f"  {'met ' if env_kind == 0 else 'MISS'} no healthy rollout answered `env`: {env_kind}")
    leaked = sum(chaos.held.values())
    print(
        f"  {'met ' if leaked == 0 else 'MISS'} nothing held {HELD_CHECK_AFTER_S:g} s after the last result: {leaked}"
    )
    if base is not None:
        ratio = pct(chaos.latencies, 0.99) / pct(base.latencies, 0.99)
        print(f"  {'met ' if ratio <= 2 else 'MISS'} p99 with kills <= 2x p99 without: {ratio:.2f}x")
    print(f"answered exactly once: {once}/{R}")


# --------------------------------------------------------------------------------------------- main


async def main_async(args: argparse.Namespace, cluster: Cluster) -> None:
    spec = ServerSpec(kind="standin", model=BUNDLED_MODEL, num_cpus=0.5, standin={"latency_s": args.latency})
    servers = InferenceServerSet(spec, replicas=2, probe_interval_s=2.0)
    began = time.monotonic()
    await servers.start()
    add_worker_nodes(cluster)
    print(
        f"cluster: head (stand-ins) + {WORKER_NODES} worker nodes; servers {servers.endpoints()}", flush=True
    )
    try:
        base = None
        if not args.no_baseline:
            print(f"baseline: {args.rollouts} rollouts, no kills", flush=True)
            base = await run(args, servers, None)
            print(f"  {base.wall_s:.1f} s", flush=True)
        span = base.wall_s if base is not None else args.rollouts / args.concurrency * 4 * args.latency + 20
        chaos = Chaos(args, cluster, servers, span)
        print(f"chaos: {args.rollouts} rollouts, seed {args.seed}", flush=True)
        outcome = await run(args, servers, chaos)
        print(f"  placement at the end: { {n[:8]: dict(Counter(c)) for n, c in actors_by_node().items()} }")
        report(args, base, outcome, servers)
        print(f"(whole run, cluster start included: {time.monotonic() - began:.0f} s)", file=sys.stderr)
    finally:
        await servers.aclose()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=2000, help="R (default 2000)")
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=256, help="the train lane's bound")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.5, help="seconds per model call")
    parser.add_argument("--hang-timeout", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="R=400")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run without kills")
    args = parser.parse_args()
    if args.quick:
        args.rollouts = 400
    return args


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.ERROR)
    temp_dir = tempfile.mkdtemp(prefix="chaos-ray-", dir="/tmp")
    cluster = start_cluster(temp_dir)
    try:
        ray.init(address=cluster.address, logging_level=logging.ERROR, log_to_driver=False)
        asyncio.run(main_async(args, cluster))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
