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

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

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
from rollout_actors.kernel.supervisor import Child, ChildExited, ChildKind, ChildSpec, RetireCause, Supervisor

WATCH_GRACE = 30.0  # beyond the probe interval: an actor that cannot answer this late is itself wedged
STOP_TIMEOUT_S = 30.0  # `close` grants the server STOP_GRACE (10 s) twice; then the actor is killed anyway


SERVER_RESTARTS = RestartIntensity(max_restarts=3, window_s=600.0)
"""Enough to ride out an OOM or a lost node, few enough that a server dying on every load fails. Ten
minutes, because a model server's load alone takes minutes."""


@dataclass(eq=False)
class _Server(Child):
    index: int = 0
    """Its slot: `status()[index]` is its status while it holds the slot."""
    status: ServerStatus = field(default_factory=lambda: ServerStatus(state="starting"))


def _read_watch(server: _Server, status: ServerStatus) -> Health:
    """`watch` returns at once when the server exits, or was killed as wedged: then it is dead."""
    if status.state != "ready":
        server.status = status
        raise ChildExited(status.reason)
    return Health(pid=status.pid)


class InferenceServerSet(ChildKind[_Server]):
    """`replicas` servers started from one `ServerSpec`: the kernel's supervisor, slots kept full."""

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
        settings = Supervision.read(
            restart=restart,
            ready_timeout_s=spec.ready_timeout_s + 2 * WATCH_GRACE,
            probe_interval_s=probe_interval_s,
            hang_timeout_s=probe_interval_s + WATCH_GRACE,
        )
        child_spec = ChildSpec(
            kind="inference server",
            actor=InferenceServer,
            options=lambda name: server_actor_options(spec),
            args=lambda name: (spec,),
            name=lambda n: f"inference-server.{n + 1}",
            record=_Server,
            probe="watch",  # one long call per interval: it returns at once if the server exits
            probe_args=lambda settings: (settings.probe_interval_s,),
            read_probe=_read_watch,
            stop="close",  # lost or not: `close` takes vLLM's worker processes (its process group) down
            stop_timeout_s=STOP_TIMEOUT_S,
        )
        self.supervisor = Supervisor("inference servers", child_spec, settings, self)
        self.supervisor.floor = replicas

    async def start(self) -> list[str]:
        """Start every replica; raises `ServerStartupError` (and stops the others) if one fails."""
        try:
            await self.supervisor.start()
        except ServerStartupError:
            raise
        except Exception as exc:
            raise ServerStartupError(ServerStatus(state="dead", reason=f"not ready: {exc!r}")) from exc
        return self.endpoints()

    def endpoints(self) -> list[str]:
        """OpenAI base URLs of the servers that are ready now (a dead one drops out at once)."""
        ready = sorted(self.supervisor.ready(), key=lambda s: s.index)
        return [s.status.url for s in ready if s.status.state == "ready" and s.status.url]

    def status(self) -> list[ServerStatus]:
        """Per slot: its server's status, or the last one's that held it (`created`: none yet)."""
        held: dict[int, ServerStatus] = {}
        for server in [*self.supervisor.retired.values(), *self.supervisor.children.values()]:
            held[server.index] = server.status  # oldest first: the newest holder of a slot wins
        return [held.get(i, ServerStatus(state="created")) for i in range(self.supervisor.floor)]

    @property
    def restarts(self) -> int:
        """Replacements started over the set's life."""
        return self.supervisor.budget.spent_total

    @property
    def exhausted(self) -> bool:
        """True when some slot is empty because its restart budget ran out."""
        return self.supervisor.starved

    def actors(self) -> list[Any]:
        return [s.handle for s in self.supervisor.children.values()]

    async def aclose(self) -> None:
        """Stop supervising, then stop every server."""
        await self.supervisor.close()

    # ------------------------------------------------------------------------- the kind's hooks

    def on_created(self, server: _Server) -> None:
        taken = {s.index for s in self.supervisor.children.values()}
        server.index = min(set(range(self.supervisor.floor)) - taken)

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
        server.status = status  # only a ready server enters endpoints()
        raise_for_startup(status)

    def on_retired(self, server: _Server, reason: str, cause: RetireCause) -> None:
        status = server.status
        if status.state in ("ready", "starting"):
            server.status = status.model_copy(update={"state": "dead", "reason": reason})
