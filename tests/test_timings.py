"""Where a rollout's time goes: every turn's phases and every result's waits, from a real plane run, read
back by the report (terminal phase table, the run's timeline) and by `rollouts report`."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
from env_pools import TEST_REF_PREFIXES

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.job.report import format_summary, read_results, summarize
from rollout_actors.job.timeline import timeline
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

pytestmark = pytest.mark.slow  # a plane, its pools and a stand-in: seconds

LATENCY_S = 0.3  # the stand-in's own latency per model call: the model phase must hold it
LANE = 2
ROLLOUTS = 6
DEADLINE_S = 180


@pytest.fixture(scope="module")
def run_results(ray_session, standin, tmp_path_factory):
    """A group of calculator rollouts (two token-mode turns each) through a lane of 2, so 4 wait for it;
    written as `rollouts run` writes its lines."""

    async def scenario():
        config = PlaneConfig(
            lanes={"train": LANE, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
        client = ClientConfig(
            base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Latency": str(LATENCY_S)}
        )
        request = RolloutRequest(
            env=Ref("env_actors.examples.calculator_env:CalculatorEnv"),
            task_index=1,
            client=client,
            sampling=SamplingConfig(max_tokens=200, seed=3),
        )
        async with RolloutPlane(config) as plane:
            group = await (await plane.submit_group(request, ROLLOUTS)).wait(timeout=DEADLINE_S - 30)
            return group.results

    results = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    path = tmp_path_factory.mktemp("timings") / "results.jsonl"
    path.write_text("".join(r.model_dump_json(exclude_defaults=True) + "\n" for r in results))
    return results, path


@pytest.mark.timeout(DEADLINE_S + 30)
def test_every_turn_records_its_phases_and_the_model_phase_holds_the_servers_latency(run_results):
    results, _ = run_results
    assert [r.kind for r in results] == ["ok"] * ROLLOUTS, [r.error for r in results]
    for result in results:
        assert len(result.turns) == 2
        for turn in result.turns:
            phases = turn.timings
            assert phases.model_s >= LATENCY_S  # the stand-in slept that long inside the call
            assert phases.render_s > 0 and phases.parse_s > 0 and phases.env_s > 0  # token mode: all four
            assert phases.model_s < result.finished_at - result.started_at


@pytest.mark.timeout(DEADLINE_S + 30)
def test_every_result_records_its_waits_and_they_fit_inside_its_latency(run_results):
    results, _ = run_results
    for result in results:
        waits = result.timings
        assert waits.submitted_at is not None and waits.submitted_at <= result.started_at + 0.001
        assert waits.env_open_s > 0 and waits.renderer_s > 0 and waits.teardown_s > 0
        recorded = (
            waits.lane_s + waits.env_pool_s + waits.worker_s + waits.env_open_s + waits.renderer_s
        ) + sum(p for t in result.turns for p in t.timings.model_dump().values())
        assert recorded <= result.finished_at - waits.submitted_at + 0.01  # phases never overlap
    # A lane of 2 holds 6 rollouts of two 0.3 s turns: the last four waited at least one rollout's turns.
    waited = sorted(r.timings.lane_s for r in results)
    assert waited[-4] >= 2 * LATENCY_S, waited
    # The first rollouts found the env pool cold: the plane waited for it to start.
    assert max(r.timings.env_pool_s for r in results) > 0


@pytest.mark.timeout(DEADLINE_S + 30)
def test_the_report_prints_the_phase_table_and_places_the_run_from_its_first_submission(run_results):
    results, path = run_results
    lines = read_results(path)
    run = timeline(lines)
    assert run.cold_start_s is not None and 0 < run.cold_start_s < run.first_result_s <= run.end_s
    assert [s.kind for s in run.spans] == ["ok"] * ROLLOUTS
    assert len(run.turns) == 2 * ROLLOUTS and all(t.ended <= run.end_s for t in run.turns)
    text = format_summary(summarize(lines))
    table = {line.split()[0]: line.split() for line in text.splitlines() if line.startswith("  ")}
    assert {"render", "model", "parse", "env", "lane", "env_open", "renderer", "teardown"} <= set(table)
    value, unit = table["model"][1:3]  # "312.4 ms": the median model call holds the server's latency
    assert float(value) * (1e-3 if unit == "ms" else 1.0) >= LATENCY_S, table["model"]
    assert "cold start:" in text and "first result at" in text

    shown = subprocess.run(
        [sys.executable, "-m", "rollout_actors.cli", "report", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "per turn:" in shown.stdout and "p99" in shown.stdout
    assert json.loads(path.read_text().splitlines()[0])["turns"][0]["timings"]["model_s"] >= LATENCY_S


@pytest.mark.timeout(300)  # a stand-in of its own: its start alone may take two minutes on a loaded machine
def test_the_servers_own_queue_time_is_recorded_where_it_reports_it():
    """A server started as `ServerSpec` starts vLLM (`--enable-per-request-metrics`) reports each call's
    queue time; with room for one request in its KV budget, the second of two waits out the first."""
    import openai
    from conftest import served_like_vllm

    from rollout_actors.inference.standin import StandinServer
    from rollout_actors.rollout.model_call import complete_tokens

    async def scenario(server):
        headers = {"X-Standin-Latency": str(LATENCY_S)}
        client = openai.AsyncOpenAI(
            base_url=server.base_url, api_key="EMPTY", max_retries=0, default_headers=headers
        )
        sampling = SamplingConfig(max_tokens=16, seed=1)
        # Two different prompts: identical ones would share their cached prefix blocks and both fit.
        prompts = [list(range(1 + k, 150 + k)) for k in range(2)]
        try:
            return await asyncio.gather(
                *(complete_tokens(client, BUNDLED_MODEL, p, sampling, timeout_s=60) for p in prompts)
            )
        finally:
            await client.close()

    with StandinServer(served_like_vllm(kv_cache_tokens=200)) as server:  # one ~165-token call at a time
        answers = asyncio.run(asyncio.wait_for(scenario(server), 120))
    waits = sorted(answer.queue_s for answer in answers)
    assert waits[0] < LATENCY_S / 2 and waits[1] >= LATENCY_S * 0.9, waits


def test_vllm_is_launched_to_report_per_request_timing_unless_told_not_to():
    from rollout_actors.inference.server_actor import ServerSpec, standin_options, vllm_command

    assert "--enable-per-request-metrics" in vllm_command(
        ServerSpec(model="Qwen/Qwen3-8B"), "127.0.0.1", 8000
    )
    quiet = ServerSpec(model="Qwen/Qwen3-8B", per_request_metrics=False)
    assert "--enable-per-request-metrics" not in vllm_command(quiet, "127.0.0.1", 8000)
    assert standin_options(ServerSpec(kind="standin", model=BUNDLED_MODEL)).enable_per_request_metrics
