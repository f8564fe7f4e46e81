"""`RendererPool`: one named async actor that hands renderer slots to every rollout worker.

Usage (the session does this for a rollout; see `renderer_actors.session`)::

    pool = get_or_create_renderer_pool("plane-1/renderer-pool")
    slot = await pool.acquire.remote(key.to_json(), multiplex=256)
    ids = await slot.renderer.start.remote(messages, tools)
    await pool.release.remote(slot.slot_id)

Policy, per `RendererKey` (model, library renderer config + template kwargs, history policy):

- The first slot for a key returns at once and warms one renderer in the background; callers wait for
  its readiness themselves (`renderer.ready`), within their own deadlines.
- A slot is placed on the least-loaded renderer with a free slot (ready ones first). A renderer is
  added only when every renderer of the key holds `multiplex` slots.
- `multiplex` is not part of the key: configs that differ only in multiplex share one pool of renderers,
  and the first slot for a key fixes its multiplex (later values are ignored, and `stats` shows the
  one in force).
- Idle renderers beyond one per key are retired after `idle_timeout_s`.
- A dead renderer (reported by a session that saw it die, or missed health checks) is replaced; its
  slots are orphaned and their holders acquire new ones. A startup failure fails every slot for that key
  at once for `failure_hold_s`, with the renderer's traceback, instead of spawning a doomed renderer per
  call.
- Every spawn after the key's first (a renderer more under load, or one replacing a renderer that died,
  wedged or failed to start) spends one restart from the key's budget (`RendererPoolConfig.restart`). With
  none left the key does not grow (slots overfill its live renderers) and is not respawned: with none
  live, slots fail at once saying so, until the window moves on.

Each key's renderers are children of the kernel's `Supervisor` (readiness, probes, wedges, replacement);
the pool keeps only slots, placement and its reaper. `close` stops them all and kills the renderers.
Renderers are created by the pool, so they fate-share with it.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from renderer_actors.calls import RendererSlot
from renderer_actors.config import RendererKeyStats, RendererPoolConfig, RendererPoolStats, RendererStats
from renderer_actors.key import RendererKey
from rollout_actors.kernel import new_id
from rollout_actors.kernel.faults import CallerError, LoadFailed, ray_loss, remote_cause
from rollout_actors.kernel.metric import Metric
from rollout_actors.kernel.supervision import Health
from rollout_actors.kernel.supervisor import (
    Child,
    ChildKind,
    RestartBudgetSpent,
    RetireCause,
    Supervisor,
    TaskOwner,
)

log = logging.getLogger(__name__)

LOST_OWNER_MEMORY = 1_000  # lost owners remembered, so a slot one asked for before dying is refused
POOL_MAX_CONCURRENCY = 10_000  # slots are instant; this only bounds how many callers may queue at once
FAILED_LOAD_LINGER_S = 5.0  # a renderer whose load failed answers its waiters with the failure this long
RENDERER_MIN_CONCURRENCY = 64  # health checks and readiness waits on top of `multiplex` rollouts


RENDERERS = Metric(kind="gauge", name="renderers", description="Renderer actors per key", tag_keys=("key",))
SLOTS = Metric(  # the metric keeps its published name
    kind="gauge", name="renderer_leases", description="Renderer slots held per key", tag_keys=("key",)
)


class RendererStartupError(LoadFailed):
    """A renderer for this key failed to load recently (the message carries its traceback): every slot
    of the key fails at once with it for `failure_hold_s` (`caller` when the load refused the key itself)."""


class RendererBudgetSpent(RestartBudgetSpent):
    """The key's renderers died, wedged or failed to start more often than its restart budget allows."""


@dataclass(eq=False)
class _Renderer(Child):
    slots: set[str] = field(default_factory=set)
    idle_since: float = 0.0
    linger: bool = False
    """Its load failed: killed a moment later, so sessions waiting on `ready` get the load's own failure."""


