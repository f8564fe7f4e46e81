"""Agent mode end to end: real Ray, the real stand-in, real agent programs (`env_actors.faults.agents`): an
in-process OpenAI-SDK loop and a subprocess using the official `openai` client. Each call an agent makes is
a turn, recorded token-exact; the agent's failures, a cancellation and a rewritten history each give the
result the README documents ("Agent mode"), and nothing of the agent outlives its rollout."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import openai
import psutil
import pytest
import ray
from planes import lent, plane_on_own_loop
from waiting import runner

from env_actors.examples.calculator_env import CalculatorEnv
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import RolloutPlane
from rollout_actors.plane.naming import PoolNames
from rollout_actors.samples import trainer_samples, turn_prompts
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig

pytestmark = pytest.mark.slow

DEADLINE_S = 120  # every test here answers well inside this, or fails instead of hanging
TWIN = Ref(target="env_actors.faults.agents:TwoToolCalculatorEnv")
SDK_AGENT = Ref(target="env_actors.faults.agents:SdkAgentEnv")
PROGRAM = Ref(target="env_actors.faults.agents:ProgramAgentEnv")
RIGHT = {"X-Standin-Correct-Rate": "1"}  # the stand-in answers right: both modes must reach reward 1


run = runner(DEADLINE_S)


@pytest.fixture(scope="module")
def shared(ray_session):
    """(run, plane): one plane for the module (its tests only submit, read their own results and check that
    nothing is held after them); a plane start with three env pools is seconds here."""
    with plane_on_own_loop({"train": 16}, DEADLINE_S, worker_num_cpus=0.5) as started:
        yield started


def program_task(behaviour: str = "normal", **where) -> dict:
    """Task 4 of the calculator (as `task_index=4` gives the token-mode twin), and how the agent behaves."""
    env = CalculatorEnv()
    asyncio.run(env.load())
    return {**env.task(4), "behaviour": behaviour, **{key: str(value) for key, value in where.items()}}


def program(behaviour: str = "normal", **where) -> dict:
    """Request fields for the subprocess agent: one env pool serves every behaviour (the task says which)."""
    return {"env": PROGRAM, "task_index": None, "task": program_task(behaviour, **where)}


def request(
    standin, env: Ref | None = None, mode: str = "agent", headers=RIGHT, **overrides
) -> RolloutRequest:
    fields = dict(
        env=env,
        task_index=4,
        mode=mode,
        client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL, headers=headers),
        sampling=SamplingConfig(max_tokens=200, seed=11),
    )
    fields.update(overrides)
    return RolloutRequest(**fields)


async def resample(standin, prompt: list[int]) -> list[int]:
    client = openai.AsyncOpenAI(base_url=standin.base_url, api_key="EMPTY", max_retries=0)
    try:
        response = await client.completions.create(
            model=BUNDLED_MODEL,
            prompt=prompt,
            max_tokens=200,
            seed=11,
            logprobs=1,
            extra_body={"return_token_ids": True},
            extra_headers=RIGHT,
        )
    finally:
        await client.close()
    return response.choices[0].model_extra["token_ids"]


def assert_token_exact(standin, result: Result) -> None:
    """Re-sampling each turn's recorded prompt ids gives exactly its completion ids."""
    for turn, prompt in zip(result.turns, turn_prompts(result), strict=True):
        assert run(resample(standin, prompt)) == turn.completion_ids


async def held(plane: RolloutPlane, *envs: Ref, settle_s: float = 10.0) -> dict:
    """What the (one) worker still holds (clients, connections, its agent endpoint's routes) and the env
    sessions still open in the pools of `envs`. A connection the client side just closed is seen closed
    by the endpoint a moment later: asked again for up to `settle_s` until nothing is held."""
    worker = plane._workers.live()[0].handle
    pools = [ray.get_actor(PoolNames(plane.names.prefix).env_pool(env)) for env in envs]
    give_up = time.monotonic() + settle_s
    while True:
        resources = await worker.debug_resources.remote()
        resources["env_sessions"] = [(await pool.stats.remote()).sessions for pool in pools]
        if _nothing_held(resources) or time.monotonic() > give_up:
            return resources
        await asyncio.sleep(0.2)


