"""Metrics reach Prometheus through Ray's own metrics API: read back from the node's export endpoint."""

from __future__ import annotations

import asyncio
import os
import re
import time
import urllib.request

import pytest
from conftest import METRICS_PORT
from env_pools import TEST_REF_PREFIXES

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

# every test here starts real actors or servers (a plane, a pool, a server process): seconds each
pytestmark = pytest.mark.slow

ROLLOUTS = 8
DEADLINE_S = 120


def scrape() -> dict[str, float]:
    """`name{labels}` -> value for every `ray_rollouts_*` sample, summed over the reporting processes."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=5).read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r"(ray_rollouts_\w+)(\{[^}]*\})? (\S+)$", line)
        if match:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            keep = {
                k: v
                for k, v in labels.items()
                if k in ("lane", "kind", "state", "le", "env", "key", "outcome", "phase")
            }
            key = match.group(1) + str(sorted(keep.items()))
            samples[key] = samples.get(key, 0.0) + float(match.group(3))
    return samples


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for key, v in samples.items():
        metric, _, rest = key.partition("[")
        if metric == name and all(f"('{k}', '{w}')" in rest for k, w in labels.items()):
            total += v
    return total


@pytest.mark.timeout(DEADLINE_S + 30)
def test_rollouts_pools_and_lanes_appear_on_the_prometheus_endpoint(ray_session, standin):
    async def scenario():
        config = PlaneConfig(
            lanes={"train": 16, "eval": 4},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
        async with RolloutPlane(config) as plane:
            request = RolloutRequest(
                env=Ref("env_actors.examples.calculator_env:CalculatorEnv"),
                task_index=1,
                client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL),
                sampling=SamplingConfig(max_tokens=200, seed=3),
            )
            group = await (await plane.submit_group(request, ROLLOUTS)).wait(timeout=60)
            results = group.results
            # Poll while the plane (and its pools) still run: gauges are sampled by live processes.
            deadline = time.monotonic() + 60
            while True:
                samples = await asyncio.to_thread(scrape)
                wanted = {
                    "finished": value(samples, "ray_rollouts_finished_total", kind="ok"),
                    "submitted": value(samples, "ray_rollouts_submitted_total", lane="train"),
                    "latency": value(samples, "ray_rollouts_rollout_latency_s_count", kind="ok"),
                    "turns": value(samples, "ray_rollouts_turns_per_rollout_count"),
                    "limit": value(samples, "ray_rollouts_lane_limit", lane="train"),
                    "env_workers": value(samples, "ray_rollouts_env_workers", state="ready"),
                    "renderers": value(samples, "ray_rollouts_renderers"),
                    "workers_live": value(samples, "ray_rollouts_workers_live"),
                    "model_calls": value(samples, "ray_rollouts_model_call_latency_s_count", outcome="ok"),
                    "loop_stall_series": sum(1 for k in samples if "worker_loop_stall_s" in k),
                    "model_phase": value(samples, "ray_rollouts_turn_phase_s_count", phase="model"),
                    "env_phase": value(samples, "ray_rollouts_turn_phase_s_count", phase="env"),
                    "env_open_wait": value(samples, "ray_rollouts_rollout_wait_s_count", phase="env_open"),
                }
                if all(v > 0 for v in wanted.values()) and wanted["finished"] >= ROLLOUTS:
                    return results, wanted
                assert time.monotonic() < deadline, f"metrics missing after 60 s: {wanted}"
                await asyncio.sleep(1.0)

    results, figures = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert [r.kind for r in results] == ["ok"] * ROLLOUTS, [r.error for r in results]
    assert figures["submitted"] >= ROLLOUTS and figures["latency"] >= ROLLOUTS
    # Every turn's phases are a histogram per phase: one model observation per turn sampled.
    assert figures["model_phase"] >= sum(len(r.turns) for r in results) >= ROLLOUTS


@pytest.mark.timeout(DEADLINE_S + 30)
def test_a_failed_rollout_is_logged_once_where_it_was_classified_naming_request_lease_and_worker(
    ray_session, standin, caplog
):
    """A model failure is classified on the worker: one line in that worker's log names the rollout; a
    request refused at submission is classified by the plane: one line in the driver's log."""
    import ray

    failing = ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Fault": "500"})

    async def scenario():
        config = PlaneConfig(lanes={"train": 4}, workers=1, worker_num_cpus=0.25, env_pool={"num_cpus": 0.25})
        async with RolloutPlane(config) as plane:
            request = RolloutRequest(
                env=Ref("env_actors.examples.math_env:MathEnv"), task_index=0, client=failing, max_turns=1
            )
            await plane.submit(request)
            refused = await plane.submit({**request.model_dump(mode="json"), "request_id": "bad id\r\n"})
            return request, [await plane.next_result(timeout=60) for _ in range(2)], refused

    with caplog.at_level("WARNING", logger="rollout_actors"):
        request, results, refused = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    model = next(r for r in results if r.request_id == request.request_id)
    assert model.kind == "model" and model.worker
    driver_lines = [r.getMessage() for r in caplog.records if "ended" in r.getMessage()]
    assert not any(request.request_id in line for line in driver_lines)  # the worker logged it, not the plane
    assert sum("ended caller" in line for line in driver_lines) == 1

    log_dir = ray._private.worker.global_worker.node.get_logs_dir_path()
    deadline = time.monotonic() + 30
    while True:
        lines = []
        for path in os.listdir(log_dir):
            if path.startswith("worker-") and path.endswith((".err", ".out")):
                with open(os.path.join(log_dir, path), errors="replace") as f:
                    lines += [line for line in f if request.request_id in line and " ended " in line]
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(lines) == 1, lines
    assert request.lease_id in lines[0] and model.worker in lines[0] and "ended model" in lines[0]
