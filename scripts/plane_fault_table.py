"""Plane fault table: each actor the plane holds one of, lost while rollouts run, and how fast it recovers.

    python scripts/plane_fault_table.py             # starts a local Ray (or joins RAY_ADDRESS) and a stand-in
    python scripts/plane_fault_table.py --requests  # only the second table (failures that follow the request)

One plane, two environments (so two env pools), a renderer pool. For each singleton, rollouts are put in
flight (holding env sessions and renderer leases), then the singleton is killed (`ray.kill`) or frozen
(SIGSTOP: wedged, found by its hang timeout). Each row says what the rollouts in flight ended as, how
many were re-dispatched under their lease, how long from the loss until the plane's supervisor had a
replacement serving (`restart`; a frozen pool is first found by its hang timeout), and how long until a rollout submitted after the loss ended `ok` (`recover`: new
rollouts are submitted one after another from the moment of the loss until one is `ok`). A row whose
requests were not each answered exactly once, or whose plane never served again, prints BROKEN and makes
the script exit 1. Timings are reported, not asserted. The last line is `slowest recovery: <seconds> s`.

A second table times failures that follow the request, not the part (docs/design.md contracts 5 and 8): an
environment that blocks its loop in every step (a poison request: answered after two env servers, within
2 x `hang_timeout_s` + a spawn), sixteen of them among 64 healthy rollouts of one pool of 8 servers
(within 4 rounds of a hang timeout and a spawn: each server sees 2 x 16 / 8 wedges in a row), and renderer keys
that cannot load (every rollout of the key answered at once, not re-dispatched; the hub case waits at most
`RAY_ROLLOUTS_HUB_TIMEOUT_S`). Its env pools run on the default restart budget. Each row: how the
rollouts ended, dispatches, env servers lost (and of those, how many were replaced outside the restart
budget because a known request's call wedged them), the pool's restarts left, and the seconds from submit
until the last of them was answered.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any

import ray

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.standin import StandinOptions, StandinServer
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.plane.pool_supervisor import SupervisedPool
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

MATH = Ref(target="env_actors.examples.math_env:MathEnv")
ECHO = Ref(target="env_actors.faults.envs:EchoEnv")
IN_FLIGHT = 8  # rollouts holding sessions and leases when the singleton is lost
LATENCY_S = 1.5  # per model call: long enough that the loss lands mid-rollout
HANG_TIMEOUT_S = 3.0  # the pools' hang timeout here (production: 30 s), so a frozen pool is found fast
STATS_TIMEOUT_S = 30.0  # a pool that cannot say its stats in this long is hung: the script fails, never waits
CASE_DEADLINE_S = 120.0  # a case that takes longer has a stalled future somewhere: the bug we hunt


ENV_HANG_TIMEOUT_S = 2.0  # the env pools' hang timeout in the second table
BLOCKS = "env_actors.faults.envs:BlocksLoopEnv"
POISON, HEALTHY = 16, 64
BLOCKS_POOL = {"min_servers": 8, "max_servers": 8, "multiplex": 8}
"""The blocking environment's pools (both rows), as in `tests/test_poison.py`: every server started
with the pool (growth would spend the budget the mixed row is about), a multiplex that spreads 80
sessions over them. On the default pool (one server, multiplex 64, growing to two) every re-dispatch
piled onto the one ready server while its replacement started: measured, one wedge at a time, 32 in a
row, 166 s."""


@dataclass
class RequestRow:
    case: str
    ended: str
    dispatches: str
    servers_lost: int | None
    blamed: int | None
    """Servers wedged by a known request's call, replaced outside the restart budget."""
    restarts_left: int | None
    answered_s: float
    target_s: float
    broken: str = ""


@dataclass
class Row:
    case: str
    in_flight: str
    redispatched: int
    restart_s: float | None
    recover_s: float | None
    broken: str = ""


