"""`scripts/bench_serve_env.py`'s front side at a small load: `rollouts serve-env` started from its command
line (flags, then the front, then an env pool in verifiers 0.4's interpreter, with an embedded Ray of its
own), verifiers' own `EnvClient` running 3-turn episodes through it. Every episode is answered with its
three model calls, and the bench's meter sees the processes it reports on. No timing is asserted: the
speeds are the script's to print, side by side."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest
from test_serve_env import vf04_python

from renderer_actors.tokenizer import BUNDLED_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).parent.parent / "scripts" / "bench_serve_env.py"


def bench():
    spec = importlib.util.spec_from_file_location("bench_serve_env", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_bench_front_side_answers_every_3_turn_episode_and_meters_its_processes(standin):
    args = argparse.Namespace(
        concurrency=[8], workers=1, latency=0.0, warmup=1, load_timeout=300.0, profile=None
    )
    side = bench().measure_front(vf04_python(), args, standin.base_url, BUNDLED_MODEL)
    load = side.loads[8]
    assert (load["answered"], load["ok"]) == (8, 8), load["errors"]
    assert load["calls"] == {"3": 8}  # three model calls each: the harness's turns all reached the model
    assert load["deltas"] >= 8 * 3  # a delta per turn at least, relayed as the episodes ran
    kinds = load["cpu_by_kind"]
    assert {"driver (CLI, ROUTER)", "ray::EnvServer", "raylet", "gcs_server"} <= set(kinds), kinds
    assert kinds["ray::EnvServer"][1] > 0
