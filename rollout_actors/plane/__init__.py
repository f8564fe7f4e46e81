"""The plane: its public facade (`RolloutPlane`, `PlaneConfig`), the dispatcher that answers each
request exactly once, lanes and groups, placement and concurrency, and the supervision of the workers
and shared pools it starts."""

from __future__ import annotations

from typing import Any

__all__ = ["PlaneConfig", "PlaneStartError", "RolloutPlane", "SyncRolloutPlane"]


def __getattr__(name: str) -> Any:
    # Lazy, so a rollout worker that imports one module of this folder does not load the whole plane.
    if name == "PlaneConfig":
        from rollout_actors.plane.config import PlaneConfig

        return PlaneConfig
    if name in ("RolloutPlane", "PlaneStartError"):
        from rollout_actors.plane import facade

        return getattr(facade, name)
    if name == "SyncRolloutPlane":
        from rollout_actors.plane.sync import SyncRolloutPlane

        return SyncRolloutPlane
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