def request(base_url: str, env: Ref, latency_s: float, index: int) -> RolloutRequest:
    headers = {"X-Standin-Latency": str(latency_s)} if latency_s else {}
    client = ClientConfig(base_url=base_url, model=BUNDLED_MODEL, headers=headers)
    sampling = SamplingConfig(max_tokens=32, seed=index)
    return RolloutRequest(env=env, task_index=index % 8, client=client, sampling=sampling)


async def holding(plane: RolloutPlane, env: Ref, count: int) -> None:
    """Until `count` rollouts hold an env session (and, in token mode, a renderer lease)."""
    env_pool, renderer_pool = plane._pools.supervisor(env).current(), plane._pools.supervisor().current()
    while (await env_pool.stats.remote()).sessions < count or (
        await renderer_pool.stats.remote()
    ).slots < count:
        await asyncio.sleep(0.05)


def kill(handle: Any) -> None:
    ray.kill(handle, no_restart=True)


def freeze(handle: Any) -> None:
    os.kill(ray.get(handle.health.remote(), timeout=30).pid, signal.SIGSTOP)


async def case(
    plane: RolloutPlane, base_url: str, name: str, env: Ref, pool: SupervisedPool, lose: Callable[[Any], None]
) -> Row:
    before = plane.stats().redispatched
    incarnation = pool.incarnation
    ids = [await plane.submit(request(base_url, env, LATENCY_S, i)) for i in range(IN_FLIGHT)]
    await holding(plane, env, IN_FLIGHT)
    lost_at = time.monotonic()
    lose(pool.current())
    results: dict[str, Any] = {}
    recover_s = None
    while recover_s is None:  # new rollouts, one after another, until one is ok
        probe = await plane.submit(request(base_url, env, 0.0, len(results)))
        while probe not in results:
            result = await plane.next_result(timeout=CASE_DEADLINE_S)
            if result.request_id in results:
                return Row(name, "", 0, None, None, broken=f"{result.request_id} answered twice")
            results[result.request_id] = result
        if results[probe].kind == "ok":
            recover_s = time.monotonic() - lost_at
    while not all(i in results for i in ids):
        result = await plane.next_result(timeout=CASE_DEADLINE_S)
        if result.request_id in results:
            return Row(name, "", 0, None, None, broken=f"{result.request_id} answered twice")
        results[result.request_id] = result
    kinds = Counter(results[i].kind for i in ids)
    restart_s = (
        pool.serving_since - lost_at if pool.incarnation > incarnation and pool.serving_since else None
    )
    return Row(
        name,
        ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())),
        plane.stats().redispatched - before,
        restart_s,
        recover_s,
        broken="" if pool.incarnation > incarnation else "not restarted",
    )


async def run_cases(base_url: str) -> list[Row]:
    config = PlaneConfig(
        lanes={"train": 64},
        workers=2,
        worker_num_cpus=0.25,
        env_pool={"num_cpus": 0.25},
        allowed_ref_prefixes=("env_actors.examples.", "env_actors.faults."),
        pool_supervision={"probe_interval_s": 0.2, "hang_timeout_s": HANG_TIMEOUT_S},
    )
    rows = []
    frozen: list[int] = []
    async with RolloutPlane(config) as plane:
        for env in (MATH, ECHO):  # both env pools up, the renderer pool warm
            await plane.submit(request(base_url, env, 0.0, 0))
            await plane.next_result(timeout=CASE_DEADLINE_S)
        pools = plane._pools
        cases = [
            ("renderer pool killed", MATH, pools.supervisor(), kill),
            ("env pool (math) killed", MATH, pools.supervisor(MATH), kill),
            ("env pool (echo) killed", ECHO, pools.supervisor(ECHO), kill),
            ("renderer pool frozen (SIGSTOP)", MATH, pools.supervisor(), freeze),
            ("env pool (math) frozen (SIGSTOP)", MATH, pools.supervisor(MATH), freeze),
        ]
        for name, env, pool, lose in cases:
            if lose is freeze:
                frozen.append(ray.get(pool.current().health.remote(), timeout=30).pid)
            try:
                rows.append(
                    await asyncio.wait_for(case(plane, base_url, name, env, pool, lose), CASE_DEADLINE_S)
                )
            except TimeoutError:
                rows.append(Row(name, "", 0, None, None, broken=f"no recovery within {CASE_DEADLINE_S:g} s"))
                break  # the plane is in an unknown state: later rows would measure the wreck
    for pid in frozen:  # killed by the supervisor already; a stray one must not stay frozen
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return rows


