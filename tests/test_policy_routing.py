"""Which policy a rollout samples from: the version it reports is the adapter it was sent to, and a server
that joins routing serves the active policy before its first rollout."""

from __future__ import annotations

import os
import signal

import numpy as np
import openai
import pytest
from adapters import served_models, unload_adapters
from env_pools import TEST_REF_PREFIXES
from waiting import runner, wait_until

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.server_actor import ServerSpec
from rollout_actors.inference.server_set import InferenceServerSet
from rollout_actors.kernel.supervision import RestartIntensity
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.policy.lora import LoraAdapter, lora_config
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

# every test here starts real actors or servers (a plane, a pool, a server process): seconds each
pytestmark = pytest.mark.slow

MATH = Ref(target="env_actors.examples.math_env:MathEnv")
DEADLINE_S = 150
STANDIN = ServerSpec(kind="standin", model=BUNDLED_MODEL, host="127.0.0.1", ready_timeout_s=60, num_cpus=0)


run = runner(DEADLINE_S)


def adapter(seed: int) -> LoraAdapter:
    rng = np.random.default_rng(seed)
    tensors = {
        f"base_model.model.layers.0.self_attn.q_proj.lora_{ab}.weight": rng.standard_normal(
            (8, 64) if ab == "A" else (64, 8), dtype=np.float32
        )
        for ab in ("A", "B")
    }
    return LoraAdapter(tensors, lora_config(8, 16, ["q_proj"], BUNDLED_MODEL))


def config(**overrides) -> PlaneConfig:
    fields = dict(
        lanes={"train": 16, "eval": 4},
        workers=1,
        worker_num_cpus=0.25,
        env_pool={"num_cpus": 0.25},
        allowed_ref_prefixes=TEST_REF_PREFIXES,
    )
    fields.update(overrides)
    return PlaneConfig(**fields)


def request(base_url: str, **overrides) -> RolloutRequest:
    fields = dict(
        env=MATH,
        task_index=2,
        client=ClientConfig(base_url=base_url, model=BUNDLED_MODEL),
        sampling=SamplingConfig(max_tokens=64, seed=5),
    )
    fields.update(overrides)
    return RolloutRequest(**fields)


async def sampled_by(url: str, model: str, prompt_ids: list[int]) -> list[int]:
    """What `model` (the base or an adapter name) samples for this prompt with the request's settings."""
    async with openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0) as client:
        response = await client.completions.create(
            model=model, prompt=prompt_ids, max_tokens=64, seed=5, extra_body={"return_token_ids": True}
        )
    return response.choices[0].model_extra["token_ids"]


def test_a_pinned_policy_version_is_sampled_from_that_versions_adapter(ray_session, standin, tmp_path):
    url = standin.base_url

    async def scenario():
        # A fixed name prefix: adapter names (and so the stand-in's answers) are the same on every run.
        fixed = config(endpoints=[url], policy_storage_dir=str(tmp_path), name_prefix="routing-test")
        async with RolloutPlane(fixed) as plane:
            names = {}
            for version in (1, 2):
                names[version] = (await (await plane.publish_policy(adapter(version), version)).wait(30)).name
            ids = {
                "v1": await plane.submit(request(url, policy_version=1)),
                "base": await plane.submit(request(url, policy_version=0)),
                "active": await plane.submit(request(url)),
                "gone": await plane.submit(request(url, policy_version=7)),
            }
            results = {r.request_id: r for r in [await plane.next_result(timeout=60) for _ in ids]}
            by_name = {name: results[rid] for name, rid in ids.items()}
            prompt = by_name["v1"].turns[0].new_prompt_ids  # a first turn adds its whole prompt
            truth = {f"v{v}": await sampled_by(url, name, prompt) for v, name in names.items()}
            truth[BUNDLED_MODEL] = await sampled_by(url, BUNDLED_MODEL, prompt)
            assert by_name["v1"].model == names[1] and by_name["active"].model == names[2]
            return by_name, truth

    try:
        results, truth = run(scenario())
    finally:
        unload_adapters([url])
    v1, base, active, gone = results["v1"], results["base"], results["active"], results["gone"]
    for result in (v1, base, active):
        assert result.kind == "ok", result.error
    assert len({tuple(ids) for ids in truth.values()}) == 3, "each policy samples differently"
    # The version a result reports is the one whose adapter sampled its tokens.
    assert v1.policy_version_start == 1 and v1.turns[0].completion_ids == truth["v1"]
    assert base.policy_version_start == 0 and base.turns[0].completion_ids == truth[BUNDLED_MODEL]
    assert active.policy_version_start == 2 and active.turns[0].completion_ids == truth["v2"]
    assert [t.policy_version for t in v1.turns] == [1] and [t.policy_version for t in base.turns] == [0]
    assert gone.kind == "caller" and "policy_version=7" in gone.error.message


def test_the_base_model_is_version_zero(ray_session, standin):
    async def scenario():
        async with RolloutPlane(config(endpoints=[standin.base_url])) as plane:
            assert plane.policy_version == 0
            await plane.submit(request(standin.base_url))
            return await plane.next_result(timeout=60)

    result = run(scenario())
    assert result.kind == "ok", result.error
    assert (result.policy_version_start, result.policy_version_end) == (0, 0)
    assert all(turn.policy_version == 0 and not turn.version_changes for turn in result.turns)


def test_a_replacement_server_serves_the_active_adapter_before_its_first_rollout(ray_session, tmp_path):
    async def scenario():
        servers = InferenceServerSet(
            STANDIN, replicas=1, restart=RestartIntensity(max_restarts=2, window_s=60)
        )
        await servers.start()
        plane = RolloutPlane(config(policy_storage_dir=str(tmp_path)), servers=servers)
        try:
            async with plane:
                v1 = (await (await plane.publish_policy(adapter(1), 1)).wait(timeout=30)).name
                (first,) = servers.endpoints()
                os.kill(servers.status()[0].pid, signal.SIGKILL)
                await wait_until(lambda: first not in servers.endpoints(), timeout=10)
                await wait_until(lambda: len(servers.endpoints()) == 1, timeout=90)
                (replacement,) = servers.endpoints()
                # Routed only now, and it already holds the active adapter.
                loaded = served_models(replacement)
                await plane.submit(request("http://unused.invalid/v1"))
                return v1, loaded, await plane.next_result(timeout=60)
        finally:
            await servers.aclose()

    v1, loaded, result = run(scenario())
    assert v1 in loaded
    assert result.kind == "ok", result.error
    assert result.policy_version_start == 1
