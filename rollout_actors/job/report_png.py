"""The run report as one PNG: what a user tunes a run with (`rollouts report --png`, `rollouts run
--report-png`).

Eight panels on the run's clock (seconds since the first submission), each time panel marking the cold
start (until the first turn began: pools and tokenizers loading) and the first result:

  time per turn by phase      stacked: mean seconds of render, model, parse, env per turn, by when it ended
  waits outside the turns     stacked: mean seconds per rollout waiting for lane, pool, worker, ... by
                              when it was submitted (the cold start shows here, not inside the turns)
  rollout latency             each result: submission to result, and from its first turn on
  throughput                  turns/s and sampled tokens/s
  in flight                   submitted and not answered, and running turns, to the last result
  failures by kind over time  or "no failures"
  off-policy lag              results by versions behind, or "the policy did not change"
  reward                      its distribution
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rollout_actors.job.report import FAILURE_KINDS, summarize
from rollout_actors.job.timeline import Timeline
from rollout_actors.timings import TURN_PHASES, WAIT_PHASES, phase_name

MAX_TIME_BINS = 60  # bars over time: enough to see a trend, few enough to read one bar
MIN_PER_BIN = 5  # turns per bin on average, so a bin's mean is not one turn's noise
PHASE_COLORS = {
    "render_s": "tab:purple",
    "model_s": "tab:blue",
    "parse_s": "tab:pink",
    "env_s": "tab:green",
    "lane_s": "tab:gray",
    "env_pool_s": "tab:brown",
    "worker_s": "tab:olive",
    "dispatch_s": "tab:cyan",
    "env_open_s": "tab:green",
    "renderer_s": "tab:purple",
    "score_s": "tab:orange",
    "teardown_s": "tab:red",
}


class _Bins:
    """Equal-width bins over [0, end] of the run's clock."""

    def __init__(self, end: float, samples: int) -> None:
        self.count = max(5, min(MAX_TIME_BINS, samples // MIN_PER_BIN))
        self.width = max(end, 1e-6) / self.count
        self.mids = [(i + 0.5) * self.width for i in range(self.count)]

    def index(self, t: float) -> int:
        return min(max(int(t / self.width), 0), self.count - 1)


def _stacked_means(
    ax: Any, bins: _Bins, rows: list[tuple[float, tuple[float, ...]]], names: tuple[str, ...]
) -> None:
    """Stacked bars of the mean of each column of `rows` per bin (a row: its time, its values)."""
    sums = [[0.0] * bins.count for _ in names]
    counts = [0] * bins.count
    for at, values in rows:
        i = bins.index(at)
        counts[i] += 1
        for column, value in enumerate(values):
            sums[column][i] += value
    bottom = [0.0] * bins.count
    for column, name in enumerate(names):
        means = [s / n if n else 0.0 for s, n in zip(sums[column], counts, strict=True)]
        if not any(means):
            continue
        ax.bar(
            bins.mids,
            means,
            width=bins.width * 0.9,
            bottom=bottom,
            label=phase_name(name),
            color=PHASE_COLORS.get(name),
        )
        bottom = [b + m for b, m in zip(bottom, means, strict=True)]
    if any(bottom):
        ax.legend(loc="best", fontsize=8)


def _mark_phases(ax: Any, run: Timeline, legend: bool = False) -> None:
    """The cold start shaded and the first result as a line, on a time panel."""
    cold, first = run.cold_start_s, run.first_result_s
    if cold is not None and cold > 0:
        ax.axvspan(0, cold, color="0.85", zorder=0, label=f"cold start ({cold:.1f} s)")
    if first is not None:
        ax.axvline(first, color="black", linestyle="--", linewidth=1, label=f"first result ({first:.1f} s)")
    ax.set_xlim(0, max(run.end_s, 1e-3) * 1.03)  # the last drop to 0 stays in view
    if legend:
        ax.legend(loc="upper left", fontsize=8)


def _note(ax: Any, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=12)
    ax.set_xticks([])
    ax.set_yticks([])


def write_png(results: list[dict[str, Any]], path: str | Path) -> Path:
    """Draw the run's report into the PNG at `path`. This module reads the summary (`report.summarize`);
    the report never imports this one, so the two do not import each other. Returns the file's absolute
    path: a run under `ray job submit` works in a copy of its working dir, so a relative name alone would
    not say where the file is."""
    import matplotlib.pyplot as plt

    fig = figure(results)
    path = Path(path).resolve()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def figure(results: list[dict[str, Any]]) -> Any:
    """The report's matplotlib figure: its eight panels, row by row (`fig.axes`, twin axes last)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to the file
    import matplotlib.pyplot as plt

    summary = summarize(results)
    run = summary.time
    assert run is not None
    end = run.end_s
    fig, axes = plt.subplots(4, 2, figsize=(14, 17), constrained_layout=True)

    ax = axes[0][0]
    bins = _Bins(end, len(run.turns))
    _stacked_means(ax, bins, [(t.ended, t.phases) for t in run.turns], TURN_PHASES)
    if any(t.queue_s for t in run.turns):  # the server's own queue, part of the model call: a line, not a bar
        queued, counts = [0.0] * bins.count, [0] * bins.count
        for turn in run.turns:
            queued[bins.index(turn.ended)] += turn.queue_s
            counts[bins.index(turn.ended)] += 1
        means = [q / n if n else 0.0 for q, n in zip(queued, counts, strict=True)]
        ax.step(bins.mids, means, where="mid", color="black", label="of model: server queue")
        ax.legend(loc="best", fontsize=8)
    _mark_phases(ax, run)
    ax.set(title="time per turn by phase", xlabel="turn ended at (s)", ylabel="mean seconds per turn")

    ax = axes[0][1]
    rows = run.wait_rows
    _stacked_means(ax, _Bins(end, len(rows)), rows, WAIT_PHASES)
    _mark_phases(ax, run)
    ax.set(title="waits outside the turns, per rollout", xlabel="submitted at (s)", ylabel="mean seconds")

    ax = axes[1][0]
    spans = run.spans
    ax.scatter(
        [s.finished for s in spans],
        [s.latency_s for s in spans],
        s=6,
        alpha=0.5,
        label="submission to result",
    )
    active = [s for s in spans if s.first_turn is not None]
    ax.scatter(
        [s.finished for s in active],
        [s.active_s for s in active],
        s=6,
        alpha=0.5,
        color="tab:orange",
        label="from its first turn",
    )
    _mark_phases(ax, run, legend=True)
    ax.set_ylim(bottom=0)
    ax.set(title="rollout latency", xlabel="answered at (s)", ylabel="seconds")

    ax = axes[1][1]
    turns_per_bin, tokens_per_bin = [0] * bins.count, [0] * bins.count
    for turn in run.turns:
        turns_per_bin[bins.index(turn.ended)] += 1
        tokens_per_bin[bins.index(turn.ended)] += turn.tokens
    ax.step(bins.mids, [n / bins.width for n in turns_per_bin], where="mid", label="turns / s")
    _mark_phases(ax, run)
    ax.set(title="throughput", xlabel="time (s)", ylabel="turns / s")
    ax.set_ylim(bottom=0)
    twin = ax.twinx()
    twin.step(
        bins.mids,
        [n / bins.width for n in tokens_per_bin],
        where="mid",
        color="tab:orange",
        label="sampled tokens / s",
    )
    twin.set_ylabel("sampled tokens / s")
    twin.set_ylim(bottom=0)
    ax.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)

    ax = axes[2][0]
    _in_flight(ax, run)
    _mark_phases(ax, run, legend=True)

    ax = axes[2][1]
    failed = [s for s in spans if s.kind != "ok"]
    if failed:
        fail_bins = _Bins(end, len(spans))
        bottom = [0] * fail_bins.count
        for kind in sorted({s.kind for s in failed}, key=lambda k: (k not in FAILURE_KINDS, k)):
            counts = [0] * fail_bins.count
            for s in failed:
                if s.kind == kind:
                    counts[fail_bins.index(s.finished)] += 1
            ax.bar(
                fail_bins.mids,
                counts,
                width=fail_bins.width * 0.9,
                bottom=bottom,
                label=f"{kind} ({sum(counts)})",
            )
            bottom = [b + c for b, c in zip(bottom, counts, strict=True)]
        _mark_phases(ax, run)
        ax.legend(loc="best", fontsize=8)
        ax.set(title="failures by kind over time", xlabel="answered at (s)", ylabel="results")
    else:
        _note(ax, f"no failures\n({len(spans)} results, all ok)")
        ax.set_title("failures by kind over time")

    ax = axes[3][0]
    lags = Counter(s.versions_behind for s in spans if s.versions_behind is not None)
    if any(lag for lag in lags):
        ordered = sorted(lags)
        ax.bar([str(lag) for lag in ordered], [lags[lag] for lag in ordered], color="tab:purple")
        ax.set(
            title="off-policy lag: versions behind when answered", xlabel="versions behind", ylabel="results"
        )
    else:
        _note(ax, "the policy did not change during the run\n(every result 0 versions behind)")
        ax.set_title("off-policy lag")

    ax = axes[3][1]
    ax.hist(summary.rewards or [0.0], bins=20, color="tab:green")
    ax.set(title=f"reward (mean {summary.mean_reward or 0:.3f})", xlabel="reward", ylabel="rollouts")

    cold = f"cold start {run.cold_start_s:.1f} s, " if run.cold_start_s is not None else ""
    fig.suptitle(
        f"{summary.rollouts} rollouts in {end:.1f} s ({cold}first result at {run.first_result_s or 0:.1f} s)"
    )
    return fig


def _in_flight(ax: Any, run: Timeline) -> None:
    """Submitted-not-answered and turn-running counts as exact step curves, down to 0 at the end."""
    submitted = sorted([(s.submitted, 1) for s in run.spans] + [(s.finished, -1) for s in run.spans])
    running = sorted(
        [(s.first_turn, 1) for s in run.spans if s.first_turn is not None]
        + [(s.finished, -1) for s in run.spans if s.first_turn is not None]
    )
    for events, label in ((submitted, "submitted, not answered"), (running, "in their turns")):
        if not events:
            continue
        times, counts, level = [0.0], [0], 0
        for at, step in events:
            level += step
            times.append(at)
            counts.append(level)
        ax.step(times, counts, where="post", label=label)
    ax.set(title="rollouts in flight", xlabel="time (s)", ylabel="rollouts")
    ax.set_ylim(bottom=0)
