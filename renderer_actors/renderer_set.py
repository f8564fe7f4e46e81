"""`RendererSet`: the renderers of one `RendererKey`, as a kind of child of the kernel's `Supervisor`.

The kernel decides what a loss means (readiness, probes, wedges, replacement on the restart budget). What
is the key's own (the slots that `RendererPool` leases on these renderers are counted here, placed there):

- placement: the least-loaded renderer with a free slot, ready ones first; one more only when every
  renderer holds `multiplex` slots, up to `max_renderers_per_key`; beyond that, slots overfill.
- budget: the key's first renderer is free; every later spawn (growth, or the replacement of one that
  died, wedged or failed to start) spends one restart (growth and restarts share the budget). With none
  left the key does not grow, and with no renderer live a slot fails at once saying so.
- startup failure: a load that fails fails every slot of the key at once for `failure_hold_s`, with the
  renderer's traceback, instead of spawning a doomed renderer per call; a death while loading is a loss.
- shrink: idle renderers beyond one are retired after `idle_timeout_s`, warming and newest first.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from renderer_actors.config import RendererKeyStats, RendererPoolConfig, RendererStats
from renderer_actors.key import RendererKey
from rollout_actors.kernel import new_id
from rollout_actors.kernel.faults import CallerError, LoadFailed, ray_loss, remote_cause
from rollout_actors.kernel.metric import Metric
from rollout_actors.kernel.supervisor import Child, ChildKind, RestartBudgetSpent, RetireCause, Supervisor

log = logging.getLogger(__name__)

RENDERERS = Metric(kind="gauge", name="renderers", description="Renderer actors per key", tag_keys=("key",))
SLOTS = Metric(  # the metric keeps its published name
    kind="gauge", name="renderer_leases", description="Renderer slots held per key", tag_keys=("key",)
)
FAILED_LOAD_LINGER_S = 5.0  # a renderer whose load failed answers its waiters with the failure this long
RENDERER_MIN_CONCURRENCY = 64  # health checks and readiness waits on top of `multiplex` rollouts


class RendererStartupError(LoadFailed):
    """A renderer for this key failed to load recently (the message carries its traceback): every slot
    of the key fails at once with it for `failure_hold_s` (`caller` when the load refused the key itself)."""


class RendererBudgetSpent(RestartBudgetSpent):
    """The key's renderers died, wedged or failed to start more often than its restart budget allows."""


@dataclass(eq=False)
class RendererChild(Child):
    slots: set[str] = field(default_factory=set)
    """The ids of the slots leased on it."""
    idle_since: float = 0.0
    linger: bool = False
    """Its load failed: killed a moment later, so sessions waiting on `ready` get the load's own failure."""


