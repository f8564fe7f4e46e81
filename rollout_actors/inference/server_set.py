"""`InferenceServerSet`: owns N `InferenceServer` actors, routes only to ready ones, replaces the dead.

    servers = InferenceServerSet(ServerSpec(model="Qwen/Qwen3-8B", tensor_parallel_size=2), replicas=4)
    await servers.start()                  # all ready, or ServerStartupError (exit code + log tail)
    client_urls = servers.endpoints()      # live OpenAI base URLs, for routing and for publication
    ...
    await servers.aclose()

It runs in the driver's event loop beside the plane (it is not an actor: `endpoints()` is a plain call).
The servers are children of the kernel's `Supervisor`; their signs of life are long `watch()` calls. A
death (the process exited, was killed as wedged, or the actor / its node died) takes the slot out of
`endpoints()` at once; a replacement is started within the restart budget and takes traffic only once
ready (and once `before_routing`, e.g. `PolicyPublisher.load_current`, has succeeded on it). While the
budget is spent the slot stays empty and the set says so (`exhausted`, `status()`): it fails loudly
rather than flapping.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import ray

from rollout_actors.inference.server_actor import (
    InferenceServer,
    ServerSpec,
    ServerStartupError,
    ServerStatus,
    raise_for_startup,
    server_actor_options,
)
from rollout_actors.kernel.renamed import warn_renamed
from rollout_actors.kernel.supervision import Health, RestartIntensity, Supervision
from rollout_actors.kernel.supervisor import Child, ChildKind, RetireCause, Supervisor

logger = logging.getLogger(__name__)

WATCH_GRACE = 30.0  # beyond the probe interval: an actor that cannot answer this late is itself wedged


SERVER_RESTARTS = RestartIntensity(max_restarts=3, window_s=600.0)
"""Enough to ride out an OOM or a lost node, few enough that a server dying on every load fails. Ten
minutes, because a model server's load alone takes minutes."""


@dataclass(eq=False)
class _Server(Child):
    index: int = 0
    """Its slot: `status()[index]` is its status."""


class InferenceServerSet(Supervisor[_Server], ChildKind[_Server]):
    """`replicas` servers started from one `ServerSpec`: the kernel's supervisor, slots kept full."""

    stop_timeout_s = 30.0
    """`close` grants the server STOP_GRACE (10 s) twice; then the actor is killed anyway."""

    def __init__(
        self,
        spec: ServerSpec,
        replicas: int = 1,
        restart: RestartIntensity = SERVER_RESTARTS,
        probe_interval_s: float = 30.0,
        before_routing: Callable[[str], Awaitable[None]] | None = None,
        *,
        watch_period: float | None = None,  # the old name of probe_interval_s (docs/design.md, "Words")
    ):
        if watch_period is not None:
            warn_renamed("InferenceServerSet(watch_period=)", "probe_interval_s=")
            probe_interval_s = watch_period  # the old name's value
        self.spec = spec
        self.probe_interval_s = probe_interval_s
        self.before_routing = before_routing
        """Awaited with a replacement's URL before it takes traffic; raising rejects the replacement."""
        self._status = [ServerStatus(state="created") for _ in range(replicas)]
        settings = Supervision(
            restart=restart,
            ready_timeout_s=spec.ready_timeout_s + 2 * WATCH_GRACE,
            probe_interval_s=probe_interval_s,
            probe_timeout_s=probe_interval_s + WATCH_GRACE,
            hang_timeout_s=probe_interval_s + WATCH_GRACE,
        )
        super().__init__("inference servers", self, settings)
        self.floor = replicas

    async def start(self) -> list[str]:  # type: ignore[override]
        """Start every replica; raises `ServerStartupError` (and stops the others) if one fails."""
        try:
            await super().start()
        except ServerStartupError:
            raise
        except Exception as exc:
            raise ServerStartupError(ServerStatus(state="dead", reason=f"not ready: {exc!r}")) from exc
        return self.endpoints()

    def endpoints(self) -> list[str]:
        """OpenAI base URLs of the servers that are ready now (a dead one drops out at once)."""
        status = [self._status[s.index] for s in sorted(self.ready(), key=lambda s: s.index)]
        return [s.url for s in status if s.state == "ready" and s.url]

    def status(self) -> list[ServerStatus]:
        return list(self._status)

    @property
    def restarts(self) -> int:
        """Replacements started over the set's life."""
        return self.budget.spent_total

    @property
    def exhausted(self) -> bool:
        """True when some slot is empty because its restart budget ran out."""
        return self.refused is not None and len(self.children) < self.floor

    def actors(self) -> list[ray.actor.ActorHandle]:
        return [s.handle for s in self.children.values()]

    async def aclose(self) -> None:
        """Stop supervising, then stop every server."""
        await self.close()

    # ------------------------------------------------------------------------- the kind's hooks

    def create(self, name: str) -> _Server:
        index = min(set(range(self.floor)) - {s.index for s in self.children.values()})
        actor = InferenceServer.options(**server_actor_options(self.spec)).remote(self.spec)
        self._status[index] = ServerStatus(state="starting")
        return _Server(f"inference-server-{index}.{self.spawns}", actor, index=index)

    async def handshake(self, server: _Server) -> None:
        try:
            status = await server.handle.start.remote()
        except Exception as exc:
            status = ServerStatus(state="dead", reason=f"actor failed during startup: {exc!r}")
        if status.state == "ready" and self.before_routing is not None:
            try:
                await self.before_routing(status.url)
            except Exception as exc:
                status = status.model_copy(update={"state": "dead", "reason": f"before_routing: {exc!r}"})
        self._status[server.index] = status  # only a ready server enters endpoints()
        raise_for_startup(status)

    async def probe(self, server: _Server) -> Health:
        status = await server.handle.watch.remote(self.probe_interval_s)  # returns at once if it exits
        if status.state != "ready":  # it exited, or was killed as wedged
            self._status[server.index] = status
            self.retire(server, f"died: {status.reason}", "died")
        return Health(pid=status.pid)

    def on_retired(self, server: _Server, reason: str, cause: RetireCause) -> None:
        status = self._status[server.index]
        if status.state in ("ready", "starting"):
            self._status[server.index] = status.model_copy(update={"state": "dead", "reason": reason})
        if cause in ("died", "wedged"):
            logger.warning("inference server %s retired: %s", status.url, reason)

    def stop(self, server: _Server) -> Awaitable[ServerStatus]:
        # Lost or not: `close` takes vLLM's worker processes (its process group) down with the server.
        return server.handle.close.remote()
