"""A pool's `pip` requirements checked beside Ray's build of its runtime env, so that one that cannot be
installed fails the pool's start after one pip resolution, not after Ray's whole build.

Ray's runtime-env agent builds a `pip` env up to three times (`RUNTIME_ENV_RETRY_TIMES`, a setting of the
node, not of the actor), each time a fresh virtualenv plus a pip run, and only then tells the actor's
caller: a requirement that does not exist took 85.6 s to fail a rollout. Here, while Ray builds, the
supervisor asks pip once whether the requirements resolve (`pip install --dry-run --no-deps`: names,
versions and the interpreter's tags against the configured indexes, nothing installed) and, when they do
not, fails the start at once with pip's own error, as Ray's `RuntimeEnvSetupError` (what
`kernel.faults.runtime_env_failed` reads). A check that cannot decide (pip missing, slow past its
timeout) decides nothing: Ray's build still stands, and a good config pays no latency for the check.

    response = await started_unless_pip_fails(resolve(handle.start.remote()), config.runtime_env)
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable
from typing import TypeVar

from env_actors.config import EnvRuntimeEnv

T = TypeVar("T")

PIP_CHECK_TIMEOUT_S = 120.0  # a resolution against a slow index; past this the check decides nothing
PIP_ERROR_TAIL_CHARS = 3000  # pip's explanation is at the end of its output
DEFINITE_FAILURES = (
    "No matching distribution",
    "Invalid requirement",
    "ResolutionImpossible",
    "does not exist",
)
"""What pip says when the requirements themselves cannot be installed (not a network that failed)."""
_verdicts: dict[tuple[str, ...], str | None] = {}
"""Requirements -> pip's error (None: they resolve), per process: a pool's spawns ask once."""


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
            from ray.exceptions import RuntimeEnvSetupError  # Ray's own type: the one the supervisor reads

            raise RuntimeEnvSetupError(f"pip cannot install {runtime_env.pip}: {checking.result()}")
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
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
    except OSError:
        return None
    try:
        output, _ = await asyncio.wait_for(process.communicate(), PIP_CHECK_TIMEOUT_S)
    except TimeoutError:
        return None
    finally:
        if process.returncode is None:  # timed out or cancelled: the check ends with its caller
            process.kill()
            with contextlib.suppress(Exception):
                await process.wait()
    text = output.decode("utf-8", "replace")
    if process.returncode == 0:
        verdict = None
    elif any(sign in text for sign in DEFINITE_FAILURES):
        verdict = text.strip()[-PIP_ERROR_TAIL_CHARS:]
    else:  # an index this node cannot reach, a crash of pip itself: Ray's own build decides
        return None
    _verdicts[requirements] = verdict
    return verdict
