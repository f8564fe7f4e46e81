"""The adapters host the field's environment packages unchanged: through the plane, on the stand-in, an
environment gives the same reward, metrics and environment messages as its own framework's loop given
the same assistant turns. Each framework runs in its own pool `runtime_env` (an interpreter with its
packages, `framework_stacks.py`), beside the plane's own packages, in one plane."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from framework_envs import EXPRESSIONS, PROBLEMS, calculator
from framework_stacks import FRAMEWORK_ENVS, FRAMEWORK_VF_CHAT, FRAMEWORK_VF_TASKS, STACKS, stack_python
from readme import DOCS, argv, block, commands
from waiting import runner

from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.renderer import Renderer
from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.samples import trainer_samples
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the shared plane starts four framework pools

SKYRL = "env_actors.adapters.skyrl_gym:SkyRLGymEnv"
VF_CLASSIC = "env_actors.adapters.verifiers_classic:VerifiersClassicEnv"
VF_V1 = "env_actors.adapters.verifiers_v1:VerifiersV1Env"
VF_V1_AGENT = "env_actors.adapters.verifiers_agent:VerifiersV1AgentEnv"
DEADLINE_S = 360  # a pool's first start in a fresh runtime env imports its framework: tens of seconds here
TESTS = Path(__file__).parent


run = runner(DEADLINE_S)


def stack_pool(stack: str) -> dict[str, Any]:
    """An env pool config that runs its servers in `stack`'s interpreter with the test environments."""
    return {
        "num_cpus": 0.25,
        "env_packages": ["framework_envs.", "framework_vf_tasks", "framework_vf_chat"],
        "runtime_env": {
            "py_executable": stack_python(stack),
            "py_modules": [str(FRAMEWORK_ENVS), str(FRAMEWORK_VF_TASKS), str(FRAMEWORK_VF_CHAT)],
        },
    }


def plane(env_pools: dict[str, Any]) -> RolloutPlane:
    return RolloutPlane(
        PlaneConfig(
            lanes={"train": 16}, workers=1, worker_num_cpus=0.5, env_pools=env_pools, env_ready_timeout_s=180
        )
    )


def request(
    standin, env: Ref, index: int, seed: int, mode: str = "token", think_rate: float | None = None
) -> RolloutRequest:
    headers = {"X-Standin-Correct-Rate": "0.5"}
    if think_rate is not None:  # the stand-in's policy reasons this often in token mode (chat mode: always)
        headers["X-Standin-Think-Rate"] = str(think_rate)
    return RolloutRequest(
        env=env,
        task_index=index,
        mode=mode,
        client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL, headers=headers),
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
    no_proxy = ",".join(filter(None, [os.environ.get("NO_PROXY", ""), "127.0.0.1"]))  # its scripted model
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "NO_PROXY": no_proxy,
        "no_proxy": no_proxy,
    }
    done = subprocess.run(
        [stack_python(stack), str(TESTS / "framework_loops.py"), stack],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def env_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the environment said (opening and added messages), in order, as role and content."""
    return [{"role": m["role"], "content": m.get("content")} for m in messages if m["role"] != "assistant"]


SKY_ENV = Ref(SKYRL, {"package": "framework_envs.sky_math", "tasks": "framework_envs.sky_math:rows"})


def vf_classic(kind: str) -> Ref:
    return Ref(VF_CLASSIC, {"env_id": "framework_envs.vf_classic_envs", "env_args": {"kind": kind}})


def vf_v1(taskset_config: dict[str, Any] | None = None) -> Ref:
    return Ref(VF_V1, {"taskset": "framework-vf-tasks", "taskset_config": taskset_config or {}})


VF_V1_AGENT_ENV = Ref(VF_V1_AGENT, {"taskset": "framework-vf-tasks", "harness": {"id": "framework-vf-chat"}})
"""verifiers' own episode with a chat harness (in process: the `null` harness's uv script needs the
network to install), its model calls through the rollout's agent-mode endpoint."""


def plugged_reward(name: str) -> dict[str, Any]:
    return {"task": {"rewards": {name: {"fn": f"framework_vf_tasks:{name}", "weight": 0.5}}}}


CASES = {
    "skyrl": [(SKY_ENV, i % 4, 11 + i) for i in range(5)],
    "vf-tools": [(vf_classic("tools"), i % 3, 21 + i) for i in range(4)],
    "vf-follow-up": [(vf_classic("follow_up"), i % 4, 31 + i) for i in range(8)],
    "vf-group": [(vf_classic("group"), 0, 41)],
    "vf-raises": [(vf_classic("raises"), 0, 51)],
    "vf1-math": [(vf_v1(), i % 4, 61 + i) for i in range(6)],
    "vf1-raises": [(vf_v1(plugged_reward("explodes")), 0, 71)],
    "vf1-runtime": [(vf_v1(plugged_reward("on_disk")), 0, 72)],
    "vf1-agent": [(VF_V1_AGENT_ENV, i % 4, 61 + i, "agent") for i in range(4)],
    **{
        f"{label}-{mode}": [(env, i % 4, 81 + i, mode, 1.0) for i in range(4)]
        for label, env in (
            ("vf-reasoned", vf_classic("reasoning")),
            ("vf1-reasoned", vf_v1(plugged_reward("reasoned"))),
        )
        for mode in ("token", "chat")
    },
}
"""label -> (env, task index, seed[, mode[, think rate]]) of the rollouts one plane runs, every framework in its own pool."""