class RendererSet(Supervisor[RendererChild], ChildKind[RendererChild]):
    """The renderers of one key: the kernel's supervisor, with renderer start-up and placement plugged in."""

    def __init__(self, key_json: str, multiplex: int, config: RendererPoolConfig, orphan: Any) -> None:
        """`orphan(renderer)`: its slots are void (it left service)."""
        self.key_json, self.multiplex, self.config = key_json, multiplex, config
        self.startup_failure: str | None = None
        self.startup_kind = "infrastructure"
        """`caller` when the load refused what the key names (a `CallerError` on the renderer's side)."""
        self.failed_at = 0.0
        self.startup_failures = self.shrunk = 0
        self._orphan = orphan
        super().__init__(RendererKey.from_json(key_json).short(), self, config.supervision)

    def place(self) -> RendererChild:
        """The renderer for one more slot (see the module's docstring); raises when there is none."""
        now = time.monotonic()
        live = list(self.children.values())
        if self.startup_failure and now - self.failed_at < self.config.failure_hold_s:
            if not self.ready():
                raise RendererStartupError(self.startup_failure, kind=self.startup_kind)
        free = [r for r in live if len(r.slots) < self.multiplex]
        renderer = min(free, key=_preference) if free else None
        if renderer is None and len(live) < self.config.max_renderers_per_key:
            renderer = self.spawn("initial" if not self.spawns else "grow" if live else "restart")
            if renderer is None and not live:
                raise self.budget_spent(f"renderer for {self.key_json}", RendererBudgetSpent)
        return renderer or min(live, key=_preference)

    def stats(self, now: float) -> RendererKeyStats:
        renderers = sorted(self.children.values(), key=lambda r: r.born)
        return RendererKeyStats(
            multiplex=self.multiplex,
            loads=[len(r.slots) for r in renderers],
            renderers=[
                RendererStats(
                    renderer_id=r.name,
                    load=len(r.slots),
                    ready=r.state == "ready",
                    idle_s=(now - r.idle_since) if not r.slots else 0.0,
                )
                for r in renderers
            ],
            startup_failure=self.startup_failure,
            restarts_left=self.budget.remaining(),
        )

    # ------------------------------------------------------------------------- the kind's hooks

    def create(self, name: str) -> RendererChild:
        renderer_id = new_id("renderer")
        handle = (
            _remote_renderer()
            .options(
                num_cpus=self.config.renderer_num_cpus,
                max_concurrency=2 * self.multiplex + RENDERER_MIN_CONCURRENCY,
                scheduling_strategy="SPREAD",  # one node's loss takes a fraction of the renderers
            )
            .remote(self.key_json, renderer_id, self.config.allowed_ref_prefixes)
        )
        return RendererChild(renderer_id, handle, idle_since=time.monotonic())

    async def handshake(self, renderer: RendererChild) -> None:
        await renderer.handle.ready.remote()

    def on_spawn_failed(self, renderer: RendererChild, exc: BaseException) -> None:
        if ray_loss(exc) is not None:
            # Its process died while loading (killed, its node lost): a death, replaced under the key's
            # restart budget, not a startup failure that would fail every slot for failure_hold_s.
            self.spawn("restart")
            return
        what = str(exc) if not isinstance(exc, TimeoutError) else f"timed out ({exc})"
        self.startup_failure = f"renderer for {self.key_json} failed to start: {what}"
        self.startup_kind = "caller" if isinstance(remote_cause(exc), CallerError) else "infrastructure"
        self.failed_at = time.monotonic()
        self.startup_failures += 1
        renderer.linger = True
        log.warning("%s", self.startup_failure)

    def on_ready(self, renderer: RendererChild) -> None:
        self.startup_failure = None

    def on_retired(self, renderer: RendererChild, reason: str, cause: RetireCause) -> None:
        self._orphan(renderer)

    def kill(self, renderer: RendererChild) -> None:
        if renderer.linger and not self.closed:
            asyncio.get_running_loop().call_later(FAILED_LOAD_LINGER_S, super().kill, renderer)
        else:
            super().kill(renderer)

    def tick(self, now: float) -> None:
        idle = [
            r
            for r in self.children.values()
            if not r.slots and now - r.idle_since >= self.config.idle_timeout_s
        ]
        # Retire warming ones first, then the newest: the survivor should be a warm, old renderer.
        for renderer in sorted(idle, key=lambda r: (r.state == "ready", -r.born)):
            if len(self.children) <= 1:
                break
            self.retire(renderer, "idle", "shrunk")
            self.shrunk += 1

    def record(self) -> None:
        RENDERERS.record(len(self.children), {"key": self.name})
        SLOTS.record(sum(len(r.slots) for r in self.children.values()), {"key": self.name})


def _preference(renderer: RendererChild) -> tuple[bool, int, float]:
    return (renderer.state != "ready", len(renderer.slots), renderer.born)


@functools.cache
def _remote_renderer() -> Any:
    # Imported when the pool first spawns one: the renderer's library (and the `openai` it imports) costs
    # the pool's own process ~1.5 s of start on 2 cores, and the pool never renders.
    from renderer_actors.actor import RendererActor

    return ray.remote(RendererActor)
