"""Off-policy bounds: which rollouts in flight are too stale to finish once a newer policy is active.

An asynchronous trainer drops samples more than `max_off_policy_steps` versions behind the policy it is
training; a rollout that will be dropped anyway should not keep its lane slot and its server's KV cache.
`PlaneConfig.max_off_policy_steps` turns this on: when a new version becomes active, every rollout in
flight that started under a version older than `active - max_off_policy_steps` is cancelled (it answers
`cancelled`, error type `Stale`, with the turns it had), and so is one that would start under such a
version (a member pinned to an old one). Every result reports its lag (`Result.versions_behind`).
"""

from __future__ import annotations

from collections import Counter

from pydantic import BaseModel, ConfigDict

STALE = "Stale"
"""`Failure.type` of a rollout cancelled for being too far off policy."""


class OffPolicyStats(BaseModel):
    """The guard's counts since the plane started (`PlaneStats.off_policy`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_off_policy_steps: int | None
    """The bound in force; None: no rollout is cancelled for staleness."""
    cancelled_stale: int
    """Rollouts cancelled (`Stale`) for starting too many versions behind the active policy."""
    versions_behind: dict[int, int]
    """Delivered results by `Result.versions_behind`, lowest lag first."""


class OffPolicyGuard:
    def __init__(self, max_steps: int | None) -> None:
        self.max_steps = max_steps
        self.cancelled = 0
        self.lag: Counter[int] = Counter()
        """Delivered results by `versions_behind`."""

    def too_old(self, version: int, active: int) -> bool:
        return self.max_steps is not None and active - version > self.max_steps

    def finished(self, versions_behind: int | None) -> None:
        """A result was delivered with this lag."""
        if versions_behind is not None:
            self.lag[versions_behind] += 1

    def why(self, version: int, active: int) -> str:
        return (
            f"off policy: started under v{version}, v{active} is active "
            f"(max_off_policy_steps={self.max_steps})"
        )

    def snapshot(self) -> OffPolicyStats:
        return OffPolicyStats(
            max_off_policy_steps=self.max_steps,
            cancelled_stale=self.cancelled,
            versions_behind=dict(sorted(self.lag.items())),
        )
