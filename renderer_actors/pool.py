"""`RendererPool`: one named async actor that leases renderer slots to every rollout worker.

Usage (the session does this for a rollout; see `renderer_actors.session`)::

    pool = get_or_create_renderer_pool("plane-1/renderer-pool")
    lease = await pool.lease.remote(key.to_json(), multiplex=256)
    ids = await lease.renderer.start.remote(messages, tools)
    await pool.release.remote(lease.lease_id)

Policy, per `RendererKey` (model, library renderer config + template kwargs, history policy):

- The first lease for a key returns at once and warms one renderer in the background; callers wait for
  its readiness themselves (`renderer.ready`), within their own deadlines.
- A lease takes a slot on the least-loaded renderer with a free slot (ready ones first). A renderer is
  added only when every renderer of the key holds `multiplex` leases.
- `multiplex` is not part of the key: configs that differ only in multiplex share one pool of renderers,
  and the first lease for a key fixes its multiplex (later values are ignored, and `stats` shows the
  one in force).
- Idle renderers beyond one per key are retired after `idle_timeout_s`.
- A dead renderer (reported by a session that saw it die, or missed health checks) is replaced; its
  leases are orphaned and their holders re-lease. A startup failure fails every lease for that key at
  once for `failure_hold_s`, with the renderer's traceback, instead of spawning a doomed renderer per call.
- Every spawn that replaces a renderer of the key that died, wedged or failed to start spends one restart
  from the key's budget (`RendererPoolConfig.restart`). With none left the key is not respawned: leases
  go to its live renderers, or, with none live, fail at once saying so, until the window moves on.

The pool owns its background loops (health, reaper) and every renderer's warm-up; `shutdown` stops them
and kills the renderers. Renderers are created by the pool, so they fate-share with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from renderer_actors.actor import RendererActor
from renderer_actors.calls import RendererLease
from renderer_actors.config import RendererKeyStats, RendererPoolConfig, RendererPoolStats, RendererStats
from renderer_actors.key import RendererKey
from rollout_actors.kernel import new_id
from rollout_actors.kernel.faults import CallerError, LoadFailed, Unavailable, ray_loss, remote_cause
from rollout_actors.kernel.metric import Metric
from rollout_actors.kernel.supervision import Liveness, RestartBudget

log = logging.getLogger(__name__)

LOST_OWNER_MEMORY = 1_000  # lost owners remembered, so a lease one asked for before dying is refused
POOL_MAX_CONCURRENCY = 10_000  # leases are instant; this only bounds how many callers may queue at once
FAILED_LOAD_LINGER_S = 5.0  # a renderer whose load failed answers its waiters with the failure this long
RENDERER_MIN_CONCURRENCY = 64  # health checks and readiness waits on top of `multiplex` rollouts


RENDERERS = Metric(kind="gauge", name="renderers", description="Renderer actors per key", tag_keys=("key",))
LEASES = Metric(
    kind="gauge", name="renderer_leases", description="Renderer leases held per key", tag_keys=("key",)
)


class RendererStartupError(LoadFailed):
    """A renderer for this key failed to load recently (the message carries its traceback): every lease
    of the key fails at once with it for `failure_hold_s` (`caller` when the load refused the key itself)."""


class RendererBudgetSpent(Unavailable):
    """The key's renderers died, wedged or failed to start more often than its restart budget allows."""


@dataclass
class _Renderer:
    renderer_id: str
    handle: Any
    created: float
    leases: set[str] = field(default_factory=set)
    ready: bool = False
    idle_since: float = 0.0
    warm_task: asyncio.Task[None] | None = None
    life: Liveness | None = None
    """Set once ready: when it last answered a health call (the kernel's rule, as for every actor)."""


@dataclass
class _KeyPool:
    key_json: str
    multiplex: int
    budget: RestartBudget
    renderers: dict[str, _Renderer] = field(default_factory=dict)
    startup_failure: str | None = None
    startup_kind: str = "infrastructure"
    """`caller` when the load refused what the key names (a `CallerError` on the renderer's side)."""
    failed_at: float = 0.0
    owed: int = 0
    """Renderers of this key that died, wedged or failed to start and are not respawned yet: the next
    spawns are restarts (they spend the budget), not growth."""
    last_death: str = ""


@dataclass
class _Lease:
    key_json: str
    renderer_id: str
    expires: float
    owner: str | None = None
    """The actor that took it (a rollout worker); `release_owned` returns it when that actor is lost."""


