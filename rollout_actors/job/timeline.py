"""A finished run on one clock: every result and every turn placed in seconds since the run began.

Built from result dicts (`rollouts run`'s JSON lines read back), so the report reads files of older
versions (no timings: turns then have no phases and the run starts at the first rollout's start). The
run begins at the first submission (`timings.submitted_at`); a turn ends at its rollout's worker start
plus the waits before its first turn plus the phases of the turns up to it (what the phases add up to:
rounding and the loop's own few microseconds are not in them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_actors.timings import SERVER_PHASES, TURN_PHASES, WAIT_PHASES

BEFORE_FIRST_TURN = ("env_open_s", "renderer_s")
"""The worker-side waits between a rollout's start on its worker and its first turn."""


@dataclass(frozen=True)
class Span:
    """One result on the run's clock."""

    submitted: float
    finished: float
    first_turn: float | None
    """When its first turn began; None when it never reached one."""
    kind: str
    versions_behind: int | None

    @property
    def latency_s(self) -> float:
        """Submission to result: what the caller waited."""
        return self.finished - self.submitted

    @property
    def active_s(self) -> float:
        """From its first turn on: the latency without the waits for lane, pools, worker and slot."""
        return self.finished - self.first_turn if self.first_turn is not None else self.latency_s


@dataclass(frozen=True)
class TurnPoint:
    ended: float
    phases: tuple[float, ...]
    """Seconds per phase, in `TURN_PHASES` order."""
    tokens: int
    """Completion tokens sampled."""
    queue_s: float = 0.0
    """Of the model phase, the server's own queue time (where it reported it)."""


@dataclass
class Timeline:
    start: float
    """Wall-clock time the run began (its first submission)."""
    spans: list[Span] = field(default_factory=list)
    turns: list[TurnPoint] = field(default_factory=list)
    turn_phases: dict[str, list[float]] = field(default_factory=dict)
    """Per turn phase: its seconds in every turn that has timings."""
    waits: dict[str, list[float]] = field(default_factory=dict)
    """Per wait: its seconds in every result that has timings (0 where it did not wait)."""
    wait_rows: list[tuple[float, tuple[float, ...]]] = field(default_factory=list)
    """(submitted, the waits in `WAIT_PHASES` order) per result with timings."""

    @property
    def end_s(self) -> float:
        return max((span.finished for span in self.spans), default=0.0)

    @property
    def first_result_s(self) -> float | None:
        return min((span.finished for span in self.spans), default=None)

    @property
    def cold_start_s(self) -> float | None:
        """Until the first turn began anywhere: the pools had started and a renderer had its tokenizer."""
        return min((s.first_turn for s in self.spans if s.first_turn is not None), default=None)

    def longest(self, wait: str) -> float | None:
        return max(self.waits.get(wait) or [0.0]) if self.waits else None

    def steady_rates(self) -> tuple[float, float, float] | None:
        """Rollouts/s, turns/s and sampled tokens/s after the cold start, or None without a steady span."""
        cold, end = self.cold_start_s, self.end_s
        if cold is None or end - cold <= 0:
            return None
        width = end - cold
        done = sum(1 for s in self.spans if s.finished > cold)
        turns = [t for t in self.turns if t.ended > cold]
        return done / width, len(turns) / width, sum(t.tokens for t in turns) / width


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def timeline(results: list[dict[str, Any]]) -> Timeline:
    submitted = [
        _number((r.get("timings") or {}).get("submitted_at")) or _number(r.get("started_at")) for r in results
    ]
    start = min((s for s in submitted if s is not None), default=0.0)
    run = Timeline(start=start)
    run.turn_phases = {name: [] for name in TURN_PHASES + SERVER_PHASES}
    run.waits = {name: [] for name in WAIT_PHASES}
    for result, sent in zip(results, submitted, strict=True):
        finished, started = _number(result.get("finished_at")), _number(result.get("started_at"))
        if finished is None or sent is None:
            continue  # a line of no time (hand-written, or truncated): counted by kind, not placed
        waits = result.get("timings") or {}
        turns = result.get("turns") or []
        first_turn = None
        if started is not None and turns:
            first_turn = started - start + sum(_number(waits.get(w)) or 0.0 for w in BEFORE_FIRST_TURN)
        behind = result.get("versions_behind")
        run.spans.append(
            Span(
                submitted=sent - start,
                finished=finished - start,
                first_turn=first_turn,
                kind=str(result.get("kind", "?")),
                versions_behind=behind if isinstance(behind, int) else None,
            )
        )
        if "timings" in result:
            row = tuple(_number(waits.get(w)) or 0.0 for w in WAIT_PHASES)
            run.wait_rows.append((sent - start, row))
            for name, value in zip(WAIT_PHASES, row, strict=True):
                run.waits[name].append(value)
        clock = first_turn
        for turn in turns:
            phases = tuple(_number((turn.get("timings") or {}).get(p)) or 0.0 for p in TURN_PHASES)
            if "timings" in turn:
                for name, value in zip(TURN_PHASES, phases, strict=True):
                    run.turn_phases[name].append(value)
                for name in SERVER_PHASES:
                    run.turn_phases[name].append(_number(turn["timings"].get(name)) or 0.0)
            if clock is not None:
                clock += sum(phases)
                queued = _number((turn.get("timings") or {}).get("queue_s")) or 0.0
                tokens = len(turn.get("completion_ids") or [])
                run.turns.append(TurnPoint(min(clock, finished - start), phases, tokens, queued))
    return run
