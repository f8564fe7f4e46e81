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


class SharedPools:
    def __init__(self, names: PoolNames, config: PlaneConfig) -> None:
        self._names = names
        self._config = config
        self._renderer_pool: Any = None
        self._env_pools: dict[str, asyncio.Future[Any]] = {}

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

    async def close(self) -> None:
        for future in self._env_pools.values():
            if not future.done():
                future.cancel()
        handles = [
            f.result() for f in self._env_pools.values() if not f.cancelled() and f.exception() is None
        ]
        await asyncio.gather(*(stop_env_pool(handle) for handle in handles))
        if self._renderer_pool is not None:
            try:
                await asyncio.wait_for(self._renderer_pool.shutdown.remote(), POOL_SHUTDOWN_TIMEOUT_S)
            except Exception as exc:
                log.warning("renderer pool shutdown: %s", exc)
            ray.kill(self._renderer_pool, no_restart=True)
