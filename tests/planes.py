"""The suite's small planes: a module's plane factory, and a plane on an event loop of its own for
module-scoped fixtures that drive it from sync tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

from env_pools import TEST_REF_PREFIXES

from rollout_actors.plane import PlaneConfig, RolloutPlane

SMALL_PLANE: dict[str, Any] = dict(
    workers=1,
    worker_num_cpus=0.25,
    env_pool={"num_cpus": 0.25},
    allowed_ref_prefixes=TEST_REF_PREFIXES,
)
"""What every test plane shares on a 2-core machine: one small worker, small env servers, the test refs."""


def plane_factory(**defaults: Any) -> Callable[..., RolloutPlane]:
    """A module's `plane(**overrides)`: `SMALL_PLANE`, then the module's `defaults`, then the call's
    overrides (each replaces a whole field, as `PlaneConfig(**fields)` would)."""

    def plane(**overrides: Any) -> RolloutPlane:
        return RolloutPlane(PlaneConfig(**{**SMALL_PLANE, **defaults, **overrides}))

    return plane


@contextmanager
def plane_on_own_loop(
    lanes: dict[str, int], timeout_s: float, **overrides: Any
) -> Iterator[tuple[Callable[[Any], Any], RolloutPlane]]:
    """(run, plane): one small started plane (one worker, `SMALL_PLANE` then `overrides`); `run(coro)` runs
    on its loop under `timeout_s`. Closed, and its loop with it, on exit. For a module's tests that only
    submit and read their own results: one plane start (worker, pools, renderer) instead of one per test."""
    loop = asyncio.new_event_loop()
    plane = RolloutPlane(PlaneConfig(lanes=lanes, **{**SMALL_PLANE, **overrides}))

    def run(coro: Any) -> Any:
        return loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    run(plane.start())
    try:
        yield run, plane
    finally:
        run(plane.close())
        loop.close()


@asynccontextmanager
async def lent(plane: RolloutPlane) -> AsyncIterator[RolloutPlane]:
    """A module's shared plane where a test would start its own (`async with lent(plane) as p:`): left
    open on exit, for the next test."""
    yield plane
