"""`RendererSet`: the renderers of one `RendererKey`: a child spec for the kernel's `Supervisor`, and placement.

The kernel decides what a loss means (readiness, probes, wedges, replacement on the restart budget); the
spec declares the rest as data (the actor and its options, readiness is `ready()`, a renderer whose load
failed lingers `FAILED_LOAD_LINGER_S` before it is killed). What is the key's own (the slots that
`RendererPool` leases on these renderers are counted here, placed there):

- placement: the least-loaded renderer with a free slot, ready ones first; one more only when every
  renderer holds `multiplex` slots, up to `max_renderers_per_key`; beyond that, slots overfill.
- budget: the key's first renderer is free; every later spawn (growth, or the replacement of one that
  died, wedged or failed to start) spends one restart (growth and restarts share the budget). With none
  left the key does not grow, and with no renderer live a slot fails at once saying so.
- startup failure: a load that fails fails every slot of the key at once for `failure_hold_s`, with the
  renderer's traceback, instead of spawning a doomed renderer per call; a death while loading is a loss
  (the kernel replaces it on the budget).
- shrink: the wanted count leaves out renderers idle for `idle_timeout_s` (one is always kept); the
  kernel retires them, warming and newest first.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from renderer_actors.config import RendererKeyStats, RendererPoolConfig, RendererStats
from renderer_actors.key import RendererKey
from rollout_actors.kernel import new_id
from rollout_actors.kernel.faults import CallerError, LoadFailed, remote_cause
from rollout_actors.kernel.metric import Metric
from rollout_actors.kernel.supervisor import (
    Child,
    ChildKind,
    ChildSpec,
    RestartBudgetSpent,
    RetireCause,
    Supervisor,
)

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
    idle_since: float = field(default_factory=time.monotonic)


class RendererSet(ChildKind[RendererChild]):
    """The renderers of one key: the kernel's supervisor, with renderer start-up and placement plugged in."""

    def __init__(self, key_json: str, multiplex: int, config: RendererPoolConfig, orphan: Any) -> None:
        """`orphan(renderer)`: its slots are void (it left service)."""
        self.key_json, self.multiplex, self.config = key_json, multiplex, config
        self.startup_failure: str | None = None
        self.startup_kind = "infrastructure"
        """`caller` when the load refused what the key names (a `CallerError` on the renderer's side)."""
        self.failed_at = 0.0
        self.startup_failures = 0
        self._orphan = orphan
        spec = ChildSpec(
            kind="renderer",
            actor=_LazyRendererClass(),
            options=lambda name: {
                "num_cpus": config.renderer_num_cpus,
                "max_concurrency": 2 * multiplex + RENDERER_MIN_CONCURRENCY,
                "scheduling_strategy": "SPREAD",  # one node's loss takes a fraction of the renderers
            },
            args=lambda name: (key_json, name, config.allowed_ref_prefixes),
            name=lambda n: new_id("renderer"),
            record=RendererChild,
            ready="ready",
            kill_linger_s=FAILED_LOAD_LINGER_S,
        )
        self.supervisor = Supervisor(RendererKey.from_json(key_json).short(), spec, config.supervision, self)

    def place(self) -> RendererChild:
        """The renderer for one more slot (see the module's docstring); raises when there is none."""
        sup, now = self.supervisor, time.monotonic()
        live = list(sup.children.values())
        if self.startup_failure and now - self.failed_at < self.config.failure_hold_s:
            if not sup.ready():
                raise RendererStartupError(self.startup_failure, kind=self.startup_kind)
        free = [r for r in live if len(r.slots) < self.multiplex]
        renderer = min(free, key=_preference) if free else None
        if renderer is None and len(live) < self.config.max_renderers_per_key:
            renderer = sup.more()
            if renderer is None and not live:
                raise sup.budget_spent(f"renderer for {self.key_json}", RendererBudgetSpent)
        return renderer or min(live, key=_preference)

    def stats(self, now: float) -> RendererKeyStats:
        renderers = sorted(self.supervisor.children.values(), key=lambda r: r.born)
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
            restarts_left=self.supervisor.budget.remaining(),
        )

    # ------------------------------------------------------------------------- the kind's hooks

    def on_spawn_failed(self, renderer: RendererChild, exc: BaseException) -> None:
        # A load error (a death while loading is a loss the kernel replaces, not a startup failure that
        # would fail every slot for failure_hold_s).
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

    def wanted(self, now: float) -> int:
        idle = self.idle(now)
        return max(min(1, len(self.supervisor.children)), len(self.supervisor.children) - len(idle))

    def idle(self, now: float) -> list[RendererChild]:
        timeout_s = self.config.idle_timeout_s
        idle = [
            r for r in self.supervisor.children.values() if not r.slots and now - r.idle_since >= timeout_s
        ]
        # Retire warming ones first, then the newest: the survivor should be a warm, old renderer.
        return sorted(idle, key=lambda r: (r.state == "ready", -r.born))

    def record(self) -> None:
        children, tags = self.supervisor.children.values(), {"key": self.supervisor.name}
        RENDERERS.record(len(children), tags)
        SLOTS.record(sum(len(r.slots) for r in children), tags)


def _preference(renderer: RendererChild) -> tuple[bool, int, float]:
    return (renderer.state != "ready", len(renderer.slots), renderer.born)


class _LazyRendererClass:
    """The renderer's Ray actor class, imported at the first spawn (`_remote_renderer`)."""

    def options(self, **options: Any) -> Any:
        return _remote_renderer().options(**options)


@functools.cache
def _remote_renderer() -> Any:
    # Imported when the pool first spawns one: the renderer's library (and the `openai` it imports) costs
    # the pool's own process ~1.5 s of start on 2 cores, and the pool never renders.
    from renderer_actors.actor import RendererActor

    return ray.remote(RendererActor)
