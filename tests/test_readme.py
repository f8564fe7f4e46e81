"""The README's code runs: every Python block against the stand-in, the quick start's `rollouts run`, and
every other command either run by a test (the local dev loop: `test_job_submit.py`) or listed below with
the reason it cannot run here. A README example that stops working fails CI."""

from __future__ import annotations

import ast
import asyncio
import inspect
import os
import subprocess
import sys
import time

import pytest
from readme import README, block, blocks, commands

from renderer_actors.tokenizer import BUNDLED_MODEL

PYTHON_BLOCK_DEADLINE_S = 240

NOT_RUN = {
    "pip install -e": "CI's own first step (`.ci/run`) installs '.[test]', a superset of every install here",
    "pytest": "the suite itself",
    "python3 -m venv .venv": "CI's own first step (`.ci/run`) creates a fresh venv, `.venv-ci`",
    ". .venv/bin/activate": "CI's own (`.ci/run`), in its `.venv-ci`",
    "rollouts pool-python": "installs verifiers from PyPI; test_pool_python.py runs the subcommand with local "
    "wheels, and test_env_adapters.py's framework stacks are built by the same code",
    "ray stop": "stops every Ray process of the user, this suite's included; test_job_submit ends its head "
    "by its own processes instead",
    "ray get-auth-token": "writes the user's ~/.ray/auth_token; the dev-loop test gives its head a private token",
    "ray up cluster.yaml": "needs an AWS account; tests/test_cluster_yaml.py validates cluster.yaml",
    "ray dashboard cluster.yaml": "needs the AWS cluster",
    "ray down cluster.yaml": "needs the AWS cluster",
    "rollouts serve-env": "serves until stopped, in a verifiers-0.4 interpreter; tests/test_serve_env.py runs "
    "the same front against verifiers' own EnvClient",
    "rollouts serve-standin": "serves until Ctrl-C; tests/test_cli.py runs it and checks the base URL and model "
    "it prints",
    "rollouts run --base-url http://127.0.0.1:8000/v1": "needs a server on port 8000 (the stand-in above, or vLLM "
    "on a GPU); the suite runs `rollouts run` against its own stand-in (test_quick_start_..., test_cli.py)",
    "vllm serve": "needs a GPU and the model's weights; its flags are those `ServerSpec` builds, which "
    "tests/test_vllm_conformance.py parses with vLLM's own `serve` parser",
    "RAY_AUTH_MODE=token ray job submit": "the cluster's submit (a real vLLM endpoint); the same command "
    "against a local head runs in test_job_submit.py",
}
"""Commands of the README the suite does not execute, by prefix, with the reason."""

RUN_BY_DEV_LOOP_TEST = (
    "ray start --head",
    "HEAD=$!",
    "export RAY_AUTH_MODE=token",
    "ray job submit",
    "ray job logs",
    "kill $HEAD",
)
"""Run by `test_job_submit.py` (docs/cluster.md's local development loop) against a head of its own: its own
ports and temp dir, a private token, stopped by signalling its `ray start --block` as `kill $HEAD` does."""

RUN_HERE = ("rollouts run",)


def _substitute(code: str, base_url: str) -> str:
    """The examples name a vLLM server; here they run against the stand-in. The key variable is one the
    suite sets before Ray starts (the stand-in takes any key)."""
    return (
        code.replace('"http://vllm:8000/v1"', repr(base_url))
        .replace('"Qwen/Qwen3-8B"', repr(BUNDLED_MODEL))
        .replace('"VLLM_KEY"', '"RAY_ROLLOUTS_TEST_SECRET"')
    )


@pytest.mark.slow
@pytest.mark.timeout(PYTHON_BLOCK_DEADLINE_S + 30)
@pytest.mark.parametrize("snippet", blocks("python"), ids=lambda b: b.name)
def test_python_block_runs(snippet, ray_session, standin):
    run_python_block(snippet.code, f"README.md:{snippet.line}", standin.base_url, "__readme__")


