"""A real env pool for the length of a test, stopped (workers killed) on every exit path."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import ray

from env_actors.pool import EnvPoolConfig, close_env_pool, start_env_pool
from rollout_actors.wire import Ref

READY_TIMEOUT_S = 30
TEST_REF_PREFIXES = ("env_actors.examples.", "env_actors.faults.")
"""The fault-injection environments are outside the default allowlist: tests widen it explicitly."""


def widened(config: EnvPoolConfig | None = None) -> EnvPoolConfig:
    """`config` (or the defaults) with the allowlist widened to the fault environments, unless it names one."""
    config = config or EnvPoolConfig()
    if config.allowed_ref_prefixes is not None:
        return config
    return config.model_copy(update={"allowed_ref_prefixes": TEST_REF_PREFIXES})


def pool_name() -> str:
    return f"test-env-{uuid.uuid4().hex[:8]}"


@asynccontextmanager
async def env_pool(target: str, config: EnvPoolConfig | None = None, **env_config: Any) -> AsyncIterator[Any]:
    name = f"test-env-{uuid.uuid4().hex[:8]}"
    pool = await start_env_pool(name, Ref(target=target, config=env_config), widened(config), READY_TIMEOUT_S)
    try:
        yield pool
    finally:
        await close_env_pool(pool)


async def call_started(worker: str, timeout: float = 20.0) -> None:
    """Wait until env worker `worker` reports a call running (its `health().calls`), so a fault injected
    next lands on a call in flight, not on one still on its way."""
    handle = ray.get_actor(worker)
    deadline = time.monotonic() + timeout
    while (await handle.health.remote()).calls < 1:
        assert time.monotonic() < deadline, f"no call started on {worker} within {timeout:g} s"
        await asyncio.sleep(0.02)