@pytest.fixture(scope="module")
def plane_results(ray_session, standin) -> dict[str, list[Result]]:
    pools = {
        SKYRL: stack_pool("skyrl-gym"),
        VF_CLASSIC: stack_pool("verifiers-0.3"),
        VF_V1: stack_pool("verifiers-0.4"),
        VF_V1_AGENT: stack_pool("verifiers-0.4"),
    }
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


CLASSIC_KINDS = {"vf-tools": "tools", "vf-follow-up": "follow_up"}


@pytest.fixture(scope="module")
def classic_own_loops(plane_results) -> dict[str, list[dict[str, Any]]]:
    """label -> verifiers 0.3's own loop over the assistant turns of each of its rollouts that ended `ok` (the
    test fails on any other first), both kinds in one process: importing verifiers takes seconds."""
    cases, labels = [], []
    for label, kind in CLASSIC_KINDS.items():
        for result in plane_results[label]:
            if result.kind != "ok":
                continue
            assistant = [m for m in result.messages if m["role"] == "assistant"]
            labels.append(label)
            cases.append(
                {
                    "module": "framework_envs.vf_classic_envs",
                    "env_args": {"kind": kind},
                    "index": result.task_index,
                    "assistant": assistant,
                }
            )
    outcomes: dict[str, list[dict[str, Any]]] = {label: [] for label in CLASSIC_KINDS}
    for label, own in zip(labels, own_loops("verifiers-0.3", cases) if cases else [], strict=True):
        outcomes[label].append(own)
    return outcomes


@pytest.mark.parametrize("label, kind", list(CLASSIC_KINDS.items()))
def test_verifiers_classic_env_matches_its_own_loop(plane_results, classic_own_loops, label, kind):
    rewards = set()
    for result in plane_results[label]:
        assert result.kind == "ok", result.error
    for result, own in zip(plane_results[label], classic_own_loops[label], strict=True):
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


def test_verifiers_v1_taskset_matches_its_own_episode_beside_a_classic_one(plane_results):
    # One plane ran both verifiers APIs at once, each pool in its own interpreter (0.3 and 0.4 clash).
    assert all(r.kind == "ok" for r in plane_results["vf-follow-up"])
    results = plane_results["vf1-math"]
    assert all(r.kind == "ok" for r in results), [r.error for r in results]
    episodes = [
        {"index": r.task_index, "assistant": [m for m in r.messages if m["role"] == "assistant"]}
        for r in results
    ]
    [own] = own_loops("verifiers-0.4", [{"taskset": "framework-vf-tasks", "episodes": episodes}])
    for result, theirs in zip(results, own, strict=True):
        assert result.reward == theirs["reward"]  # exact: the same reward functions, weights and sum
        assert result.metrics["stop_condition"] == theirs["stop_condition"]
        metrics = {k: v for k, v in result.metrics.items() if k not in ("turns", "stop_condition")}
        assert metrics == theirs["metrics"]
        assert env_messages(result.messages) == env_messages(theirs["messages"])
    assert len({r.reward for r in results}) > 1, "the stand-in's answers should earn different rewards"


def test_a_v1_reward_that_raises_fails_the_score_and_one_that_needs_a_runtime_is_refused(plane_results):
    [raised] = plane_results["vf1-raises"]
    assert raised.kind not in ("ok", "caller") and raised.reward is None
    assert "ZeroDivisionError: the grader divided by zero" in raised.error.traceback
    [refused] = plane_results["vf1-runtime"]
    assert refused.kind == "caller"
    assert "needs what this adapter cannot give: a runtime for its reward on_disk" in refused.error.message


def test_verifiers_v1_with_its_own_harness_in_agent_mode_matches_token_mode_token_for_token(plane_results):
    agent, token = plane_results["vf1-agent"], plane_results["vf1-math"]
    for result, twin in zip(agent, token, strict=False):  # the same task and seed in both modes
        assert result.kind == "ok", result.error
        assert (result.task_index, result.reward) == (twin.task_index, twin.reward)
        assert result.metrics["stop_condition"] == twin.metrics["stop_condition"]
        assert [t.new_prompt_ids for t in result.turns] == [t.new_prompt_ids for t in twin.turns]
        assert [t.completion_ids for t in result.turns] == [t.completion_ids for t in twin.turns]
        [sample] = trainer_samples(result)
        assert sum(sample.loss_mask) == sum(len(t.completion_ids) for t in result.turns)
    assert len({r.reward for r in agent}) > 1, "the stand-in's answers should earn different rewards"


