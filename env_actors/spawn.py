"""Creating an `EnvServer` actor for a pool: its Ray options (concurrency groups, spread placement, no
Ray-level restarts) and the pool's own `runtime_env`, uploaded the way Ray uploads a job's."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import ray

from env_actors.config import EnvCallLimits, EnvPoolConfig, EnvRuntimeEnv
from env_actors.server import PROBE_GROUP, EnvServer
from rollout_actors.kernel import DEFAULT_ALLOWED_PREFIXES, CallerError, Ref

PROBE_GROUP_SIZE = 4  # a probe and slack for probes that outlived their caller's timeout
MIN_SERVER_CONCURRENCY = 64


def create_env_server(name: str, env: Ref, config: EnvPoolConfig) -> ray.actor.ActorHandle:
    """Create (not await) one EnvServer actor for a pool; the caller runs the readiness handshake."""
    return ENV_SERVER_ACTOR.options(**env_server_options(name, config)).remote(
        *env_server_args(name, env, config)
    )


def env_server_options(name: str, config: EnvPoolConfig) -> dict[str, Any]:
    """One EnvServer's Ray options, its pool's `runtime_env` uploaded (refused as the configuration's fault
    when its interpreter is not an executable here)."""
    runtime_env = uploaded_runtime_env(config.runtime_env) if config.runtime_env is not None else None
    python = runtime_env and runtime_env.get("py_executable")
    if python and not os.access(python, os.X_OK):
        # Ray retries a process whose interpreter is missing for ever: refused here, on the pool's node
        # (interpreters are at the same path on every node), as the configuration's fault.
        raise CallerError(f"the env pool's runtime_env.py_executable {python!r} is not an executable here")
    return {
        "name": name,
        "num_cpus": config.num_cpus,
        "resources": dict(config.resources) or None,
        "max_concurrency": max(MIN_SERVER_CONCURRENCY, 2 * config.multiplex),
        "scheduling_strategy": "SPREAD",  # one node's loss takes a fraction of the pool, not all of it
        "runtime_env": runtime_env,
    }


def env_server_args(name: str, env: Ref, config: EnvPoolConfig) -> tuple[Any, ...]:
    prefixes = config.allowed_ref_prefixes or DEFAULT_ALLOWED_PREFIXES
    return (env, name, tuple(prefixes), EnvCallLimits.of(config), tuple(config.env_packages))


_UPLOADED: dict[str, dict[str, Any]] = {}


def uploaded_runtime_env(runtime_env: EnvRuntimeEnv) -> dict[str, Any]:
    """`runtime_env` as Ray takes it for one actor: local `py_modules` and `working_dir` uploaded to the
    cluster and named by URI. Ray uploads local folders itself only for a job's runtime env (`ray.init`);
    a pool's own is uploaded here the same way (Ray's own upload step, content-addressed, once per
    process and config), from the pool's node, where the paths the user gave are valid."""
    key = runtime_env.model_dump_json()
    if key not in _UPLOADED:
        from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
        from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

        scratch = tempfile.gettempdir()
        try:
            env = upload_py_modules_if_needed(
                runtime_env.ray_dict(), include_gitignore=True, scratch_dir=scratch
            )
            env = upload_working_dir_if_needed(env, include_gitignore=True, scratch_dir=scratch)
        except Exception as exc:  # a missing folder, a non-package path: the pool's configuration
            raise CallerError(f"the env pool's runtime_env could not be uploaded: {exc}") from exc
        _UPLOADED[key] = env
    return _UPLOADED[key]


# Concurrency groups can only be declared here, not in `.options()`. No Ray-level restarts: the
# supervisor replaces servers under its restart budget; Ray restarting them behind its back would hide
# deaths and spend no budget.
ENV_SERVER_ACTOR = ray.remote(
    concurrency_groups={PROBE_GROUP: PROBE_GROUP_SIZE}, max_restarts=0, max_task_retries=0
)(EnvServer)
