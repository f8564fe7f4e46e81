"""The shared actors a plane starts and owns: one renderer pool, one env pool per environment Ref.

They are created from the driver so they fate-share with the orchestrator, not with a rollout worker that
may be killed. An env pool starts on the first request that names its Ref; a startup failure (bad import,
load error) answers every request for that Ref at once, without retrying the start each time.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from env_actors.pool import EnvPoolConfig, start_env_pool, stop_env_pool
from renderer_actors.pool import get_or_create_renderer_pool
from rollout_actors.config import PlaneConfig
from rollout_actors.naming import PoolNames, env_key
from rollout_actors.wire import Ref

log = logging.getLogger(__name__)

POOL_SHUTDOWN_TIMEOUT_S = 10.0  # a pool that cannot stop in this long is killed regardless
RELEASE_TIMEOUT_S = 30.0  # telling a pool to release a lost worker's holdings; it ends them in parallel


class SharedPools:
    def __init__(self, names: PoolNames, config: PlaneConfig) -> None:
        self._names = names
        self._config = config
        self._renderer_pool: Any = None
        self._env_pools: dict[str, asyncio.Future[Any]] = {}
        self._releases: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._renderer_pool = get_or_create_renderer_pool(
            self._names.renderer_pool, self._config.renderer_pool
        )

    def _env_pool_config(self) -> EnvPoolConfig:
        config: EnvPoolConfig = self._config.env_pool
        if config.allowed_ref_prefixes is None:  # the plane's allowlist, unless the pool names its own
            config = config.model_copy(update={"allowed_ref_prefixes": self._config.allowed_ref_prefixes})
        return config

    async def ensure_env_pool(self, env: Ref) -> Any:
        key = env_key(env)
        future = self._env_pools.get(key)
        if future is None:
            future = asyncio.ensure_future(
                start_env_pool(
                    self._names.env_pool(env),
                    env,
                    self._env_pool_config(),
                    ready_timeout=self._config.env_ready_timeout_s,
                )
            )
            self._env_pools[key] = future
        return await asyncio.shield(future)

    def release_owner(self, owner: str | None) -> None:
        """A rollout worker was lost: every pool ends the env sessions and returns the renderer leases its
        rollouts held, now rather than at their idle timeouts, and refuses what it asks for later (a call
        it sent before dying may still arrive)."""
        if owner is None:
            return
        calls = [(self._renderer_pool, "release_owned")] if self._renderer_pool is not None else []
        calls += [
            (f.result(), "close_owned")
            for f in self._env_pools.values()
            if f.done() and not f.cancelled() and f.exception() is None
        ]
        for pool, method in calls:
            task = asyncio.get_running_loop().create_task(self._release(pool, method, owner))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release(self, pool: Any, method: str, owner: str) -> None:
        try:
            released = await asyncio.wait_for(getattr(pool, method).remote(owner), RELEASE_TIMEOUT_S)
            log.info("%s of lost worker %s: %s", method, owner, released)
        except Exception as exc:  # a pool that is gone holds nothing; one that is wedged is not ours to fix
            log.warning("%s of lost worker %s failed: %s", method, owner, exc)

    async def close(self) -> None:
        if self._releases:
            await asyncio.wait(self._releases, timeout=RELEASE_TIMEOUT_S)
        starting = [f for f in self._env_pools.values() if not f.done()]
        for future in starting:
            future.cancel()  # a start still under way kills its pool actor as it unwinds
        if starting:
            await asyncio.wait(starting, timeout=POOL_SHUTDOWN_TIMEOUT_S)
        handles = [
            f.result()
            for f in self._env_pools.values()
            if f.done() and not f.cancelled() and f.exception() is None
        ]
        await asyncio.gather(*(stop_env_pool(handle) for handle in handles))
        if self._renderer_pool is not None:
            try:
                await asyncio.wait_for(self._renderer_pool.shutdown.remote(), POOL_SHUTDOWN_TIMEOUT_S)
            except Exception as exc:
                log.warning("renderer pool shutdown: %s", exc)
            ray.kill(self._renderer_pool, no_restart=True)
