"""Interpreters with the field's environment packages, for the adapter tests: one virtualenv per stack,
built once into a cache folder and reused (`RAY_ROLLOUTS_STACKS`, default `~/.cache/ray-rollouts/stacks`).

The packages clash with the plane's own (verifiers 0.4 needs `openai<3`, 0.3 brings `datasets`, the plane
runs `openai` 3.x), so they never go into the test interpreter. A stack is built the way a user builds a
pool's interpreter (`env_actors.pool_python`, `rollouts pool-python`): its virtualenv sees the packages of
the interpreter running the tests (ray, pydantic, this project; a venv's or not) under its own, which win;
env pools run it through `runtime_env.py_executable`. Building needs PyPI (as `pip install -e .[test]`
does); a stack that fails to build fails the tests that need it, with pip's output.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import sys
import time
from pathlib import Path

from env_actors.pool_python import LAYER_PTH, build_pool_python

STACKS = {
    "skyrl-gym": ["skyrl-gym==0.4.0"],
    "verifiers-0.3": ["verifiers==0.3.1"],
    "verifiers-0.4": ["verifiers==0.4.0"],
}
"""The releases the adapters are tested against."""
FRAMEWORK_ENVS = Path(__file__).parent / "framework_envs"
"""The test environments, shipped to the pools with `runtime_env.py_modules`."""
FRAMEWORK_VF_TASKS = Path(__file__).parent / "framework_vf_tasks"
"""The verifiers v1 test taskset: a top-level package, as verifiers loads tasksets by id."""
FRAMEWORK_VF_CHAT = Path(__file__).parent / "framework_vf_chat"
"""A verifiers v1 harness (the plain chat loop, in process), for verifiers' own episodes."""
FRAMEWORK_VF_TOOLS = Path(__file__).parent / "framework_vf_tools"
"""A verifiers v1 taskset with a toolset (a `calculator` MCP server per rollout): multi-turn episodes."""
FRAMEWORK_VF_AGENT = Path(__file__).parent / "framework_vf_agent"
"""A verifiers v1 harness that runs the chat loop as a program of its own, through the interception."""


def cache_dir() -> Path:
    return Path(os.environ.get("RAY_ROLLOUTS_STACKS") or Path.home() / ".cache" / "ray-rollouts" / "stacks")


def stack_python(name: str) -> str:
    """The interpreter of stack `name`, built first if the cache lacks it (concurrent callers wait)."""
    requirements = STACKS[name]
    # The interpreter it layers over and how (a stack of another layout is never reused) are in the key.
    key = hashlib.sha256(f"{sys.version}|{sys.prefix}|{LAYER_PTH}|{requirements}".encode()).hexdigest()[:12]
    home = cache_dir() / f"{name}-{key}"
    python = home / "bin" / "python"
    ready = home / ".ready"
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            started = time.monotonic()
            build_pool_python(home, requirements)
            ready.write_text(f"built in {time.monotonic() - started:.0f} s\n")
    return str(python)
