"""The adapters host the field's environment packages unchanged: through the plane, on the stand-in, an
environment gives the same reward, metrics and environment messages as its own framework's loop given
the same assistant turns. Each framework runs in its own pool `runtime_env` (an interpreter with its
packages, `framework_stacks.py`), beside the plane's own packages, in one plane."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from framework_stacks import FRAMEWORK_ENVS, stack_python
from waiting import runner

from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.samples import trainer_samples
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig

pytestmark = pytest.mark.slow

SKYRL = "env_actors.adapters.skyrl_gym:SkyRLGymEnv"
VF_CLASSIC = "env_actors.adapters.verifiers_classic:VerifiersClassicEnv"
DEADLINE_S = 240  # a pool's first start in a fresh runtime env imports its framework: tens of seconds here
TESTS = Path(__file__).parent


run = runner(DEADLINE_S)


def stack_pool(stack: str) -> dict[str, Any]:
    """An env pool config that runs its servers in `stack`'s interpreter with the test environments."""
    return {
        "num_cpus": 0.25,
        "env_packages": ["framework_envs."],
        "runtime_env": {"py_executable": stack_python(stack), "py_modules": [str(FRAMEWORK_ENVS)]},
    }


def plane(env_pools: dict[str, Any]) -> RolloutPlane:
    return RolloutPlane(
        PlaneConfig(
            lanes={"train": 16}, workers=1, worker_num_cpus=0.5, env_pools=env_pools, env_ready_timeout_s=180
        )
    )


def request(standin, env: Ref, index: int, seed: int, mode: str = "token") -> RolloutRequest:
    return RolloutRequest(
        env=env,
        task_index=index,
        mode=mode,
        client=ClientConfig(
            base_url=standin.base_url, model=BUNDLED_MODEL, headers={"X-Standin-Correct-Rate": "0.5"}
        ),
        sampling=SamplingConfig(max_tokens=200, seed=seed),
        max_turns=6,  # more than any test environment allows: each ends its episodes itself
        return_messages=True,
    )


async def run_all(rollouts: RolloutPlane, requests: list[RolloutRequest]) -> list[Result]:
    async with rollouts:
        for item in requests:
            await rollouts.submit(item)
        results = [await rollouts.next_result(timeout=DEADLINE_S) for _ in requests]
    by_id = {r.request_id: r for r in results}
    return [by_id[item.request_id] for item in requests]


