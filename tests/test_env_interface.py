"""What the environment interface grew for the field's packages: a per-step reward kept per turn, the raw
assistant text for environments that parse it themselves, and synchronous environment code run off the
env server's event loop (a CPU-bound reward never makes the server look wedged)."""

from __future__ import annotations

import pytest
from env_pools import TEST_REF_PREFIXES, env_pool
from waiting import runner

from env_actors.faults.sync_env import ECHO_PREFIX
from env_actors.pool import EnvPoolConfig
from env_actors.session import EnvSession
from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.samples import trainer_samples
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session")]

SYNC = "env_actors.faults.sync_env:SyncRewardEnv"
WEDGE = dict(hang_timeout_s=2.0, probe_interval_s=0.2, probe_timeout_s=0.5)
"""A loop stalled past 2 s is a wedged worker: far less than the 5 s reward below computes."""


run = runner(120)


def test_a_five_second_cpu_bound_sync_reward_leaves_its_server_live():
    async def body():
        async with env_pool(SYNC, EnvPoolConfig(**WEDGE), turns=1, score_cpu_s=5.0) as pool:
            async with await EnvSession.open(pool, task_index=0, timeout=10) as session:
                step = await session.step(
                    {"role": "assistant", "content": "hi", "raw_text": "hi"}, timeout=10
                )
                assert step.done and step.reward == 1.0
                score = await session.score(timeout=30)
            stats = await pool.stats.remote()
            return score, stats

    score, stats = run(body())
    assert score.reward == 1.0 and score.metrics["spins"] > 0
    assert stats.deaths == 0 and stats.ready == 1, stats.retired


def test_per_step_rewards_and_raw_text_travel_through_the_plane(standin):
    async def body():
        config = PlaneConfig(
            lanes={"train": 8},
            workers=1,
            worker_num_cpus=0.5,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
        )
        async with RolloutPlane(config) as plane:
            await plane.submit(
                RolloutRequest(
                    env=Ref(SYNC, {"turns": 3}),
                    task_index=1,
                    client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL),
                    sampling=SamplingConfig(max_tokens=40, seed=3),
                    return_messages=True,
                )
            )
            return await plane.next_result(timeout=90)

    result = run(body())
    assert result.kind == "ok", result.error
    assert [t.reward for t in result.turns] == [1.0, 0.5, 1 / 3]
    assert result.reward == pytest.approx(1.0 + 0.5 + 1 / 3)
    samples = trainer_samples(result)  # one per branch (a template that rewrites history forks)
    assert [r for s in samples for r in s.step_rewards] == [1.0, 0.5, 1 / 3]
    # The environment saw each completion as sampled (decoded, stop token left out); the conversation
    # the renderer and the result hold has no such key.
    renderer = Renderer.load(RendererKey.from_config(BUNDLED_MODEL, RendererConfig()))
    echoes = [m["content"] for m in result.messages if m["content"] and m["content"].startswith(ECHO_PREFIX)]
    for turn, echo in zip(result.turns, echoes, strict=False):
        ids = turn.completion_ids
        assert echo == ECHO_PREFIX + renderer.decode(ids[:-1] if ids[-1] in renderer.stop_ids else ids)
    assert len(echoes) == 2
    assert not any("raw_text" in m for m in result.messages)
