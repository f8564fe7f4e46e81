"""Where a rollout worker finds the pools a dispatch names: `PoolRoute` in, live handles out.

    route = PoolRoute(env_pool=PoolName("p/env-pool/ab12", 2), renderer_pool=PoolName("p/renderer-pool", 1))
    env_pool, renderer_pool = route.wire()          # the actor names, as plain strings in `wire.Dispatch`
    handles = await lookup.resolve(PoolRoute.from_wire(env_name, renderer_name))   # in the worker

The plane supervises the pools and names, with every dispatch, the incarnation of each pool that is serving
(`PoolName`: a base name and an incarnation number; each incarnation is its own named actor, so a name
never comes to mean another actor). The worker looks a name up once (`ray.get_actor`, in a thread: it is a
blocking GCS call and must not stall the rollouts on this event loop; concurrent asks share one lookup)
and keeps only the newest incarnation of each pool: the first dispatch naming a replacement drops the lost
one's handle and looks the replacement up. A name that cannot be found (the incarnation was lost between
dispatch and lookup) fails the dispatch as that pool's loss, which the plane re-dispatches.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import ray

from rollout_actors.kernel import Loss, Part
from rollout_actors.kernel.faults import PartLost
from rollout_actors.kernel.tasks import holds_value, retrieve_exception
from rollout_actors.rollout.loop import PoolHandles

LOOKUP_TIMEOUT_S = 10.0  # one GCS name lookup; a GCS that cannot answer this fast is itself in trouble


@dataclass(frozen=True)
class PoolName:
    """One incarnation of a supervised pool actor."""

    base: str
    incarnation: int

    @property
    def actor_name(self) -> str:
        return self.base if self.incarnation == 1 else f"{self.base}@{self.incarnation}"

    @classmethod
    def parse(cls, actor_name: str) -> PoolName:
        base, at, number = actor_name.rpartition("@")
        if at and number.isdigit() and int(number) >= 2:
            return cls(base, int(number))
        return cls(actor_name, 1)


@dataclass(frozen=True)
class PoolRoute:
    """The serving pool incarnations one dispatch talks to."""

    env_pool: PoolName
    renderer_pool: PoolName | None
    """None: the rollout does not render (chat mode)."""

    def wire(self) -> tuple[str, str | None]:
        """The actor names, as they travel with the dispatch: plain strings (Ray packs them without
        pickling, which an object would need on every dispatch)."""
        return self.env_pool.actor_name, self.renderer_pool.actor_name if self.renderer_pool else None

    @classmethod
    def from_wire(cls, env_pool: str, renderer_pool: str | None) -> PoolRoute:
        return cls(PoolName.parse(env_pool), PoolName.parse(renderer_pool) if renderer_pool else None)


class PoolLookupFailed(PartLost):
    """A pool the dispatch names could not be found: it was lost after the plane named it (a lost part,
    so the plane re-dispatches the rollout rather than fail it)."""


class PoolLookup:
    """A worker's named lookups, one per pool incarnation, never held past the next incarnation."""

    def __init__(self, namespace: str | None = None) -> None:
        self._namespace = namespace
        self._known: dict[str, tuple[int, asyncio.Future[Any]]] = {}
        """Pool base name -> (incarnation, its handle: a future shared by everyone who asked for it)."""

    async def resolve(self, route: PoolRoute, timeout: float = LOOKUP_TIMEOUT_S) -> PoolHandles:
        env = await self._handle(route.env_pool, timeout, "PoolUnreachable", "env pool")
        renderer = None
        if route.renderer_pool is not None:
            renderer = await self._handle(
                route.renderer_pool, timeout, "RendererUnavailable", "renderer pool"
            )
        return PoolHandles(renderer=renderer, env=env)

    async def _handle(self, name: PoolName, timeout: float, failure_type: str, what: Part) -> Any:
        known = self._known.get(name.base)
        if known is None or known[0] < name.incarnation:  # first ask, or a replacement: look it up
            lookup = asyncio.ensure_future(self._lookup(name.actor_name))
            lookup.add_done_callback(retrieve_exception)  # its askers may all have given up
            self._known[name.base] = known = (name.incarnation, lookup)
        elif known[0] > name.incarnation:
            # An older incarnation than one already seen here: it was lost after this dispatch was sent.
            raise _lost(failure_type, what, name, "was replaced meanwhile")
        lookup = known[1]
        if holds_value(lookup):
            return lookup.result()  # every dispatch but the first: no timer, no task
        try:
            return await asyncio.wait_for(asyncio.shield(lookup), timeout)
        except Exception as exc:
            if self._known.get(name.base) is known:  # a failed lookup is not kept: the next ask retries
                del self._known[name.base]
            raise _lost(failure_type, what, name, f"not found: {exc!r}") from exc

    async def _lookup(self, actor_name: str) -> Any:
        return await asyncio.wait_for(
            asyncio.to_thread(ray.get_actor, actor_name, namespace=self._namespace), LOOKUP_TIMEOUT_S
        )


def _lost(failure_type: str, part: Part, name: PoolName, why: str) -> PoolLookupFailed:
    loss = Loss(part=part, how="died", call="lookup", name=name.actor_name)
    return PoolLookupFailed(f"{part} {name.actor_name} {why}", lost=loss, type_name=failure_type)
