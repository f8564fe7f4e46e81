"""Lanes: named concurrency bounds (`train`, `eval`, ...) so one kind of work never starves another.

`acquire` waits (async) while a lane is full: that is the plane's back-pressure. `set_limit` changes the
bound live; lowering it never interrupts running rollouts, it only holds new ones back until the lane
drains below the new bound.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict


@dataclass
class Lane:
    """A bound on rollouts in flight. Waiters are served first come, first served; a freed slot wakes
    exactly one of them (the slot is taken on its behalf), so a release costs the same with 10 waiters
    as with 10,000 (a condition's `notify_all` woke every waiter to re-check, per release)."""

    name: str
    limit: int
    in_flight: int = 0
    peak: int = 0
    _waiters: deque[asyncio.Future[None]] = field(default_factory=deque)

    def try_acquire(self) -> bool:
        """Take a slot now if one is free and nobody is waiting for it (FIFO); else False."""
        if self.in_flight < self.limit and not self._waiting():
            self._take()
            return True
        return False

    async def acquire(self) -> None:
        if self.try_acquire():
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed a slot, then cancelled: give it back
                self._give_back()
            raise

    async def release(self) -> None:
        self._give_back()

    async def set_limit(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"lane {self.name!r}: limit must be >= 1, got {limit}")
        self.limit = limit
        self._wake()

    def _take(self) -> None:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)

    def _give_back(self) -> None:
        self.in_flight -= 1
        self._wake()

    def _waiting(self) -> bool:
        while self._waiters and self._waiters[0].done():  # cancelled while waiting
            self._waiters.popleft()
        return bool(self._waiters)

    def _wake(self) -> None:
        while self.in_flight < self.limit and self._waiting():
            self._take()
            self._waiters.popleft().set_result(None)


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
