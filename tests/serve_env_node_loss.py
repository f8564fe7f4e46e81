"""`rollouts serve-env` losing the node that runs an episode's env server, on a `ray.cluster_utils.Cluster`
of this machine (in its own process: a Cluster cannot share one with the suite's session Ray).
`tests/test_serve_env_faults.py` runs it.

    PYTHONPATH=.:tests python tests/serve_env_node_loss.py     # one JSON line; exit 0 if it held

The head runs the front (its ROUTER, its env pool actor) and no env server (no CPUs); the env servers run
on a worker node, which is removed (SIGKILL of its raylet and workers: no goodbye to the GCS) while two
runs hold sessions there: one has streamed deltas, one has not. The first must be answered `success=False`
naming its env server within seconds, the second dispatched again to a server on the surviving node and
answered ok, each once, and the runs sent after the loss ok; the front's pool is never restarted.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import ray
from node_loss import schedulable, start_cluster
from test_serve_env import Front
from test_serve_env_faults import HELD, QUIET_S, Client, pool

from rollout_actors.serve_env.front import ServeEnvConfig

AFTER = 4  # runs sent once the node is gone
DEADLINE_S = 120.0  # any one wait of the scenario


def scenario(cluster, doomed) -> dict:
    config = ServeEnvConfig(address="tcp://127.0.0.1:0", env=HELD, pool=pool(min_servers=1))
    front = Front(config)
    client = Client(front.front.address)
    try:
        assert front.call(front.front.wait_loaded(DEADLINE_S), DEADLINE_S)
        pool_node = ray.get(front.front.pool.health.remote(), timeout=30).node_id
        survivor = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        schedulable(survivor.node_id)
        hold = Path(tempfile.mkdtemp()) / "hold"
        hold.touch()
        streaming = client.run(deltas=3, gap_s=60.0)
        held = client.run(hold=str(hold), deltas=1)
        client.until(lambda: client.deltas(streaming), DEADLINE_S)
        end = time.monotonic() + DEADLINE_S
        while True:
            servers = ray.get(front.front.pool.stats.remote(), timeout=30).servers
            if sum(s.sessions for s in servers) >= 2:
                holding = [s.node_id for s in servers if s.sessions]
                break
            assert time.monotonic() < end, "the runs never took their sessions"
            time.sleep(0.05)
        lost_at = time.monotonic()
        cluster.remove_node(doomed, allow_graceful=False)
        client.until(client.answered(streaming), DEADLINE_S)
        streaming_s = time.monotonic() - lost_at
        hold.unlink()
        client.until(client.answered(held), DEADLINE_S)
        held_s = time.monotonic() - lost_at
        after = [client.run(deltas=1) for _ in range(AFTER)]
        client.until(client.answered(*after), DEADLINE_S)
        client.pump(QUIET_S)
        servers = ray.get(front.front.pool.stats.remote(), timeout=30).servers
        return {
            "sessions_on_doomed_node": [node == doomed.node_id for node in holding],
            "pool_on_head": pool_node == cluster.head_node.node_id,
            "pool_incarnation": front.front.supervised.incarnation,
            "streaming": client.replies(streaming),
            "streaming_deltas_pids": sorted({d["pid"] for d in client.deltas(streaming)}),
            "streaming_s": round(streaming_s, 2),
            "held": client.replies(held),
            "held_s": round(held_s, 2),
            "after": [client.replies(r) for r in after],
            "servers_after_on": ["survivor" if s.node_id == survivor.node_id else s.node_id for s in servers],
        }
    finally:
        client.close()
        front.close()


def main() -> int:
    started = time.monotonic()
    cluster = start_cluster(head_cpus=0)  # the head serves the front; env servers need a worker node
    try:
        doomed = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
        schedulable(doomed.node_id)
        report = scenario(cluster, doomed)
    finally:
        ray.shutdown()
        cluster.shutdown()
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
