"""The serve-env fault table, side by side: verifiers 0.4.0's own elastic pool and `rollouts serve-env`,
the same `EnvClient` (verifiers' own, in the verifiers-0.4 interpreter), the same faults, both measured.

    python scripts/serve_env_faults.py --py-executable /path/to/vf04/bin/python [--faults sigkill,blocks]

Rows (`tests/serve_env_fault_rows.py` measures them; `tests/test_serve_env_faults.py` holds ours): the
worker / env server running an episode SIGKILLed mid-episode; an environment that fails to import; one
that blocks its event loop; the process holding the ROUTER SIGKILLed mid-episode. Columns: how the client
learned (a reply, or still waiting after `--wait` s), the seconds it took (from the kill, or from the run's
send where nothing is killed), and what the next 16 runs got. The front runs with production defaults
(`hang_timeout_s` 30 s). Several minutes: the verifiers rows wait `--wait` s where nothing answers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

HEADER = ["fault", "server", "how the client learned", "s to learn", "next 16 runs"]


def main() -> int:
    from serve_env_fault_rows import FAULTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--py-executable", required=True, help="the verifiers-0.4 interpreter")
    parser.add_argument("--wait", type=float, default=60.0, help="how long a client may wait for its reply")
    parser.add_argument(
        "--next-wait", type=float, default=120.0, help="how long the next 16 runs may take, all together"
    )
    parser.add_argument("--faults", default=",".join(FAULTS), help=f"a comma list of {', '.join(FAULTS)}")
    parser.add_argument(
        "--side", choices=("both", "verifiers", "front"), default="both",
        help="measure one side only (verifiers' pool needs no Ray)",
    )  # fmt: skip
    args = parser.parse_args()
    faults = args.faults.split(",")
    if unknown := set(faults) - set(FAULTS):
        parser.error(f"unknown faults: {sorted(unknown)}")
    rows = measure(args.py_executable, args.wait, args.next_wait, faults, args.side)
    print("\n".join(format_table(rows)))
    return 0


def measure(python: str, wait_s: float, next_wait_s: float, faults: list[str], side: str) -> list:
    import ray
    from conftest import served_like_vllm
    from serve_env_fault_rows import Setup, front_row, verifiers_row

    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.inference.standin import StandinServer

    rows = []
    with StandinServer(served_like_vllm()) as standin:
        setup = Setup(python, standin.base_url, BUNDLED_MODEL, wait_s=wait_s, next_wait_s=next_wait_s)
        if side != "front":
            rows += [verifiers_row(setup, fault) for fault in faults]
        if side != "verifiers":
            ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
            try:
                rows += [asyncio.run(front_row(setup, fault)) for fault in faults]
            finally:
                ray.shutdown()
    return sorted(rows, key=lambda row: list(faults).index(row.fault))


def format_table(rows: list) -> list[str]:
    cells = [HEADER, *(row.cells() for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(HEADER))]

    def line(row: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

    return [line(HEADER), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells[1:])]


if __name__ == "__main__":
    sys.exit(main())
