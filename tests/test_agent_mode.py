"""Agent mode end to end: real Ray, the real stand-in, real agent programs (`env_actors.faults.agents`): an
in-process OpenAI-SDK loop and a subprocess using the official `openai` client. Each call an agent makes is
a turn, recorded token-exact; the agent's failures, a cancellation and a rewritten history each give the
result the README documents ("Agent mode"), and nothing of the agent outlives its rollout."""

from __future__ import annotations

import asyncio

import openai
import pytest
from env_pools import TEST_REF_PREFIXES

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.samples import trainer_samples, turn_prompts
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig

pytestmark = pytest.mark.slow

DEADLINE_S = 120  # every test here answers well inside this, or fails instead of hanging
TWIN = Ref(target="env_actors.faults.agents:TwoToolCalculatorEnv")
SDK_AGENT = Ref(target="env_actors.faults.agents:SdkAgentEnv")
RIGHT = {"X-Standin-Correct-Rate": "1"}  # the stand-in answers right: both modes must reach reward 1


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, DEADLINE_S))


def plane() -> RolloutPlane:
    return RolloutPlane(
        PlaneConfig(
            lanes={"train": 16},
            workers=1,
            worker_num_cpus=0.5,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
    )


def program(behaviour: str = "normal", **config) -> Ref:
    return Ref(target="env_actors.faults.agents:ProgramAgentEnv", config={"behaviour": behaviour, **config})


def request(standin, env: Ref, mode: str = "agent", headers=RIGHT, **overrides) -> RolloutRequest:
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


async def held(plane: RolloutPlane) -> dict:
    """What the (one) worker still holds: clients, connections, and its agent endpoint's routes."""
    worker = plane._workers.live()[0].handle
    return await worker.debug_resources.remote()


def assert_nothing_held(held: dict) -> None:
    assert held["open_clients"] == 0, held
    assert held["agent"]["routes"] == 0, held  # every rollout's route revoked
    assert held["agent"]["connections"] == 0, held  # and the connections its agent opened closed


def test_agents_reach_the_token_mode_reward_with_token_exact_turns(ray_session, standin):
    token, sdk, sub = (
        request(standin, TWIN, mode="token"),
        request(standin, SDK_AGENT),
        request(standin, program()),
    )

    async def scenario():
        async with plane() as p:
            for r in (token, sdk, sub):
                await p.submit(r)
            results = {}
            for _ in range(3):
                result = await p.next_result(timeout=DEADLINE_S)
                results[result.request_id] = result
            return [results[r.request_id] for r in (token, sdk, sub)], await held(p)

    (by_token, by_sdk, by_program), left = run(scenario())
    for result in (by_token, by_sdk, by_program):
        assert result.kind == "ok", result.error
        assert result.reward == 1.0 and not result.forked
    # Same task, same prompts: each agent's calls were the very turns token mode sampled, token for token.
    for agent in (by_sdk, by_program):
        assert len(agent.turns) == len(by_token.turns) == 2
        for ours, theirs in zip(agent.turns, by_token.turns, strict=True):
            assert ours.new_prompt_ids == theirs.new_prompt_ids
            assert ours.completion_ids == theirs.completion_ids
            assert ours.logprobs == theirs.logprobs
        assert [t.tool_calls[0].name for t in agent.turns[:1]] == ["calculator"]
        assert_token_exact(standin, agent)
        (sample,) = trainer_samples(agent)  # one branch, the loss mask on sampled tokens only
        assert sum(sample.loss_mask) == sum(len(t.completion_ids) for t in agent.turns)
    assert_nothing_held(left)
