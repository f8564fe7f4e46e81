"""Deterministic startup failures fail fast and once (docs/design.md contract 8): a renderer key that cannot load
fails every waiting and new rollout of that key with the load's traceback, without re-dispatching any,
`caller` where the request named something no hub could serve, `infrastructure` otherwise; the failure is
remembered for the key (no second renderer spawned for it while held); an env pool whose interpreter cannot
start a Ray worker fails every rollout of its pool as `caller`, quoting the interpreter's own error, long
before the readiness deadline. Real actors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from env_pools import TEST_REF_PREFIXES

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.plane import PlaneConfig, RolloutPlane
from rollout_actors.wire import ClientConfig, Ref, RendererConfig, RolloutRequest, SamplingConfig

pytestmark = pytest.mark.slow

DEADLINE_S = 240
CALC = Ref(target="env_actors.examples.calculator_env:CalculatorEnv")


def request(standin, tokenizer: str, index: int) -> RolloutRequest:
    return RolloutRequest(
        env=CALC,
        task_index=index,
        client=ClientConfig(base_url=standin.base_url, model="served-model"),
        renderer=RendererConfig(tokenizer=tokenizer),
        sampling=SamplingConfig(max_tokens=16, seed=index),
    )


async def wave(plane: RolloutPlane, standin, tokenizer: str, n: int) -> list:
    for index in range(n):
        await plane.submit(request(standin, tokenizer, index))
    return [await plane.next_result(timeout=DEADLINE_S) for _ in range(n)]


def test_a_tokenizer_that_cannot_load_fails_every_rollout_of_its_key_once_and_is_remembered(
    ray_session, standin
):
    async def scenario():
        config = PlaneConfig(
            lanes={"train": 64, "eval": 1},
            workers=1,
            worker_num_cpus=0.25,
            env_pool={"num_cpus": 0.25},
            allowed_ref_prefixes=TEST_REF_PREFIXES,
            renderer_pool={"failure_hold_s": 600.0},
        )
        async with RolloutPlane(config) as plane:
            first = await wave(plane, standin, "/nonexistent/tokenizer", 16)  # all wait on one load
            second = await wave(plane, standin, "/nonexistent/tokenizer", 16)  # held: no new load
            nowhere = await wave(plane, standin, "org/name/not-an-id", 2)  # no hub could serve it
            renderers = await ray.get_actor(plane.names.renderer_pool).stats.remote()
            return first, second, nowhere, plane.stats(), renderers

    first, second, nowhere, stats, renderers = asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    for result in first + second:
        assert result.kind == "infrastructure" and result.error.fault == "load", result.error
        assert result.attempts == 1 and "/nonexistent/tokenizer" in result.error.message
        assert result.error.traceback
    assert {(r.kind, r.error.fault, r.attempts) for r in nowhere} == {("caller", "load", 1)}
    assert stats.redispatched == 0 and stats.kinds["infrastructure"] == 32 and stats.kinds["caller"] == 2
    assert renderers.startup_failures == 2  # one load per key, not one per rollout or per wave


MATH = Ref(target="env_actors.examples.math_env:MathEnv")
INTERPRETER_DEADLINE_S = (
    60  # well below the readiness wait (120 s) an interpreter that cannot start used to cost
)


def venv_python(folder, *, ray_module: str | None = None) -> str:
    """A fresh virtualenv's interpreter, without this suite's packages (no `ray`), or with a `ray` package
    whose import runs `ray_module`."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(folder)], check=True, timeout=120)
    python = str(folder / "bin" / "python")
    if ray_module is not None:
        where = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        site = subprocess.run([python, "-c", where], capture_output=True, text=True, check=True).stdout
        (Path(site.strip()) / "ray").mkdir(parents=True)
        (Path(site.strip()) / "ray" / "__init__.py").write_text(ray_module)
    return python


def test_a_pool_interpreter_that_cannot_start_a_ray_worker_fails_every_rollout_as_caller_with_its_error(
    ray_session, standin, tmp_path
):
    bare = venv_python(tmp_path / "bare")
    crashing = venv_python(
        tmp_path / "crashing", ray_module="raise RuntimeError('planted: ray broke here')\n"
    )
    pools = {
        CALC.target: {"num_cpus": 0.25, "runtime_env": {"py_executable": bare}},
        MATH.target: {"num_cpus": 0.25, "runtime_env": {"py_executable": crashing}},
    }
    config = PlaneConfig(
        lanes={"train": 64},
        workers=1,
        worker_num_cpus=0.25,
        env_pools=pools,
        allowed_ref_prefixes=TEST_REF_PREFIXES,
    )
    requests = [
        request(standin, BUNDLED_MODEL, i).model_copy(update={"env": env})
        for env in (CALC, MATH)
        for i in range(8)
    ]

    async def scenario():
        async with RolloutPlane(config) as plane:
            submitted = time.monotonic()
            for item in requests:
                await plane.submit(item)
            results = [await plane.next_result(timeout=INTERPRETER_DEADLINE_S) for _ in requests]
            print(
                f"\ninterpreter cannot start a Ray worker: 16 rollouts answered {time.monotonic() - submitted:.1f} s after submit"
            )
            return {r.request_id: r for r in results}

    by_id = asyncio.run(asyncio.wait_for(scenario(), INTERPRETER_DEADLINE_S))
    for item in requests:
        result = by_id[item.request_id]
        python, cause = (
            (bare, "No module named 'ray'") if item.env == CALC else (crashing, "planted: ray broke here")
        )
        assert result.kind == "caller" and result.attempts == 1, result.error
        assert python in result.error.message and cause in result.error.message, result.error.message


