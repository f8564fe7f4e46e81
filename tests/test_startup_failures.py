"""Deterministic startup failures fail fast and once (DESIGN.md contract 8): a renderer key that cannot load
fails every waiting and new rollout of that key with the load's traceback, without re-dispatching any,
`caller` where the request named something no hub could serve, `infrastructure` otherwise; the failure is
remembered for the key (no second renderer spawned for it while held). Real renderer actors."""

from __future__ import annotations

import asyncio

import pytest
import ray
from env_pools import TEST_REF_PREFIXES

from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RendererConfig, RolloutRequest, SamplingConfig

pytestmark = pytest.mark.slow

DEADLINE_S = 240
CALC = Ref(target="env_actors.examples.calculator_env:CalculatorEnv")


def request(standin, tokenizer: str, index: int) -> RolloutRequest:
    return RolloutRequest(
        env=CALC,
        task_index=index,
        client=ClientConfig(base_url=standin.base_url, model="served-model"),
        renderer=RendererConfig(tokenizer=tokenizer),
        sampling=SamplingConfig(max_tokens=16, seed=index),
    )


async def wave(plane: RolloutPlane, standin, tokenizer: str, n: int) -> list:
    for index in range(n):
        await plane.submit(request(standin, tokenizer, index))
    return [await plane.next_result(timeout=DEADLINE_S) for _ in range(n)]


def test_a_tokenizer_that_cannot_load_fails_every_rollout_of_its_key_once_and_is_remembered(
    ray_session, standin
):
    async def scenario():
        config = PlaneConfig(
            lanes={"train": 64, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
            renderer_pool={"failure_hold_s": 600.0},
        )
        async with RolloutPlane(config) as plane:
            first = await wave(plane, standin, "/nonexistent/tokenizer", 16)  # all wait on one load
            second = await wave(plane, standin, "/nonexistent/tokenizer", 16)  # held: no new load
            nowhere = await wave(plane, standin, "org/name/not-an-id", 2)  # no hub could serve it
            renderers = await ray.get_actor(plane.names.renderer_pool).stats.remote()
            return first, second, nowhere, plane.stats(), renderers

    first, second, nowhere, stats, renderers = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    for result in first + second:
        assert result.kind == "infrastructure" and result.error.fault == "load", result.error
        assert result.attempts == 1 and "/nonexistent/tokenizer" in result.error.message
        assert result.error.traceback
    assert {(r.kind, r.error.fault, r.attempts) for r in nowhere} == {("caller", "load", 1)}
    assert stats.redispatched == 0 and stats.kinds["infrastructure"] == 32 and stats.kinds["caller"] == 2
    assert renderers.startup_failures == 2  # one load per key, not one per rollout or per wave
