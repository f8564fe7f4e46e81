"""The shared actors a plane starts and supervises: one renderer pool, one env pool per environment Ref.

    pools = SharedPools(names, config)
    await pools.start()                              # the renderer pool, ready
    await pools.ensure_env_pool(request.env)         # first use of an environment: its pool, ready
    route = await pools.route(request, timeout)      # the serving pools one dispatch talks to
    ...
    await pools.close()

They are created from the driver and placed on the driver's node, or on `PoolSupervision.node_id` while
the GCS says that node is alive (each incarnation looks again), and each is supervised by a `SupervisedPool`: lost
(died, or wedged past its hang timeout), it is restarted within its restart budget under a new actor name
(`<name>@<incarnation>`). Each dispatch names the serving incarnations (`PoolRoute`). An env pool starts
on the first request that names its Ref; a startup failure (bad import, load error) answers every request
for that Ref at once, without retrying the start each time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from env_actors.pool import EnvPoolConfig, EnvStartupError, start_env_pool
from renderer_actors.pool import get_or_create_renderer_pool
from rollout_actors.kernel.faults import Fault, Unavailable
from rollout_actors.kernel.tasks import holds_value, kill_actor
from rollout_actors.plane.config import PlaneConfig
from rollout_actors.plane.naming import PoolNames, env_key
from rollout_actors.plane.pool_supervisor import PoolStatus, PoolUnavailable, SupervisedPool
from rollout_actors.rollout.pool_lookup import PoolRoute
from rollout_actors.wire import Ref, RolloutRequest

log = logging.getLogger(__name__)

POOL_SHUTDOWN_TIMEOUT_S = 10.0  # a pool start being cancelled at close unwinds in this long
START_RETRY_S = 60.0
"""How long an environment whose pool failed to start is remembered as failed: requests naming it fail at
once meanwhile (its load failed the same way for every server it tried), then the next starts it again."""
RELEASE_TIMEOUT_S = 30.0  # telling a pool to release a lost worker's holdings; it ends them in parallel
POOL_READY_TIMEOUT_S = 60.0  # the renderer pool's own process start (it loads nothing until asked)


class SharedPools:
    def __init__(self, names: PoolNames, config: PlaneConfig) -> None:
        self._names = names
        self.config = config
        """What pools are started with (the plane fits its CPU requests to the cluster at `start`)."""
        self._driver_node: str | None = None
        self._renderer: SupervisedPool | None = None
        self._env: dict[str, tuple[SupervisedPool, asyncio.Future[Any]]] = {}
        """Env key -> its supervisor and the first start (shared by every request that waits for it)."""
        self._env_failed_at: dict[str, float] = {}
        """Env key -> when its pool's start failed: the failure answers every request until `START_RETRY_S`."""
        self._releases: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._driver_node = ray.get_runtime_context().get_node_id()
        self._renderer = SupervisedPool(
            "renderer pool",
            self._names.renderer_pool,
            self._start_renderer_pool,
            self.config.pool_supervision,
        )
        await self._renderer.start()

    async def ensure_env_pool(self, env: Ref) -> None:
        """Start the environment's pool on first use and wait until it is ready; raises its startup
        failure (every later call for the Ref raises the same one at once, until `START_RETRY_S` after
        the failure: then the next request starts the pool afresh)."""
        key = env_key(env)
        entry = self._env.get(key)
        if entry is not None and self._env_failed_at.get(key, math.inf) < time.monotonic() - START_RETRY_S:
            entry = None
            self._env_failed_at.pop(key, None)
        if entry is None:
            pool = SupervisedPool(
                f"env pool {env.target} ({key})",
                self._names.env_pool(env),
                lambda name: self._start_env_pool(env, name),
                self.config.pool_supervision,
            )
            entry = self._env[key] = (pool, asyncio.ensure_future(pool.start()))
            entry[1].add_done_callback(lambda done, key=key: self._stamp_failure(key, done))
        try:
            await asyncio.shield(entry[1])
        except (EnvStartupError, PoolUnavailable) as exc:  # typed: whose fault it was, from its failure
            failure = exc.failure
            kind = "caller" if failure.fault == "caller" else "infrastructure"
            raise Fault.from_failure(failure, kind=kind) from exc

    def _stamp_failure(self, key: str, start: asyncio.Future[Any]) -> None:
        if not start.cancelled() and start.exception() is not None:
            self._env_failed_at[key] = time.monotonic()

    def env_pool_started(self, env: Ref) -> bool:
        """The environment's pool has started (so `ensure_env_pool` would return at once)."""
        entry = self._env.get(env_key(env))
        return entry is not None and holds_value(entry[1])

    async def route(self, request: RolloutRequest, timeout: float, verify: bool = False) -> PoolRoute:
        """The serving pools `request` talks to, waiting up to `timeout` for any being restarted; raises
        `Unavailable` when one is not serving. `verify`: a re-dispatch after a part of ours was lost;
        each pool is checked alive first (see `SupervisedPool.serving`). Needs `ensure_env_pool` first."""
        assert self._renderer is not None, "call `start` first"
        deadline = time.monotonic() + timeout
        try:
            env = await self._env[env_key(request.env)][0].serving(timeout, verify)
            if request.mode != "chat":  # token and agent mode render every turn
                renderer = await self._renderer.serving(max(0.0, deadline - time.monotonic()), verify)
            else:  # a chat rollout never renders: it neither waits for the renderer pool nor checks it
                renderer = None
        except PoolUnavailable as exc:
            failure = exc.failure
            raise Unavailable(failure.message, type_name=failure.type, traceback=failure.traceback) from exc
        return PoolRoute(env_pool=env, renderer_pool=renderer)

    def supervisor(self, env: Ref | None = None) -> SupervisedPool:
        """The supervisor of the renderer pool, or (given its Ref) of an environment's started pool."""
        if env is None:
            assert self._renderer is not None, "call `start` first"
            return self._renderer
        return self._env[env_key(env)][0]

    def renderer_pool(self) -> Any:
        """The serving renderer pool's handle, or None while there is none (the dispatcher warms keys)."""
        return self._renderer.current() if self._renderer is not None else None

    def release_owner(self, owner: str | None) -> None:
        """A rollout worker was lost: every pool ends the env sessions and returns the renderer slots its
        rollouts held, now rather than at their idle timeouts, and refuses what it asks for later (a call
        it sent before dying may still arrive). A pool being restarted holds nothing of it any more."""
        if owner is None or self._renderer is None:
            return
        calls = [(self._renderer.current(), "release_owned")]
        calls += [(pool.current(), "close_owned") for pool, _ in self._env.values()]
        for handle, method in calls:
            if handle is None:
                continue
            task = asyncio.get_running_loop().create_task(self._release(handle, method, owner))
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release(self, pool: Any, method: str, owner: str) -> None:
        try:
            released = await asyncio.wait_for(getattr(pool, method).remote(owner), RELEASE_TIMEOUT_S)
            log.info("%s of lost worker %s: %s", method, owner, released)
        except Exception as exc:  # a pool that is gone holds nothing; one that is wedged is its supervisor's
            log.warning("%s of lost worker %s failed: %s", method, owner, exc)

    def statuses(self) -> list[PoolStatus]:
        pools = [self._renderer] if self._renderer is not None else []
        pools += [pool for pool, _ in self._env.values()]
        return [pool.status() for pool in pools]

    async def close(self) -> None:
        if self._releases:
            await asyncio.wait(self._releases, timeout=RELEASE_TIMEOUT_S)
        starting = [started for _, started in self._env.values() if not started.done()]
        for started in starting:
            started.cancel()  # a start still under way kills its pool actor as it unwinds
        if starting:
            await asyncio.wait(starting, timeout=POOL_SHUTDOWN_TIMEOUT_S)
        pools = [pool for pool, _ in self._env.values()]
        await asyncio.gather(*(pool.close() for pool in pools))
        if self._renderer is not None:
            await self._renderer.close()

    # ------------------------------------------------------------------------------- incarnations

    async def _start_renderer_pool(self, name: str) -> Any:
        handle = get_or_create_renderer_pool(
            name, self.config.renderer_pool, scheduling_strategy=await self._placement()
        )
        try:
            await asyncio.wait_for(handle.health.remote(), POOL_READY_TIMEOUT_S)
        except BaseException:
            kill_actor(handle)
            raise
        return handle

    async def _start_env_pool(self, env: Ref, name: str) -> Any:
        config: EnvPoolConfig = self.config.env_pools.get(env.target, self.config.env_pool)
        if config.allowed_ref_prefixes is None:  # the plane's allowlist, unless the pool names its own
            config = config.model_copy(update={"allowed_ref_prefixes": self.config.allowed_ref_prefixes})
        return await start_env_pool(
            name,
            env,
            config,
            ready_timeout=self.config.env_ready_timeout_s,
            scheduling_strategy=await self._placement(),
        )

    async def _placement(self) -> NodeAffinitySchedulingStrategy:
        """Pinned (not soft: Ray's soft affinity moves an actor elsewhere whenever it likes) to the
        configured node while it is alive, else to the driver's node, which lives as long as the plane."""
        wanted = self.config.pool_supervision.node_id
        if wanted is not None and wanted != self._driver_node:
            nodes = await asyncio.to_thread(ray.nodes)  # a GCS call: kept off the plane's event loop
            if any(node["NodeID"] == wanted and node["Alive"] for node in nodes):
                return NodeAffinitySchedulingStrategy(node_id=wanted, soft=False)
            log.warning("pool node %s is gone: placing the pool on the driver's node", wanted)
        assert self._driver_node is not None
        return NodeAffinitySchedulingStrategy(node_id=self._driver_node, soft=False)
