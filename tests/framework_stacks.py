"""Interpreters with the field's environment packages, for the adapter tests: one virtualenv per stack,
built once into a cache folder and reused (`RAY_ROLLOUTS_STACKS`, default `~/.cache/ray-rollouts/stacks`).

The packages clash with the plane's own (verifiers 0.4 needs `openai<3`, 0.3 brings `datasets`, the plane
runs `openai` 3.x), so they never go into the test interpreter. A stack's virtualenv sees the cluster's
packages (`--system-site-packages`: ray, pydantic, this project) under its own, which win; env pools run
it through `runtime_env.py_executable`. Building needs PyPI (as `pip install -e .[test]` does); a stack
that fails to build fails the tests that need it, with pip's output.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

STACKS = {
    "skyrl-gym": ["skyrl-gym==0.4.0"],
    "verifiers-0.3": ["verifiers==0.3.1"],
    "verifiers-0.4": ["verifiers==0.4.0"],
}
"""The releases the adapters are tested against."""
BUILD_TIMEOUT_S = 1200  # a cold build on a 2-core CI machine takes a few minutes; past this pip is stuck
FRAMEWORK_ENVS = Path(__file__).parent / "framework_envs"
"""The test environments, shipped to the pools with `runtime_env.py_modules`."""
FRAMEWORK_VF_TASKS = Path(__file__).parent / "framework_vf_tasks"
"""The verifiers v1 test taskset: a top-level package, as verifiers loads tasksets by id."""
FRAMEWORK_VF_CHAT = Path(__file__).parent / "framework_vf_chat"
"""A verifiers v1 harness (the plain chat loop, in process), for verifiers' own episodes."""


def cache_dir() -> Path:
    return Path(os.environ.get("RAY_ROLLOUTS_STACKS") or Path.home() / ".cache" / "ray-rollouts" / "stacks")


def stack_python(name: str) -> str:
    """The interpreter of stack `name`, built first if the cache lacks it (concurrent callers wait)."""
    requirements = STACKS[name]
    key = hashlib.sha256(f"{sys.version}|{sys.prefix}|{requirements}".encode()).hexdigest()[:12]
    home = cache_dir() / f"{name}-{key}"
    python = home / "bin" / "python"
    ready = home / ".ready"
    home.parent.mkdir(parents=True, exist_ok=True)
    with open(home.parent / f"{name}-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ready.exists():
            started = time.monotonic()
            _run([sys.executable, "-m", "venv", "--clear", "--system-site-packages", str(home)])
            _run(
                [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *requirements]
            )
            ready.write_text(f"built in {time.monotonic() - started:.0f} s\n")
    return str(python)


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"building a test stack failed: {' '.join(command)}\n{tail}")
