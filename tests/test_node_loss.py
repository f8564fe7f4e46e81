"""Losing the node that hosts the plane's pool actors: the plane recovers by itself. The scenario runs in
its own process (`tests/node_loss.py`) on a two-node `ray.cluster_utils.Cluster`, which cannot share a
process with the suite's session Ray; this test only needs the suite's stand-in server."""

from __future__ import annotations

import pytest
from node_loss import report_of

pytestmark = pytest.mark.ray  # a two-node Ray cluster of its own, in a subprocess

SCENARIO_TIMEOUT_S = 200  # the scenario's own asyncio deadline is 150 s: this only catches a hung process


@pytest.fixture(scope="module")
def node_loss(standin) -> dict:
    """Run the scenario once; its report is what the tests read."""
    return report_of("node_loss.py", standin.base_url, timeout=SCENARIO_TIMEOUT_S)


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