def test_a_reward_that_reads_the_reasoning_gets_it_in_chat_mode_as_in_token_mode(plane_results):
    """One field, one name, end to end: chat mode's reasoning (the server parsed it) reaches the environment
    as token mode's does (the renderer parsed it), in both verifiers APIs."""

    def reasoned(result: Result) -> float:  # what the rollout recorded: the turns' reasoning
        return 1.0 if any(t.reasoning for t in result.turns) else 0.0

    for label, seen in (
        ("vf-reasoned", lambda r: r.metrics["reasoned"]),
        ("vf1-reasoned", lambda r: r.components["reasoned"]),
    ):
        token, chat = plane_results[f"{label}-token"], plane_results[f"{label}-chat"]
        for result in token + chat:
            assert result.kind == "ok", result.error
            assert seen(result) == reasoned(result), (label, [t.reasoning for t in result.turns])
        assert all(reasoned(r) for r in token + chat), "the stand-in reasons on every turn here"
        assert [seen(r) for r in chat] == [seen(r) for r in token] == [1.0] * len(token)


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


README_SECTION = "Bring your environments: verifiers and skyrl-gym"
README_RUN_DEADLINE_S = 600  # the stand-in, a pool loading its framework: minutes when loaded


def readme_packages(folder: Path) -> None:
    """The packages the README's commands name, written as a user's would be: the test environments,
    self-contained (no import of `framework_envs`)."""
    inline = ("from framework_envs import PROBLEMS", f"PROBLEMS = {PROBLEMS!r}")
    with_tool = (
        "from framework_envs import EXPRESSIONS, PROBLEMS, calculator",
        f"PROBLEMS = {PROBLEMS!r}\nEXPRESSIONS = {EXPRESSIONS!r}\n\n\n{inspect.getsource(calculator)}",
    )
    sources = {
        "my_vf_env": (FRAMEWORK_ENVS / "vf_classic_envs.py").read_text().replace(*with_tool),
        "my_sky_env": (FRAMEWORK_ENVS / "sky_math.py")
        .read_text()
        .replace(*inline)
        .replace("framework_envs.sky_math:RetryMath", "my_sky_env:RetryMath"),
        "my_taskset": (FRAMEWORK_VF_TASKS / "__init__.py").read_text().replace(*inline),
    }
    for name, source in sources.items():
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(source)


def as_tested(args: list[str], base_url: str) -> list[str]:
    """A README command with this suite's three substitutions (docs/environments.md says which): `pip` -> the cached
    interpreter with those packages, the `null` harness -> the same chat loop in process, and the suite's
    stand-in (`base_url`) instead of one started per command."""
    args = [*args, "--base-url", base_url, "--model", BUNDLED_MODEL]
    flag = args.index("--env-runtime-env") + 1
    runtime_env = json.loads(args[flag])
    [stack] = [name for name, wanted in STACKS.items() if wanted == runtime_env["pip"]]
    runtime_env = {
        "py_executable": stack_python(stack),
        **{k: v for k, v in runtime_env.items() if k != "pip"},
    }
    if '"harness": {"id": "null"}' in args[args.index("--env-config") + 1]:
        config = json.loads(args[args.index("--env-config") + 1])
        config["harness"] = {"id": "framework-vf-chat"}
        args[args.index("--env-config") + 1] = json.dumps(config)
        runtime_env["py_modules"] = [*runtime_env["py_modules"], str(FRAMEWORK_VF_CHAT)]
        args += ["--env-package", "framework_vf_chat"]
    args[flag] = json.dumps(runtime_env)
    return args


README_COMMANDS = [
    c
    for c in commands(block(README_SECTION, "bash", path=DOCS / "environments.md"))
    if c.startswith("rollouts run")
]


@pytest.mark.timeout(README_RUN_DEADLINE_S + 60)
@pytest.mark.parametrize("command", README_COMMANDS, ids=lambda c: argv(c)[argv(c).index("--env") + 1])
def test_the_readme_environment_commands_run_end_to_end(command, tmp_path, ray_session, standin):
    readme_packages(tmp_path)
    args = as_tested(argv(command), standin.base_url)
    # On the suite's Ray, joined as the CLI joins any cluster (`$RAY_ADDRESS`): an embedded Ray per command
    # cost each ~6 s more here, and test_readme.py's quick start runs the CLI on its embedded Ray.
    env = {**os.environ, "RAY_ADDRESS": ray_session.get_runtime_context().gcs_address}
    rollouts = os.path.join(os.path.dirname(sys.executable), "rollouts")
    done = subprocess.run(
        [rollouts, *args[1:], "--no-progress"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=README_RUN_DEADLINE_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tasks = int(args[args.index("--tasks") + 1])
    (results,) = list(tmp_path.glob("rollouts-*.jsonl"))
    kinds = [json.loads(line).get("kind", "ok") for line in results.read_text().splitlines()]
    assert len(kinds) == tasks * 4 and set(kinds) == {"ok"}, (kinds, done.stdout[-2000:])


def test_pip_tells_a_requirement_that_cannot_be_installed_from_one_that_can():
    from env_actors.runtime_env_check import pip_problem

    problem = run(pip_problem(("ray-rollouts-no-such-package==0.0.1",)))
    assert problem is not None and "No matching distribution" in problem
    assert run(pip_problem(("pydantic",))) is None  # installed here: nothing to fetch
