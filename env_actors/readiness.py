"""An env server's readiness, and a pool's start: what "ready" means for an environment, and how a start
that failed is told to the caller.

Ready means loaded: `start()` loaded the environment (pip's verdict on the pool's own packages is read
beside Ray's slower build of them), then one `health()` answer. A load error fails the pool's start at
once with the environment's traceback; a runtime_env that did not build, or an interpreter that cannot
start a Ray worker, is the caller's (docs/design.md contract 8).
"""

from __future__ import annotations

import asyncio
from typing import Any

from env_actors.config import EnvPoolConfig
from env_actors.failures import EnvReadinessTimeout, EnvServerDied, LoadError, UnexplainedEnvFailure
from env_actors.runtime_env_check import interpreter_problem, started_unless_pip_fails
from rollout_actors.kernel import Failure
from rollout_actors.kernel.faults import CallerError, ray_loss, runtime_env_failed
from rollout_actors.kernel.supervisor import Child, RestartBudgetSpent, Supervisor
from rollout_actors.kernel.tasks import resolve

DIAGNOSE_TIMEOUT_S = 0.5  # one probe to say why a server missed its readiness deadline


async def handshake(server: Child, config: EnvPoolConfig) -> dict[str, Any]:
    """Its readiness: what `start()` answered (pid, node, num_tasks), once it also answered `health()`."""
    try:
        # pip's verdict on the pool's own packages, beside Ray's slower build of them
        response = await started_unless_pip_fails(resolve(server.handle.start.remote()), config.runtime_env)
    except Exception as exc:
        if runtime_env_failed(exc):  # the pool's own packages did not build: its configuration
            raise LoadError(CallerError(f"its runtime_env failed to build: {exc}"[-4000:]).failure) from exc
        raise
    if not response.success:
        raise LoadError(response.error or UnexplainedEnvFailure("start failed").failure)
    await resolve(server.handle.health.remote())
    return response.value or {}


async def diagnose(server: Child, config: EnvPoolConfig) -> str:
    """Why it missed its readiness deadline, from one more probe."""
    try:
        health = await asyncio.wait_for(resolve(server.handle.health.remote()), DIAGNOSE_TIMEOUT_S)
    except Exception:
        wants = {"CPU": config.num_cpus, **config.resources}
        return f"it never answered a probe: resources {wants} never granted, or its process is frozen"
    return (
        f"stuck in phase {health.phase!r} with its event loop stalled {health.loop_stall_s:.1f} s "
        "(a hanging constructor or load()?)"
    )


async def start_first(
    supervisor: Supervisor[Any], config: EnvPoolConfig, ready_timeout: float
) -> Failure | None:
    """Spawn `min_servers` and wait for the first to be ready (the kernel's `start`: a server that died
    while loading is replaced on the budget within the deadline). On failure everything is retired and
    the failure returned: a load error at once (with the environment's traceback), servers that died
    while loading past the restart budget, or the readiness deadline; an interpreter (`py_executable`)
    that cannot start a Ray worker before anything is spawned (`runtime_env_check`)."""
    runtime_env = config.runtime_env
    if runtime_env is not None and runtime_env.py_executable:  # before a server is spawned with it
        problem = await interpreter_problem(runtime_env.py_executable, runtime_env.env_vars)
        if problem is not None:
            return CallerError(problem).failure
    try:
        await supervisor.start(ready_timeout_s=ready_timeout, need=1)
        return None
    except LoadError as exc:
        return exc.failure
    except TimeoutError as exc:
        return EnvReadinessTimeout(str(exc)).failure
    except Exception as exc:
        if not isinstance(exc, RestartBudgetSpent) and ray_loss(exc) != "died":
            return Failure.from_exception(exc)  # e.g. nothing could be created (malformed resources)
        deadline = f"readiness deadline ({ready_timeout:g} s) passed; last loss: {supervisor.last_loss}"
        why = exc if isinstance(exc, RestartBudgetSpent) else deadline
        message = f"env server died while loading {supervisor.spawn_failures} time(s); {why}"
        return EnvServerDied(message).failure
