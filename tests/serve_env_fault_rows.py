"""The serve-env fault table's rows, measured: verifiers 0.4.0's own elastic pool and `rollouts serve-env`,
driven by the same client (verifiers' `EnvClient`, in the verifiers-0.4 interpreter: `serve_env_client.py`)
with the same taskset (`framework_vf_tasks`, verifiers' chat loop `framework_vf_chat`) against the same
stand-in model server. `scripts/serve_env_faults.py` prints the table; `tests/test_serve_env_faults.py`
holds our rows.

    row = verifiers_row(setup, "blocks")              # verifiers' pool, in processes of its own
    row = await front_row(setup, "blocks")             # the front, on the Ray this process has joined

The faults (`FAULTS`), each with the moment "seconds" count from:

- `sigkill`: the worker / env server running an episode SIGKILLed while its model call is in flight
  (seconds from the kill);
- `import`: the environment fails to import (a taskset id nothing provides; seconds from the run's send);
- `blocks`: the environment blocks its event loop (a reward that calls `time.sleep` inside `async def`,
  on one task: `framework_vf_tasks.blocking`; seconds from the run's send);
- `router`: the process holding the ROUTER SIGKILLed mid-episode: verifiers' broker, and for the front the
  `rollouts serve-env` process itself (its ROUTER lives in the CLI's driver); then the server is started
  again at the same address (seconds from the kill).

Then 16 more runs of tasks that do not block, through a fresh client: how many were answered, and ok.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
CLIENT = TESTS / "serve_env_client.py"
KEY_VAR = "SERVE_ENV_TEST_KEY"  # the stand-in takes any key; verifiers' client wants the variable set
TASKSET = {"id": "framework-vf-tasks"}
AGENT = {"harness": {"id": "framework-vf-chat"}, "runtime": {"type": "subprocess"}}
PACKAGES = ("framework_envs.", "framework_vf_tasks", "framework_vf_chat")
MODULES = [str(TESTS / "framework_envs"), str(TESTS / "framework_vf_tasks"), str(TESTS / "framework_vf_chat")]
BLOCKING_REWARD = {"task": {"rewards": {"blocks": {"fn": "framework_vf_tasks.blocking:blocks_on_mia"}}}}
MIA = 3  # the one task the blocking reward blocks on
FAULTS = {
    "sigkill": "the worker / env server running an episode SIGKILLed mid-episode",
    "import": "the environment fails to import",
    "blocks": "the environment blocks its event loop",
    "router": "the process holding the ROUTER SIGKILLed mid-episode",
}
NEXT_RUNS = 16
MODEL_LATENCY_S = 20.0  # the killed episode's model call: in flight whenever the kill lands
START_WAIT_S = 300.0  # a server's first start: a fresh interpreter importing verifiers, on a loaded machine


@dataclass(frozen=True)
class Setup:
    python: str
    """The verifiers-0.4 interpreter."""
    base_url: str
    """The stand-in model server."""
    model: str
    wait_s: float = 60.0
    """How long a client waits for its run's reply before it counts as still waiting."""
    next_wait_s: float = 180.0
    """How long the next 16 runs may take (a replacement server's start included)."""


@dataclass(frozen=True)
class Row:
    server: str
    fault: str
    learned: str
    """`reply: <error>` (or `reply: ok`), or `still waiting after N s`."""
    seconds: float | None
    """Seconds to learn it (None: it never did)."""
    next_answered: int
    next_ok: int

    def cells(self, width: int = 100) -> list[str]:
        learned = self.learned if len(self.learned) <= width else self.learned[: width - 3] + "..."
        seconds = "-" if self.seconds is None else f"{self.seconds:.1f}"
        nxt = f"{self.next_ok}/{NEXT_RUNS} ok"
        if self.next_answered != NEXT_RUNS:
            nxt = f"{self.next_answered}/{NEXT_RUNS} answered, {self.next_ok} ok"
        return [FAULTS[self.fault], self.server, learned, seconds, nxt]


def env_config(fault: str) -> dict[str, Any]:
    if fault == "import":
        return {"taskset": {"id": "framework-vf-missing"}, "agent": AGENT}
    if fault == "blocks":
        return {"taskset": {**TASKSET, **BLOCKING_REWARD}, "agent": AGENT}
    return {"taskset": TASKSET, "agent": AGENT}


def stack_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{ROOT}", **{KEY_VAR: "unused"})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------- the client