def _nothing_held(held: dict) -> bool:
    return (
        held["open_clients"] == 0
        and not any(held["env_sessions"])
        and held["agent"]["routes"] == 0
        and held["agent"]["connections"] == 0
    )


def assert_nothing_held(held: dict) -> None:
    assert held["open_clients"] == 0, held
    assert not any(held["env_sessions"]), held  # every agent's env session ended
    assert held["agent"]["routes"] == 0, held  # every rollout's route revoked
    assert held["agent"]["connections"] == 0, held  # and the connections its agent opened closed


def test_agents_reach_the_token_mode_reward_with_token_exact_turns(shared, standin):
    token, sdk, sub = (
        request(standin, TWIN, mode="token"),
        request(standin, SDK_AGENT),
        request(standin, **program()),
    )
    # Out of turns after one call: token mode scores what it has; so does agent mode, refusing the second.
    short_token, short_sdk = (
        request(standin, TWIN, mode="token", max_turns=1),
        request(standin, SDK_AGENT, max_turns=1),
    )
    wave = (token, sdk, sub, short_token, short_sdk)

    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as p:
            for r in wave:
                await p.submit(r)
            results = {}
            for _ in wave:
                result = await p.next_result(timeout=DEADLINE_S)
                results[result.request_id] = result
            return [results[r.request_id] for r in wave], await held(p, SDK_AGENT, PROGRAM)

    (by_token, by_sdk, by_program, by_short_token, by_short_sdk), left = on_plane(scenario())
    for result in (by_token, by_sdk, by_program):
        assert result.kind == "ok", result.error
        assert result.reward == 1.0 and not result.forked
    # Same task, same prompts: each agent's calls were the very turns token mode sampled, token for token.
    for agent, twin in ((by_sdk, by_token), (by_program, by_token), (by_short_sdk, by_short_token)):
        assert len(agent.turns) == len(twin.turns)
        for ours, theirs in zip(agent.turns, twin.turns, strict=True):
            assert ours.new_prompt_ids == theirs.new_prompt_ids
            assert ours.completion_ids == theirs.completion_ids
            assert ours.logprobs == theirs.logprobs
        assert [t.tool_calls[0].name for t in agent.turns[:1]] == ["calculator"]
        assert_token_exact(standin, agent)
        (sample,) = trainer_samples(agent)  # one branch, the loss mask on sampled tokens only
        assert sum(sample.loss_mask) == sum(len(t.completion_ids) for t in agent.turns)
    assert len(by_token.turns) == 2
    assert (
        by_short_sdk.kind == by_short_token.kind == "ok"
        and by_short_sdk.reward == by_short_token.reward == 0.0
    )
    assert_nothing_held(left)


def wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.1)


def pids_in(directory) -> list[int]:
    return [int(path.stem) for path in directory.glob("*.pid")]


