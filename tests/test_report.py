"""`rollouts report`: a finished run's JSON lines read back into a summary and one PNG of four panels."""

from __future__ import annotations

import json
import subprocess
import sys

from rollout_actors.report import format_summary, percentile, read_results, summarize, write_png


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
