"""The env server's batch path in process, Ray-free: CPU per echo step through `call_many`, this tree against
another revision, side by side in one run.

    python scripts/bench_env_batch.py [--base 4610233] [--batch 64] [--rounds 300] [--repeats 5]

`--base` is extracted with `git archive` into a scratch folder. Each measurement runs in a fresh process
(one per tree and repeat, the two trees alternating, so drift on a shared machine falls on both alike): an
`EnvServer` with an `EchoEnv` loaded in process (what `start` does, minus Ray; a tree whose server runs
environment code on a loop of its own starts that loop, so each batch crosses it as in the actor),
`--batch` sessions, then `--rounds` batches of one step per session through `call_many` (and `collect` for
any call not answered in the first reply). Two figures per step: the server alone, and with the batch pickled both ways as it
crosses Ray (the calls by the caller, the answers by the server, each unpickled on the far side; Ray's
cloudpickle). The table shows the median of the repeats and the ratio base / this tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("env_actors", "rollout_actors", "renderer_actors")


def measure(batch: int, rounds: int) -> dict[str, float]:
    """Run in the child process, on whichever tree PYTHONPATH names first."""
    import asyncio

    from ray import cloudpickle

    from env_actors.faults.envs import EchoEnv
    from env_actors.interface import EnvCall
    from env_actors.server import EnvServer
    from rollout_actors.kernel import Ref

    async def run(wire: bool) -> float:
        server = EnvServer(Ref(target="env_actors.faults.envs:EchoEnv"), "env-bench")
        server._env, server._phase = EchoEnv(num_tasks=batch, turns=10**9), "ready"
        if hasattr(server, "_env_loop"):  # environment code on a loop of its own, as in the actor
            server._env_loop.start()
        ids = [f"envsess-{i}" for i in range(batch)]
        await server.call_many([EnvCall("reset", sid, (i, None), 30.0) for i, sid in enumerate(ids)])
        message = {"role": "assistant", "content": "hello"}
        started = time.process_time()
        for _ in range(rounds):
            calls = [EnvCall("step", sid, (message,), 30.0) for sid in ids]
            if wire:
                calls = cloudpickle.loads(cloudpickle.dumps(calls))
            replies = await server.call_many(calls)
            if wire:
                replies = cloudpickle.loads(cloudpickle.dumps(replies))
            while missing := [r.ticket for r in replies if r.response is None]:
                replies = await server.collect(missing)
        return (time.process_time() - started) / (rounds * batch) * 1e6

    async def both() -> dict[str, float]:
        return {"server": await run(wire=False), "pickled": await run(wire=True)}

    return asyncio.run(both())


def extract(rev: str, into: str) -> None:
    archive = subprocess.run(["git", "archive", rev, *PACKAGES], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", into], input=archive.stdout, check=True)


def child(tree: str, batch: int, rounds: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}
    code = f"import json, sys; sys.path.insert(0, {str(ROOT / 'scripts')!r}); import bench_env_batch as b; "
    code += f"print(json.dumps(b.measure({batch}, {rounds})))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, check=True, capture_output=True)
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base", default="4610233", help="the revision to compare against")
    parser.add_argument("--batch", type=int, default=64, help="sessions, and calls per call_many")
    parser.add_argument("--rounds", type=int, default=300, help="batches per measurement")
    parser.add_argument("--repeats", type=int, default=5, help="processes per tree, alternating")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as base_tree:
        extract(args.base, base_tree)
        trees = {args.base: base_tree, "this tree": str(ROOT)}
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
        for _ in range(args.repeats):
            for name, tree in trees.items():
                runs[name].append(child(tree, args.batch, args.rounds))
    print(f"CPU us per echo step, call_many of {args.batch}, {args.rounds} batches, median of {args.repeats}")
    print(f"{'':12}{'server':>10}{'pickled':>10}")
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for name, figures in medians.items():
        print(f"{name:12}{figures['server']:10.1f}{figures['pickled']:10.1f}")
    base, head = medians[args.base], medians["this tree"]
    print(f"{'ratio':12}{base['server'] / head['server']:9.2f}x{base['pickled'] / head['pickled']:9.2f}x")


if __name__ == "__main__":
    main()
