"""What the plane benchmarks share around one wave of rollouts: the process's open-files limit, a
renderer pool grown and loaded before the wave, and CPU snapshots diffed by role.

    run_on_local_ray(main_async(args))              # a private local Ray around one asyncio run
    raise_open_files_limit()                        # before Ray starts: its processes inherit it
    await grow_renderer_pool(plane, model, multiplex, c)
    cpu = cpu_diff(before, after)                   # `_bench_probe.cpu_by_role` snapshots
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import time
from collections.abc import Coroutine
from typing import Any

import ray

from renderer_actors.key import RendererKey
from rollout_actors.plane import RolloutPlane
from rollout_actors.wire import RendererConfig

RENDERERS_LOADED_TIMEOUT_S = 300.0


def run_on_local_ray(main: Coroutine[Any, Any, None], **init: Any) -> None:
    """Run a benchmark's `main` on a private local Ray (8 logical CPUs, no dashboard; never someone else's
    running cluster), with the open-files limit raised first, and shut Ray down whatever happens."""
    logging.basicConfig(level=logging.WARNING)
    limit = raise_open_files_limit()
    print(f"(open files limit {limit}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)", flush=True)
    try:
        ray.init(address="local", num_cpus=8, include_dashboard=False, **init)
    except BaseException:
        main.close()  # never started: nothing to await, nothing to warn about
        raise
    try:
        asyncio.run(main)
    finally:
        ray.shutdown()


def raise_open_files_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (at most 65,536), before Ray and
    the stand-ins start so they inherit it: a socket per rollout on each side. Returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


async def grow_renderer_pool(plane: RolloutPlane, model: str, multiplex: int, c: int) -> None:
    """Bring the renderer pool to the size the wave will use (one renderer per `multiplex` slots) and wait
    until every renderer is loaded, as the single-process ways load theirs before the wave: a renderer's
    startup is not a cost per turn."""
    pool = ray.get_actor(plane.names.renderer_pool)
    key_json = RendererKey.from_config(model, RendererConfig(multiplex=multiplex)).to_json()
    slots = await pool.acquire_many.remote(key_json, multiplex, c)
    await pool.release_many.remote([slot.slot_id for slot in slots])
    deadline = time.monotonic() + RENDERERS_LOADED_TIMEOUT_S
    while time.monotonic() < deadline:
        renderers = (await pool.stats.remote()).keys[key_json].renderers
        if all(r.ready for r in renderers):
            return
        await asyncio.sleep(0.5)
    raise TimeoutError(
        f"the renderer pool did not load its renderers within {RENDERERS_LOADED_TIMEOUT_S:g} s"
    )


def cpu_diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds by role between two `cpu_by_role` snapshots (roles that spent nothing left out)."""
    return {
        role: after[role] - before.get(role, 0.0) for role in after if after[role] > before.get(role, 0.0)
    }
