"""`rollouts report RESULTS.jsonl [--png report.png]`: read a finished run back.

Prints the summary (results by kind, reward, latency percentiles, turns, rollouts/s, failures grouped by
type with one example message each) and, with `--png`, writes one figure of four panels: the reward
distribution, rollout latency over time, rollouts in flight and finished per second over time, and
failures by kind over time. It reads the JSON lines as plain dicts, so a file written by an older
version of the plane still reads.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("ok", "model", "env", "infrastructure", "caller", "cancelled")
FAILURE_KINDS = KINDS[1:]
MAX_TIME_BINS = 60  # panels over time: up to this many bins across the run, ~10 rollouts per bin


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
    spans = [_span(r) for r in results]
    latencies = [end - start for start, end in spans if start is not None and end is not None]
    starts = [s for s, _ in spans if s is not None]
    ends = [e for _, e in spans if e is not None]
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
        latencies=latencies,
        turns=[len(r.get("turns") or []) for r in results],
        elapsed_s=(max(ends) - min(starts)) if starts and ends else 0.0,
        failures=dict(sorted(failures.items(), key=lambda item: -item[1][0])),
    )


def _span(result: dict[str, Any]) -> tuple[float | None, float | None]:
    start, end = result.get("started_at"), result.get("finished_at")
    return (
        start if isinstance(start, (int, float)) else None,
        end if isinstance(end, (int, float)) else None,
    )


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
    lines = [
        f"rollouts: {summary.rollouts} in {summary.elapsed_s:.1f} s ({rate:.2f}/s)",
        f"by kind: {kinds}",
        f"reward: mean {'n/a' if mean is None else f'{mean:.3f}'} over {len(summary.rewards)} scored"
        + (f", min {min(summary.rewards):.3f}, max {max(summary.rewards):.3f}" if summary.rewards else ""),
        f"latency: p50 {secs(summary.latency(50))}, p90 {secs(summary.latency(90))}, "
        f"p99 {secs(summary.latency(99))}, max {secs(max(summary.latencies, default=None))}",
        f"turns: mean {sum(turns) / len(turns):.2f}, max {max(turns)}" if turns else "turns: n/a",
    ]
    if summary.failures:
        lines.append("failures:")
        for key, (count, _, example) in summary.failures.items():
            lines.append(f"  {count:>6}  {key}: {example[:160]}")
    return "\n".join(lines)


def write_png(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Four panels: reward distribution, latency over time, in flight and throughput, failures by kind."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to the file
    import matplotlib.pyplot as plt

    summary = summarize(results)
    spans = [(s, e, r) for r in results for s, e in [_span(r)] if s is not None and e is not None]
    t0 = min((s for s, _, _ in spans), default=0.0)
    t1 = max((e for _, e, _ in spans), default=1.0)
    bins = max(5, min(MAX_TIME_BINS, len(spans) // 10))
    width = max(t1 - t0, 1e-6) / bins
    edges = [t0 + i * width for i in range(bins + 1)]
    mids = [(a + b) / 2 - t0 for a, b in zip(edges, edges[1:], strict=False)]

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), constrained_layout=True)
    ax = axes[0][0]
    ax.hist(summary.rewards or [0.0], bins=20, color="tab:green")
    ax.set(title=f"reward (mean {summary.mean_reward or 0:.3f})", xlabel="reward", ylabel="rollouts")

    ax = axes[0][1]
    ax.scatter([e - t0 for _, e, _ in spans], [e - s for s, e, _ in spans], s=4, alpha=0.5)
    ax.set(title="rollout latency over time", xlabel="finished at (s)", ylabel="latency (s)")

    ax = axes[1][0]
    in_flight = [sum(1 for s, e, _ in spans if s <= t0 + m < e) for m in mids]
    finished = [0] * bins
    failed_by_kind: dict[str, list[int]] = defaultdict(lambda: [0] * bins)
    for _, e, r in spans:
        index = min(int((e - t0) / width), bins - 1)
        finished[index] += 1
        if r.get("kind") in FAILURE_KINDS:
            failed_by_kind[r["kind"]][index] += 1
    ax.plot(mids, in_flight, label="in flight")
    ax.set(title="in flight and throughput", xlabel="time (s)", ylabel="rollouts in flight")
    twin = ax.twinx()
    twin.plot(mids, [n / width for n in finished], color="tab:orange", label="finished / s")
    twin.set_ylabel("finished / s")
    ax.legend(loc="upper left")
    twin.legend(loc="upper right")

    ax = axes[1][1]
    bottom = [0] * bins
    for kind in FAILURE_KINDS:
        counts = failed_by_kind.get(kind)
        if counts:
            ax.bar(mids, counts, width=width, bottom=bottom, label=kind)
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
    ax.set(title="failures by kind over time", xlabel="time (s)", ylabel="rollouts")
    if failed_by_kind:
        ax.legend()
    fig.suptitle(f"{summary.rollouts} rollouts")
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
