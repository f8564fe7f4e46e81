"""Full-weight updates through the plane: every server pauses in keep mode, takes the new weights through
vLLM's weight-update routes, resumes; rollouts in flight continue, and every token says which weights
sampled it. Two dedicated stand-in servers (their weight version must not leak into other tests)."""

from __future__ import annotations

import asyncio
import re

import openai
import pytest
from conftest import served_like_vllm
from env_pools import TEST_REF_PREFIXES

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.inference.standin import StandinServer
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.samples import trainer_samples, turn_prompts
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

# every test here starts real actors or servers (a plane, a pool, a server process): seconds each
pytestmark = pytest.mark.slow

try:
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx

ECHO = Ref(target="env_actors.faults.envs:EchoEnv", config={"num_tasks": 8, "turns": 3})
MAX_TOKENS = 48
DEADLINE_S = 150
TOKEN_LATENCY_S = 0.08
INIT_INFO = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3}
"""NCCL rendezvous as a trainer would name it (vLLM 0.33 `NCCLWeightTransferInitInfo`)."""


def nccl_info(*names: str) -> dict:
    """An NCCL `update_info` (vLLM 0.33 `NCCLWeightTransferUpdateInfo`): one dtype and shape per tensor."""
    return {"names": list(names), "dtype_names": ["bfloat16"] * len(names), "shapes": [[8, 8]] * len(names)}


@pytest.fixture(scope="module")
def servers():
    pair = [StandinServer(served_like_vllm()).start(wait=False) for _ in range(2)]
    try:
        yield [server.wait_ready() for server in pair]
    finally:
        for server in pair:
            server.close()


def request(url: str, index: int) -> RolloutRequest:
    # ~40 tokens a turn at 80 ms each: a turn takes ~3 s, so an update sent while turns are sampled lands
    # inside one even when a loaded machine takes seconds to carry the pause to the servers.
    client = ClientConfig(
        base_url=url, model=BUNDLED_MODEL, headers={"X-Standin-Per-Token-Latency": str(TOKEN_LATENCY_S)}
    )
    return RolloutRequest(
        env=ECHO, task_index=index, client=client, sampling=SamplingConfig(max_tokens=MAX_TOKENS, seed=11)
    )


def unhurried(item: RolloutRequest) -> RolloutRequest:
    """`item` sampled at the stand-in's own pace (no per-token latency): for a rollout no update lands in."""
    return item.model_copy(update={"client": item.client.model_copy(update={"headers": {}})})


async def running(url: str) -> int:
    async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
        text = (await http.get(f"{url}/metrics")).text
    return int(float(re.search(r"^vllm:num_requests_running\{[^}]*\} (\S+)$", text, re.M).group(1)))


def test_rollouts_in_flight_continue_across_a_weight_update_and_record_where_it_landed(ray_session, servers):
    urls = [server.base_url for server in servers]

    async def scenario():
        config = PlaneConfig(
            lanes={"train": 8, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
            endpoints=urls,
        )
        async with RolloutPlane(config) as plane:
            ids = [await plane.submit(request(urls[0], i)) for i in range(4)]
            deadline = asyncio.get_running_loop().time() + 60
            while sum([await running(s.url) for s in servers]) < 2:  # turns are being sampled right now
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
            # A request counts as running before its first token: an update that lands then samples the
            # whole turn on the new weights (no straddle to see). ~8 tokens in, ~30 still to come.
            await asyncio.sleep(8 * TOKEN_LATENCY_S)
            await plane.init_weight_transfer(INIT_INFO)
            report = await plane.update_weights(nccl_info("model.embed_tokens.weight"), version=1)
            results = [await plane.next_result(timeout=120) for _ in ids]
            late = await plane.submit(unhurried(request(urls[0], 5)))  # only its versions are read
            after = await plane.next_result(timeout=120)
            assert after.request_id == late
            return report, results, after, plane.policy_version

    report, results, after, active = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert active == 1 and report.version == 1 and len(report.servers) == 2
    assert all(r.kind == "ok" for r in results), [r.error for r in results]
    straddled = [(r, t) for r in results for t in r.turns if t.version_changes]
    assert straddled, "an update in the middle of sampled turns must show on the turn it landed in"
    for result, turn in straddled:
        (change,) = turn.version_changes
        assert turn.policy_version == 0 and change.version == 1 and 0 <= change.at <= len(turn.completion_ids)
        # Both versions on one rollout, and each later turn wholly on the new weights.
        later = result.turns[result.turns.index(turn) + 1 :]
        assert all(t.policy_version == 1 and not t.version_changes for t in later)
        versions = trainer_samples(result)[0].policy_versions
        assert {0, 1} <= set(versions)
    # Token-exact: the tokens before the change stay as sampled, and what follows is exactly what the new
    # weights sample from the prompt plus those tokens.
    result, turn = straddled[0]
    prompt = turn_prompts(result)[result.turns.index(turn)]
    at = turn.version_changes[0].at
    continued = asyncio.run(resample(urls[0], prompt + turn.completion_ids[:at], MAX_TOKENS - at))
    assert continued == turn.completion_ids[at:]
    assert all(t.policy_version == 1 for t in after.turns) and after.policy_version_start == 1


async def resample(url: str, prompt: list[int], max_tokens: int) -> list[int]:
    async with openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0) as client:
        response = await client.completions.create(
            model=BUNDLED_MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            seed=11,
            extra_body={"return_token_ids": True},
        )
    return response.choices[0].model_extra["token_ids"]


