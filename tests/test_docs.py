"""The docs site builds as CI builds it (`mkdocs build --strict`: a broken link, a missing anchor or a page
left out of the nav fails), and every code block in `docs/` is one the suite holds: a diagram (`text`),
TOML that parses, or shell commands each of which the README's rules cover (`test_readme.py`: run by a
test, or listed with the reason it cannot run here). A page that brings Python brings the test that runs
it, as `test_readme.py` runs the README's."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from readme import blocks, commands
from test_readme import NOT_RUN, RUN_BY_DEV_LOOP_TEST, RUN_HERE

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
BUILD_TIMEOUT_S = 120  # the site builds in about a second; past this mkdocs is stuck


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
            known = RUN_HERE + RUN_BY_DEV_LOOP_TEST + tuple(NOT_RUN)
            for command in commands(block):
                assert command.startswith(known), f"{where}: no test runs `{command}` nor says why not"
        else:
            pytest.fail(f"{where}: a `{block.lang}` block no test runs")
