"""`rollouts report RESULTS.jsonl [--png report.png]`: read a finished run back.

Prints the summary: results by kind, reward, latency percentiles (and the same without the waits before
the first turn), turns, the groups' learning signal (`group_stats.py`), rollouts/s, when the cold start
ended and the first result came, the phase table (median, p90, p99 and share of the time per phase: where
a turn's time goes), and failures grouped by type with one example message each. `--png` draws the run (`report_png.py`). It reads the JSON lines as plain
dicts, so a file written by an older version of the plane (no timings) still reads.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rollout_actors.job.group_stats import GroupStats, group_lines, group_stats
from rollout_actors.job.timeline import Timeline, timeline
from rollout_actors.timings import SERVER_PHASES, WAIT_PHASES, phase_name

TABLED_TURN_PHASES = ("render_s", "model_s", "queue_s", "parse_s", "env_s")
"""Turn phases in table order: the server's queue under the model call it is part of."""

KINDS = ("ok", "model", "env", "infrastructure", "caller", "cancelled")
FAILURE_KINDS = KINDS[1:]


@dataclass
class RunSummary:
    rollouts: int
    kinds: dict[str, int]
    rewards: list[float]
    latencies: list[float]
    turns: list[int]
    elapsed_s: float
    failures: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    """`kind/type` -> (count, kind, one example message)."""
    active: list[float] = field(default_factory=list)
    """Each rollout's latency less its waits before the first turn (and the plane's)."""
    time: Timeline | None = None
    groups: GroupStats | None = None
    """Reward spread inside groups, groups without a learning signal, pass@k, per-task means."""

    @property
    def mean_reward(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    def latency(self, q: float) -> float | None:
        return percentile(self.latencies, q)


def read_results(path: str | Path) -> list[dict[str, Any]]:
    results = []
    with open(path) as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                results.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
    return results


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of `values`; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarize(results: list[dict[str, Any]]) -> RunSummary:
    kinds = Counter(r.get("kind", "?") for r in results)
    rewards = [float(r["reward"]) for r in results if isinstance(r.get("reward"), (int, float))]
    run = timeline(results)
    failures: dict[str, tuple[int, str, str]] = {}
    for r in results:
        error = r.get("error") or {}
        if r.get("kind") in (None, "ok") or not error:
            continue
        key = f"{r['kind']}/{error.get('type', '?')}"
        count, _, example = failures.get(key, (0, r["kind"], str(error.get("message", ""))))
        failures[key] = (count + 1, r["kind"], example)
    return RunSummary(
        rollouts=len(results),
        kinds=dict(kinds),
        rewards=rewards,
        latencies=[span.latency_s for span in run.spans],
        active=[span.active_s for span in run.spans if span.first_turn is not None],
        turns=[len(r.get("turns") or []) for r in results],
        elapsed_s=run.end_s,
        failures=dict(sorted(failures.items(), key=lambda item: -item[1][0])),
        time=run,
        groups=group_stats(results),
    )


def _ms(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value * 1e3:.1f} ms" if value < 1 else f"{value:.2f} s"


def phase_table(run: Timeline) -> list[str]:
    """Median, p90, p99 and share of all recorded time, per turn phase and per wait of a rollout."""
    lines = [f"{'phase':<20}{'median':>11}{'p90':>11}{'p99':>11}{'total':>11}{'share':>8}"]
    groups = (
        ("per turn", TABLED_TURN_PHASES, run.turn_phases),
        ("per rollout, outside its turns", WAIT_PHASES, run.waits),
    )
    grand = sum(sum(v) for _, _, phases in groups for name, v in phases.items() if name not in SERVER_PHASES)
    grand = grand or 1.0
    for title, names, phases in groups:
        lines.append(f"{title}:")
        for name in names:
            values = phases.get(name, [])
            if not any(values):
                continue  # a wait nothing waited on (no lane was full, no pool was cold) is left out
            total = sum(values)
            inside = name in SERVER_PHASES  # part of the model phase: tabled under it, not counted twice
            label = f"  {phase_name(name)}" if inside else phase_name(name)
            share = "-" if inside else f"{total / grand:.1%}"
            lines.append(
                f"  {label:<18}{_ms(percentile(values, 50)):>11}{_ms(percentile(values, 90)):>11}"
                f"{_ms(percentile(values, 99)):>11}{_ms(total):>11}{share:>8}"
            )
    return lines


def format_summary(summary: RunSummary) -> str:
    def secs(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f} s"

    rate = summary.rollouts / summary.elapsed_s if summary.elapsed_s > 0 else 0.0
    kinds = "  ".join(f"{k}={summary.kinds.get(k, 0)}" for k in KINDS)
    others = {k: v for k, v in summary.kinds.items() if k not in KINDS}
    if others:
        kinds += "  " + "  ".join(f"{k}={v}" for k, v in others.items())
    mean = summary.mean_reward
    turns = summary.turns
    active = summary.active
    lines = [
        f"rollouts: {summary.rollouts} in {summary.elapsed_s:.1f} s ({rate:.2f}/s)",
        f"by kind: {kinds}",
        f"reward: mean {'n/a' if mean is None else f'{mean:.3f}'} over {len(summary.rewards)} scored"
        + (f", min {min(summary.rewards):.3f}, max {max(summary.rewards):.3f}" if summary.rewards else ""),
        f"latency: p50 {secs(summary.latency(50))}, p90 {secs(summary.latency(90))}, "
        f"p99 {secs(summary.latency(99))}, max {secs(max(summary.latencies, default=None))}",
        f"  without waits before the first turn: p50 {secs(percentile(active, 50))}, "
        f"p90 {secs(percentile(active, 90))}, p99 {secs(percentile(active, 99))}",
        f"turns: mean {sum(turns) / len(turns):.2f}, max {max(turns)}" if turns else "turns: n/a",
    ]
    lines += group_lines(summary.groups)
    if summary.time is not None:
        lines += format_timings(summary.time)
    lines += failure_lines(summary)
    return "\n".join(lines)


def failure_lines(summary: RunSummary) -> list[str]:
    """Failures by kind and type, most frequent first, with a count and one example message each: a
    failure shared by every rollout of a run is one line, not one per rollout. `rollouts run` ends with
    the same block."""
    if not summary.failures:
        return []
    lines = ["failures (count, kind/type: one example):"]
    for key, (count, _, example) in summary.failures.items():
        first = example.strip().splitlines()[0] if example.strip() else ""
        lines.append(f"  {count:>6}  {key}: {first[:160]}")
    return lines


def format_timings(run: Timeline) -> list[str]:
    """The cold start, the first result, steady-state rates and the phase table of a run."""

    def secs(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f} s"

    if not run.spans:
        return []
    # Lines of at most 80 columns: a terminal wraps none of them.
    lines = [
        f"cold start: {secs(run.cold_start_s)} until the first turn began",
        f"  longest waits in it: env pool start {secs(run.longest('env_pool_s'))}, "
        f"renderer slot {secs(run.longest('renderer_s'))}",
        f"first result at {secs(run.first_result_s)}, last at {secs(run.end_s)} (after the first submit)",
    ]
    steady = run.steady_rates()
    if steady is not None:
        lines.append(
            f"after the cold start: {steady[0]:.2f} rollouts/s, {steady[1]:.2f} turns/s, "
            f"{steady[2]:.0f} sampled tokens/s"
        )
    if run.turn_phases.get("model_s"):
        lines += phase_table(run)
    return lines