def test_calls_name_their_rollout_and_turn_and_carry_their_versions_cache_salt(ray_session, servers):
    url = servers[1].base_url

    async def scenario():
        config = PlaneConfig(
            lanes={"train": 4, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
            endpoints=[url],
        )
        async with RolloutPlane(config) as plane:
            await plane.submit(unhurried(request(url, 1)))
            result = await plane.next_result(timeout=60)
            version = plane.policy_version
        async with httpx.AsyncClient(timeout=5, trust_env=False) as http:
            seen = (await http.get(f"{servers[1].url}/admin/requests")).json()["requests"]
        return result, version, seen

    result, version, seen = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert result.kind == "ok", result.error
    mine = [r for r in seen if (r["request_id"] or "").startswith(result.request_id)]
    assert [r["request_id"] for r in mine] == [
        f"{result.request_id}-turn{i}" for i in range(len(result.turns))
    ]
    assert {r["cache_salt"] for r in mine} == {f"policy-v{version}"}


def test_a_turn_the_plane_paused_in_abort_mode_resumes_from_its_tokens(ray_session):
    """`update_weights(mode="abort")`: vLLM ends the turns in flight (`finish_reason` "abort"); because the
    plane asked for it, each resumes after the update from exactly the tokens it had."""
    with StandinServer(served_like_vllm()) as server:
        url = server.base_url

        async def scenario():
            config = PlaneConfig(
                lanes={"train": 8, "eval": 1},
                workers=1,
                worker_num_cpus=0.25,
                env_pool={"num_cpus": 0.25},
                allowed_ref_prefixes=TEST_REF_PREFIXES,
                endpoints=[url],
            )
            async with RolloutPlane(config) as plane:
                ids = [await plane.submit(request(url, i)) for i in range(3)]
                deadline = asyncio.get_running_loop().time() + 60
                while await running(server.url) < 2:
                    assert asyncio.get_running_loop().time() < deadline
                    await asyncio.sleep(0.05)
                await plane.init_weight_transfer(INIT_INFO)
                await plane.update_weights(nccl_info("lm_head.weight"), version=1, mode="abort")
                return [await plane.next_result(timeout=120) for _ in ids]

        results = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
        assert all(r.kind == "ok" for r in results), [r.error for r in results]
        resumed = [(r, t) for r in results for t in r.turns if t.version_changes]
        assert resumed, "the abort must have landed inside a turn"
        result, turn = resumed[0]
        at = turn.version_changes[0].at
        assert turn.policy_version == 0 and turn.version_changes[0].version == 1
        assert turn.finish_reason != "abort" and len(turn.logprobs) == len(turn.completion_ids)
        prompt = turn_prompts(result)[result.turns.index(turn)]
        assert (
            asyncio.run(resample(url, prompt + turn.completion_ids[:at], MAX_TOKENS - at))
            == turn.completion_ids[at:]
        )