def run_python_block(text: str, where: str, base_url: str, module: str) -> None:
    """Run a documented Python block as written, against `base_url` (a block that awaits at top level
    runs on its own event loop), within `PYTHON_BLOCK_DEADLINE_S`."""
    code = compile(_substitute(text, base_url), where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    namespace: dict = {"__name__": module}

    async def run_async() -> None:
        await asyncio.wait_for(eval(code, namespace), PYTHON_BLOCK_DEADLINE_S)

    if code.co_flags & inspect.CO_COROUTINE:  # the block awaits at top level
        asyncio.run(run_async())
    else:
        exec(code, namespace)


ORCHESTRATOR_CPUS = 2
"""What a plain `ray.init()` gives on a 2-core machine: as many CPUs as the default lanes' two rollout
workers ask, none left for an env server or a renderer unless the plane fits its requests to the cluster."""
ORCHESTRATOR_DEADLINE_S = 240  # two runs of the example in one Ray of its own; the old way waited 141 s each


@pytest.mark.slow
@pytest.mark.ray  # the example runs in a Ray of its own, sized as a 2-core machine's `ray.init()`
@pytest.mark.timeout(ORCHESTRATOR_DEADLINE_S + 30)
def test_the_orchestrator_example_runs_on_a_two_cpu_ray_and_names_a_missing_key(standin):
    example = block("Using it from an orchestrator", "python")
    with_key = _substitute(example.code, standin.base_url)
    without_key = with_key.replace('"RAY_ROLLOUTS_TEST_SECRET"', '"RAY_ROLLOUTS_UNSET_KEY"')
    assert without_key != with_key
    script = "\n".join(
        [
            "import ray",
            f"ray.init(address='local', num_cpus={ORCHESTRATOR_CPUS}, include_dashboard=False)",
            f"exec(compile({with_key!r}, 'README.md', 'exec'), {{'__name__': '__readme__'}})",
            "print('--- the key variable unset', flush=True)",
            f"exec(compile({without_key!r}, 'README.md', 'exec'), {{'__name__': '__readme__'}})",
        ]
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ROLLOUTS_UNSET_KEY")}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=ORCHESTRATOR_DEADLINE_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with_key_out, without_key_out = done.stdout.split("--- the key variable unset")
    kinds = ("ok", "model", "env", "infrastructure", "caller", "cancelled")
    answered = [line for line in with_key_out.splitlines() if line.split(" ", 1)[0] in kinds]
    assert [line.split(" ", 1)[0] for line in answered] == ["ok"] * 8, with_key_out
    refused = [line for line in without_key_out.splitlines() if line.split(" ", 1)[0] in kinds]
    assert len(refused) == 8, without_key_out
    for line in refused:  # the caller's own mistake, and which variable, in the example's own output
        assert line.startswith("caller ") and "RAY_ROLLOUTS_UNSET_KEY" in line, line


@pytest.mark.slow
@pytest.mark.ray  # `rollouts run` starts a Ray of its own
@pytest.mark.timeout(300)
def test_quick_start_runs_the_main_job_on_embedded_defaults(tmp_path):
    run = [c for c in commands(block("Quick start", "bash")) if c.startswith("rollouts run")]
    assert run == ["rollouts run"], run
    started = time.monotonic()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "rollouts"), "run"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "rollouts: 256 in" in done.stdout and "by kind: ok=256" in done.stdout
    (results,) = list(tmp_path.glob("rollouts-*.jsonl"))
    assert len(results.read_text().splitlines()) == 256
    assert time.monotonic() - started < 280


def test_ci_runs_the_readme_test_command_in_a_venv_of_its_own():
    """`.ci/run` is the README's test line, in a venv it creates afresh (`.venv-ci`, so a developer's
    `.venv` is never replaced): nothing installed on the machine can hide a dependency the project lacks."""
    code = [line.split(" #", 1)[0].strip() for line in block("Quick start", "bash").code.splitlines()]
    (line,) = [command for command in code if command.endswith("pytest")]
    ci = (README.parent / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == line.replace(".venv", ".venv-ci"), ci[-1]
    assert "rm -rf .venv-ci" in ci


def test_every_readme_command_is_run_by_a_test_or_says_why_not():
    unclassified = []
    for snippet in blocks("bash"):
        for command in commands(snippet):
            known = RUN_HERE + RUN_BY_DEV_LOOP_TEST + tuple(NOT_RUN)
            if not command.startswith(known):
                unclassified.append(f"{snippet.name}: {command}")
    assert not unclassified, "README commands nobody runs or explains:\n" + "\n".join(unclassified)
    assert {b.lang for b in blocks()} <= {"python", "bash", "toml", ""}, "a block of a language no test reads"


README_MAX_LINES = 300
"""The README is the door (issue #48): what it is, the quick start, the folder map, one orchestrator example
and links; the guides live in docs/, where test_docs.py runs their code."""


def test_the_readme_stays_a_door_of_at_most_300_lines():
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the rest into docs/"
    assert lines[2] == "## Quick start", "the README opens with the quick start"
