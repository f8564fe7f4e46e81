"""Node loss, end to end, on a two-node `ray.cluster_utils.Cluster` of this machine (run in its own process:
a Cluster cannot share a process with the suite's session Ray). `tests/test_node_loss.py` runs it.

    PYTHONPATH=.:tests python tests/node_loss.py [STANDIN_BASE_URL]   # one JSON line; exit 0 if it held

The plane's pool actors are placed on purpose on the node that is then removed (SIGKILL of its raylet and
workers: no goodbye to the GCS), with rollouts in flight. The plane must recover with no operator action:
its pools restarted on the surviving node, every request answered exactly once, and every rollout
submitted after the loss `ok`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

import psutil
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.standin import StandinOptions, StandinServer
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

MATH = Ref(target="env_actors.examples.math_env:MathEnv")
ROLLOUTS = 4  # in flight at the loss, and again submitted after it
DEADLINE_S = 150.0  # the whole scenario, cluster start included; the test's own timeout is above it
FAST_NODE_DEATH = {  # the GCS declares a silent node dead in ~3 s (Ray's default is tens of seconds)
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 3,
}


def request(base_url: str, latency_s: float, task_index: int) -> RolloutRequest:
    client = ClientConfig(
        base_url=base_url, model=BUNDLED_MODEL, headers={"X-Standin-Latency": str(latency_s)}
    )
    return RolloutRequest(
        env=MATH, task_index=task_index, client=client, sampling=SamplingConfig(max_tokens=32, seed=1)
    )


async def holding(plane: RolloutPlane, count: int, within: float = 60) -> None:
    """Until `count` rollouts hold an env session and a renderer lease."""
    env, renderer = plane._pools.supervisor(MATH).current(), plane._pools.supervisor().current()
    deadline = time.monotonic() + within
    while (await env.stats.remote()).sessions < count or (await renderer.stats.remote()).slots < count:
        assert time.monotonic() < deadline, "the rollouts never took their sessions and leases"
        await asyncio.sleep(0.05)


MARKS: dict[str, float] = {}
"""Seconds since the process started at each step: where a slow run spent its time."""
_T0 = time.time()


def mark(name: str) -> None:
    MARKS[name] = round(time.time() - _T0, 1)


async def scenario(cluster: Cluster, doomed_node_id: str, base_url: str) -> dict:
    mark("scenario")
    config = PlaneConfig(
        lanes={"train": 32},
        workers=2,
        worker_num_cpus=0.25,
        hang_timeout_s=5.0,
        probe_interval_s=0.5,
        env_pool={"num_cpus": 0.25},
        pool_supervision={"node_id": doomed_node_id, "probe_interval_s": 0.2, "hang_timeout_s": 5.0},
    )
    async with RolloutPlane(config) as plane:
        mark("plane started")
        warm = [await plane.submit(request(base_url, 0.0, i)) for i in range(2)]
        warm_results = [await plane.next_result(timeout=60) for _ in warm]
        pools = [plane._pools.supervisor(), plane._pools.supervisor(MATH)]
        placed = [(await pool.current().health.remote()).node_id for pool in pools]

        in_flight = [await plane.submit(request(base_url, 2.0, i)) for i in range(ROLLOUTS)]
        await holding(plane, ROLLOUTS)  # env sessions and renderer leases on the doomed node
        mark("node removed")
        lost_at = time.time()
        doomed = next(node for node in cluster.worker_nodes if node.node_id == doomed_node_id)
        cluster.remove_node(doomed, allow_graceful=False)
        after = [await plane.submit(request(base_url, 0.0, i)) for i in range(ROLLOUTS)]
        results = [await plane.next_result(timeout=90) for _ in range(2 * ROLLOUTS)]
        mark("all answered")
        first_ok_after = min(
            (r.finished_at for r in results if r.request_id in after and r.kind == "ok"), default=None
        )
        stats = plane.stats()
        moved = [(await pool.current().health.remote()).node_id for pool in pools]
        return {
            "warm": [r.kind for r in warm_results],
            "placed_on_doomed_node": all(node == doomed_node_id for node in placed),
            "moved_off_doomed_node": all(node != doomed_node_id for node in moved),
            "answered_once": sorted(r.request_id for r in results) == sorted(in_flight + after),
            "in_flight": [r.kind for r in results if r.request_id in in_flight],
            "after": [r.kind for r in results if r.request_id in after],
            "errors": [f"{r.error.type}: {r.error.message[:300]}" for r in results if r.error],
            "duplicates_dropped": stats.duplicates_dropped,
            "redispatched": stats.redispatched,
            "workers_lost": stats.workers_lost,
            "pools": [
                s.model_dump(mode="json", include={"pool", "state", "incarnation", "last_loss"})
                for s in stats.pools
            ],
            "first_ok_after_loss_s": None if first_ok_after is None else round(first_ok_after - lost_at, 2),
        }


@ray.remote(num_cpus=0)
class _Here:
    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()


def schedulable(node_id: str) -> None:
    """Wait until the GCS schedules on the new node (registered is not enough: a soft node affinity
    to a node whose resources the scheduler has not seen yet quietly falls back to another node)."""
    here = _Here.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
    assert ray.get(here.node.remote(), timeout=60) == node_id
    ray.kill(here)


def start_cluster(attempts: int = 2, head_cpus: int = 2) -> Cluster:
    """The head node, retried once: Ray gives a raylet 30 s to register (not configurable), which a
    machine loaded by other work can miss. What a failed attempt started is killed before the next."""
    for attempt in range(1, attempts + 1):
        cluster = Cluster(initialize_head=False)
        try:
            cluster.add_node(num_cpus=head_cpus, include_dashboard=False, _system_config=FAST_NODE_DEATH)
            return cluster
        except Exception as exc:
            print(f"cluster start {attempt} failed: {exc}", file=sys.stderr, flush=True)
            cluster.shutdown()
            for child in psutil.Process().children(recursive=True):  # the failed node's GCS, raylet
                with suppress(psutil.NoSuchProcess):
                    child.kill()
            if attempt == attempts:
                raise
    raise AssertionError("unreachable")


def report_of(script: str, *args: str, timeout: float) -> dict:
    """Run a cluster scenario (`tests/<script>`, one JSON line out) in a process and process group of its
    own, and return its report; the calling test fails if it hangs or reports nothing."""
    import pytest

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "tests")])
    proc = subprocess.Popen(
        [sys.executable, str(root / "tests" / script), *args], cwd=root, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{script} hung; its log ends:\n{err[-4000:]}")
    finally:
        with suppress(ProcessLookupError):  # whatever of its cluster outlived it (its own process group)
            os.killpg(proc.pid, signal.SIGKILL)
    lines = out.strip().splitlines()
    assert lines, f"{script}: no report (exit {proc.returncode}); log ends:\n{err[-4000:]}"
    return json.loads(lines[-1])


def main() -> int:
    started = time.monotonic()
    cluster = start_cluster()
    try:
        doomed = cluster.add_node(num_cpus=2)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, configure_logging=False, log_to_driver=False)
        schedulable(doomed.node_id)
        mark("cluster up")
        left = DEADLINE_S - (time.monotonic() - started)
        if len(sys.argv) > 1:  # the suite's stand-in server (it runs outside the cluster either way)
            report = asyncio.run(asyncio.wait_for(scenario(cluster, doomed.node_id, sys.argv[1]), left))
        else:
            with StandinServer(StandinOptions()) as standin:
                report = asyncio.run(
                    asyncio.wait_for(scenario(cluster, doomed.node_id, standin.base_url), left)
                )
    finally:
        ray.shutdown()
        cluster.shutdown()
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["marks"] = MARKS
    held = (
        report["warm"] == ["ok", "ok"]
        and report["placed_on_doomed_node"]
        and report["moved_off_doomed_node"]
        and report["answered_once"]
        and report["duplicates_dropped"] == 0
        and all(kind == "ok" for kind in report["after"])
    )
    report["held"] = held
    print(json.dumps(report), flush=True)
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
