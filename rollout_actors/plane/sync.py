"""`SyncRolloutPlane`: the plane for scripts that do not use asyncio.

    with SyncRolloutPlane(PlaneConfig(lanes={"train": 64, "eval": 8})) as plane:
        results = plane.run([request_a, request_b])        # in request order
        group = plane.run_group(request, n=8)               # a complete `Group`
        plane.publish_policy(adapter, version=1)            # returns once every server has it
        plane.call(lambda p: p.set_limit("train", 32))      # anything else: a coroutine on the plane

The plane runs on its own event loop in a background thread that this object starts and stops: the
plane's background work (liveness probes, group deadlines, metrics) keeps running between calls. Every
call waits with a deadline (`timeout`, or the plane's own answer deadlines).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from rollout_actors.plane.config import PlaneConfig
from rollout_actors.plane.facade import RolloutPlane
from rollout_actors.plane.groups import Group, Stragglers
from rollout_actors.plane.stats import PlaneStats
from rollout_actors.wire import Result, RolloutRequest

T = TypeVar("T")

START_TIMEOUT_S = 600.0  # starting pools and workers on a cold cluster: minutes, not hours
CLOSE_TIMEOUT_S = 120.0


class SyncRolloutPlane:
    def __init__(self, config: PlaneConfig | None = None, **plane_kwargs: Any) -> None:
        """Same arguments as `RolloutPlane` (`endpoints=`, `servers=`)."""
        self._config = config
        self._plane_kwargs = plane_kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rollout-plane", daemon=True)
        self._plane: RolloutPlane | None = None

    def start(self) -> SyncRolloutPlane:
        import ray

        if not ray.is_initialized():
            ray.init()  # in the caller's thread: Ray installs its signal handlers there
        self._thread.start()

        async def build() -> RolloutPlane:
            return await RolloutPlane(self._config, **self._plane_kwargs).start()

        self._plane = self._wait(build(), START_TIMEOUT_S)
        return self

    def close(self) -> None:
        try:
            if self._plane is not None:
                self._wait(self._plane.close(), CLOSE_TIMEOUT_S)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=CLOSE_TIMEOUT_S)
            self._loop.close()

    def __enter__(self) -> SyncRolloutPlane:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def plane(self) -> RolloutPlane:
        """The async plane underneath (use it only through `call`: it lives on another thread)."""
        if self._plane is None:
            raise RuntimeError(
                "SyncRolloutPlane used before start(): use `with SyncRolloutPlane(...) as plane:`"
            )
        return self._plane

    def call(self, fn: Callable[[RolloutPlane], Awaitable[T]], timeout: float | None = None) -> T:
        """Run `fn(plane)` on the plane's loop and return its result."""
        plane = self.plane

        async def invoke() -> T:
            return await fn(plane)

        return self._wait(invoke(), timeout)

    def run(
        self, requests: Sequence[RolloutRequest | dict[str, Any]], timeout: float | None = None
    ) -> list[Result]:
        """Submit every request (waiting for lane slots), then wait for all their results, in request
        order. Reads the plane's single results: run it alone, not alongside other readers of them."""

        async def go(plane: RolloutPlane) -> list[Result]:
            ids = [await plane.submit(request) for request in requests]
            wanted, got = set(ids), {}
            while wanted - got.keys():
                result = await plane.next_result(timeout=timeout)
                got[result.request_id] = result
            return [got[request_id] for request_id in ids]

        return self.call(go)

    def run_group(
        self,
        request: RolloutRequest | dict[str, Any],
        n: int,
        stragglers: Stragglers | None = None,
        one_policy: bool = False,
        timeout: float | None = None,
    ) -> Group:
        async def go(plane: RolloutPlane) -> Group:
            handle = await plane.submit_group(request, n, stragglers=stragglers, one_policy=one_policy)
            return await handle.wait(timeout)

        return self.call(go)

    def publish_policy(self, adapter: Any, version: int, timeout: float | None = None) -> Any:
        """Publish and wait until every server has loaded it; returns the active policy."""

        async def go(plane: RolloutPlane) -> Any:
            return await (await plane.publish_policy(adapter, version)).wait(timeout)

        return self.call(go)

    def stats(self) -> PlaneStats:
        async def go(plane: RolloutPlane) -> PlaneStats:
            return plane.stats()

        return self.call(go)

    def _wait(self, coro: Awaitable[T], timeout: float | None) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise
