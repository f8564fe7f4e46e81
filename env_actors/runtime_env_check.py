"""A pool's runtime env checked by the pool itself, so that one that cannot work fails the pool's start in
seconds with the failing side's own words, not at the readiness deadline.

Two things Ray reports late or never:

- `pip` requirements that cannot be installed. Ray's runtime-env agent builds a `pip` env up to three
  times (`RUNTIME_ENV_RETRY_TIMES`, a setting of the node, not of the actor), each time a fresh
  virtualenv plus a pip run, and only then tells the actor's caller: a requirement that does not exist
  took 85.6 s to fail a rollout. Here pip is asked once whether they resolve (`pip install --dry-run
  --no-deps`: names, versions and the interpreter's tags against the configured indexes, nothing
  installed), and pip's own error fails the start.
- A `py_executable` that cannot start a Ray worker (no `ray`, an import that crashes, another Ray
  version). The raylet starts the worker, sees it exit before registering, logs it in its own files and
  starts another, for ever: the actor stays pending and the caller hears nothing (Ray 2.60 surfaces no
  worker-start failure to the caller; only a runtime-env *build* failure reaches it). Worse, each such
  process holds one of the node's worker-start slots (as many as its cores) until the raylet's
  registration timeout (60 s): two of them stopped every other actor on a 2-core node from starting for
  a minute. So the interpreter is checked *before* the pool spawns a server with it, once per process:
  it runs the first thing a Ray worker runs, `import ray`, under the pool's `env_vars`, and its own
  output is the error.

pip's verdict is raised as Ray's `RuntimeEnvSetupError` (what `kernel.faults.runtime_env_failed` reads),
the interpreter's returned to the pool: either way the pool's configuration is at fault. A check that
cannot decide (pip missing, slow past its timeout) decides nothing: Ray's start still stands.

    problem = await interpreter_problem(python, env_vars)      # before the first spawn
    response = await started_unless_pip_fails(resolve(handle.start.remote()), config.runtime_env)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Awaitable
from typing import Any, TypeVar

from env_actors.config import EnvRuntimeEnv
from rollout_actors.kernel.faults import runtime_env_setup_error

T = TypeVar("T")

PIP_CHECK_TIMEOUT_S = 120.0  # a resolution against a slow index; past this the check decides nothing
INTERPRETER_CHECK_TIMEOUT_S = 60.0  # `import ray` takes ~1 s, more on a loaded node; past this, no verdict
PIP_ERROR_TAIL_CHARS = 3000  # pip's explanation is at the end of its output
INTERPRETER_ERROR_TAIL_CHARS = 2000  # a traceback's last frames and its exception line
WORKER_IMPORT = "import ray, sys; sys.stdout.write('\\nray ' + ray.__version__ + '\\n')"
"""What a Ray worker process does first (`default_worker.py` imports ray), and the version it got."""
DEFINITE_FAILURES = (
    "No matching distribution",
    "Invalid requirement",
    "ResolutionImpossible",
    "does not exist",
)
"""What pip says when the requirements themselves cannot be installed (not a network that failed)."""
_verdicts: dict[Any, str | None] = {}
"""Requirements, or interpreter and env vars -> the error (None: fine), per process: a pool's spawns
ask once."""


async def started_unless_pip_fails(start: Awaitable[T], runtime_env: EnvRuntimeEnv | None) -> T:
    """Await `start` (an env server's start call); raise Ray's `RuntimeEnvSetupError` with pip's error
    as soon as pip says the pool's requirements cannot be installed, whichever comes first."""
    if runtime_env is None or not runtime_env.pip:
        return await start
    starting = asyncio.ensure_future(start)
    checking = asyncio.ensure_future(pip_problem(tuple(runtime_env.pip)))
    try:
        await asyncio.wait({starting, checking}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done() and checking.result() is not None:
            raise runtime_env_setup_error(checking.result())
        return await starting
    finally:
        for task in (starting, checking):
            if not task.done():
                task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(starting, checking, return_exceptions=True)


async def pip_problem(requirements: tuple[str, ...]) -> str | None:
    """pip's error when `requirements` cannot be installed for this interpreter; None when they resolve
    or the check cannot tell."""
    if requirements in _verdicts:
        return _verdicts[requirements]
    argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--quiet"]
    argv += ["--disable-pip-version-check", "--no-input", "--", *requirements]
    ran = await _run(argv, None, PIP_CHECK_TIMEOUT_S)
    if ran is None:
        return None
    returncode, text = ran
    if returncode == 0:
        verdict = None
    elif any(sign in text for sign in DEFINITE_FAILURES):
        verdict = f"pip cannot install {list(requirements)}: {text.strip()[-PIP_ERROR_TAIL_CHARS:]}"
    else:  # an index this node cannot reach, a crash of pip itself: Ray's own build decides
        return None
    _verdicts[requirements] = verdict
    return verdict


async def interpreter_problem(python: str, env_vars: dict[str, str]) -> str | None:
    """Why `python` cannot start a Ray worker of this cluster, in its own words (its exit status and
    output of `import ray`, or the Ray version it found); None when it can or the check cannot tell."""
    key = ("py_executable", python, tuple(sorted(env_vars.items())))
    if key in _verdicts:
        return _verdicts[key]
    import ray

    ran = await _run([python, "-c", WORKER_IMPORT], {**os.environ, **env_vars}, INTERPRETER_CHECK_TIMEOUT_S)
    if ran is None:
        return None
    returncode, text = ran
    lines = text.strip().splitlines()
    found = lines[-1].removeprefix("ray ") if returncode == 0 and lines else None
    if returncode != 0:
        tail = text.strip()[-INTERPRETER_ERROR_TAIL_CHARS:]
        verdict = f"`import ray` exited with status {returncode}:\n{tail}"
    elif found != ray.__version__:  # the worker would refuse to join: Ray checks versions on connect
        verdict = f"it imports ray {found}, the cluster runs ray {ray.__version__}"
    else:
        verdict = None
    if verdict is not None:
        verdict = f"the env pool's py_executable {python} cannot start a Ray worker: {verdict}"
    _verdicts[key] = verdict
    return verdict


async def _run(argv: list[str], env: dict[str, str] | None, timeout_s: float) -> tuple[int, str] | None:
    """`argv`'s exit status and output (stdout and stderr together); None when it could not run or
    outlived `timeout_s` (it is killed: the check ends with its caller)."""
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            env=env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError:
        return None
    try:
        output, _ = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        return None
    finally:
        if process.returncode is None:  # timed out or cancelled
            process.kill()
            with contextlib.suppress(Exception):
                await process.wait()
    assert process.returncode is not None
    return process.returncode, output.decode("utf-8", "replace")