def own_loops(stack: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The framework's own loop over each of `cases`, in the stack's interpreter (one separate process for
    all of them: importing a framework takes seconds)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [stack_python(stack), str(TESTS / "framework_loops.py"), stack],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def env_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the environment said (opening and added messages), in order, as role and content."""
    return [{"role": m["role"], "content": m.get("content")} for m in messages if m["role"] != "assistant"]


SKY_ENV = Ref(SKYRL, {"package": "framework_envs.sky_math", "tasks": "framework_envs.sky_math:rows"})


def vf_classic(kind: str) -> Ref:
    return Ref(VF_CLASSIC, {"env_id": "framework_envs.vf_classic_envs", "env_args": {"kind": kind}})


CASES = {
    "skyrl": [(SKY_ENV, i % 4, 11 + i) for i in range(5)],
    "vf-tools": [(vf_classic("tools"), i % 3, 21 + i) for i in range(4)],
    "vf-follow-up": [(vf_classic("follow_up"), i % 4, 31 + i) for i in range(8)],
    "vf-group": [(vf_classic("group"), 0, 41)],
    "vf-raises": [(vf_classic("raises"), 0, 51)],
}
"""label -> (env, task index, seed) of the rollouts one plane runs, every framework in its own pool."""


@pytest.fixture(scope="module")
def plane_results(ray_session, standin) -> dict[str, list[Result]]:
    pools = {SKYRL: stack_pool("skyrl-gym"), VF_CLASSIC: stack_pool("verifiers-0.3")}
    labelled = [(label, request(standin, *case)) for label, cases in CASES.items() for case in cases]
    results = run(run_all(plane(pools), [item for _, item in labelled]))
    by_label: dict[str, list[Result]] = {}
    for (label, _), result in zip(labelled, results, strict=True):
        by_label.setdefault(label, []).append(result)
    return by_label


def test_skyrl_gym_env_matches_its_own_loop_with_per_step_rewards(plane_results):
    renderer = Renderer.load(RendererKey.from_config(BUNDLED_MODEL, RendererConfig()))
    rows = json.loads(subprocess.check_output(_rows_command("skyrl-gym"), text=True))
    rewards = set()
    cases = []
    for result in plane_results["skyrl"]:
        assert result.kind == "ok", result.error
        # the raw text each step received: the sampled ids decoded, the closing stop token left out
        texts = [
            renderer.decode(
                t.completion_ids[:-1] if t.completion_ids[-1] in renderer.stop_ids else t.completion_ids
            )
            for t in result.turns
        ]
        cases.append({"package": "framework_envs.sky_math", "task": rows[result.task_index], "texts": texts})
    for result, own in zip(plane_results["skyrl"], own_loops("skyrl-gym", cases), strict=True):
        assert result.reward == pytest.approx(own["reward"])
        assert [t.reward for t in result.turns] == pytest.approx(own["step_rewards"])
        for sample in trainer_samples(result):  # one per branch (a template that rewrites history forks)
            assert sample.step_rewards == [result.turns[i].reward for i in sample.turns]
        assert {k: v for k, v in result.metrics.items() if k != "turns"} == own["metrics"]
        assert env_messages(result.messages) == env_messages(own["messages"])
        rewards.add(result.reward)
    assert len(rewards) > 1, "the stand-in's answers should earn different rewards across seeds"


@pytest.mark.parametrize("label, kind", [("vf-tools", "tools"), ("vf-follow-up", "follow_up")])
def test_verifiers_classic_env_matches_its_own_loop(plane_results, label, kind):
    rewards = set()
    cases = []
    for result in plane_results[label]:
        assert result.kind == "ok", result.error
        assistant = [m for m in result.messages if m["role"] == "assistant"]
        cases.append(
            {
                "module": "framework_envs.vf_classic_envs",
                "env_args": {"kind": kind},
                "index": result.task_index,
                "assistant": assistant,
            }
        )
    for result, own in zip(plane_results[label], own_loops("verifiers-0.3", cases), strict=True):
        assert result.reward == pytest.approx(own["reward"])
        assert {k: v for k, v in result.metrics.items() if k != "turns"} == own["metrics"]
        assert env_messages(result.messages) == env_messages(own["messages"])
        rewards.add(result.reward)
    if kind == "tools":  # the stand-in called the tool, and the tool's answer came back as a tool message
        assert any(m["role"] == "tool" for r in plane_results[label] for m in r.messages)
    assert len(rewards) > 1, "the stand-in's answers should earn different rewards across seeds"


def test_a_group_rubric_is_refused_at_load_with_a_clear_message(plane_results):
    [result] = plane_results["vf-group"]
    assert result.kind == "caller"
    assert "group reward functions (group_diversity)" in result.error.message


def test_a_raising_reward_function_fails_the_score_with_its_traceback_not_zero(plane_results):
    [result] = plane_results["vf-raises"]
    assert result.kind not in ("ok", "caller") and result.reward is None
    assert "ZeroDivisionError: the grader divided by zero" in result.error.traceback
    assert "RewardFunctionError" in result.error.traceback


def _rows_command(stack: str) -> list[str]:
    code = "import json, framework_envs.sky_math as m; print(json.dumps(m.rows()))"
    return ["env", f"PYTHONPATH={TESTS}", stack_python(stack), "-c", code]


def test_a_runtime_env_that_cannot_build_fails_its_rollouts_with_the_build_error(ray_session, standin):
    pools = {
        SKYRL: {"num_cpus": 0.25, "runtime_env": {"py_executable": "/nonexistent/bin/python"}},
        VF_CLASSIC: {"num_cpus": 0.25, "runtime_env": {"pip": ["ray-rollouts-no-such-package==0.0.1"]}},
    }
    requests = [request(standin, SKY_ENV, 0, 1), request(standin, vf_classic("tools"), 0, 2)]
    missing_python, failed_pip = run(run_all(plane(pools), requests))
    # Ray itself would retry a missing interpreter for ever: the pool refuses it at spawn.
    assert missing_python.kind == "caller", missing_python.error
    assert "/nonexistent/bin/python" in missing_python.error.message
    # A pip install that fails is reported as soon as Ray reports it (not at the readiness deadline).
    assert failed_pip.kind == "caller", failed_pip.error
    assert "runtime_env failed to build" in failed_pip.error.message