class RendererPool:
    """Leases renderer slots per `RendererKey`. Run as a named async actor: `get_or_create_renderer_pool`."""

    def __init__(self, config: RendererPoolConfig | dict[str, Any] | None = None) -> None:
        self._config = (
            config if isinstance(config, RendererPoolConfig) else RendererPoolConfig(**(config or {}))
        )
        self._keys: dict[str, _KeyPool] = {}
        self._leases: dict[str, _Lease] = {}
        self._lost_owners: dict[str, None] = {}
        self._loops: list[asyncio.Task[None]] = []
        self._closed = False
        self._counters = {
            "spawned": 0,
            "retired": 0,
            "replaced": 0,
            "startup_failures": 0,
            "expired_leases": 0,
            "budget_denials": 0,
        }

    # ----------------------------------------------------------------------------------- leases

    async def lease(
        self,
        key_json: str,
        multiplex: int = 256,
        *,
        dead_renderer_id: str | None = None,
        release_lease_id: str | None = None,
        owner: str | None = None,
    ) -> RendererLease:
        """A slot on a renderer for `key_json`. Never waits.

        `dead_renderer_id`: the caller saw this renderer die (it is replaced before the lease is placed);
        `release_lease_id`: the caller's previous lease, released in the same call; `owner`: the actor
        asking (see `release_owned`)."""
        if release_lease_id is not None:
            self._release(release_lease_id)
        if dead_renderer_id is not None:
            self._replace(dead_renderer_id, "reported dead by a session")
        self._check_owner(owner)
        return self._lease_one(self._key_pool(key_json, multiplex), owner)

    async def renderer_lost(self, renderer_id: str) -> None:
        """A session saw this renderer die on a call: replace it now, not at the next health check (a
        notice: nobody waits for its answer)."""
        self._replace(renderer_id, "reported dead by a session")

    async def lease_many(
        self, key_json: str, multiplex: int, count: int, owner: str | None = None
    ) -> list[RendererLease]:
        """`count` leases placed one after another, exactly as `count` calls to `lease` would be (a
        process's concurrent sessions ask in one call: see `renderer_actors.batching`)."""
        self._check_owner(owner)
        pool = self._key_pool(key_json, multiplex)
        return [self._lease_one(pool, owner) for _ in range(count)]

    async def release_owned(self, owner: str) -> int:
        """The actor `owner` was lost (a rollout worker killed or dead): return every lease it held now,
        not at `max_lease_s`, and refuse leases it asked for before dying that arrive later. Returns how
        many leases were held."""
        self._lost_owners[owner] = None
        while len(self._lost_owners) > LOST_OWNER_MEMORY:
            del self._lost_owners[next(iter(self._lost_owners))]
        owned = [lease_id for lease_id, lease in self._leases.items() if lease.owner == owner]
        return sum(self._release(lease_id) for lease_id in owned)

    def _check_owner(self, owner: str | None) -> None:
        if owner is not None and owner in self._lost_owners:
            raise RuntimeError(f"the asking actor {owner} was lost; no lease is placed for it")

    async def release(self, lease_id: str) -> bool:
        """Give a slot back. Idempotent; False for an unknown lease (already released, or orphaned by a
        renderer's death)."""
        return self._release(lease_id)

    async def release_many(self, lease_ids: list[str]) -> int:
        """Release several leases; returns how many were held."""
        return sum(self._release(lease_id) for lease_id in lease_ids)

    async def health(self) -> dict[str, Any]:
        """Liveness for the plane's supervisor: answered on the loop that serves every lease, so an answer
        means that loop turns (`loop_stall_s` is 0 by construction). Ready once it answers."""
        return {
            "loop_stall_s": 0.0,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "keys": len(self._keys),
        }

    async def stats(self) -> RendererPoolStats:
        now = time.monotonic()
        keys = {}
        for key_json, pool in self._keys.items():
            renderers = sorted(pool.renderers.values(), key=lambda r: r.created)
            keys[key_json] = RendererKeyStats(
                multiplex=pool.multiplex,
                loads=[len(r.leases) for r in renderers],
                renderers=[
                    RendererStats(
                        renderer_id=r.renderer_id,
                        load=len(r.leases),
                        ready=r.ready,
                        idle_s=(now - r.idle_since) if not r.leases else 0.0,
                    )
                    for r in renderers
                ],
                startup_failure=pool.startup_failure,
                restarts_left=pool.budget.remaining(),
            )
        return RendererPoolStats(keys=keys, leases=len(self._leases), **self._counters)

    async def shutdown(self) -> None:
        """Stop the background loops and warm-ups, kill every renderer. Idempotent."""
        self._closed = True
        tasks = list(self._loops)
        for pool in self._keys.values():
            for renderer in list(pool.renderers.values()):
                if renderer.warm_task is not None:
                    tasks.append(renderer.warm_task)
                self._drop(pool, renderer)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        self._loops.clear()
        self._leases.clear()

    # -------------------------------------------------------------------------------- placement

    def _key_pool(self, key_json: str, multiplex: int) -> _KeyPool:
        if self._closed:
            raise RuntimeError("renderer pool is shut down")
        self._ensure_loops()
        key_json = RendererKey.from_json(key_json).to_json()  # canonical, whatever the caller sent
        pool = self._keys.get(key_json)
        if pool is None:
            budget = RestartBudget(self._config.restart)
            pool = self._keys[key_json] = _KeyPool(key_json, max(1, int(multiplex)), budget)
        return pool

    def _lease_one(self, pool: _KeyPool, owner: str | None = None) -> dict[str, Any]:
        now = time.monotonic()
        live = list(pool.renderers.values())
        if pool.startup_failure and now - pool.failed_at < self._config.failure_hold_s:
            if not any(r.ready for r in live):
                raise RendererStartupError(pool.startup_failure, kind=pool.startup_kind)
        free = [r for r in live if len(r.leases) < pool.multiplex]
        renderer = None
        if free:
            renderer = min(free, key=lambda r: (not r.ready, len(r.leases), r.created))
        elif len(live) < self._config.max_renderers_per_key:
            try:
                renderer = self._spawn(pool)
            except RendererBudgetSpent:
                if not live:
                    raise
        if renderer is None:  # at the size limit, or the key's restart budget is spent: overfill
            renderer = min(live, key=lambda r: (not r.ready, len(r.leases), r.created))
        lease_id = new_id("rlease")
        renderer.leases.add(lease_id)
        self._leases[lease_id] = _Lease(
            pool.key_json, renderer.renderer_id, now + self._config.max_lease_s, owner
        )
        return RendererLease(lease_id, renderer.handle, renderer.renderer_id, renderer.ready)

    # -------------------------------------------------------------------------------- renderers

    def _spawn(self, pool: _KeyPool) -> _Renderer:
        """Start one renderer for the key. A spawn that replaces a lost one spends a restart; with the
        budget spent it raises `RendererBudgetSpent` and starts nothing."""
        if pool.owed:
            if not pool.budget.try_spend():
                self._counters["budget_denials"] += 1
                raise RendererBudgetSpent(
                    f"renderer for {pool.key_json} is not restarted: {pool.budget.spent_message()}; "
                    f"last: {pool.last_death}"
                )
            pool.owed -= 1
        renderer_id = new_id("renderer")
        handle = _REMOTE_RENDERER.options(
            num_cpus=self._config.renderer_num_cpus,
            max_concurrency=2 * pool.multiplex + RENDERER_MIN_CONCURRENCY,
            scheduling_strategy="SPREAD",  # one node's loss takes a fraction of the renderers
        ).remote(pool.key_json, renderer_id, self._config.allowed_ref_prefixes)
        now = time.monotonic()
        renderer = _Renderer(renderer_id, handle, created=now, idle_since=now)
        renderer.warm_task = asyncio.get_running_loop().create_task(self._warm(pool, renderer))
        pool.renderers[renderer_id] = renderer
        self._counters["spawned"] += 1
        return renderer

    async def _warm(self, pool: _KeyPool, renderer: _Renderer) -> None:
        try:
            await asyncio.wait_for(renderer.handle.ready.remote(), self._config.startup_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if renderer.renderer_id not in pool.renderers:
                return  # retired or replaced meanwhile: not a startup failure
            if ray_loss(exc) is not None:
                # Its process died while loading (killed, its node lost): a death, replaced under the key's
                # restart budget, not a startup failure that would fail every lease for failure_hold_s. A
                # load that kills its process every time spends the budget and then fails loudly.
                self._replace(renderer.renderer_id, f"died while starting: {type(exc).__name__}")
                return
            what = (
                f"timed out after {self._config.startup_timeout_s:g} s"
                if isinstance(exc, TimeoutError)
                else str(exc)
            )
            pool.startup_failure = f"renderer for {pool.key_json} failed to start: {what}"
            pool.startup_kind = "caller" if isinstance(remote_cause(exc), CallerError) else "infrastructure"
            pool.failed_at = time.monotonic()
            self._counters["startup_failures"] += 1
            log.warning("%s", pool.startup_failure)
            # Killed a moment later, not now: sessions waiting on its `ready` get the load's own failure
            # (not re-dispatched) rather than a death (a lost part, re-dispatched to fail the same way).
            self._drop(pool, renderer, lost=pool.startup_failure, linger_s=FAILED_LOAD_LINGER_S)
            return
        renderer.ready = True
        renderer.life = Liveness(self._config.health_timeout_s)
        pool.startup_failure = None

    def _drop(
        self, pool: _KeyPool, renderer: _Renderer, lost: str | None = None, linger_s: float = 0.0
    ) -> None:
        """Forget a renderer and kill it. Its leases are orphaned: releasing them is a no-op. `lost`: why
        it died, wedged or failed to start (its respawn is a restart), None when it was retired."""
        if lost is not None and renderer.renderer_id in pool.renderers:
            pool.owed += 1
            pool.last_death = lost
        pool.renderers.pop(renderer.renderer_id, None)
        for lease_id in renderer.leases:
            self._leases.pop(lease_id, None)
        renderer.leases.clear()
        if renderer.warm_task is not None and renderer.warm_task is not asyncio.current_task():
            renderer.warm_task.cancel()
        if linger_s > 0 and not self._closed:
            asyncio.get_running_loop().call_later(linger_s, _kill, renderer.handle)
        else:
            _kill(renderer.handle)

    def _replace(self, renderer_id: str, why: str) -> None:
        for pool in self._keys.values():
            renderer = pool.renderers.get(renderer_id)
            if renderer is None:
                continue
            log.warning("renderer %s %s; replacing it", renderer_id, why)
            self._drop(pool, renderer, lost=f"renderer {renderer_id} {why}")
            if self._closed:
                return
            try:
                self._spawn(pool)
            except RendererBudgetSpent as exc:
                log.error("%s", exc)
                return
            self._counters["replaced"] += 1
            return

    def _release(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        pool = self._keys.get(lease.key_json)
        renderer = pool.renderers.get(lease.renderer_id) if pool else None
        if renderer is not None:
            renderer.leases.discard(lease_id)
            if not renderer.leases:
                renderer.idle_since = time.monotonic()
        return True

    # --------------------------------------------------------------------------- background loops

    def _ensure_loops(self) -> None:
        if self._loops or self._closed:
            return
        loop = asyncio.get_running_loop()
        self._loops = [loop.create_task(self._reap_loop()), loop.create_task(self._health_loop())]

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.reap_interval_s)
            try:
                self._reap(time.monotonic())
            except Exception:  # a bug here must not stop the loop that keeps the pool small
                log.exception("renderer pool reaper")

    def _reap(self, now: float) -> None:
        for lease_id, lease in list(self._leases.items()):
            if lease.expires <= now:
                self._release(lease_id)
                self._counters["expired_leases"] += 1
        for pool in self._keys.values():
            idle = [
                r
                for r in pool.renderers.values()
                if not r.leases and now - r.idle_since >= self._config.idle_timeout_s
            ]
            # Retire warming ones first, then the newest: the survivor should be a warm, old renderer.
            idle.sort(key=lambda r: (r.ready, -r.created))
            for renderer in idle:
                if len(pool.renderers) <= 1:
                    break
                self._drop(pool, renderer)
                self._counters["retired"] += 1
            key = RendererKey.from_json(pool.key_json).short()
            RENDERERS.record(len(pool.renderers), {"key": key})
            LEASES.record(sum(len(r.leases) for r in pool.renderers.values()), {"key": key})

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.health_interval_s)
            # Warming renderers are covered by their warm-up's startup timeout.
            renderers = [r for pool in self._keys.values() for r in pool.renderers.values() if r.ready]
            results = await asyncio.gather(*(self._check(r) for r in renderers), return_exceptions=True)
            for renderer, lost in zip(renderers, results, strict=True):
                if lost is not None:
                    self._replace(renderer.renderer_id, f"failed its health check ({lost!r})")

    async def _check(self, renderer: _Renderer) -> str | None:
        """None while the renderer is alive; why it is lost: died, or wedged (silent past the timeout)."""
        assert renderer.life is not None
        try:
            await asyncio.wait_for(renderer.handle.health.remote(), self._config.health_timeout_s)
            renderer.life.heard()
        except Exception as exc:
            if ray_loss(exc) == "died":
                return f"died: {type(exc).__name__}"
            # No answer in time, or unreachable for now: silence, judged below.
        return f"wedged: {renderer.life.verdict()}" if renderer.life.wedged() else None


def _kill(handle: Any) -> None:
    with contextlib.suppress(Exception):
        ray.kill(handle, no_restart=True)


def get_or_create_renderer_pool(
    name: str,
    config: RendererPoolConfig | dict[str, Any] | None = None,
    namespace: str | None = None,
    scheduling_strategy: Any = None,
) -> Any:
    """The named `RendererPool` actor, created on first call (num_cpus=0: it only waits). `config`
    applies only when this call creates it. Created without `lifetime="detached"`, so it fate-shares with
    the process that created it (the plane's driver); its owner stops it with `shutdown` + `ray.kill`."""
    return _REMOTE_POOL.options(
        name=name,
        namespace=namespace,
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=POOL_MAX_CONCURRENCY,
        scheduling_strategy=scheduling_strategy,
    ).remote(config)


_REMOTE_RENDERER = ray.remote(RendererActor)
_REMOTE_POOL = ray.remote(RendererPool)