def client(
    setup: Setup, address: str, runs: list[dict], latency: float = 0.0, wait: bool = True
) -> subprocess.Popen:
    """verifiers' `EnvClient` running `runs` (tasks of the healthy taskset: the client ships each task)
    at once against `address`, in a process of its own; `wait`: for a healthy server first."""
    case = {
        "address": address,
        "taskset": TASKSET,
        "client": {"type": "eval", "base_url": setup.base_url, "api_key_var": KEY_VAR,
                   "headers": {"X-Standin-Latency": str(latency)}},
        "model": setup.model,
        "sampling": {"max_tokens": 64, "seed": 7},
        "runs": runs,
        "wait_for_startup": wait,
        "startup_timeout": START_WAIT_S,
    }  # fmt: skip
    proc = subprocess.Popen(
        [setup.python, str(CLIENT), "client"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=stack_env(),
    )  # fmt: skip
    proc.stdin.write(json.dumps(case))
    proc.stdin.close()
    proc.stdin = None  # written: `communicate` only reads
    return proc


def outcome(proc: subprocess.Popen, wait_s: float, since: float | None = None) -> tuple[str, float | None]:
    """How the client learned its one run's fate within `wait_s`, and the seconds it took: since `since`
    (`time.monotonic()`), else since the run's send."""
    try:  # communicate, not wait: an episode's JSON can outgrow the pipe's buffer
        out, _ = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"still waiting after {wait_s:g} s", None
    [result] = json.loads(out)
    took = result["seconds"] if since is None else time.monotonic() - since
    return f"reply: {result['error'] or 'ok'}", took


def next_runs(setup: Setup, address: str, wait: bool = True) -> tuple[int, int]:
    """(answered, ok) of 16 runs of tasks that do not block, through a fresh client."""
    proc = client(setup, address, [{"index": i % MIA} for i in range(NEXT_RUNS)], wait=wait)
    try:
        out, _ = proc.communicate(timeout=setup.next_wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return 0, 0
    results = json.loads(out)
    return len(results), sum(r["error"] is None for r in results)


def model_call_in_flight(setup: Setup, timeout: float = START_WAIT_S) -> None:
    """Until the stand-in holds a model call (an episode mid-way), whichever server sent it."""
    from rollout_actors.inference.load import parse_load

    metrics = setup.base_url.rsplit("/v1", 1)[0] + "/metrics"
    deadline = time.monotonic() + timeout
    while parse_load(urllib.request.urlopen(metrics, timeout=10).read().decode()).running < 1:
        assert time.monotonic() < deadline, "no episode reached its model call"
        time.sleep(0.2)


# ------------------------------------------------------------------------------- verifiers' pool


class VerifiersPool:
    """verifiers' own `serve_env` elastic pool (2 workers at most), as `vf-eval` / prime-rl spawn it."""

    def __init__(self, setup: Setup, address: str, config: dict[str, Any]) -> None:
        self.address = address
        self.process = subprocess.Popen(
            [setup.python, str(CLIENT), "server", address, "2"], stdin=subprocess.PIPE, text=True,
            env=stack_env(), start_new_session=True,
        )  # fmt: skip
        self.process.stdin.write(json.dumps(config))
        self.process.stdin.close()

    def processes(self) -> list[Any]:
        import psutil

        root = psutil.Process(self.process.pid)
        return [root, *root.children(recursive=True)]

    def workers(self) -> list[Any]:
        """The pool's workers: spawned children of its broker."""
        return [p for p in self.processes()[1:] if "spawn_main" in " ".join(p.cmdline())]

    def router(self) -> Any:
        """The process holding the client-facing ROUTER: the one listening on the address's port."""
        port = int(self.address.rsplit(":", 1)[1])
        for proc in self.processes():
            if any(c.laddr.port == port and c.status == "LISTEN" for c in proc.net_connections("tcp")):
                return proc
        raise AssertionError(f"nothing listens on {self.address}")

    def close(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)


def verifiers_row(setup: Setup, fault: str) -> Row:
    address = f"tcp://127.0.0.1:{free_port()}"
    pools = [VerifiersPool(setup, address, env_config(fault))]
    try:
        if fault in ("sigkill", "router"):
            proc = client(setup, address, [{"index": 1}], MODEL_LATENCY_S)
            model_call_in_flight(setup)
            victim = pools[0].workers()[0] if fault == "sigkill" else pools[0].router()
            victim.send_signal(signal.SIGKILL)
            learned, seconds = outcome(proc, setup.wait_s, time.monotonic())
            if fault == "router":  # started again where the client's socket reconnects
                pools[0].close()
                pools.append(VerifiersPool(setup, address, env_config(fault)))
        else:
            index = MIA if fault == "blocks" else 0
            learned, seconds = outcome(client(setup, address, [{"index": index}]), setup.wait_s)
        answered, ok = next_runs(setup, address)
        return Row("verifiers 0.4.0 elastic pool", fault, learned, seconds, answered, ok)
    finally:
        for pool in pools:
            pool.close()


# ------------------------------------------------------------------------------------- the front


def pool_config(python: str, fault: str, **overrides: Any) -> Any:
    """The front's env pool: the verifiers interpreter and the test packages. For `import`, the missing
    taskset's module passes the package gate, so verifiers really tries to import it."""
    from env_actors.config import EnvPoolConfig

    packages = (*PACKAGES, "framework_vf_missing") if fault == "import" else PACKAGES
    runtime_env = {"py_executable": python, "py_modules": MODULES, "env_vars": {KEY_VAR: "unused"}}
    return EnvPoolConfig(num_cpus=0.25, env_packages=packages, runtime_env=runtime_env, **overrides)


async def front_row(setup: Setup, fault: str, **pool: Any) -> Row:
    """Our row, the front on the Ray this process has joined; `pool`: `EnvPoolConfig` fields to override
    (the test shortens `hang_timeout_s`)."""
    if fault == "router":
        return await asyncio.to_thread(_front_process_row, setup, pool)
    from rollout_actors.serve_env.front import ServeEnvConfig, ServeEnvFront

    config = ServeEnvConfig(
        address="tcp://127.0.0.1:0",
        env_config=env_config(fault),
        pool=pool_config(setup.python, fault, **pool),
    )
    front = ServeEnvFront(config)
    await front.start()
    try:
        loaded = await front.wait_loaded(START_WAIT_S * config.load_attempts)
        assert loaded == (fault != "import"), front.load_failure
        if fault == "sigkill":
            proc = client(setup, front.address, [{"index": 1}], MODEL_LATENCY_S)
            await asyncio.to_thread(model_call_in_flight, setup)
            [busy] = [s for s in (await front.pool.stats.remote()).servers if s.sessions]
            os.kill(busy.pid, signal.SIGKILL)
            learned, seconds = await asyncio.to_thread(outcome, proc, setup.wait_s, time.monotonic())
        else:  # health answers the load's failure at once: the client does not wait for a healthy server
            index = MIA if fault == "blocks" else 0
            proc = client(setup, front.address, [{"index": index}], wait=fault != "import")
            learned, seconds = await asyncio.to_thread(outcome, proc, setup.wait_s)
        answered, ok = await asyncio.to_thread(next_runs, setup, front.address, fault != "import")
        return Row("rollouts serve-env", fault, learned, seconds, answered, ok)
    finally:
        await front.aclose()


def serve_env_process(setup: Setup, address: str, pool: dict[str, Any]) -> subprocess.Popen:
    """`rollouts serve-env` as a user starts it, joined to this process's Ray."""
    import ray

    runtime_env = {"env_vars": {KEY_VAR: "unused"}}
    command = [
        sys.executable, "-m", "rollout_actors.cli", "serve-env", "--address", address,
        "--ray-address", ray.get_runtime_context().gcs_address, "--taskset", TASKSET["id"],
        "--env-config", json.dumps({"agent": AGENT}), "--py-executable", setup.python,
        "--pool-config", json.dumps({"num_cpus": 0.25, "runtime_env": runtime_env, **pool}),
    ]  # fmt: skip
    for module in MODULES:
        command += ["--py-module", module]
    for package in PACKAGES:
        command += ["--env-package", package]
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL)


def _front_process_row(setup: Setup, pool: dict[str, Any]) -> Row:
    address = f"tcp://127.0.0.1:{free_port()}"
    fronts = [serve_env_process(setup, address, pool)]
    try:
        proc = client(setup, address, [{"index": 1}], MODEL_LATENCY_S)
        model_call_in_flight(setup)
        fronts[0].send_signal(signal.SIGKILL)  # the driver: its ROUTER, and the pool it owns, go with it
        learned, seconds = outcome(proc, setup.wait_s, time.monotonic())
        fronts[0].wait(10)
        fronts.append(serve_env_process(setup, address, pool))
        answered, ok = next_runs(setup, address)
        return Row("rollouts serve-env", "router", learned, seconds, answered, ok)
    finally:
        for front in fronts:
            if front.poll() is None:
                front.send_signal(signal.SIGTERM)  # closes its pool, as `ray job stop` would
                try:
                    front.wait(30)
                except subprocess.TimeoutExpired:
                    front.kill()
                    front.wait(10)
