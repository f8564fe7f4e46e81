"""`rollouts serve-env`: the flags, checked before Ray starts, and the process that serves until stopped.

    rollouts serve-env --address tcp://0.0.0.0:5555 --taskset my-taskset --taskset-args '{"split": "train"}' \\
        --py-executable /opt/vf04/bin/python
    ray job submit -- rollouts serve-env --address tcp://0.0.0.0:5555 --taskset my-taskset ...

The process is a Ray driver: it binds the ROUTER, owns the env pool, and serves until SIGINT / SIGTERM
(`ray job stop`), then closes the pool. It joins `--ray-address` (or `$RAY_ADDRESS`, as a job does),
else starts a local Ray of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

logger = logging.getLogger(__name__)


def add_parser(sub: Any) -> None:
    serve = sub.add_parser(
        "serve-env",
        help="serve one verifiers environment over verifiers 0.4's serve protocol (prime-rl's serve.address)",
        description="Bind a verifiers-0.4-compatible env server at --address, its episodes run by the plane's "
        "supervised env servers. prime-rl's orchestrator connects to it with serve.address.",
    )
    serve.add_argument("--address", default="tcp://127.0.0.1:5000", help="where to bind, tcp://HOST:PORT")
    serve.add_argument("--taskset", default=None, help="the taskset id (verifiers' --env.taskset.id)")
    serve.add_argument(
        "--taskset-args", type=_json_object, default={}, help="JSON: the rest of the taskset config"
    )
    serve.add_argument(
        "--env-config",
        type=_json_object,
        default={},
        help="JSON: verifiers' whole EnvConfig (agent, timeouts, ...)",
    )
    serve.add_argument(
        "--py-executable", default=None, help="the verifiers 0.4 interpreter the env servers run"
    )
    serve.add_argument(
        "--py-module", action="append", default=[], help="a local package shipped to the env servers"
    )
    serve.add_argument(
        "--env-package",
        action="append",
        default=None,
        help="a module prefix the env servers may import as the environment (default: the taskset's module)",
    )
    serve.add_argument("--pool-config", type=_json_object, default={}, help="JSON: EnvPoolConfig fields")
    serve.add_argument(
        "--run-timeout", type=float, default=3600.0, help="seconds each run's episode may take"
    )
    serve.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: $RAY_ADDRESS or local)"
    )


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("a JSON object")
    return value


def config_from_args(args: argparse.Namespace) -> Any:
    """The `ServeEnvConfig` the flags say, or `ValueError` naming what is wrong (before Ray starts)."""
    from env_actors.adapters.verifiers_v1 import plugin_module
    from env_actors.config import EnvPoolConfig
    from rollout_actors.serve_env.front import ServeEnvConfig

    if not args.address.startswith(("tcp://", "ipc://")):
        raise ValueError(f"--address {args.address!r}: want tcp://HOST:PORT (or ipc://PATH)")
    env_config = dict(args.env_config)
    taskset = dict(env_config.get("taskset") or {})
    taskset.update(args.taskset_args)
    if args.taskset:
        taskset["id"] = args.taskset
    if not taskset.get("id"):
        raise ValueError("name the taskset: --taskset ID (or taskset.id in --env-config)")
    env_config["taskset"] = taskset
    pool = dict(args.pool_config)
    runtime_env = dict(pool.get("runtime_env") or {})
    if args.py_executable:
        if not os.access(args.py_executable, os.X_OK):
            raise ValueError(f"--py-executable {args.py_executable!r} is not an executable")
        runtime_env["py_executable"] = args.py_executable
    if args.py_module:
        runtime_env["py_modules"] = [str(Path(p).resolve()) for p in args.py_module]
    if runtime_env:
        pool["runtime_env"] = runtime_env
    if args.env_package is not None:
        pool["env_packages"] = args.env_package
    pool.setdefault("env_packages", [plugin_module(taskset["id"])])
    try:
        return ServeEnvConfig(
            address=args.address,
            env_config=env_config,
            pool=EnvPoolConfig.model_validate(pool),
            run_timeout_s=args.run_timeout,
        )
    except ValidationError as exc:
        raise ValueError(str(exc)) from exc


def serve_env(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except (ValueError, argparse.ArgumentTypeError) as exc:
        print(f"rollouts serve-env: {exc}", file=sys.stderr)
        return 2
    logging.getLogger("rollout_actors.serve_env").setLevel(logging.INFO)
    from rollout_actors.job.local_ray import init_ray

    init_ray(args.ray_address)
    return asyncio.run(_serve(config))


async def _serve(config: Any) -> int:
    from rollout_actors.serve_env.front import ServeEnvFront

    front = ServeEnvFront(config)
    await front.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(front.aclose()))
    print(f"serve-env: listening at {front.address}", flush=True)
    await front.closed()
    return 0 if front.load_failure is None else 1
