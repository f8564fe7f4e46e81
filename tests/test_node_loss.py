"""Losing the node that hosts the plane's pool actors: the plane recovers by itself. The scenario runs in
its own process (`tests/node_loss.py`) on a two-node `ray.cluster_utils.Cluster`, which cannot share a
process with the suite's session Ray; this test only needs the suite's stand-in server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

pytestmark = pytest.mark.ray  # a two-node Ray cluster of its own, in a subprocess

ROOT = Path(__file__).resolve().parent.parent
SCENARIO_TIMEOUT_S = 200  # the scenario's own asyncio deadline is 150 s: this only catches a hung process


@pytest.fixture(scope="module")
def node_loss(standin) -> dict:
    """Run the scenario once; its report is what the tests read."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "node_loss.py"), standin.base_url],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=SCENARIO_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"node-loss scenario hung; its log ends:\n{err[-4000:]}")
    finally:
        with suppress(ProcessLookupError):  # whatever of its cluster outlived it (its own process group)
            os.killpg(proc.pid, signal.SIGKILL)
    lines = out.strip().splitlines()
    assert lines, f"no report (exit {proc.returncode}); log ends:\n{err[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.slow
@pytest.mark.timeout(SCENARIO_TIMEOUT_S + 30)
def test_losing_the_pools_node_restarts_them_elsewhere_and_answers_each_request_once(node_loss):
    assert node_loss["warm"] == ["ok", "ok"], node_loss
    assert node_loss["placed_on_doomed_node"], node_loss  # the pools really were on the node that was lost
    assert node_loss["moved_off_doomed_node"], node_loss  # and serve again from the surviving one
    assert all(pool["state"] == "serving" and pool["incarnation"] == 2 for pool in node_loss["pools"]), (
        node_loss
    )
    assert node_loss["answered_once"] and node_loss["duplicates_dropped"] == 0, node_loss


@pytest.mark.slow
def test_rollouts_submitted_after_the_node_loss_end_ok(node_loss):
    assert node_loss["after"] and all(kind == "ok" for kind in node_loss["after"]), node_loss
    assert node_loss["held"], node_loss
