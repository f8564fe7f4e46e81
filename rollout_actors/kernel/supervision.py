"""The supervision kit: restart intensity as declared data, the budget that spends it, and one liveness rule.
Every supervisor of the project (rollout workers, pools, renderers, env servers, inference servers) uses
it; it imports nothing else of the project."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

K, V = TypeVar("K"), TypeVar("V")


class RestartIntensity(BaseModel):
    """Restart intensity, as declared data (Erlang/OTP): at most `max_restarts` restarts within any
    `window_s` seconds. Rare deaths over a long run fit inside the window and are tolerated; something that
    dies on every start spends it in seconds and its supervisor stops restarting it, loudly. Both fields
    are required: each supervisor declares its own default beside the reason for it, and a setting never
    silently takes half of a generic default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_restarts: int = Field(ge=0)
    window_s: float = Field(gt=0)

    def describe(self) -> str:
        return f"{self.max_restarts} restarts in {self.window_s:g} s"


@dataclass
class RestartBudget:
    """Spends a `RestartIntensity`. One edge rule everywhere: a restart counts for exactly `window_s`
    seconds after it was spent (at `t + window_s` it no longer does).

    >>> budget = RestartBudget(RestartIntensity(max_restarts=2, window_s=60))
    >>> budget.try_spend(now=0.0), budget.try_spend(now=1.0), budget.try_spend(now=2.0)
    (True, True, False)
    >>> budget.try_spend(now=60.0)  # the first restart left the window
    True
    """

    intensity: RestartIntensity
    spent_total: int = 0
    """Restarts spent over the budget's whole life."""
    _spent: deque[float] = field(default_factory=deque, repr=False)

    def try_spend(self, now: float | None = None) -> bool:
        """Spend one restart if the window has room: True (and it counts), or False (nothing changes)."""
        now = time.monotonic() if now is None else now
        self._expire(now)
        if len(self._spent) >= self.intensity.max_restarts:
            return False
        self._spent.append(now)
        self.spent_total += 1
        return True

    def remaining(self, now: float | None = None) -> int:
        self._expire(time.monotonic() if now is None else now)
        return self.intensity.max_restarts - len(self._spent)

    def used(self, now: float | None = None) -> int:
        """Restarts counting against the window now."""
        return self.intensity.max_restarts - self.remaining(now)

    def spent_message(self) -> str:
        return f"restart budget spent ({self.intensity.describe()})"

    def _expire(self, now: float) -> None:
        while self._spent and now - self._spent[0] >= self.intensity.window_s:
            self._spent.popleft()


@dataclass
class Liveness:
    """One rule for every supervisor: a child is alive while something shows it alive, and wedged once
    nothing has for `hang_timeout_s`. A sign of life is an answer to `health()`, dated back by the
    `loop_stall_s` the child reports (an answer from a side loop says nothing of a stalled main loop).
    Time the supervisor itself could not listen (its own loop stalled) is excused, never held against
    the child: load alone must never look like a wedge.

    >>> life = Liveness(hang_timeout_s=10, last_alive=0.0)
    >>> life.heard(loop_stall_s=0.0, now=5.0); life.wedged(now=14.0), life.wedged(now=15.5)
    (False, True)
    >>> life.excuse(4.0, now=15.5); life.wedged(now=15.5)  # the supervisor was deaf for 4 s of that
    False
    """

    hang_timeout_s: float
    last_alive: float = field(default_factory=time.monotonic)

    def heard(self, loop_stall_s: float = 0.0, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last_alive = max(self.last_alive, now - max(0.0, loop_stall_s))

    def excuse(self, deaf_s: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self.last_alive = min(now, self.last_alive + max(0.0, deaf_s))

    def silent_s(self, now: float | None = None) -> float:
        return max(0.0, (time.monotonic() if now is None else now) - self.last_alive)

    def wedged(self, now: float | None = None) -> bool:
        return self.silent_s(now) > self.hang_timeout_s

    def verdict(self, now: float | None = None) -> str:
        return f"no sign of life for {self.silent_s(now):.1f} s (hang_timeout_s {self.hang_timeout_s:g} s)"


class Supervision(BaseModel):
    """The one declared supervision setting of a kind of child (Ray Serve's spelling of liveness): its
    restart intensity and the four durations every supervisor reads. Every field is required: each kind
    declares its defaults beside the reasons for them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    restart: RestartIntensity
    """Restarts and growth spawns together (docs/design.md contract 9)."""
    ready_timeout_s: float = Field(gt=0)
    """From spawn to ready (loaded what it serves, answered a health call)."""
    probe_interval_s: float = Field(gt=0)
    """How often a ready child is asked for a sign of life."""
    probe_timeout_s: float = Field(gt=0)
    """How long one probe may go unanswered before it counts as silence (then it is asked again)."""
    hang_timeout_s: float = Field(gt=0)
    """Silence (no answer, or answers reporting a stalled loop) past this is a wedge: retired, replaced."""

    @classmethod
    def read(cls, config: Any = None, **given: Any) -> Supervision:
        """The setting read off a config that declares these fields flat (an env pool's, a renderer
        pool's), `given` supplying or overriding fields; a probe may take up to `hang_timeout_s` unless
        `probe_timeout_s` is declared.

        >>> Supervision.read(restart=RestartIntensity(max_restarts=1, window_s=60), ready_timeout_s=9,
        ...                  probe_interval_s=1, hang_timeout_s=5).probe_timeout_s
        5.0
        """
        fields = {name: given.get(name, getattr(config, name, None)) for name in cls.model_fields}
        if fields["probe_timeout_s"] is None:
            fields["probe_timeout_s"] = fields["hang_timeout_s"]
        return cls(**fields)


class Health(BaseModel):
    """A child actor's answer to `health()`: frozen, typed. Kinds subclass it with what they report."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    loop_stall_s: float = 0.0
    """How long the loop that does the child's work has gone without progress (`LoopWatch`), so an answer
    from a side loop says nothing good of a stalled main loop."""
    pid: int | None = None
    node_id: str | None = None


class Recent(dict[K, V]):
    """A dict that remembers only its newest `memory` keys, for what a supervisor must recall about parts
    already gone (why a child was retired; which owners were lost, so a call one sent before it was lost
    and that arrives later is refused). Only item assignment evicts.

    >>> lost = Recent(memory=2); lost["a"] = lost["b"] = lost["c"] = None
    >>> list(lost)
    ['b', 'c']
    """

    def __init__(self, memory: int) -> None:
        super().__init__()
        self.memory = memory

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        if len(self) > self.memory:
            del self[next(iter(self))]
