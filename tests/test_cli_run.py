"""`rollouts run` on the suite's Ray (joined as the CLI joins any cluster, `$RAY_ADDRESS`): a task count
above the environment's is refused before anything is submitted, and a failure every rollout shares ends
the run as one line with its count, exit status 1, with no line per rollout on the way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from renderer_actors.tokenizer import BUNDLED_MODEL

REPO = Path(__file__).resolve().parent.parent
RUN_TIMEOUT_S = 240


def _rollouts(args: list[str], ray_session, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "rollout_actors.cli", "run", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 30)
def test_too_many_tasks_is_refused_before_submitting_and_a_shared_failure_is_one_line_with_a_count(
    tmp_path, ray_session, standin
):
    output = tmp_path / "results.jsonl"
    common = [
        "--env",
        "env_actors.faults.envs:StepRaisesEnv",  # every step raises KeyError: an `env` failure each rollout
        "--env-config",
        '{"num_tasks": 4}',
        "--allow-ref-prefix",
        "env_actors.faults.",
        "--base-url",
        standin.base_url,
        "--model",
        BUNDLED_MODEL,
        "--output",
        str(output),
        "--no-progress",
    ]
    refused = _rollouts([*common, "--tasks", "5"], ray_session, tmp_path)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == (
        "rollouts run: --tasks 5: env_actors.faults.envs:StepRaisesEnv has 4 tasks (indices 0..3)"
    ), refused.stderr[-2000:]
    assert not output.exists()  # nothing was submitted

    failed = _rollouts([*common, "--tasks", "4", "--group-size", "8"], ray_session, tmp_path)
    printed = failed.stdout + failed.stderr
    assert failed.returncode == 1, printed[-4000:]
    assert " ended env" not in failed.stderr, failed.stderr[-3000:]  # no log line per failed rollout
    (line,) = [line for line in failed.stdout.splitlines() if "env/KeyError" in line]
    assert line.startswith("      32  env/KeyError: "), failed.stdout[-3000:]
    assert "more than --max-failed-fraction 0" in failed.stderr
    assert len(output.read_text().splitlines()) == 32


@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_an_environment_that_cannot_load_ends_the_run_before_submitting_in_one_line(
    tmp_path, ray_session, standin
):
    output = tmp_path / "results.jsonl"
    done = _rollouts(
        [
            "--env",
            "env_actors.faults.envs:LoadRaisesEnv",  # load() raises FileNotFoundError: a missing dataset shard
            "--allow-ref-prefix",
            "env_actors.faults.",
            "--base-url",
            standin.base_url,
            "--model",
            BUNDLED_MODEL,
            "--output",
            str(output),
            "--no-progress",
        ],
        ray_session,
        tmp_path,
    )
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "rollouts run: --env env_actors.faults.envs:LoadRaisesEnv: its pool did not start"
    ), last
    assert "FileNotFoundError" in last, last
    # The pool's supervisor logs the environment's own traceback (what its author fixes); none is ours.
    assert "rollout_actors/job/" not in done.stderr and "rollout_actors/cli.py" not in done.stderr, (
        done.stderr
    )
    assert not output.exists()
