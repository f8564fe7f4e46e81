"""`rollouts report`: a finished run's JSON lines read back into a summary and one PNG of four panels."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from rollout_actors.job.report import format_summary, percentile, read_results, summarize
from rollout_actors.job.report_png import write_png


def _results(path):
    lines = []
    for i in range(40):
        kind = "ok" if i % 10 else ("model" if i % 20 else "infrastructure")
        result = {
            "request_id": f"req-{i}",
            "lease_id": f"lease-{i}",
            "kind": kind,
            "reward": (i % 3) / 2 if kind == "ok" else None,
            "turns": [{}] * (1 + i % 3),
            "started_at": 1000.0 + i * 0.1,
            "finished_at": 1000.0 + i * 0.1 + 1.0 + (i % 5),
            "error": None if kind == "ok" else {"type": f"{kind.title()}Error", "message": f"boom {i}"},
        }
        lines.append(json.dumps(result))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_summary_counts_kinds_rewards_latency_and_groups_failures_by_type(tmp_path):
    summary = summarize(read_results(_results(tmp_path / "r.jsonl")))
    assert summary.rollouts == 40
    assert summary.kinds == {"ok": 36, "model": 2, "infrastructure": 2}
    assert summary.latency(50) == 3.0 and summary.latency(100) == 5.0
    text = format_summary(summary)
    assert (
        "ok=36" in text
        and "model/ModelError: boom 10" in text
        and "infrastructure/InfrastructureError" in text
        and "env=0" in text  # every kind is named, environment faults apart from ours
    )
    assert percentile([], 50) is None


def test_png_has_four_panels_and_the_command_prints_the_summary(tmp_path):
    results = _results(tmp_path / "r.jsonl")
    png = write_png(read_results(results), tmp_path / "report.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "rollout_actors.cli",
            "report",
            str(results),
            "--png",
            str(tmp_path / "b.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "rollouts: 40" in shown.stdout and (tmp_path / "b.png").exists()


def _timed_run(fail: bool, lag: bool) -> list[dict]:
    """20 rollouts of two turns as `rollouts run` writes them: the first wave of 10 waits 5 s for a cold
    env pool and renderer, the second starts warm; one model failure and a weight update if asked."""
    results = []
    for i in range(20):
        cold = i < 10
        submitted = 1000.0 + (0 if cold else 7.0)
        waits = {"submitted_at": submitted, "env_pool_s": 3.0 if cold else 0.0, "env_open_s": 0.05}
        waits |= {"renderer_s": 2.0 if cold else 0.001, "teardown_s": 0.01}
        started = submitted + waits["env_pool_s"]
        turn = {
            "completion_ids": [1] * 50,
            "timings": {"render_s": 0.002, "model_s": 0.5, "queue_s": 0.2, "env_s": 0.1},
        }
        finished = started + waits["env_open_s"] + waits["renderer_s"] + 2 * 0.602 + 0.01
        failed = fail and i == 15
        results.append(
            {
                "request_id": f"req-{i}",
                "lease_id": f"lease-{i}",
                "kind": "model" if failed else "ok",
                "error": {"type": "MalformedResponse", "message": "no choices"} if failed else None,
                "turns": [turn, turn],
                "started_at": started,
                "finished_at": finished,
                "timings": waits,
                "versions_behind": 1 if lag and not cold else 0,
            }
        )
    return results


def test_the_timeline_starts_at_the_first_submission_and_marks_the_cold_start_apart():
    from rollout_actors.job.timeline import timeline

    run = timeline(_timed_run(fail=False, lag=False))
    # The first wave's first turn began after 3 s of env pool and 2.05 s of env reset and renderer slot.
    assert run.cold_start_s == pytest.approx(5.05) and run.first_result_s == pytest.approx(6.264)
    assert [round(s.latency_s, 3) for s in run.spans[:1]] == [6.264]  # submission to result
    assert [round(s.active_s, 3) for s in run.spans[:1]] == [1.214]  # its turns, without the waits
    assert len(run.turns) == 40 and max(t.ended for t in run.turns) <= run.end_s
    rollouts_per_s, turns_per_s, tokens_per_s = run.steady_rates()
    assert turns_per_s == pytest.approx(2 * rollouts_per_s) and tokens_per_s == pytest.approx(
        50 * turns_per_s
    )
    text = format_summary(summarize(_timed_run(fail=False, lag=False)))
    assert "cold start: 5.05 s" in text and "first result at 6.26 s" in text
    assert f"last at {run.end_s:.2f} s (after the first submit)" in text
    assert "  env_pool " in text and "  lane " not in text  # no lane was full: that wait is left out
    queue = next(line for line in text.splitlines() if line.startswith("    queue "))  # under model
    assert queue.split()[1:3] == ["200.0", "ms"] and queue.endswith(
        "   -"
    )  # inside model: no share of its own


def test_png_shows_no_failures_plainly_and_the_in_flight_curve_down_to_zero_at_the_last_result():
    from rollout_actors.job.report_png import figure

    fig = figure(_timed_run(fail=False, lag=False))
    failures, lag, in_flight = fig.axes[5], fig.axes[6], fig.axes[4]
    assert any("no failures" in t.get_text() for t in failures.texts)
    assert any("did not change" in t.get_text() for t in lag.texts)
    end = max(r["finished_at"] for r in _timed_run(fail=False, lag=False)) - 1000.0
    curves = [line for line in in_flight.lines if not line.get_label().startswith("first result")]
    assert len(curves) == 2  # submitted and not answered; in their turns
    for line in curves:
        xs, ys = line.get_data()
        assert ys[-1] == 0 and xs[-1] == pytest.approx(end)  # to the end, not a bin short of it
    assert in_flight.get_xlim()[1] >= end


def test_png_shows_failures_by_kind_and_the_off_policy_lag_when_there_are_some():
    from rollout_actors.job.report_png import figure

    fig = figure(_timed_run(fail=True, lag=True))
    failures, lag = fig.axes[5], fig.axes[6]
    assert not failures.texts and "model (1)" in [t.get_text() for t in failures.get_legend().get_texts()]
    assert [tick.get_text() for tick in lag.get_xticklabels()] == ["0", "1"]
    assert sorted(bar.get_height() for bar in lag.patches) == [10, 10]


def test_the_png_is_named_by_its_absolute_path(tmp_path, monkeypatch):
    """A run under `ray job submit` works in a copy of its working dir: the path it prints must say where."""
    results = read_results(_results(tmp_path / "r.jsonl"))
    monkeypatch.chdir(tmp_path)
    png = write_png(results, "relative.png")
    assert png.is_absolute() and png == tmp_path / "relative.png" and png.exists()
