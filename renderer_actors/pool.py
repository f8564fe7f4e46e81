"""`RendererPool`: one named async actor that leases renderer slots to every rollout worker.

Usage (the session does this for a rollout; see `renderer_actors.session`)::

    pool = get_or_create_renderer_pool("plane-1/renderer-pool")
    slot = await pool.acquire.remote(key.to_json(), multiplex=256)
    ids = await slot.renderer.start.remote(messages, tools)
    await pool.release.remote(slot.slot_id)

The first slot for a `RendererKey` (model, library renderer config + template kwargs, history policy)
returns at once and warms one renderer in the background; callers wait for its readiness themselves
(`renderer.ready`), within their own deadlines. `multiplex` is not part of the key: configs that differ
only in multiplex share one set of renderers, and the first slot for a key fixes its multiplex (later
values are ignored; `stats` shows the one in force). A slot is held until released, until its holder is
lost (`release_owned`), for at most `slot_timeout_s`, or until its renderer leaves service (then it is
orphaned and its holder acquires a new one).

This module is the leasing; each key's renderers are supervised by a `RendererSet` (`renderer_set.py`:
placement, growth on the key's restart budget, startup failures, idle shrink). `close` stops them all.
Renderers are created by the pool, so they fate-share with it.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import ray

from renderer_actors.calls import RendererSlot
from renderer_actors.config import RendererPoolConfig, RendererPoolStats
from renderer_actors.key import RendererKey
from renderer_actors.renderer_set import RendererBudgetSpent, RendererChild, RendererSet, RendererStartupError
from rollout_actors.kernel.supervision import Health, Recent
from rollout_actors.kernel.tasks import TaskOwner

__all__ = ["RendererBudgetSpent", "RendererPool", "RendererStartupError", "get_or_create_renderer_pool"]

LOST_OWNER_MEMORY = 1_000  # lost owners remembered, so a slot one asked for before dying is refused
POOL_MAX_CONCURRENCY = 10_000  # slots are instant; this only bounds how many callers may queue at once


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
        self._keys: dict[str, RendererSet] = {}
        self._slots: dict[str, _HeldSlot] = {}
        self._lost_owners: Recent[str, None] = Recent(LOST_OWNER_MEMORY)
        self._tasks: TaskOwner | None = None
        self._closed = False
        self._expired_slots = 0
        self._slot_ids = itertools.count()
        self._incarnation = uuid.uuid4().hex[:8]
        """Slot ids are this pool's incarnation and a count: unique, and no slot of a pool lost before
        (under the same name) can be mistaken for one of this one's."""

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
        self,
        key_json: str,
        multiplex: int,
        count: int,
        owner: str | None = None,
        known: list[str] | None = None,
    ) -> list[RendererSlot]:
        """`count` slots placed one after another, exactly as `count` calls to `acquire` would be (a
        process's concurrent sessions ask in one call: see `renderer_actors.batching`). A slot on a
        renderer named in `known` (the asker holds its handle) comes without the handle."""
        self._check_owner(owner)
        pool = self._key_pool(key_json, multiplex)
        held = frozenset(known or ())
        return [self._place_slot(pool, owner, held) for _ in range(count)]

    async def release_owned(self, owner: str) -> int:
        """The actor `owner` was lost (a rollout worker killed or dead): return every slot it held now,
        not at `slot_timeout_s`, and refuse slots it asked for before dying that arrive later. Returns how
        many slots were held."""
        self._lost_owners[owner] = None
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
            spawned=sum(p.supervisor.spawns for p in pools),
            replaced=sum(p.supervisor.spawned_for["restart"] for p in pools),
            startup_failures=sum(p.startup_failures for p in pools),
            budget_denials=sum(p.supervisor.budget_denials for p in pools),
            retired=sum(p.supervisor.shrunk for p in pools),
            expired_slots=self._expired_slots,
        )

    async def close(self) -> None:
        """Stop the background loops and warm-ups, kill every renderer. Idempotent."""
        self._closed = True
        if self._tasks is not None:
            await self._tasks.close()
        for pool in self._keys.values():
            await pool.supervisor.close()
        self._slots.clear()

    # -------------------------------------------------------------------------------- placement

    def _key_pool(self, key_json: str, multiplex: int) -> RendererSet:
        if self._closed:
            raise RuntimeError("renderer pool is shut down")
        if self._tasks is None:
            self._tasks = TaskOwner("renderer pool")
            self._tasks.keep(self._reap_loop, "reaper")
        key_json = RendererKey.from_json(key_json).to_json()  # canonical, whatever the caller sent
        pool = self._keys.get(key_json)
        if pool is None:
            pool = self._keys[key_json] = RendererSet(
                key_json, max(1, int(multiplex)), self._config, self._orphan
            )
        return pool

    def _place_slot(
        self, pool: RendererSet, owner: str | None = None, known: frozenset[str] = frozenset()
    ) -> RendererSlot:
        renderer = pool.place()
        slot_id = f"rslot-{self._incarnation}-{next(self._slot_ids)}"
        renderer.slots.add(slot_id)
        expires = time.monotonic() + self._config.slot_timeout_s
        self._slots[slot_id] = _HeldSlot(pool.key_json, renderer.name, expires, owner)
        handle = None if renderer.name in known else renderer.handle
        return RendererSlot(slot_id, handle, renderer.name, renderer.state == "ready")

    def _lost(self, renderer_id: str) -> None:
        for pool in self._keys.values():
            if (renderer := pool.supervisor.children.get(renderer_id)) is not None:
                pool.supervisor.retire(renderer, "reported dead by a session", "died")

    def _orphan(self, renderer: RendererChild) -> None:
        """Its slots are orphaned: releasing them is a no-op."""
        for slot_id in renderer.slots:
            self._slots.pop(slot_id, None)
        renderer.slots.clear()

    def _release(self, slot_id: str) -> bool:
        slot = self._slots.pop(slot_id, None)
        if slot is None:
            return False
        pool = self._keys.get(slot.key_json)
        renderer = pool.supervisor.children.get(slot.renderer_id) if pool else None
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
        # Slots are held in the order they were placed, so in the order they expire (one `slot_timeout_s`
        # for all): the expired ones are at the front, and the scan stops at the first that is not.
        expired = []
        for slot_id, slot in self._slots.items():
            if slot.expires > now:
                break
            expired.append(slot_id)
        for slot_id in expired:
            self._release(slot_id)
        self._expired_slots += len(expired)


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


_REMOTE_POOL = ray.remote(RendererPool)