def test_agent_failures_and_a_rewritten_history_give_their_documented_results(shared, standin, tmp_path):
    killed_dir, waiting_dir, rewrite_dir = (tmp_path / name for name in ("killed", "waiting", "rewrite"))
    for directory in (killed_dir, waiting_dir, rewrite_dir):
        directory.mkdir()
    slow = {**RIGHT, "X-Standin-Latency": "5"}
    killed = request(standin, **program(pid_dir=killed_dir), headers=slow)
    never = request(standin, **program("never_calls", pid_dir=waiting_dir), timeout_s=20)
    rewrite = request(standin, **program("rewrite", pid_dir=rewrite_dir))
    silent = request(standin, **program("no_calls"))

    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as p:
            for r in (killed, never, rewrite, silent):
                await p.submit(r)
            # Kill the agent while its first call is being sampled (each model call takes 5 s here).
            await asyncio.to_thread(wait_for, lambda: pids_in(killed_dir), "the agent to start")
            # its first call has reached the model (not a fixed sleep: a loaded machine starts agents slowly)
            await asyncio.to_thread(
                wait_for, lambda: standin.session_counts().get(killed.request_id), "the agent's first call"
            )
            os.kill(pids_in(killed_dir)[0], signal.SIGKILL)
            results = {}
            for _ in range(4):
                result = await p.next_result(timeout=DEADLINE_S)
                results[result.request_id] = result
            return [results[r.request_id] for r in (killed, never, rewrite, silent)], await held(p, PROGRAM)

    (by_killed, by_never, by_rewrite, by_silent), left = on_plane(scenario())
    # Killed mid-call: the environment's failure, with how it ended and its output tail; its call was
    # cancelled with it, so no half-finished turn is recorded.
    assert by_killed.kind == "env" and by_killed.error.type == "AgentFailed", by_killed.error
    assert "signal 9" in by_killed.error.message
    assert "calling the model (turn 0)" in by_killed.error.message
    assert by_killed.turns == []
    # Never calls: stopped before the rollout's deadline, reported with its output tail, its key redacted.
    assert by_never.kind == "env" and by_never.error.type == "AgentFailed", by_never.error
    assert "did not finish" in by_never.error.message
    assert "agent waiting without calling, key=[redacted]" in by_never.error.message
    # Finished without a single call: nothing to train on, reported as the environment's failure.
    assert by_silent.kind == "env" and by_silent.error.type == "AgentMadeNoCalls", by_silent.error
    assert "agent" in by_silent.error.message and by_silent.turns == []
    # A rewritten history forks explicitly: the second call starts branch 1 from a full render, and both
    # branches stay token-exact and trainable.
    assert by_rewrite.kind == "ok" and by_rewrite.reward == 1.0, by_rewrite.error
    assert by_rewrite.forked and [t.branch for t in by_rewrite.turns] == [0, 1]
    first, second = turn_prompts(by_rewrite)
    assert second == by_rewrite.turns[1].new_prompt_ids and second[: len(first)] != first
    assert_token_exact(standin, by_rewrite)
    assert [s.branch for s in trainer_samples(by_rewrite)] == [0, 1]
    # Nothing of any agent outlives its rollout: processes, routes, connections.
    for directory in (killed_dir, waiting_dir, rewrite_dir):
        (pid,) = pids_in(directory)
        assert not psutil.pid_exists(pid), f"agent process {pid} outlived its rollout"
    assert_nothing_held(left)


def test_a_cancelled_rollout_stops_its_agent_and_refuses_its_late_calls(shared, standin, tmp_path):
    leak_file = tmp_path / "endpoint.json"
    stuck = {**RIGHT, "X-Standin-Latency": "60"}
    leaky = request(standin, **program("leak", pid_dir=tmp_path, leak_file=leak_file), headers=stuck)

    async def late_call(leaked: dict):
        """The agent's endpoint called with its own key after the end, as a surviving agent would."""
        client = openai.AsyncOpenAI(base_url=leaked["base_url"], api_key=leaked["api_key"], max_retries=0)
        try:
            await client.chat.completions.create(
                model=BUNDLED_MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        except openai.APIStatusError as exc:
            return exc.status_code, exc.code
        finally:
            await client.close()
        return 200, None

    on_plane, shared_plane = shared

    async def scenario():
        async with lent(shared_plane) as p:
            await p.submit(leaky)
            await asyncio.to_thread(wait_for, lambda: pids_in(tmp_path) and leak_file.exists(), "the agent")
            await asyncio.sleep(1.0)  # its first call is in flight (a model call takes 60 s here)
            assert await p.cancel(leaky.request_id)
            result = await p.next_result(timeout=DEADLINE_S)
            leaked = json.loads(leak_file.read_text())
            return result, leaked, await late_call(leaked), await held(p, PROGRAM)

    result, leaked, refused, left = on_plane(scenario())
    assert result.kind == "cancelled"
    assert refused == (410, "rollout_ended")
    (pid,) = pids_in(tmp_path)
    assert not psutil.pid_exists(pid), "the cancelled rollout's agent process is still running"
    assert_nothing_held(left)
    assert leaked["api_key"] not in result.model_dump_json()
