"""`rollouts serve-env` against verifiers 0.4.0's own worker pool, side by side in one run: the same
`EnvClient` load, the same 3-turn episodes, the same stand-in model server with a latency model.

    python scripts/bench_serve_env.py [--concurrency 256 1024] [--workers 2] [--latency 0.5] [--profile DIR]

The pool's side runs first, then the front's; each is started once and serves one load per `--concurrency`: C episodes at once through one
verifiers `EnvClient` (the client prime-rl's orchestrator uses, in the verifiers-0.4 interpreter), after a
warm-up load that every env server / pool worker has loaded the environment for. The episodes are the
suite's taskset (`tests/framework_vf_tasks`) with a harness that makes exactly three model calls
(`tests/framework_vf_turns`); every model call waits `--latency` s on the stand-in.

- verifiers: `serve_env(max_workers=W, elastic=False)`, the `EnvServerPool` broker and its W worker
  processes (pre-spawned, so both sides serve with W from the first episode);
- front: `rollouts serve-env` (the CLI, a Ray driver with an embedded local Ray) with an env pool of W env
  servers (`min_servers = max_servers = W`).

CPU is counted per process tree (`_bench_tree.TreeMeter`), sampled during the load: on each side the server's process and every descendant (the front: the CLI driver, Ray's
GCS, raylet, its agents and every worker and actor; verifiers: the broker, its workers and their
multiprocessing helper). The client is counted apart (its own `getrusage`), the stand-in on neither.
RSS is the peak over the samples of the tree's summed RSS (shared pages counted in each process).
Wall is the client's, from the first `run` sent to the last reply. The ratios are printed last. `--profile`
runs py-spy on each side's serving processes during the load (`_bench_profile`) and prints where they spent it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from _bench_tree import TreeMeter, stop_tree  # noqa: E402

TESTS = ROOT / "tests"
KEY_VAR = "SERVE_ENV_TEST_KEY"
PACKAGES = ("framework_envs", "framework_vf_tasks", "framework_vf_turns")
ENV_CONFIG = {
    "taskset": {"id": "framework-vf-tasks"},
    "agent": {"harness": {"id": "framework-vf-turns"}, "runtime": {"type": "subprocess"}},
}
PROFILED = ("driver (CLI, ROUTER)", "ray::EnvServer", "ray::EnvPool", "broker", "worker")
START_TIMEOUT_S = 600.0  # a side's start: Ray, W fresh verifiers-0.4 interpreters, the warm-up load


# ------------------------------------------------------------------------ the client (stack interpreter)


async def client_load(case: dict) -> dict:
    """Run in the verifiers-0.4 interpreter: warm up, say `ready`, wait for `go`, run the load, report."""
    import asyncio
    import resource

    from verifiers.v1.serve.client import EnvClient
    from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

    tasks = list(load_taskset(taskset_config_type(case["taskset"]["id"]).model_validate(case["taskset"])))
    env = EnvClient(case["address"])
    await env.wait_for_server_startup(timeout=START_TIMEOUT_S)

    async def one(i: int) -> dict:
        deltas, started = 0, time.monotonic()

        def on_delta(_delta: dict) -> None:
            nonlocal deltas
            deltas += 1

        data = tasks[i % len(tasks)].data.model_dump(mode="json")
        try:
            episode = await env.run(case["client"], case["model"], case["sampling"], data, on_delta)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"[:120], "deltas": deltas, "calls": 0, "s": 0.0}
        calls = sum(len(trace.calls) for trace in episode.traces)
        return {"error": None, "deltas": deltas, "calls": calls, "s": time.monotonic() - started}

    try:
        warm = await asyncio.gather(*(one(i) for i in range(case["warmup"])))
        print(json.dumps({"ready": [w["error"] for w in warm]}), flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # `go`: the meters have their first sample
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
        runs = await asyncio.gather(*(one(i) for i in range(case["concurrency"])))
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        await env.close()
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "answered": len(runs),
        "ok": sum(r["error"] is None for r in runs),
        "errors": dict(Counter(r["error"] for r in runs if r["error"])),
        "deltas": sum(r["deltas"] for r in runs),
        "calls": dict(Counter(str(r["calls"]) for r in runs)),
        "episode_s": sorted(r["s"] for r in runs),
    }


def pool_server(address: str, workers: int) -> None:
    """Run in the verifiers-0.4 interpreter: verifiers' own pool, as `vf-eval` / prime-rl spawn it."""
    from verifiers.v1.serve.pool import serve_env

    serve_env(max_workers=workers, address=address, config_data=ENV_CONFIG, elastic=False)


# ------------------------------------------------------------------------ the meter (this interpreter)


