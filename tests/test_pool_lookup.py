"""A rollout worker's named lookups (`PoolLookup`): one per pool incarnation, redone for a replacement,
never held past it, never on the worker's event loop, and a name that cannot be found is a lost pool."""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import ray
from waiting import runner

from rollout_actors.rollout import pool_lookup
from rollout_actors.rollout.pool_lookup import PoolLookup, PoolLookupFailed, PoolName, PoolRoute


@ray.remote(num_cpus=0)
class _Pool:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def whoami(self) -> str:
        return self.tag


run = runner(60.0)


def test_each_incarnation_is_looked_up_once_and_a_replacement_replaces_it(ray_session):
    base = f"test-pool-{uuid.uuid4().hex[:8]}"
    first = _Pool.options(name=PoolName(base, 1).actor_name).remote("first")
    second = _Pool.options(name=PoolName(base, 2).actor_name).remote("second")

    async def scenario():
        lookup = PoolLookup()
        route = PoolRoute(env_pool=PoolName(base, 1), renderer_pool=None)
        handles = await asyncio.gather(*(lookup.resolve(route) for _ in range(20)))
        assert {await h.env.whoami.remote() for h in handles} == {"first"}
        assert handles[0].renderer is None
        known_first = lookup._known[base][1]
        assert all(h.env._actor_id == handles[0].env._actor_id for h in handles)  # one lookup, shared

        moved = await lookup.resolve(PoolRoute(env_pool=PoolName(base, 2), renderer_pool=None))
        assert await moved.env.whoami.remote() == "second"
        assert lookup._known[base][1] is not known_first  # the lost incarnation's handle is dropped
        with pytest.raises(PoolLookupFailed, match="replaced meanwhile") as stale:
            await lookup.resolve(route)  # a dispatch sent before the replacement, arriving after it
        assert stale.value.failure.type == "PoolUnreachable"

    try:
        run(scenario())
    finally:
        ray.kill(first)
        ray.kill(second)


def test_a_name_that_is_gone_fails_as_that_pools_loss_and_is_not_remembered(ray_session):
    async def scenario():
        lookup = PoolLookup()
        gone = PoolName(f"test-gone-{uuid.uuid4().hex[:8]}", 3)
        route = PoolRoute(env_pool=PoolName(f"test-gone-{uuid.uuid4().hex[:8]}", 1), renderer_pool=gone)
        with pytest.raises(PoolLookupFailed) as failed:
            await lookup.resolve(route)
        assert failed.value.failure.type == "PoolUnreachable"  # re-dispatched by the plane, not failed
        assert not lookup._known  # a failed lookup is asked again next time

    run(scenario())


def test_lookups_run_off_the_event_loop(ray_session, monkeypatch):
    """The fake `ray.get_actor` answers only once the event loop has run another coroutine meanwhile: a
    lookup made on the loop itself would never see that happen and fail."""
    loop_turned = threading.Event()

    def get_actor(name: str, namespace: str | None = None) -> str:
        if not loop_turned.wait(timeout=10):
            raise RuntimeError("the event loop was blocked while the lookup ran")
        return f"handle of {name}"

    monkeypatch.setattr(pool_lookup.ray, "get_actor", get_actor)

    async def scenario():
        async def other_rollout() -> None:
            await asyncio.sleep(0.05)
            loop_turned.set()

        other = asyncio.ensure_future(other_rollout())
        handles = await PoolLookup().resolve(PoolRoute(env_pool=PoolName("p", 1), renderer_pool=None))
        await other
        return handles.env

    assert run(scenario()) == "handle of p"


def test_a_route_travels_as_plain_actor_names_and_comes_back_the_same():
    route = PoolRoute(
        env_pool=PoolName("p@1x/env-pool/ab12", 3), renderer_pool=PoolName("p/renderer-pool", 1)
    )
    assert route.wire() == ("p@1x/env-pool/ab12@3", "p/renderer-pool")
    assert PoolRoute.from_wire(*route.wire()) == route
    chat = PoolRoute(env_pool=PoolName("p/env-pool/ab12", 1), renderer_pool=None)
    assert PoolRoute.from_wire(*chat.wire()) == chat
