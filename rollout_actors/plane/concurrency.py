"""Load-aware concurrency: lane limits that follow what the inference servers can hold.

    PlaneConfig(lanes={"train": 64, "eval": 16}, concurrency=ConcurrencyConfig(lanes=("train",)))

A fixed lane limit is either too low (the servers idle while KV cache is free) or too high (requests wait
in the servers' queues and, on vLLM, running ones get preempted and recomputed when the KV cache fills).
The controller polls every live server's `/metrics` (`vllm:kv_cache_usage_perc`,
`vllm:num_requests_waiting` and the counter `vllm:num_preemptions_total`, through
`inference.load.LoadReader`) and moves the lanes it steers with `set_limit`, judging by the fullest server:

- **grow** while KV usage is below `grow_below` and has stopped rising (a rollout's KV grows over its
  life, so the reading lags what the lane already admitted), nothing waits, no server preempted since the
  last poll, and the limit is what holds the lane back (it is nearly full): toward the limit that would put
  KV usage at `aim` at the current tokens per rollout, by a factor that tapers from `grow_factor` at an
  empty cache to 1 at `aim` (prime-rl's gradient-gated AIMD does the same), and only while the last growth
  paid: the servers run more requests than before it (where the plane itself, an environment or a
  renderer is what holds rollouts back, a higher limit only queues them in front of it);
- **shrink** (x `shrink_factor`) when KV usage reaches `shrink_above`, a server preempted since the last
  poll (each preemption throws away a prefill and recomputes it), or requests wait two polls running;
- **cut** when a server is about to preempt (KV usage at `preempt_at` with requests waiting): the limit
  drops to `shrink_factor` x what is running, and, if `cancel_fraction` > 0, the youngest rollouts on that
  server are cancelled (`error.type == "Overload"`): they have sampled least, so cancelling them frees KV
  for the rest at the smallest loss. Off by default: a lower limit drains the excess without losing work.

After a shrink or a cut the controller lets the move show before the next one: no further move until the
lane has drained below the new limit and the servers' queues are empty, or `settle_s` has passed (a
limit acts only as rollouts finish turns, seconds later than the poll that moved it).

It is a state machine driven by one loop the plane owns (started in `start`, cancelled in `close`); a
server whose `/metrics` cannot be read is left out of that poll. `stats().concurrency` shows it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollout_actors.inference.load import LoadReader, ServerLoad

log = logging.getLogger(__name__)

OVERLOAD = "Overload"
"""`Failure.type` of a rollout the controller cancelled to keep a server from preempting."""
HISTORY = 4096  # decisions kept for `snapshot()` and benchmarks; older ones are dropped


class ConcurrencyConfig(BaseModel):
    """How the controller steers. Defaults suit vLLM; every threshold is a KV usage fraction (0..1)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    lanes: tuple[str, ...] = ("train",)
    """Lanes it steers; the others keep their configured limit."""
    min_limit: int = Field(default=8, ge=1)
    max_limit: int = Field(default=4096, ge=1)
    interval_s: float = Field(default=1.0, gt=0, le=60)
    """Seconds between polls: vLLM refreshes its gauges about once a second."""
    grow_below: float = Field(default=0.75, gt=0, le=1)
    max_rise: float = Field(default=0.05, ge=0, le=1)
    """Growth waits while KV usage rose more than this since the last poll (it has not caught up yet)."""
    aim: float = Field(default=0.8, gt=0, le=1)
    """A growth step goes no further than the limit that would put KV usage here."""
    shrink_above: float = Field(default=0.9, gt=0, le=1)
    preempt_at: float = Field(default=0.97, gt=0, le=1)
    smoothing: float = Field(default=0.5, gt=0, le=1)
    """Weight of the newest poll in the KV usage that grow and shrink decisions read (1: no smoothing);
    a cut reads the newest poll alone."""
    grow_factor: float = Field(default=1.5, gt=1, le=4)
    shrink_factor: float = Field(default=0.75, gt=0, lt=1)
    cancel_fraction: float = Field(default=0.0, ge=0, le=1)
    """Of the rollouts on a server about to preempt, the youngest this fraction (at least one) is
    cancelled; 0 (the default) only lowers the limit."""
    pay_fraction: float = Field(default=0.25, ge=0, le=1)
    """Growth continues only once the servers run at least this fraction of the last growth's new slots
    more requests than when it was made."""
    binding_fraction: float = Field(default=0.9, gt=0, le=1)
    """The limit holds the lane back when in flight >= this fraction of it: only then does growing help."""
    settle_s: float = Field(default=5.0, ge=0, le=600)
    """After a shrink or cut, the longest the controller waits for the servers' queues to empty before it
    may move again."""

    @model_validator(mode="after")
    def _ordered(self) -> ConcurrencyConfig:
        if not self.grow_below <= self.aim <= self.shrink_above <= self.preempt_at:
            raise ValueError("need grow_below <= aim <= shrink_above <= preempt_at")
        if self.min_limit > self.max_limit:
            raise ValueError("need min_limit <= max_limit")
        return self


