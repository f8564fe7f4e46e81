"""The serve-env fault table, side by side: verifiers 0.4.0's own elastic pool and `rollouts serve-env`,
the same `EnvClient` (verifiers' own, in the verifiers-0.4 interpreter), the same fault.

    python scripts/serve_env_faults.py --py-executable /path/to/vf04/bin/python

Row measured (so far one): the worker / env-server actor running an episode SIGKILLed mid-episode (its
model call in flight). Columns: how the client learned (a reply, or still waiting after `--wait` s), the
seconds from the kill to that, and what the next 16 runs got. The test taskset is the suite's
(`tests/framework_vf_tasks`, verifiers' chat loop `tests/framework_vf_chat`), on the bundled stand-in.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
sys.path[:0] = [str(ROOT), str(TESTS)]

KEY_VAR = "SERVE_ENV_TEST_KEY"
ENV_CONFIG = {
    "taskset": {"id": "framework-vf-tasks"},
    "agent": {"harness": {"id": "framework-vf-chat"}, "runtime": {"type": "subprocess"}},
}
CLIENT = TESTS / "serve_env_client.py"
NEXT_RUNS_WAIT_S = 180.0  # a replacement server's start (a fresh interpreter importing verifiers) included
SETTLE_S = 12.0  # from the worker's spawn to its run's 20 s model call, on a loaded 2-core machine


def stack_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{ROOT}", **{KEY_VAR: "unused"})


def client(
    python: str, address: str, base_url: str, model: str, runs: list[dict], latency: float
) -> subprocess.Popen:
    case = {
        "address": address,
        "taskset": ENV_CONFIG["taskset"],
        "client": {"type": "eval", "base_url": base_url, "api_key_var": KEY_VAR,
                   "headers": {"X-Standin-Latency": str(latency)}},
        "model": model,
        "sampling": {"max_tokens": 64, "seed": 7},
        "runs": runs,
    }  # fmt: skip
    proc = subprocess.Popen(
        [python, str(CLIENT), "client"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=stack_env(),
    )
    proc.stdin.write(json.dumps(case))
    proc.stdin.close()
    proc.stdin = None  # written: `communicate` only reads
    return proc


def outcome(proc: subprocess.Popen, wait_s: float, killed_at: float) -> tuple[str, str]:
    try:  # communicate, not wait: an episode's JSON can outgrow the pipe's buffer
        out, _ = proc.communicate(timeout=wait_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"still waiting after {wait_s:g} s", "-"
    took = time.monotonic() - killed_at
    [result] = json.loads(out)
    return f"reply: {(result['error'] or 'ok')[:60]}", f"{took:.1f}"


def next_runs(python: str, address: str, base_url: str, model: str) -> str:
    proc = client(python, address, base_url, model, [{"index": i % 4} for i in range(16)], 0.0)
    try:
        out, _ = proc.communicate(timeout=NEXT_RUNS_WAIT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return f"0/16 answered in {NEXT_RUNS_WAIT_S:g} s"
    results = json.loads(out)
    return f"{sum(r['error'] is None for r in results)}/16 ok"


def verifiers_row(python: str, base_url: str, model: str, wait_s: float) -> list[str]:
    import psutil
    from test_serve_env import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    server = subprocess.Popen(
        [python, str(CLIENT), "server", address, "2"], stdin=subprocess.PIPE, text=True, env=stack_env(),
        start_new_session=True,
    )  # fmt: skip
    server.stdin.write(json.dumps(ENV_CONFIG))
    server.stdin.close()
    try:
        proc = client(python, address, base_url, model, [{"index": 1}], 20.0)
        deadline = time.monotonic() + 300
        workers: list = []
        while not workers:  # the pool's worker: a spawned child of its broker
            assert time.monotonic() < deadline, "verifiers' pool never started a worker"
            time.sleep(0.5)
            children = psutil.Process(server.pid).children(recursive=True)
            workers = [p for p in children if "spawn_main" in " ".join(p.cmdline())]
        time.sleep(SETTLE_S)  # it loads the environment and takes the run; the model call is in flight
        victim = workers[0]
        victim.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        how, seconds = outcome(proc, wait_s, killed)
        return ["verifiers 0.4.0 elastic pool", how, seconds, next_runs(python, address, base_url, model)]
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(10)


async def front_row(python: str, base_url: str, model: str, wait_s: float) -> list[str]:
    import ray

    from env_actors.config import EnvPoolConfig
    from rollout_actors.serve_env.front import ServeEnvConfig, ServeEnvFront

    pool = EnvPoolConfig(
        num_cpus=0.25,
        env_packages=("framework_envs.", "framework_vf_tasks", "framework_vf_chat"),
        runtime_env={
            "py_executable": python,
            "py_modules": [str(TESTS / "framework_envs"), str(TESTS / "framework_vf_tasks"), str(TESTS / "framework_vf_chat")],
            "env_vars": {KEY_VAR: "unused"},
        },
    )  # fmt: skip
    front = ServeEnvFront(ServeEnvConfig(address="tcp://127.0.0.1:0", env_config=ENV_CONFIG, pool=pool))
    await front.start()
    try:
        await front.wait_loaded(600)
        proc = client(python, front.address, base_url, model, [{"index": 1}], 20.0)
        deadline = time.monotonic() + 300
        while True:
            stats = await front.pool.stats.remote()
            busy = [s for s in stats.servers if s.sessions]
            if busy:
                break
            assert time.monotonic() < deadline, "the run never reached an env server"
            await asyncio.sleep(0.2)
        await asyncio.sleep(2.0)  # its first deltas are out; the model call is in flight
        os.kill(busy[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        how, seconds = await asyncio.to_thread(outcome, proc, wait_s, killed)
        nxt = await asyncio.to_thread(next_runs, python, front.address, base_url, model)
        return ["rollouts serve-env", how, seconds, nxt]
    finally:
        await front.aclose()
        del ray


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--py-executable", required=True, help="the verifiers-0.4 interpreter")
    parser.add_argument("--wait", type=float, default=60.0, help="how long a client may wait for its reply")
    args = parser.parse_args()
    import ray
    from conftest import served_like_vllm

    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.inference.standin import StandinServer

    with StandinServer(served_like_vllm()) as standin:
        rows = [verifiers_row(args.py_executable, standin.base_url, BUNDLED_MODEL, args.wait)]
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        try:
            rows.append(
                asyncio.run(front_row(args.py_executable, standin.base_url, BUNDLED_MODEL, args.wait))
            )
        finally:
            ray.shutdown()
    header = [
        "server",
        "worker running the episode SIGKILLed: the client learned",
        "s after kill",
        "next 16 runs",
    ]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
