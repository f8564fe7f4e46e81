"""How long an env pool whose `runtime_env` cannot be built takes to say so, beside Ray alone.

    python scripts/bench_runtime_env_failure.py      # starts a local Ray (or joins RAY_ADDRESS)

Two runtime envs whose `pip` names a package that does not exist (two names: Ray caches a failed env for
ten minutes), in one cluster, side by side: an env pool's start (the pool checks the requirements with pip
beside Ray's build, `env_actors/runtime_env_check.py`), and the same env server's start awaited on Ray
alone (its whole build: three attempts, each a fresh virtualenv and a pip run). Prints the seconds until
each failed and the ratio. Both depend on the package index's latency: one pip run that finds nothing is
the floor. Timings are reported, not asserted.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import ray

from env_actors.config import EnvPoolConfig, EnvRuntimeEnv
from env_actors.pool import EnvStartupError, start_env_pool
from env_actors.spawn import create_env_server
from rollout_actors.kernel.tasks import resolve
from rollout_actors.wire import Ref

DEADLINE_S = 400.0
ENV = Ref("env_actors.examples.math_env:MathEnv", {})


def config(package: str) -> EnvPoolConfig:
    return EnvPoolConfig(num_cpus=0.1, runtime_env=EnvRuntimeEnv(pip=[f"{package}==0.0.1"]))


async def pool_start() -> tuple[float, str]:
    started = time.monotonic()
    name = f"bench-rtenv-{uuid.uuid4().hex[:8]}"
    try:
        await start_env_pool(name, ENV, config("ray-rollouts-no-such-package-a"), ready_timeout=DEADLINE_S)
    except EnvStartupError as exc:
        failure = exc.failure
        return time.monotonic() - started, f"EnvStartupError ({failure.fault if failure else '?'})"
    return time.monotonic() - started, "BROKEN: started"


async def ray_alone() -> tuple[float, str]:
    started = time.monotonic()
    handle = create_env_server(
        f"bench-rtenv-{uuid.uuid4().hex[:8]}", ENV, config("ray-rollouts-no-such-package-b")
    )
    try:
        await asyncio.wait_for(resolve(handle.start.remote()), DEADLINE_S)
    except Exception as exc:
        return time.monotonic() - started, type(exc).__name__
    finally:
        ray.kill(handle, no_restart=True)
    return time.monotonic() - started, "BROKEN: started"


async def main() -> None:
    pool_s, pool_saw = await pool_start()
    ray_s, ray_saw = await ray_alone()
    print(f"{'start':<32} {'saw':<28} {'s':>7}")
    print(f"{'env pool (pip checked beside)':<32} {pool_saw:<28} {pool_s:>7.1f}")
    print(f"{'Ray alone (its whole build)':<32} {ray_saw:<28} {ray_s:>7.1f}")
    print(
        f"pip runtime_env failure reported in: {pool_s:.1f} s (Ray alone: {ray_s:.1f} s, x{ray_s / pool_s:.1f})"
    )


if __name__ == "__main__":
    # A cluster of our own unless told to join one (never another user's on this machine).
    ray.init(address=os.environ.get("RAY_ADDRESS", "local"), include_dashboard=False, configure_logging=False)
    try:
        asyncio.run(main())
    finally:
        ray.shutdown()
