"""`InferenceServerSet`: owns N `InferenceServer` actors, routes only to ready ones, replaces the dead.

    servers = InferenceServerSet(ServerSpec(model="Qwen/Qwen3-8B", tensor_parallel_size=2), replicas=4)
    await servers.start()                  # all ready, or ServerStartupError (exit code + log tail)
    client_urls = servers.endpoints()      # live OpenAI base URLs, for routing and for publication
    ...
    await servers.aclose()

It runs in the driver's event loop beside the plane (it is not an actor: `endpoints()` is a plain call).
Each slot has one supervising task that waits on its actor's `watch()` with a deadline. A death (the
process exited, was killed as wedged, or the actor / its node died) takes the slot out of `endpoints()`
at once; a replacement is started within the restart budget and takes traffic only once ready (and
once `before_routing`, e.g. `PolicyPublisher.load_current`, has succeeded on it). When the budget is
spent the slot stays empty and the set says so in `status()`: it fails loudly rather than flapping.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import ray

from rollout_actors.inference.server_actor import (
    InferenceServer,
    ServerSpec,
    ServerStartupError,
    ServerStatus,
    raise_for_startup,
    server_actor_options,
)
from rollout_actors.kernel.supervision import RestartBudget, RestartIntensity

logger = logging.getLogger(__name__)

WATCH_GRACE = 30.0  # beyond the watch period: an actor that cannot answer this late is itself wedged
STOP_TIMEOUT = 30.0  # stop() grants the server STOP_GRACE (10 s) twice; then the actor is killed anyway


SERVER_RESTARTS = RestartIntensity(max_restarts=3, window_s=600.0)
"""Enough to ride out an OOM or a lost node, few enough that a server dying on every load fails. Ten
minutes, because a model server's load alone takes minutes."""


@dataclass
class _Slot:
    index: int
    actor: ray.actor.ActorHandle | None = None
    status: ServerStatus = field(default_factory=lambda: ServerStatus(state="created"))
    failed: str | None = None
    """Set when the budget ran out: the slot stays empty."""


class InferenceServerSet:
    """Supervisor over `replicas` servers started from one `ServerSpec`."""

    def __init__(
        self,
        spec: ServerSpec,
        replicas: int = 1,
        restart: RestartIntensity = SERVER_RESTARTS,
        watch_period: float = 30.0,
        before_routing: Callable[[str], Awaitable[None]] | None = None,
    ):
        self.spec = spec
        self.budget = RestartBudget(restart)
        self.watch_period = watch_period
        self.before_routing = before_routing
        """Awaited with a replacement's URL before it takes traffic; raising rejects the replacement."""
        self._slots = [_Slot(i) for i in range(replicas)]
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False

    async def start(self) -> list[str]:
        """Start every replica; raises `ServerStartupError` (and stops the others) if one fails."""
        results = await asyncio.gather(*(self._launch(slot) for slot in self._slots), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            await self.aclose()
            raise errors[0]
        for slot in self._slots:
            task = asyncio.create_task(self._supervise(slot), name=f"inference-server-{slot.index}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return self.endpoints()

    def endpoints(self) -> list[str]:
        """OpenAI base URLs of the servers that are ready now (a dead one drops out at once)."""
        return [s.status.url for s in self._slots if s.status.state == "ready" and s.status.url]

    def status(self) -> list[ServerStatus]:
        return [s.status for s in self._slots]

    @property
    def restarts(self) -> int:
        """Replacements started over the set's life."""
        return self.budget.spent_total

    @property
    def exhausted(self) -> bool:
        """True when some slot is empty for good (its restart budget ran out)."""
        return any(s.failed for s in self._slots)

    def actors(self) -> list[ray.actor.ActorHandle]:
        return [s.actor for s in self._slots if s.actor is not None]

    async def aclose(self) -> None:
        """Stop supervising, then stop every server."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(self._retire(slot) for slot in self._slots))

    # ------------------------------------------------------------------------------------ internal

    async def _launch(self, slot: _Slot) -> None:
        actor = InferenceServer.options(**server_actor_options(self.spec)).remote(self.spec)
        slot.actor = actor
        slot.status = ServerStatus(state="starting")
        try:
            status = await asyncio.wait_for(actor.start.remote(), self.spec.startup_timeout_s + WATCH_GRACE)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            status = ServerStatus(state="dead", reason=f"actor failed during startup: {exc!r}")
        if status.state == "ready" and self.before_routing is not None:
            try:
                await self.before_routing(status.url)
            except Exception as exc:
                status = status.model_copy(update={"state": "dead", "reason": f"before_routing: {exc!r}"})
        if status.state != "ready":
            slot.status = status
            await self._retire(slot)
        slot.status = status  # only now does a ready server appear in endpoints()
        raise_for_startup(status)

    async def _supervise(self, slot: _Slot) -> None:
        while not self._closed:
            status = await self._watch(slot)
            if status.state == "ready":
                continue
            slot.status = status  # out of routing before anything else happens
            logger.warning("inference server %s died: %s", status.url, status.reason)
            await self._retire(slot)
            while not self._closed:
                if not self.budget.try_spend():
                    slot.failed = f"{self.budget.spent_message()}; last death: {status.reason}"
                    logger.error("inference server slot %d left empty: %s", slot.index, slot.failed)
                    return
                try:
                    await self._launch(slot)
                    break
                except ServerStartupError as exc:
                    status = exc.status
                    logger.warning("replacement inference server failed to start: %s", status.reason)

    async def _watch(self, slot: _Slot) -> ServerStatus:
        assert slot.actor is not None
        try:
            return await asyncio.wait_for(
                slot.actor.watch.remote(self.watch_period), self.watch_period + WATCH_GRACE
            )
        except ray.exceptions.RayError as exc:  # the actor (or its node) died
            return slot.status.model_copy(update={"state": "dead", "reason": f"actor died: {exc!r}"})
        except TimeoutError:
            return slot.status.model_copy(update={"state": "dead", "reason": "actor did not answer watch()"})

    async def _retire(self, slot: _Slot) -> None:
        actor, slot.actor = slot.actor, None
        if actor is None:
            return
        try:
            await asyncio.wait_for(actor.stop.remote(), STOP_TIMEOUT)
        except (ray.exceptions.RayError, TimeoutError):
            pass  # dead or wedged: ray.kill below ends it either way (and the server with it)
        ray.kill(actor)