async def answered(plane: RolloutPlane, requests: list[RolloutRequest]) -> tuple[list[Any], float]:
    """Submit them all, then wait for every result: (results, seconds from the first submit to the last)."""
    started = time.monotonic()
    for one in requests:
        await plane.submit(one)
    results = [await plane.next_result(timeout=CASE_DEADLINE_S) for _ in requests]
    return results, time.monotonic() - started


def ended(results: list[Any]) -> str:
    kinds = Counter(f"{r.kind}/{r.error.fault}" if r.error else r.kind for r in results)
    return ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))


async def env_pool_stats(plane: RolloutPlane, env: Ref) -> Any:
    return await asyncio.wait_for(plane._pools.supervisor(env).current().stats.remote(), STATS_TIMEOUT_S)


async def run_request_cases(base_url: str) -> list[RequestRow]:
    env_pool = {
        "num_cpus": 0.1,
        "hang_timeout_s": ENV_HANG_TIMEOUT_S,
        "probe_interval_s": 0.2,
        "probe_timeout_s": 1.0,
    }
    config = PlaneConfig(
        lanes={"train": 128},
        workers=2,
        worker_num_cpus=0.25,
        allowed_ref_prefixes=("env_actors.examples.", "env_actors.faults."),
        env_pool=env_pool,
        env_pools={BLOCKS: {**env_pool, **BLOCKS_POOL}},
    )
    rows = []
    spawn_s = 10.0  # replacement env servers' process start and load, on a loaded machine
    async with RolloutPlane(config) as plane:
        poison_alone = Ref(target=BLOCKS, config={"num_tasks": 2})
        await plane._pools.ensure_env_pool(poison_alone)
        results, took = await answered(plane, [request(base_url, poison_alone, 0.0, 0)])
        ok = results[0].kind == "env" and results[0].error.fault == "poison"
        stats = await env_pool_stats(plane, poison_alone)
        rows.append(
            RequestRow(
                "env blocks its loop in every step",
                ended(results),
                str(results[0].attempts),
                stats.deaths,
                stats.culprit_replacements,
                stats.restarts_left,
                took,
                2 * ENV_HANG_TIMEOUT_S + spawn_s,
                "" if ok else "not answered as poison",
            )
        )
        mixed = Ref(target=BLOCKS, config={"blocking_tasks": POISON, "num_tasks": POISON + HEALTHY})
        await plane._pools.ensure_env_pool(mixed)
        batch = [request(base_url, mixed, 0.0, i) for i in range(POISON + HEALTHY)]
        for i, one in enumerate(batch):
            batch[i] = one.model_copy(update={"task_index": i})
        results, took = await answered(plane, batch)
        healthy = [r for r in results if r.task_index >= POISON]
        stats = await env_pool_stats(plane, mixed)
        broken = "" if all(r.kind == "ok" for r in healthy) else "a healthy rollout failed"
        spent = stats.restarts_left == 0 or stats.budget_denials > 0
        broken = broken or ("restart budget exhausted" if spent else "")
        # Each poison request wedges two servers itself; a server holds one wedging call at a time (the
        # others on it are collateral), so one server sees ceil(2 x 16 / 8) = 4 wedges in a row, each its
        # hang timeout plus a replacement's spawn. 2 x hang + 2 spawns would need a server per request.
        rounds = -(-2 * POISON // BLOCKS_POOL["max_servers"])
        rows.append(
            RequestRow(
                f"  ... {POISON} of them among {HEALTHY} healthy (one pool, {BLOCKS_POOL['max_servers']} servers)",
                ended(results),
                "/".join(str(n) for n in sorted({r.attempts for r in results})),
                stats.deaths,
                stats.culprit_replacements,
                stats.restarts_left,
                took,
                rounds * (ENV_HANG_TIMEOUT_S + spawn_s),
                broken,
            )
        )
        # Its last replacements are still starting: the rows below time renderer loads, not their spawns.
        settled = time.monotonic() + CASE_DEADLINE_S
        while (await env_pool_stats(plane, mixed)).starting and time.monotonic() < settled:
            await asyncio.sleep(0.5)
        for case, tokenizer, target in (
            ("renderer key cannot load (no such path), 64 rollouts", "/nonexistent/tokenizer", 10.0),
            ("renderer key: a hub id not in local files, 64 rollouts", "Qwen/Qwen3-8B", 15.0),
        ):
            renderer = {"tokenizer": tokenizer}
            batch = [
                request(base_url, MATH, 0.0, i).model_copy(update={"renderer": renderer}) for i in range(64)
            ]
            batch = [RolloutRequest.model_validate(one.model_dump()) for one in batch]
            results, took = await answered(plane, batch)
            failed_once = all(r.kind != "ok" and r.attempts == 1 for r in results)
            rows.append(
                RequestRow(
                    case,
                    ended(results),
                    "/".join(str(n) for n in sorted({r.attempts for r in results})),
                    None,
                    None,
                    None,
                    took,
                    target,
                    "" if failed_once else "re-dispatched, or served",
                )
            )
    return rows


def print_request_table(rows: list[RequestRow]) -> None:
    width = max(len(r.case) for r in rows)
    kinds = max(len("ended"), *(len(r.ended) for r in rows))
    header = (
        f"{'follows the request':<{width}}  {'ended':<{kinds}}  dispatches  servers lost  off budget  "
        "restarts left  answered s  target s"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        lost, blamed, left = (
            f"{n:>{w}}" if n is not None else f"{'-':>{w}}"
            for n, w in ((r.servers_lost, 12), (r.blamed, 10), (r.restarts_left, 13))
        )
        line = (
            f"{r.case:<{width}}  {r.ended:<{kinds}}  {r.dispatches:>10}  {lost}  {blamed}  {left}  "
            f"{r.answered_s:10.1f}  {r.target_s:8.0f}"
        )
        print(line + (f"  BROKEN: {r.broken}" if r.broken else ""))


def print_table(rows: list[Row]) -> None:
    width = max(len(r.case) for r in rows)
    flight = max(len("in flight at the loss ended"), *(len(r.in_flight) for r in rows))
    header = (
        f"{'singleton lost':<{width}}  {'in flight at the loss ended':<{flight}}  re-dispatched  "
        "restart s  recover s"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        restart = f"{r.restart_s:9.2f}" if r.restart_s is not None else f"{'-':>9}"
        recover = f"{r.recover_s:9.2f}" if r.recover_s is not None else f"{'-':>9}"
        line = f"{r.case:<{width}}  {r.in_flight:<{flight}}  {r.redispatched:>13}  {restart}  {recover}"
        print(line + (f"  BROKEN: {r.broken}" if r.broken else ""))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--requests", action="store_true", help="only the second table (failures that follow the request)"
    )
    args = parser.parse_args()
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False, configure_logging=False)
    else:  # a private Ray: a plain `ray.init()` joins whatever cluster someone's `ray start` left running
        ray.init(
            address="local", num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False
        )
    with StandinServer(StandinOptions()) as standin:
        rows = [] if args.requests else asyncio.run(run_cases(standin.base_url))
        request_rows = asyncio.run(run_request_cases(standin.base_url))
    if rows:
        print_table(rows)
        print()
    print_request_table(request_rows)
    recovered = [r.recover_s for r in rows if r.recover_s is not None]
    print(f"slowest recovery: {max(recovered):.2f} s" if recovered else "slowest recovery: n/a s")
    return 1 if any(r.broken for r in [*rows, *request_rows]) else 0


if __name__ == "__main__":
    sys.exit(main())
