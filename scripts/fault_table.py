"""Fault table: what a caller of an EnvPool sees when environment workers fail, and how fast.

    python scripts/fault_table.py            # starts a local Ray (or joins RAY_ADDRESS), ~1 minute

Each case runs against real actors and real processes (SIGKILL, SIGSTOP, ray.kill, os._exit, blocked
event loops) and prints one or more rows: case, what the caller saw, seconds until it saw it, and the
target where the issue sets one. A case that does not behave (no failure where one was due, a stalled
future) prints BROKEN and makes the script exit 1. Timings are reported, not asserted. The last line is
`killed-worker call failed in: <seconds> s`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import ray

from env_actors.pool import EnvPoolConfig, EnvStartupError, close_env_pool, start_env_pool
from env_actors.session import EnvCallFailed, EnvSession
from rollout_actors.kernel.supervision import RestartIntensity
from rollout_actors.wire import Ref

ECHO = "env_actors.faults.envs:EchoEnv"
HANG_TIMEOUT_S = 2.0
FAST = dict(hang_timeout_s=HANG_TIMEOUT_S, probe_interval_s=0.2, probe_timeout_s=0.5)  # the wedge cases
PROBES = dict(probe_interval_s=0.2)  # every other case: deaths noticed fast, no false wedges on a busy box
CASE_DEADLINE_S = 60.0  # a case that takes longer has a stalled future somewhere: that is the bug we hunt
ASSISTANT = {"role": "assistant", "content": "ok"}


@dataclass
class Row:
    case: str
    saw: str
    seconds: float | None
    target_s: float | None = None
    broken: bool = False

    def verdict(self) -> str:
        if self.broken:
            return "BROKEN"
        if self.target_s is None or self.seconds is None:
            return ""
        return f"<= {self.target_s:g} s " + ("ok" if self.seconds <= self.target_s else "MISSED")


FAULT_PREFIXES = ("env_actors.examples.", "env_actors.faults.")  # the fault environments, named explicitly


def pool_config(**settings) -> EnvPoolConfig:
    return EnvPoolConfig(allowed_ref_prefixes=FAULT_PREFIXES, **settings)


def name() -> str:
    return f"fault-{uuid.uuid4().hex[:6]}"


def ref(target: str, **config) -> Ref:
    return Ref(target=target, config=config)


def short(exc: BaseException) -> str:
    text = getattr(getattr(exc, "failure", None), "type", None) or type(exc).__name__
    return f"{type(exc).__name__} ({text})" if text != type(exc).__name__ else text


async def pid_of(pool, worker: str) -> int:
    return next(w.pid for w in (await pool.stats.remote()).servers if w.name == worker)


async def replacement_serving(pool, old_worker: str, since: float) -> float:
    """Seconds from `since` until a new session opens on a worker other than `old_worker`."""
    while True:
        try:
            session = await EnvSession.open(pool, task_index=0, timeout=5)
            await session.close()
            if session.server_name != old_worker:
                return time.monotonic() - since
        except EnvCallFailed:
            pass
        await asyncio.sleep(0.05)


async def wait_for(check: Callable[[], Awaitable[bool]], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await check():
            return True
        await asyncio.sleep(0.05)
    return False


# --------------------------------------------------------------------------------------- cases


async def healthy() -> list[Row]:
    started = time.monotonic()
    pool = await start_env_pool(name(), ref("env_actors.examples.math_env:MathEnv"), pool_config(), 60)
    ready = time.monotonic() - started
    await close_env_pool(pool)
    return [Row("healthy pool", "ready (environment loaded, health answered)", ready)]


async def startup_failure(
    case: str, env: Ref, config: EnvPoolConfig, ready_timeout: float, target: float | None
):
    started = time.monotonic()
    try:
        pool = await start_env_pool(name(), env, config, ready_timeout)
    except EnvStartupError as exc:
        failure = exc.failure
        detail = f"{failure.type}: {failure.message}" if failure else str(exc)
        if failure and failure.fault == "caller":  # an import error: its cause is at the end
            detail = "..." + failure.message[-70:]
        return [Row(case, f"EnvStartupError: {detail[:90]}", time.monotonic() - started, target)]
    await close_env_pool(pool)
    return [Row(case, "started, but should have failed", None, broken=True)]


async def killed_worker() -> list[Row]:
    pool = await start_env_pool(name(), ref(ECHO, step_delay=30.0), pool_config(**PROBES), 60)
    try:
        session = await EnvSession.open(pool, task_index=0, timeout=5)
        step = asyncio.ensure_future(session.step(ASSISTANT, timeout=60))
        await asyncio.sleep(0.3)
        pid = await pid_of(pool, session.server_name)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        try:
            await step
            return [Row("worker SIGKILLed, call in flight", "call succeeded?!", None, broken=True)]
        except EnvCallFailed as exc:
            failed = time.monotonic() - killed
            saw = f"EnvCallFailed({exc.kind}, {exc.failure.type})"
        replaced = await replacement_serving(pool, session.server_name, killed)
        return [
            Row("worker SIGKILLed, call in flight", saw, failed, 0.2),
            Row("  ... replacement", "new session served by a new worker", replaced, 3.0),
        ]
    finally:
        await close_env_pool(pool)


async def wedged_worker() -> list[Row]:
    pool = await start_env_pool(name(), ref(ECHO, step_delay=30.0), pool_config(**FAST), 60)
    pid = None
    try:
        session = await EnvSession.open(pool, task_index=0, timeout=5)
        pid = await pid_of(pool, session.server_name)
        step = asyncio.ensure_future(session.step(ASSISTANT, timeout=60))
        await asyncio.sleep(0.3)
        frozen = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        try:
            await step
            return [Row("worker SIGSTOPped, call in flight", "call succeeded?!", None, broken=True)]
        except EnvCallFailed as exc:
            failed = time.monotonic() - frozen
            saw = f"EnvCallFailed({exc.kind}, {(exc.server_exit or '')[:40]})"
        replaced = await replacement_serving(pool, session.server_name, frozen)
        return [
            Row(f"worker SIGSTOPped (hang_timeout_s {HANG_TIMEOUT_S:g} s)", saw, failed, HANG_TIMEOUT_S + 1),
            Row("  ... replacement", "new session served by a new worker", replaced, HANG_TIMEOUT_S + 3),
        ]
    finally:
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await close_env_pool(pool)


async def blocked_loop() -> list[Row]:
    env = ref("env_actors.faults.envs:BlocksLoopEnv", block_s=30.0)
    pool = await start_env_pool(name(), env, pool_config(**FAST), 60)
    try:
        session = await EnvSession.open(pool, task_index=0, timeout=5)
        started = time.monotonic()
        try:
            await session.step(ASSISTANT, timeout=60)
            return [Row("env blocks its event loop", "call succeeded?!", None, broken=True)]
        except EnvCallFailed as exc:
            saw = f"EnvCallFailed({exc.kind}, {(exc.server_exit or '')[:40]})"
            return [Row("env blocks its event loop", saw, time.monotonic() - started, HANG_TIMEOUT_S + 1)]
    finally:
        await close_env_pool(pool)


async def dies_on_every_load() -> list[Row]:
    with tempfile.TemporaryDirectory() as attempts:
        env = ref("env_actors.faults.envs:DiesOnLoadEnv", attempts_dir=attempts)
        rows = await startup_failure("env dies on every load (budget 3)", env, pool_config(), 30, None)
        await asyncio.sleep(1.0)
        count = len(list(Path(attempts).iterdir()))
        rows.append(
            Row(
                "  ... respawns",
                f"{count} loads in all (1 + budget of 3), then none",
                None,
                broken=count != 4,
            )
        )
        return rows


async def budget_spent_under_load() -> list[Row]:
    config = pool_config(
        max_servers=3,
        multiplex=2,
        grow_fraction=0.5,
        restart=RestartIntensity(max_restarts=1, window_s=60),
        **PROBES,
    )
    pool = await start_env_pool(name(), ref(ECHO), config, 60)
    try:
        first = (await pool.stats.remote()).servers[0].name
        ray.kill(ray.get_actor(first))
        await replacement_serving(pool, first, time.monotonic())
        sessions = [await EnvSession.open(pool, task_index=i, timeout=5) for i in range(6)]
        await asyncio.sleep(1.0)
        stats = await pool.stats.remote()
        for session in sessions:
            await session.close()
        saw = f"6 sessions on {stats.ready} worker(s), spawns {stats.spawns}, denials {stats.budget_denials}"
        return [Row("load after the restart budget is spent", saw, None, broken=stats.spawns != 2)]
    finally:
        await close_env_pool(pool)


async def spawn_failure_mid_serve() -> list[Row]:
    with tempfile.TemporaryDirectory() as state:
        config = pool_config(
            min_servers=2, max_servers=2, restart=RestartIntensity(max_restarts=1, window_s=60), **PROBES
        )
        env = ref("env_actors.faults.envs:FlakyLoadEnv", state_dir=state, good_loads=2)
        pool = await start_env_pool(name(), env, config, 60)
        try:
            await wait_for(lambda: _ready(pool, 2), 20)
            survivor = await EnvSession.open(pool, task_index=0, timeout=5)
            doomed = next(
                w.name for w in (await pool.stats.remote()).servers if w.name != survivor.server_name
            )
            killed = time.monotonic()
            ray.kill(ray.get_actor(doomed))
            await wait_for(lambda: _spawn_failures(pool, 1), 20)
            seen = time.monotonic() - killed
            while not (await survivor.step(ASSISTANT, timeout=5)).done:
                pass
            reward = (await survivor.score(timeout=5)).reward
            await survivor.close()
            stats = await pool.stats.remote()
            saw = f"{stats.ready}/2 ready, supervisor alive, surviving session reward {reward:g}"
            return [Row("spawn fails mid-serve", saw, seen, broken=stats.ready != 1 or reward != 1.0)]
        finally:
            await close_env_pool(pool)


async def answered_then_exited() -> list[Row]:
    env = ref("env_actors.faults.envs:ExitsAfterAnsweringEnv", answer_steps=3, turns=5)
    pool = await start_env_pool(name(), env, pool_config(**PROBES), 60)
    try:
        sessions = [await EnvSession.open(pool, task_index=i, timeout=5) for i in range(3)]
        answers = await asyncio.gather(
            *(s.step(ASSISTANT, timeout=5) for s in sessions), return_exceptions=True
        )
        kept = sum(not isinstance(a, BaseException) for a in answers)
        started = time.monotonic()
        await wait_for(lambda: _deaths(pool, 1), 10)
        try:
            await sessions[0].step(ASSISTANT, timeout=5)
            later = "next call succeeded?!"
        except EnvCallFailed as exc:
            later = f"next call EnvCallFailed({exc.kind})"
        for s in sessions:
            await s.close()
        return [
            Row(
                "worker answered 3 calls, then exited",
                f"{kept}/3 answers kept; {later}",
                time.monotonic() - started,
                broken=kept != 3,
            )
        ]
    finally:
        await close_env_pool(pool)


async def no_live_worker() -> list[Row]:
    pool = await start_env_pool(
        name(), ref(ECHO), pool_config(restart=RestartIntensity(max_restarts=0, window_s=60), **PROBES), 60
    )
    try:
        worker = (await pool.stats.remote()).servers[0].name
        ray.kill(ray.get_actor(worker))
        await wait_for(lambda: _deaths(pool, 1), 10)
        started = time.monotonic()
        try:
            await EnvSession.open(pool, task_index=0, timeout=60)
            return [Row("no live worker", "session opened?!", None, broken=True)]
        except EnvCallFailed as exc:
            return [
                Row(
                    "no live worker (budget 0)",
                    f"EnvCallFailed({exc.kind}, {exc.failure.type})",
                    time.monotonic() - started,
                )
            ]
    finally:
        await close_env_pool(pool)


async def _ready(pool, count: int) -> bool:
    return (await pool.stats.remote()).ready >= count


async def _deaths(pool, count: int) -> bool:
    return (await pool.stats.remote()).deaths >= count


async def _spawn_failures(pool, count: int) -> bool:
    return (await pool.stats.remote()).spawn_failures >= count


CASES: list[tuple[str, Callable[[], Awaitable[list[Row]]]]] = [
    ("healthy pool", healthy),
    (
        "env fails to import",
        lambda: startup_failure(
            "env fails to import",
            ref("env_actors.faults.broken_import:BrokenImportEnv"),
            pool_config(),
            30,
            2.0,
        ),
    ),
    ("worker SIGKILLed, call in flight", killed_worker),
    ("worker SIGSTOPped", wedged_worker),
    ("env blocks its event loop", blocked_loop),
    ("env dies on every load", dies_on_every_load),
    ("load after the restart budget is spent", budget_spent_under_load),
    ("spawn fails mid-serve", spawn_failure_mid_serve),
    ("worker answered, then exited", answered_then_exited),
    (
        "constructor hangs",
        lambda: startup_failure(
            "constructor hangs (ready_timeout 2 s)",
            ref("env_actors.faults.envs:HangsInConstructorEnv"),
            pool_config(),
            2.0,
            None,
        ),
    ),
    (
        "resources never granted",
        lambda: startup_failure(
            "resources never granted (ready_timeout 2 s)",
            ref(ECHO),
            pool_config(resources={"never_granted": 1.0}),
            2.0,
            None,
        ),
    ),
    ("no live worker", no_live_worker),
]


async def run_cases() -> list[Row]:
    rows: list[Row] = []
    for case, run in CASES:
        try:
            rows += await asyncio.wait_for(run(), CASE_DEADLINE_S)
        except TimeoutError:
            rows.append(
                Row(case, f"no outcome within {CASE_DEADLINE_S:g} s (a stalled future)", None, broken=True)
            )
        except Exception as exc:
            rows.append(Row(case, f"unexpected {short(exc)}: {str(exc)[:60]}", None, broken=True))
    return rows


def print_table(rows: list[Row]) -> None:
    widths = [max(len(r.case) for r in rows), max(len(r.saw) for r in rows)]
    header = f"{'case':<{widths[0]}}  {'what the caller saw':<{widths[1]}}  {'seconds':>8}  target"
    print(header)
    print("-" * len(header))
    for r in rows:
        seconds = f"{r.seconds:8.3f}" if r.seconds is not None else f"{'-':>8}"
        print(f"{r.case:<{widths[0]}}  {r.saw:<{widths[1]}}  {seconds}  {r.verdict()}")


def main() -> int:
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, configure_logging=False)
    rows = asyncio.run(run_cases())
    print_table(rows)
    killed = next(
        (r for r in rows if r.case == "worker SIGKILLed, call in flight" and r.seconds is not None), None
    )
    print(
        f"killed-worker call failed in: {killed.seconds:.3f} s"
        if killed
        else "killed-worker call failed in: n/a s"
    )
    return 1 if any(r.broken for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
