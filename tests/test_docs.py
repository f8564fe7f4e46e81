"""The docs site builds as CI builds it (`mkdocs build --strict`: a broken link, a missing anchor or a page
left out of the nav fails), and every code block in `docs/` is one the suite holds: a diagram (`text`),
TOML that parses, Python that runs here against the stand-in as `test_readme.py` runs the README's, or
shell commands each of which is run by a test or listed with the reason it cannot run here (the README's
rules, `test_readme.py`, and this module's own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from readme import block as block_under
from readme import blocks, commands
from test_readme import (
    NOT_RUN,
    PYTHON_BLOCK_DEADLINE_S,
    RUN_BY_DEV_LOOP_TEST,
    RUN_HERE,
    run_python_block,
)

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
BUILD_TIMEOUT_S = 120  # the site builds in about a second; past this mkdocs is stuck
OWN_ENV = DOCS / "environments.md"
RUN_BY_OWN_ENV_TEST = ("mkdir -p my_envs", "touch my_envs/__init__.py", "PYTHONPATH=$PWD rollouts run")
"""docs/environments.md's recipe for an environment of one's own, run by `test_the_own_environment_recipe_...`."""
OWN_ENV_DEADLINE_S = 240


def test_the_docs_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "site" / "design" / "index.html").exists()


def test_the_design_document_lives_in_the_repository():
    design = (DOCS / "design.md").read_text()
    for heading in (
        "## The shape",
        "## Contracts",
        "## The supervision tree",
        "## The fault model",
        "## Words",
    ):
        assert heading in design


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_every_code_block_in_the_docs_is_held_by_the_suite(page):
    for block in blocks(path=page):
        where = f"{page.name}:{block.name}"
        if block.lang == "text":
            continue
        if block.lang == "toml":
            tomllib.loads(block.code)
        elif block.lang == "bash":
            known = RUN_HERE + RUN_BY_DEV_LOOP_TEST + RUN_BY_OWN_ENV_TEST + tuple(NOT_RUN)
            for command in commands(block):
                assert command.startswith(known), f"{where}: no test runs `{command}` nor says why not"
        elif block.lang != "python":  # run by test_every_python_block_in_the_docs_runs
            pytest.fail(f"{where}: a `{block.lang}` block no test runs")


PYTHON_BLOCKS = [(page, b) for page in PAGES for b in blocks("python", page)]


@pytest.mark.slow
@pytest.mark.timeout(PYTHON_BLOCK_DEADLINE_S + 30)
@pytest.mark.parametrize(
    ("page", "snippet"), PYTHON_BLOCKS, ids=[f"{p.name}:{b.name}" for p, b in PYTHON_BLOCKS]
)
def test_every_python_block_in_the_docs_runs(page, snippet, ray_session, standin):
    """As `test_readme.py` runs the README's: against the suite's stand-in, on the session Ray."""
    run_python_block(snippet.code, f"{page.name}:{snippet.line}", standin.base_url, "__docs__")


@pytest.mark.slow
@pytest.mark.ray  # `rollouts run` starts a Ray of its own
@pytest.mark.timeout(OWN_ENV_DEADLINE_S + 30)
def test_the_own_environment_recipe_runs_as_written_and_is_rewarded_on_the_standin(tmp_path):
    """docs/environments.md, "Your own environment": its class saved where the recipe says, its commands run
    as written from that folder (the embedded Ray and stand-in): every rollout `ok`, and the stand-in's
    scripted answers score, so the reward is not always 0."""
    module = block_under("Your own environment", "python", path=OWN_ENV).code
    mkdir, touch, run = commands(block_under("From the command line", "bash", path=OWN_ENV))
    assert (mkdir, touch) == ("mkdir -p my_envs", "touch my_envs/__init__.py") and run.startswith(
        RUN_BY_OWN_ENV_TEST[-1]
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), env.get("PATH", "")))
    for command in (mkdir, touch):
        subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, check=True, timeout=10)
    (tmp_path / "my_envs" / "apples.py").write_text(module)
    output = tmp_path / "results.jsonl"
    done = subprocess.run(
        ["bash", "-c", f"{run} --no-progress --output {output}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=OWN_ENV_DEADLINE_S,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(results) == 16 and {r["kind"] for r in results} == {"ok"}, done.stdout[-3000:]
    assert sum(r.get("reward", 0.0) for r in results) > 0, done.stdout[-3000:]


def test_the_configuration_reference_is_the_generators_output():
    """docs/configuration.md is generated from the pydantic models (`rollout_actors.job.config_doc`): a
    setting added, renamed or re-documented in the code without regenerating the page fails here."""
    from rollout_actors.job.config_doc import reference

    committed = (DOCS / "configuration.md").read_text()
    assert committed == reference(), (
        "regenerate: python -m rollout_actors.job.config_doc > docs/configuration.md"
    )
