"""Restart intensity: how many worker spawns a pool may make in a sliding window (Erlang/OTP style).

Declared data (`RestartIntensity`), one small holder that spends it (`RestartBudget`). Replacements of
dead workers and elastic scale-up draw on the same budget; the spawns that build the pool's initial
`min_workers` do not. Rare deaths over a long run fit inside the window and are tolerated; an environment
that dies on every load spends the budget in seconds and the pool stops spawning (see `pool.py`).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_RESTARTS = 3  # rides out one OOM plus a retry, few enough that a crash loop fails loudly
DEFAULT_WINDOW_S = (
    60.0  # a minute: long enough to catch a crash loop, short enough to forgive sporadic deaths
)


class RestartIntensity(BaseModel):
    """At most `max_restarts` spawns within any `window_s` seconds."""

    model_config = ConfigDict(frozen=True)

    max_restarts: int = Field(default=DEFAULT_MAX_RESTARTS, ge=0)
    window_s: float = Field(default=DEFAULT_WINDOW_S, gt=0)


@dataclass
class RestartBudget:
    """Spends `RestartIntensity`: `try_spend()` is True (and records the spawn) while the window has room.

    >>> budget = RestartBudget(RestartIntensity(max_restarts=2, window_s=60))
    >>> budget.try_spend(now=0.0), budget.try_spend(now=1.0), budget.try_spend(now=2.0)
    (True, True, False)
    >>> budget.try_spend(now=61.0)  # the first spawn left the window
    True
    """

    intensity: RestartIntensity
    _spent: deque[float] = field(default_factory=deque)

    def _expire(self, now: float) -> None:
        while self._spent and now - self._spent[0] >= self.intensity.window_s:
            self._spent.popleft()

    def try_spend(self, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        self._expire(now)
        if len(self._spent) >= self.intensity.max_restarts:
            return False
        self._spent.append(now)
        return True

    def remaining(self, now: float | None = None) -> int:
        now = time.monotonic() if now is None else now
        self._expire(now)
        return self.intensity.max_restarts - len(self._spent)
