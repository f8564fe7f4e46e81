"""Environments that misbehave, through the whole plane: each rollout ends in exactly one result of the
kind the README's failure table documents, within the budget it documents. Real env servers; the model
is the stand-in. One plane for the module, every environment submitted at once."""

from __future__ import annotations

import asyncio

import pytest
from env_pools import TEST_REF_PREFIXES

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig

DEADLINE_S = 300
STEP_TIMEOUT_S = 3.0
SCORE_TIMEOUT_S = 2.0
HANG_TIMEOUT_S = 2.0
MAX_DISPATCHES = 3
FAULTS = "env_actors.faults.envs"

# name -> (env Ref config, kind, failure type, seconds it may take at most beyond the env's start)
CASES = {
    "step-raises": ("StepRaisesEnv", {}, "env", "KeyError", 10),
    "step-returns-a-string": ("WrongTypesEnv", {}, "env", "ValidationError", 10),
    "reward-nan": ("BadRewardEnv", {"reward": "nan", "turns": 1}, "env", "ValidationError", 10),
    "reward-inf": ("BadRewardEnv", {"reward": "-inf", "turns": 1}, "env", "ValidationError", 10),
    "assistant-message": ("BadMessagesEnv", {"kind": "assistant"}, "env", "ValidationError", 10),
    "role-robot": ("BadMessagesEnv", {"kind": "robot"}, "env", "ValidationError", 10),
    "integer-content": ("BadMessagesEnv", {"kind": "int_content"}, "env", "ValidationError", 10),
    # A rollout's steps also score the episode when it ends: the call's limit is step + score timeouts.
    "step-never-returns": (
        "NeverReturnsEnv",
        {},
        "env",
        "EnvDeadline",
        STEP_TIMEOUT_S + SCORE_TIMEOUT_S + 10,
    ),
    # It wedges its env server at the same step of every dispatch: poison after two, not three.
    "step-blocks-its-loop": ("BlocksLoopEnv", {}, "env", "PoisonRequest", 2 * (HANG_TIMEOUT_S + 15)),
}


@pytest.fixture(scope="module")
def outcomes(ray_session, standin) -> dict[str, tuple[Result, float]]:
    """name -> (result, seconds its last attempt took on its worker, its renderer slot's wait aside)."""

    async def scenario():
        config = PlaneConfig(
            lanes={"train": 16, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            max_dispatches=MAX_DISPATCHES,
            allowed_ref_prefixes=TEST_REF_PREFIXES,
            env_pool={
                "num_cpus": 0.1,
                "step_timeout_s": STEP_TIMEOUT_S,
                "score_timeout_s": SCORE_TIMEOUT_S,
                "hang_timeout_s": HANG_TIMEOUT_S,
                "probe_interval_s": 0.2,
                "probe_timeout_s": 1.0,
                "restart": {"max_restarts": 5, "window_s": 60},
            },
        )
        async with RolloutPlane(config) as plane:
            names = {}
            for name, (env, env_config, *_) in CASES.items():
                request = RolloutRequest(
                    env=Ref(target=f"{FAULTS}:{env}", config=env_config),
                    task_index=0,
                    client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL),
                    sampling=SamplingConfig(max_tokens=16, seed=0),
                    max_turns=3,
                )
                names[await plane.submit(request)] = name
            results = [await plane.next_result(timeout=DEADLINE_S) for _ in names]
            assert not plane._streams.results_pending(None)
        # The budget is the failure's, not the cold start's: the renderer's tokenizer load (a slot's wait on
        # a cold pool) is taken out, as the env pool's start is (it comes before the worker's clock starts).
        return {
            names[r.request_id]: (r, r.finished_at - r.started_at - r.timings.renderer_s) for r in results
        }

    return asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_a_misbehaving_environment_ends_in_one_result_of_its_documented_kind(outcomes, name):
    _, _, kind, failure_type, budget_s = CASES[name]
    result, took_s = outcomes[name]
    assert (result.kind, result.error.type if result.error else None) == (kind, failure_type), result.error
    assert result.reward is None
    if failure_type not in ("EnvDeadline", "PoisonRequest"):
        assert "env_actors/" in result.error.traceback  # the traceback of the side that failed
    assert took_s <= budget_s, f"{name} took {took_s:.1f} s, documented budget {budget_s} s"
    if failure_type == "PoisonRequest":
        assert result.attempts == 2 and len(result.error.losses) == 2  # two servers lost, not three
    else:
        assert result.attempts == 1  # the environment's own bug is not re-dispatched


@pytest.mark.slow
def test_a_requests_deadline_holds_while_its_env_pool_starts(ray_session, standin):
    """An environment whose constructor never returns: its pool would wait out `env_ready_timeout_s`, but a
    request with a 3 s deadline is answered at its deadline, `infrastructure` (`DeadlineExceeded`)."""

    async def scenario():
        config = PlaneConfig(
            lanes={"train": 2, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_ready_timeout_s=60,
            allowed_ref_prefixes=TEST_REF_PREFIXES,
            env_pool={"num_cpus": 0.1},
        )
        async with RolloutPlane(config) as plane:
            request = RolloutRequest(
                env=Ref(target=f"{FAULTS}:HangsInConstructorEnv"),
                task_index=0,
                client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL),
                timeout_s=3.0,
            )
            started = asyncio.get_running_loop().time()
            await plane.submit(request)
            result = await plane.next_result(timeout=DEADLINE_S)
            return result, asyncio.get_running_loop().time() - started

    result, took_s = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert (result.kind, result.error.type) == ("infrastructure", "DeadlineExceeded"), result.error
    assert "env pool" in result.error.message
    assert took_s < 3.0 + 5.0, took_s  # was: the pool's whole readiness wait (14.6 s for a 3 s deadline)