def front_kind(proc) -> str:
    line = " ".join(proc.cmdline())
    if "serve-env" in line and "rollout_actors.cli" in line:
        return "driver (CLI, ROUTER)"
    if line.startswith("ray::"):
        return line.split()[0].split(".")[0]  # ray::EnvServer, ray::EnvPool, ray::IDLE
    for name in ("gcs_server", "raylet", "dashboard", "log_monitor", "runtime_env", "monitor.py"):
        if name in line:
            return name
    return "other: " + proc.name()


def pool_kind(proc) -> str:
    line = " ".join(proc.cmdline())
    if "pool-server" in line:
        return "broker"
    if "spawn_main" in line:
        return "worker"
    if "resource_tracker" in line:
        return "resource tracker"
    return "other: " + proc.name()


# ------------------------------------------------------------------------ the two sides


@dataclass
class Side:
    name: str
    loads: dict[int, dict] = field(default_factory=dict)
    """Per concurrency: the client's report, with `cpu_by_kind` and `peak_rss` added."""


def stack_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]), **{KEY_VAR: "unused"})


def run_load(
    python: str, address: str, args: argparse.Namespace, base_url: str, model: str, c: int, meter: TreeMeter
) -> dict:
    case = {
        "address": address,
        "taskset": ENV_CONFIG["taskset"],
        "client": {"type": "eval", "base_url": base_url, "api_key_var": KEY_VAR,
                   "headers": {"X-Standin-Latency": str(args.latency)}},
        "model": model,
        "sampling": {"max_tokens": 32, "seed": 7},
        "warmup": args.warmup,
        "concurrency": c,
    }  # fmt: skip
    proc = subprocess.Popen(
        [python, __file__, "client"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=stack_env(),
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(case) + "\n")
        proc.stdin.flush()
        ready = json.loads(proc.stdout.readline() or "null")
        if ready is None:
            raise RuntimeError("the client ended before its warm-up finished")
        if any(ready["ready"]):
            raise RuntimeError(f"warm-up runs failed: {Counter(ready['ready'])}")
        meter.begin()
        profiler = profile(meter, args.profile, c) if args.profile else None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        timer = threading.Timer(args.load_timeout, proc.kill)
        timer.start()
        line = proc.stdout.readline()
        timer.cancel()
        kinds = meter.end()
        if profiler is not None:
            profiler.stop()
        if not line:
            return {"answered": 0, "ok": 0, "errors": {f"killed after {args.load_timeout:g} s": c},
                    "cpu_by_kind": kinds, "peak_rss": meter.peak_rss}  # fmt: skip
        report = json.loads(line)
        report.update(cpu_by_kind=kinds, peak_rss=meter.peak_rss, rss_by_kind=meter.peak_rss_by_kind)
        return report
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def profile(meter: TreeMeter, out_dir: str, c: int) -> object:
    """py-spy on the side's serving processes (`PROFILED`), for the load (`_bench_profile`)."""
    from _bench_profile import WaveProfiler

    roles: dict[str, list[int]] = {}
    for (pid, _), kind in meter.kinds_at_start.items():
        if kind not in PROFILED:
            continue
        role = kind.replace(" ", "_").replace("(", "").replace(")", "").replace(",", "").replace(":", "")
        roles.setdefault(role, []).append(pid)
    side = meter.kind_of.__name__.split("_")[0]
    return WaveProfiler(Path(out_dir) / f"{side}-{c}", roles).start()


def free_address() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


def measure_pool(python: str, args: argparse.Namespace, base_url: str, model: str) -> Side:
    address = free_address()
    command = [python, __file__, "pool-server", address, str(args.workers)]
    server = subprocess.Popen(command, env=stack_env(), start_new_session=True)
    side = Side(f"verifiers 0.4.0 EnvServerPool ({args.workers} workers)")
    return serve_loads(side, server, pool_kind, python, address, args, base_url, model)


def measure_front(python: str, args: argparse.Namespace, base_url: str, model: str) -> Side:
    address = free_address()
    pool = {
        "min_servers": args.workers,
        "max_servers": args.workers,
        "env_packages": list(PACKAGES),
        "runtime_env": {
            "py_executable": python,
            "py_modules": [str(TESTS / p) for p in PACKAGES],
            "env_vars": {KEY_VAR: "unused"},
        },
    }
    command = [
        sys.executable, "-m", "rollout_actors.cli", "serve-env", "--address", address,
        "--env-config", json.dumps(ENV_CONFIG), "--pool-config", json.dumps(pool),
    ]  # fmt: skip
    # the raylet's default wait for its agent (~30 s) is too short on a loaded 2-core machine (as conftest)
    env = dict(os.environ, PYTHONPATH=str(ROOT), RAY_agent_register_timeout_ms="300000")
    env.pop("RAY_ADDRESS", None)  # its own embedded Ray, never a cluster left on the machine
    server = subprocess.Popen(command, env=env, start_new_session=True)
    side = Side(f"rollouts serve-env ({args.workers} env servers)")
    return serve_loads(side, server, front_kind, python, address, args, base_url, model)


def serve_loads(
    side: Side, server: subprocess.Popen, kind_of, python: str, address: str, args, base_url: str, model: str
) -> Side:
    """One load per concurrency against the started `server`, metered; then the server is stopped."""
    try:
        for c in args.concurrency:
            meter = TreeMeter(server.pid, kind_of)
            side.loads[c] = run_load(python, address, args, base_url, model, c, meter)
    finally:
        stop_tree(server)
    return side


# ------------------------------------------------------------------------ the table


def cpu_total(load: dict) -> float:
    return sum(seconds for _, seconds in load["cpu_by_kind"].values())


def print_tables(sides: list[Side], concurrency: list[int]) -> None:
    header = ["C", "server", "answered", "ok", "calls/ep", "deltas/ep", "wall s", "episode s p50/max", "server CPU ms/ep",
              "client CPU ms/ep", "peak RSS MiB"]  # fmt: skip
    rows = []
    for c in concurrency:
        for side in sides:
            load = side.loads[c]
            n = max(1, load["answered"])
            rows.append([
                str(c), side.name, f"{load['answered']}/{c}", str(load["ok"]),
                ",".join(f"{k}x{v}" for k, v in sorted(load.get("calls", {}).items())) or "-",
                f"{load.get('deltas', 0) / n:.1f}",
                f"{load.get('wall_s', float('nan')):.1f}", spread(load.get("episode_s") or [0.0]),
                f"{1000 * cpu_total(load) / n:.1f}",
                f"{1000 * load.get('cpu_s', float('nan')) / n:.1f}", f"{load['peak_rss'] / 2**20:.0f}",
            ])  # fmt: skip
    print_table(header, rows)
    print()
    rows = []
    for c in concurrency:
        for side in sides:
            load = side.loads[c]
            n = max(1, load["answered"])
            for kind, (procs, seconds) in sorted(load["cpu_by_kind"].items(), key=lambda kv: -kv[1][1]):
                rss = load.get("rss_by_kind", {}).get(kind, 0) / 2**20
                rows.append(
                    [
                        str(c),
                        side.name,
                        kind,
                        str(procs),
                        f"{seconds:.1f}",
                        f"{1000 * seconds / n:.1f}",
                        f"{rss:.0f}",
                    ]
                )
    print_table(["C", "server", "process", "n", "CPU s", "CPU ms/ep", "RSS MiB at peak"], rows)
    for c in concurrency:
        for side in sides:
            if side.loads[c]["errors"]:
                print(f"C={c} {side.name} errors: {side.loads[c]['errors']}")
    print()
    if len(sides) != 2:
        return
    pool, front = sides
    for c in concurrency:
        p, f = pool.loads[c], front.loads[c]
        if not (p.get("wall_s") and f.get("wall_s")):
            print(f"C={c}: a side did not finish its load; no ratios")
            continue
        cpu_ratio = (cpu_total(f) / f["answered"]) / (cpu_total(p) / p["answered"])
        print(
            f"C={c}: front/pool wall {f['wall_s'] / p['wall_s']:.2f}x, "
            f"server CPU per episode {cpu_ratio:.2f}x, peak RSS {f['peak_rss'] / p['peak_rss']:.2f}x, "
            f"client CPU per episode {(f['cpu_s'] / f['answered']) / (p['cpu_s'] / p['answered']):.2f}x; "
            f"answered {f['answered']}/{c} vs {p['answered']}/{c}"
        )


def spread(seconds: list[float]) -> str:
    return f"{seconds[len(seconds) // 2]:.1f}/{seconds[-1]:.1f}"


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--py-executable", default=None, help="the verifiers-0.4 interpreter (default: built)"
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--workers", type=int, default=2, help="pool workers = env servers, on each side")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds each model call waits")
    parser.add_argument("--warmup", type=int, default=16, help="episodes before the measured load")
    parser.add_argument("--load-timeout", type=float, default=1800.0, help="seconds a load may take")
    parser.add_argument("--profile", default=None, help="py-spy every side's processes into this folder")
    parser.add_argument("--sides", nargs="+", default=["pool", "front"], choices=["pool", "front"])
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT), str(TESTS)]
    from conftest import served_like_vllm

    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.inference.standin import StandinServer

    python = args.py_executable
    if python is None:
        from framework_stacks import stack_python

        python = stack_python("verifiers-0.4")
    measure = {"pool": measure_pool, "front": measure_front}
    with StandinServer(served_like_vllm()) as standin:
        sides = [measure[name](python, args, standin.base_url, BUNDLED_MODEL) for name in args.sides]
    print_tables(sides, args.concurrency)
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        import asyncio

        print(json.dumps(asyncio.run(client_load(json.loads(sys.stdin.readline())))), flush=True)
    elif len(sys.argv) > 1 and sys.argv[1] == "pool-server":
        pool_server(sys.argv[2], int(sys.argv[3]))
    else:
        sys.exit(main())