class _KeyPool(Supervisor[_Renderer], ChildKind[_Renderer]):
    """The renderers of one key: the kernel's supervisor, with renderer start-up plugged in."""

    def __init__(self, key_json: str, multiplex: int, config: RendererPoolConfig, orphan: Any) -> None:
        self.key_json, self.multiplex, self.config = key_json, multiplex, config
        self.startup_failure: str | None = None
        self.startup_kind = "infrastructure"
        """`caller` when the load refused what the key names (a `CallerError` on the renderer's side)."""
        self.failed_at = 0.0
        self.last_death = ""
        self.startup_failures = 0
        self._orphan = orphan
        super().__init__(RendererKey.from_json(key_json).short(), self, config.supervision)

    def create(self, name: str) -> _Renderer:
        renderer_id = new_id("renderer")
        renderer_class = _remote_renderer()
        handle = renderer_class.options(
            num_cpus=self.config.renderer_num_cpus,
            max_concurrency=2 * self.multiplex + RENDERER_MIN_CONCURRENCY,
            scheduling_strategy="SPREAD",  # one node's loss takes a fraction of the renderers
        ).remote(self.key_json, renderer_id, self.config.allowed_ref_prefixes)
        return _Renderer(renderer_id, handle, idle_since=time.monotonic())

    async def handshake(self, renderer: _Renderer) -> None:
        await renderer.handle.ready.remote()

    def on_spawn_failed(self, renderer: _Renderer, exc: BaseException) -> None:
        if ray_loss(exc) is not None:
            # Its process died while loading (killed, its node lost): a death, replaced under the key's
            # restart budget, not a startup failure that would fail every slot for failure_hold_s.
            self.spawn("restart")
            return
        what = str(exc) if not isinstance(exc, TimeoutError) else f"timed out ({exc})"
        self.startup_failure = f"renderer for {self.key_json} failed to start: {what}"
        self.startup_kind = "caller" if isinstance(remote_cause(exc), CallerError) else "infrastructure"
        self.failed_at = time.monotonic()
        self.startup_failures += 1
        renderer.linger = True
        log.warning("%s", self.startup_failure)

    def on_ready(self, renderer: _Renderer) -> None:
        self.startup_failure = None

    def on_retired(self, renderer: _Renderer, reason: str, cause: RetireCause) -> None:
        if cause != "shrunk":
            self.last_death = f"renderer {renderer.name} {reason}"
        self._orphan(renderer)

    def kill(self, renderer: _Renderer) -> None:
        if renderer.linger and not self.closed:
            asyncio.get_running_loop().call_later(FAILED_LOAD_LINGER_S, super().kill, renderer)
        else:
            super().kill(renderer)

    def place(self) -> _Renderer:
        """The least-loaded renderer with a free slot (ready ones first); one more only when every one is
        full, on the key's budget (growth and restarts share it); at the limit or refused, overfill."""
        now = time.monotonic()
        live = list(self.children.values())
        if self.startup_failure and now - self.failed_at < self.config.failure_hold_s:
            if not self.ready():
                raise RendererStartupError(self.startup_failure, kind=self.startup_kind)
        free = [r for r in live if len(r.slots) < self.multiplex]
        renderer = min(free, key=_preference) if free else None
        if renderer is None and len(live) < self.config.max_renderers_per_key:
            renderer = self.spawn("initial" if not self.spawns else "grow" if live else "restart")
            if renderer is None and not live:
                raise RendererBudgetSpent(
                    f"renderer for {self.key_json} is not restarted: {self.stopped or self.refused}; "
                    f"last: {self.last_death}"
                )
        return renderer or min(live, key=_preference)

    def stats(self, now: float) -> RendererKeyStats:
        renderers = sorted(self.children.values(), key=lambda r: r.born)
        return RendererKeyStats(
            multiplex=self.multiplex,
            loads=[len(r.slots) for r in renderers],
            renderers=[
                RendererStats(
                    renderer_id=r.name,
                    load=len(r.slots),
                    ready=r.state == "ready",
                    idle_s=(now - r.idle_since) if not r.slots else 0.0,
                )
                for r in renderers
            ],
            startup_failure=self.startup_failure,
            restarts_left=self.budget.remaining(),
        )


def _preference(renderer: _Renderer) -> tuple[bool, int, float]:
    return (renderer.state != "ready", len(renderer.slots), renderer.born)


@dataclass
class _HeldSlot:
    key_json: str
    renderer_id: str
    expires: float
    owner: str | None = None
    """The actor that took it (a rollout worker); `release_owned` returns it when that actor is lost."""