class SteeredPlane(Protocol):
    """What the controller needs from the plane."""

    lanes: Any

    def live_endpoints(self) -> Sequence[str]: ...

    def running_on(self, endpoint: str) -> list[str]:
        """Request ids of the rollouts in flight on `endpoint`, oldest first."""
        ...

    async def set_limit(self, lane: str, limit: int) -> None: ...

    async def cancel_members(self, request_ids: list[str], why: str, failure_type: str = ...) -> int: ...


@dataclass(frozen=True)
class Decision:
    at: float
    action: str
    """`grow`, `shrink`, `cut` or `hold`."""
    limit: int
    kv_usage: float
    waiting: int
    cancelled: int = 0


class ConcurrencyStats(BaseModel):
    """The controller's state and counts since the plane started (`PlaneStats.concurrency`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    limit: int
    """The lowest limit of the lanes it steers, now."""
    actions: dict[str, int]
    """Decisions taken, by action (`grow`, `shrink`, `cut`, `hold`)."""
    cancelled: int
    """Rollouts cancelled (`Overload`) by cuts."""
    servers: dict[str, ServerLoad]
    """Server URL -> its load at the last poll that read it."""


class ConcurrencyController:
    def __init__(self, plane: SteeredPlane, config: ConcurrencyConfig, reader: LoadReader) -> None:
        self._plane = plane
        self.config = config
        self._reader = reader
        self.history: deque[Decision] = deque(maxlen=HISTORY)
        self.actions: Counter[str] = Counter()
        self.cancelled = 0
        self._waited_last_poll = False
        self._settling_since: float | None = None
        """When the last shrink or cut was made, until the lane and the servers have settled after it."""
        self._kv: float | None = None
        """KV usage of the fullest server, smoothed over polls."""
        self._last_growth: tuple[int, int] | None = None
        """(requests the servers ran, slots added) at the last growth, until it has paid."""
        self._preemptions: dict[str, int] = {}
        """Each server's preemption counter at the last poll that read it."""
        self.last_load: dict[str, ServerLoad] = {}

    @property
    def limit(self) -> int:
        return min(self._plane.lanes.get(lane).limit for lane in self.config.lanes)

    def _in_flight(self) -> int:
        return sum(self._plane.lanes.get(lane).in_flight for lane in self.config.lanes)

    async def run(self) -> None:
        """Poll and steer until cancelled (the plane owns this task)."""
        while True:
            try:
                await self.step()
            except Exception:  # a bad poll must not end steering; the next one may be fine
                log.exception("concurrency controller step failed")
            await asyncio.sleep(self.config.interval_s)

    async def step(self) -> Decision | None:
        """One poll and at most one move. None when no server could be read."""
        loads = await self._read_all()
        if not loads:
            return None
        self.last_load = loads
        endpoint, worst = max(loads.items(), key=lambda item: (item[1].kv_cache_usage, item[1].waiting))
        waiting = sum(load.waiting for load in loads.values())
        running = sum(load.running for load in loads.values())
        preempted = self._new_preemptions(loads)
        config, limit, in_flight, now = self.config, self.limit, self._in_flight(), time.monotonic()
        if self._settling_since is not None and in_flight <= limit:
            if waiting == 0 or now - self._settling_since >= config.settle_s:
                self._settling_since = None
        settled = self._settling_since is None
        kv = worst.kv_cache_usage
        smooth = kv if self._kv is None else config.smoothing * kv + (1 - config.smoothing) * self._kv
        rise = 0.0 if self._kv is None else smooth - self._kv
        self._kv = smooth
        action, target, cancelled = "hold", limit, 0
        if kv >= config.preempt_at and worst.waiting > 0 and settled:
            action, target = "cut", self._clamp(config.shrink_factor * max(in_flight, config.min_limit))
            cancelled = await self._cancel_youngest(endpoint)
        elif (
            smooth >= config.shrink_above or preempted > 0 or (waiting > 0 and self._waited_last_poll)
        ) and settled:
            action, target = "shrink", self._clamp(config.shrink_factor * limit)
        elif (
            smooth < config.grow_below
            and kv < config.shrink_above  # not on a high poll, whatever the average says
            and waiting == 0
            and preempted == 0
            and rise <= config.max_rise
            and in_flight >= config.binding_fraction * limit
            and self._paid(running)
            and settled
        ):
            room = in_flight * config.aim / smooth if smooth > 0 else math.inf  # KV usage at `aim`
            step = 1 + (config.grow_factor - 1) * max(0.0, 1 - smooth / config.aim)
            action, target = "grow", self._clamp(max(limit + 1, min(step * limit, room)))
        if action == "grow":
            self._last_growth = (running, target - limit)
        if action in ("cut", "shrink"):
            self._last_growth = None
            self._settling_since = now
        self._waited_last_poll = waiting > 0
        if target != limit:
            for lane in config.lanes:
                await self._plane.set_limit(lane, target)
        decision = Decision(time.time(), action, target, kv, waiting, cancelled)
        self.history.append(decision)
        self.actions[action] += 1
        return decision

    def _paid(self, running: int) -> bool:
        if self._last_growth is None:
            return True
        before, added = self._last_growth
        if running >= before + self.config.pay_fraction * added:
            self._last_growth = None
            return True
        return False

    def _new_preemptions(self, loads: dict[str, ServerLoad]) -> int:
        """Preemptions since the last poll, over the servers read both times (a counter that went back
        is a restarted server: its new count is all new)."""
        new = 0
        for url, load in loads.items():
            before = self._preemptions.get(url)
            if before is not None:
                new += load.preemptions - before if load.preemptions >= before else load.preemptions
            self._preemptions[url] = load.preemptions
        return new

    async def _read_all(self) -> dict[str, ServerLoad]:
        endpoints = list(self._plane.live_endpoints())
        answers = await asyncio.gather(*(self._reader.read(url) for url in endpoints), return_exceptions=True)
        return {
            url: load for url, load in zip(endpoints, answers, strict=True) if isinstance(load, ServerLoad)
        }

    async def _cancel_youngest(self, endpoint: str) -> int:
        running = self._plane.running_on(endpoint)
        if not running or self.config.cancel_fraction == 0:
            return 0
        count = max(1, int(self.config.cancel_fraction * len(running)))
        youngest = running[-count:]
        why = (
            f"{endpoint} was about to preempt (KV cache full, requests waiting): the youngest rollouts yield"
        )
        done = await self._plane.cancel_members(youngest, why, OVERLOAD)
        self.cancelled += done
        return done

    def _clamp(self, value: float) -> int:
        return int(min(max(value, self.config.min_limit), self.config.max_limit))

    async def aclose(self) -> None:
        await self._reader.aclose()

    def snapshot(self) -> ConcurrencyStats:
        return ConcurrencyStats(
            limit=self.limit,
            actions=dict(self.actions),
            cancelled=self.cancelled,
            servers=dict(self.last_load),
        )
