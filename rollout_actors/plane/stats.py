"""`PlaneStats`: what `RolloutPlane.stats()` answers, a frozen snapshot for tests, logs and metrics.

Every figure counts since the plane started; none is reset. `model_dump(mode="json")` is its JSON form.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from rollout_actors.plane.concurrency import ConcurrencyStats
from rollout_actors.plane.lanes import LaneStats
from rollout_actors.plane.pool_supervisor import PoolStatus
from rollout_actors.policy.staleness import OffPolicyStats


class WorkerStats(BaseModel):
    """One live rollout worker."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    """Its actor name (reachable with `ray.get_actor`)."""
    in_flight: int
    """Rollouts it holds now."""
    peak: int
    """The most rollouts it held at once."""


class PlaneStats(BaseModel):
    """A snapshot of a `RolloutPlane`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    counters: dict[str, int]
    """Every counter of the plane: `submitted`, `redispatched`, `duplicates_dropped`, `kind.<kind>` per
    delivered result, `cancelled.<reason>` per cancellation."""
    kinds: dict[str, int] = {}
    """Results delivered per kind, every kind named (`ok`, `model`, `env`, `infrastructure`, `caller`,
    `cancelled`), zeros included."""
    redispatched: int
    """Rollouts re-dispatched under their lease after a part of theirs was lost."""
    poisoned: int = 0
    """Requests answered as poison: their dispatches lost a part the same way at the same point twice."""
    duplicates_dropped: int
    """Late answers for leases already answered (never delivered)."""
    lanes: dict[str, LaneStats]
    workers: tuple[WorkerStats, ...]
    """The live rollout workers."""
    workers_lost: int
    """Rollout workers lost (dead or wedged)."""
    off_policy: OffPolicyStats
    concurrency: ConcurrencyStats | None
    """None unless `PlaneConfig.concurrency` is set."""
    pools: tuple[PoolStatus, ...]
    """The supervised pool actors: the renderer pool, then each env pool."""