FAULT_RENDERERS = ("renderer_actors.faults.",)
RENDERER_START_DEADLINE_S = 60  # budget of four starts of a fresh renderer process on a loaded machine


@pytest.mark.parametrize(
    "module, kind, fault, cause",
    [
        ("raises_on_import", "infrastructure", "load", "planted: the renderer's module broke on import"),
        ("dies_on_import", "infrastructure", "unavailable", "died while starting"),
    ],
)
def test_a_renderer_whose_start_crashes_answers_every_rollout_of_its_key_in_seconds_with_the_cause(
    ray_session, standin, module, kind, fault, cause
):
    """A custom renderer whose module raises on import fails its load once, quoting the error; one whose
    process ends during its start is restarted on the key's budget (its rollouts, not to blame for a
    renderer lost while loading, may be re-dispatched meanwhile), then every rollout is answered with why
    the last one ended. Neither waits out the renderer's ready timeout (300 s)."""
    config = PlaneConfig(
        lanes={"train": 64},
        workers=1,
        worker_num_cpus=0.25,
        env_pool={"num_cpus": 0.25},
        allowed_ref_prefixes=TEST_REF_PREFIXES,
        renderer_pool={"allowed_ref_prefixes": FAULT_RENDERERS, "renderer_num_cpus": 0.25},
    )
    renderer = RendererConfig(
        tokenizer=BUNDLED_MODEL,
        family="custom",
        custom=Ref(target=f"renderer_actors.faults.{module}:Renderer"),
    )

    async def scenario():
        async with RolloutPlane(config) as plane:
            submitted = time.monotonic()
            for index in range(8):
                item = request(standin, BUNDLED_MODEL, index)
                await plane.submit(item.model_copy(update={"renderer": renderer}))
            results = [await plane.next_result(timeout=RENDERER_START_DEADLINE_S) for _ in range(8)]
            print(
                f"\nrenderer {module}: 8 rollouts answered {time.monotonic() - submitted:.1f} s after submit"
            )
            return results, plane.stats()

    results, stats = asyncio.run(asyncio.wait_for(scenario(), RENDERER_START_DEADLINE_S + 60))
    for result in results:
        assert (result.kind, result.error.fault) == (kind, fault), result.error
        assert cause in result.error.message, result.error.message
    if fault == "load":  # a load that failed fails the same way anywhere: never re-dispatched
        assert stats.redispatched == 0 and {r.attempts for r in results} == {1}


BROKEN_ORJSON = "raise RuntimeError('planted: orjson broke in this interpreter')\n"
JOIN_AND_START = """
import asyncio, sys
import ray
from rollout_actors.plane import PlaneConfig, PlaneStartError, RolloutPlane

ray.init(address=sys.argv[1], runtime_env={"env_vars": {"PYTHONPATH": sys.argv[2]}})

async def main():
    try:
        async with RolloutPlane(PlaneConfig(workers=1, worker_num_cpus=0.25, lanes={"train": 4})):
            print("STARTED")
    except PlaneStartError as error:
        print("REFUSED", error)

asyncio.run(asyncio.wait_for(main(), 100))
"""


def test_rollout_workers_whose_start_crashes_fail_the_plane_start_in_seconds_in_one_line(
    ray_session, tmp_path
):
    """A job whose workers cannot import the project (a broken package on their path, as on a node set up
    differently from the head) gets `PlaneStartError` from `start()`: one line naming the rollout workers
    and quoting the error their constructor raised, nothing left running."""
    (tmp_path / "orjson").mkdir()
    (tmp_path / "orjson" / "__init__.py").write_text(BROKEN_ORJSON)
    root = Path(__file__).resolve().parent.parent
    address = ray.get_runtime_context().gcs_address
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", JOIN_AND_START, address, f"{tmp_path}:{root}"],
        capture_output=True,
        text=True,
        timeout=150,
        cwd=root,
    )
    elapsed = time.monotonic() - started
    print(f"\nworkers that cannot start: start() refused {elapsed:.1f} s after the driver began")
    lines = [line for line in done.stdout.splitlines() if line.startswith(("STARTED", "REFUSED"))]
    assert lines == [
        "REFUSED the plane could not start its rollout workers: "
        "RuntimeError: planted: orjson broke in this interpreter"
    ], done.stdout + done.stderr[-3000:]
