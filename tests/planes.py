"""The suite's small planes: a module's plane factory, and a plane on an event loop of its own for
module-scoped fixtures that drive it from sync tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
    lanes: dict[str, int], deadline_s: float
) -> Iterator[tuple[Callable[[Any], Any], RolloutPlane]]:
    """(run, plane): one small started plane (one worker); `run(coro)` runs on its loop under
    `deadline_s`. Closed, and its loop with it, on exit."""
    loop = asyncio.new_event_loop()
    plane = RolloutPlane(PlaneConfig(lanes=lanes, **SMALL_PLANE))

    def run(coro: Any) -> Any:
        return loop.run_until_complete(asyncio.wait_for(coro, deadline_s))

    run(plane.start())
    try:
        yield run, plane
    finally:
        run(plane.close())
        loop.close()
