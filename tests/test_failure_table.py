"""The failure table ("What fails how", docs/operations.md) is held by tests: every row names at least one test module
(or script) that exists and exercises it, so a row whose behaviour changes fails somewhere. The one row no
other module covers (no live rollout worker) is tested here."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import ray
from env_pools import TEST_REF_PREFIXES
from waiting import wait_until

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest

ROOT = Path(__file__).resolve().parents[1]


def failure_table_rows() -> list[list[str]]:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text[text.index("## What fails how") :]
    section = section[: section.index("\n## ")]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| case")]
    cells = [[cell.strip() for cell in row.strip().strip("|").split(" | ")] for row in rows]
    return [row for row in cells if not row[0].startswith("**")]  # section headings


def test_every_row_of_the_failure_table_names_tests_that_exist():
    rows = failure_table_rows()
    assert len(rows) > 20
    unheld, missing = [], []
    for row in rows:
        named = re.findall(r"`((?:tests/|scripts/)?[\w/]+(?:\.py)?)`", row[-1])
        if not named:
            unheld.append(row[0][:80])
        for name in named:
            path = ROOT / name if "/" in name else ROOT / "tests" / f"{name}.py"
            if not path.with_suffix(".py").exists() and not path.exists():
                missing.append(name)
    assert not unheld, f"rows no test holds: {unheld}"
    assert not missing, f"named tests that do not exist: {missing}"


@pytest.mark.slow
def test_with_no_live_rollout_worker_and_none_coming_a_request_fails_at_once(ray_session, standin):
    """The only worker is killed and its restart budget is zero: the next request is answered
    `infrastructure` (`NoLiveWorker`, fault `unavailable`) without waiting for anything."""
    config = PlaneConfig(
        lanes={"train": 4, "eval": 1},
        workers=1,
        worker_num_cpus=0.25,
        hang_timeout_s=5.0,
        probe_interval_s=0.5,
        worker_restart={"max_restarts": 0, "window_s": 600},
        env_pool={"num_cpus": 0.25},
        allowed_ref_prefixes=TEST_REF_PREFIXES,
    )

    def request() -> RolloutRequest:
        return RolloutRequest(
            env=Ref(target="env_actors.examples.calculator_env:CalculatorEnv"),
            task_index=0,
            client=ClientConfig(base_url=standin.base_url, model=BUNDLED_MODEL),
        )

    async def scenario():
        async with RolloutPlane(config) as plane:
            await plane.submit(request())
            assert (await plane.next_result(timeout=120)).kind == "ok"  # the pools are up
            (slot,) = plane._workers.live()
            ray.kill(slot.handle, no_restart=True)
            await wait_until(lambda: not plane._workers.live(), 60)
            await plane.submit(request())
            return await plane.next_result(timeout=60)

    result = asyncio.run(asyncio.wait_for(scenario(), 240))
    assert result.kind == "infrastructure" and result.error.type == "NoLiveWorker", result.error
    assert result.error.fault == "unavailable" and result.attempts == 0
