"""A plane on an event loop of its own, for module-scoped fixtures that drive it from sync tests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from env_pools import TEST_REF_PREFIXES

from rollout_actors.plane import PlaneConfig, RolloutPlane


@contextmanager
def plane_on_own_loop(
    lanes: dict[str, int], deadline_s: float
) -> Iterator[tuple[Callable[[Any], Any], RolloutPlane]]:
    """(run, plane): one small started plane (one worker); `run(coro)` runs on its loop under
    `deadline_s`. Closed, and its loop with it, on exit."""
    loop = asyncio.new_event_loop()
    plane = RolloutPlane(
        PlaneConfig(
            lanes=lanes,
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
    )

    def run(coro: Any) -> Any:
        return loop.run_until_complete(asyncio.wait_for(coro, deadline_s))

    run(plane.start())
    try:
        yield run, plane
    finally:
        run(plane.close())
        loop.close()