class RendererPool:
    """Hands out renderer slots per `RendererKey`. Run as a named async actor: `get_or_create_renderer_pool`."""

    def __init__(self, config: RendererPoolConfig | dict[str, Any] | None = None) -> None:
        self._config = (
            config if isinstance(config, RendererPoolConfig) else RendererPoolConfig(**(config or {}))
        )
        self._keys: dict[str, _KeyPool] = {}
        self._slots: dict[str, _HeldSlot] = {}
        self._lost_owners: dict[str, None] = {}
        self._tasks: TaskOwner | None = None
        self._closed = False
        self._counters = {"retired": 0, "expired_slots": 0}

    # ------------------------------------------------------------------------------------ slots

    async def acquire(
        self,
        key_json: str,
        multiplex: int = 256,
        *,
        dead_renderer_id: str | None = None,
        release_slot_id: str | None = None,
        owner: str | None = None,
    ) -> RendererSlot:
        """A slot on a renderer for `key_json`. Never waits.

        `dead_renderer_id`: the caller saw this renderer die (it is replaced before the slot is placed);
        `release_slot_id`: the caller's previous slot, released in the same call; `owner`: the actor
        asking (see `release_owned`)."""
        if release_slot_id is not None:
            self._release(release_slot_id)
        if dead_renderer_id is not None:
            self._lost(dead_renderer_id)
        self._check_owner(owner)
        return self._place_slot(self._key_pool(key_json, multiplex), owner)

    async def renderer_lost(self, renderer_id: str) -> None:
        """A session saw this renderer die on a call: replace it now, not at the next health check (a
        notice: nobody waits for its answer)."""
        self._lost(renderer_id)

    @ray.method(enable_task_events=False)  # per tick of every worker: see `RolloutWorker.run`
    async def acquire_many(
        self, key_json: str, multiplex: int, count: int, owner: str | None = None
    ) -> list[RendererSlot]:
        """`count` slots placed one after another, exactly as `count` calls to `acquire` would be (a
        process's concurrent sessions ask in one call: see `renderer_actors.batching`)."""
        self._check_owner(owner)
        pool = self._key_pool(key_json, multiplex)
        return [self._place_slot(pool, owner) for _ in range(count)]

    async def release_owned(self, owner: str) -> int:
        """The actor `owner` was lost (a rollout worker killed or dead): return every slot it held now,
        not at `slot_timeout_s`, and refuse slots it asked for before dying that arrive later. Returns how
        many slots were held."""
        self._lost_owners[owner] = None
        while len(self._lost_owners) > LOST_OWNER_MEMORY:
            del self._lost_owners[next(iter(self._lost_owners))]
        owned = [slot_id for slot_id, slot in self._slots.items() if slot.owner == owner]
        return sum(self._release(slot_id) for slot_id in owned)

    def _check_owner(self, owner: str | None) -> None:
        if owner is not None and owner in self._lost_owners:
            raise RuntimeError(f"the asking actor {owner} was lost; no slot is placed for it")

    async def release(self, slot_id: str) -> bool:
        """Give a slot back. Idempotent; False for an unknown slot (already released, or orphaned by a
        renderer's death)."""
        return self._release(slot_id)

    @ray.method(enable_task_events=False)  # per tick of every worker: see `RolloutWorker.run`
    async def release_many(self, slot_ids: list[str]) -> int:
        """Release several slots; returns how many were held."""
        return sum(self._release(slot_id) for slot_id in slot_ids)

    async def health(self) -> Health:
        """Liveness for the plane's supervisor: answered on the loop that serves every slot, so an answer
        means that loop turns (`loop_stall_s` is 0 by construction). Ready once it answers."""
        return Health(pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id())

    async def stats(self) -> RendererPoolStats:
        now = time.monotonic()
        pools = self._keys.values()
        return RendererPoolStats(
            keys={key_json: pool.stats(now) for key_json, pool in self._keys.items()},
            slots=len(self._slots),
            spawned=sum(p.spawns for p in pools),
            replaced=sum(p.spawned_for["restart"] for p in pools),
            startup_failures=sum(p.startup_failures for p in pools),
            budget_denials=sum(p.budget_denials for p in pools),
            **self._counters,
        )

    async def close(self) -> None:
        """Stop the background loops and warm-ups, kill every renderer. Idempotent."""
        self._closed = True
        if self._tasks is not None:
            await self._tasks.close()
        for pool in self._keys.values():
            await pool.close()
        self._slots.clear()

    # -------------------------------------------------------------------------------- placement

    def _key_pool(self, key_json: str, multiplex: int) -> _KeyPool:
        if self._closed:
            raise RuntimeError("renderer pool is shut down")
        if self._tasks is None:
            self._tasks = TaskOwner("renderer pool")
            self._tasks.keep(self._reap_loop, "reaper")
        key_json = RendererKey.from_json(key_json).to_json()  # canonical, whatever the caller sent
        pool = self._keys.get(key_json)
        if pool is None:
            pool = self._keys[key_json] = _KeyPool(
                key_json, max(1, int(multiplex)), self._config, self._orphan
            )
        return pool

    def _place_slot(self, pool: _KeyPool, owner: str | None = None) -> RendererSlot:
        renderer = pool.place()
        slot_id = new_id("rslot")
        renderer.slots.add(slot_id)
        expires = time.monotonic() + self._config.slot_timeout_s
        self._slots[slot_id] = _HeldSlot(pool.key_json, renderer.name, expires, owner)
        return RendererSlot(slot_id, renderer.handle, renderer.name, renderer.state == "ready")

    def _lost(self, renderer_id: str) -> None:
        for pool in self._keys.values():
            if (renderer := pool.children.get(renderer_id)) is not None:
                pool.retire(renderer, "reported dead by a session", "died")

    def _orphan(self, renderer: _Renderer) -> None:
        """Its slots are orphaned: releasing them is a no-op."""
        for slot_id in renderer.slots:
            self._slots.pop(slot_id, None)
        renderer.slots.clear()

    def _release(self, slot_id: str) -> bool:
        slot = self._slots.pop(slot_id, None)
        if slot is None:
            return False
        pool = self._keys.get(slot.key_json)
        renderer = pool.children.get(slot.renderer_id) if pool else None
        if renderer is not None:
            renderer.slots.discard(slot_id)
            if not renderer.slots:
                renderer.idle_since = time.monotonic()
        return True

    # --------------------------------------------------------------------------- background loops

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self._config.reap_interval_s)
            self._reap(time.monotonic())

    def _reap(self, now: float) -> None:
        for slot_id, slot in list(self._slots.items()):
            if slot.expires <= now:
                self._release(slot_id)
                self._counters["expired_slots"] += 1
        for pool in self._keys.values():
            idle = [
                r
                for r in pool.children.values()
                if not r.slots and now - r.idle_since >= self._config.idle_timeout_s
            ]
            # Retire warming ones first, then the newest: the survivor should be a warm, old renderer.
            idle.sort(key=lambda r: (r.state == "ready", -r.born))
            for renderer in idle:
                if len(pool.children) <= 1:
                    break
                pool.retire(renderer, "idle", "shrunk")
                self._counters["retired"] += 1
            RENDERERS.record(len(pool.children), {"key": pool.name})
            SLOTS.record(sum(len(r.slots) for r in pool.children.values()), {"key": pool.name})


def get_or_create_renderer_pool(
    name: str,
    config: RendererPoolConfig | dict[str, Any] | None = None,
    namespace: str | None = None,
    scheduling_strategy: Any = None,
) -> Any:
    """The named `RendererPool` actor, created on first call (num_cpus=0: it only waits). `config`
    applies only when this call creates it. Created without `lifetime="detached"`, so it fate-shares with
    the process that created it (the plane's driver); its owner stops it with `close` + `ray.kill`."""
    return _REMOTE_POOL.options(
        name=name,
        namespace=namespace,
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=POOL_MAX_CONCURRENCY,
        scheduling_strategy=scheduling_strategy,
    ).remote(config)


@functools.cache
def _remote_renderer() -> Any:
    # Imported when the pool first spawns one: the renderer's library (and the `openai` it imports) costs
    # the pool's own process ~1.5 s of start on 2 cores, and the pool never renders.
    from renderer_actors.actor import RendererActor

    return ray.remote(RendererActor)


_REMOTE_POOL = ray.remote(RendererPool)
