"""Lanes: named concurrency bounds (`train`, `eval`, ...) so one kind of work never starves another.

`acquire` waits (async) while a lane is full: that is the plane's back-pressure. `set_limit` changes the
bound live; lowering it never interrupts running rollouts, it only holds new ones back until the lane
drains below the new bound.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict


@dataclass
class Lane:
    name: str
    limit: int
    in_flight: int = 0
    peak: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def acquire(self) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.in_flight < self.limit)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)

    async def release(self) -> None:
        async with self._changed:
            self.in_flight -= 1
            self._changed.notify_all()

    async def set_limit(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"lane {self.name!r}: limit must be >= 1, got {limit}")
        async with self._changed:
            self.limit = limit
            self._changed.notify_all()


class LaneStats(BaseModel):
    """One lane at the instant of `Lanes.snapshot`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    limit: int
    in_flight: int
    peak: int
    """The most rollouts the lane held at once since the plane started."""


class Lanes:
    def __init__(self, limits: dict[str, int]) -> None:
        self._lanes = {name: Lane(name, limit) for name, limit in limits.items()}

    def get(self, name: str) -> Lane:
        lane = self._lanes.get(name)
        if lane is None:
            raise KeyError(f"unknown lane {name!r}; lanes are {sorted(self._lanes)}")
        return lane

    def snapshot(self) -> dict[str, LaneStats]:
        return {
            n: LaneStats(limit=x.limit, in_flight=x.in_flight, peak=x.peak) for n, x in self._lanes.items()
        }

    @property
    def total_limit(self) -> int:
        return sum(lane.limit for lane in self._lanes.values())
