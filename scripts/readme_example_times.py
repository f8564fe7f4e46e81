"""The README's "Using it from an orchestrator" example as written, on this machine, against the stand-in.

    python scripts/readme_example_times.py        # a plain `ray.init()` (the example's own), this machine's CPUs

Runs the example twice in one embedded Ray: with its key variable set, then unset. Only the server and the
model name are replaced (the stand-in's); the key variable is named as written, `VLLM_KEY`. Prints the
example's own output, and the seconds from `submit_group` until the group was complete (every answer in)
and until the example ended. Timings are reported, not asserted.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import ray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from readme import block  # noqa: E402  (the tests' reader of README.md)

from renderer_actors.tokenizer import BUNDLED_MODEL  # noqa: E402
from rollout_actors.inference.standin import StandinOptions, StandinServer  # noqa: E402
from rollout_actors.plane import RolloutPlane  # noqa: E402
from rollout_actors.plane.groups import GroupHandle  # noqa: E402

marks: dict[str, float] = {}
_submit_group = RolloutPlane.submit_group
_await_group = GroupHandle.__await__


async def stamped_submit(self, *args, **kwargs):
    marks["submit"] = time.monotonic()
    return await _submit_group(self, *args, **kwargs)


def stamped_await(self):
    group = yield from _await_group(self)
    marks["answered"] = time.monotonic()
    return group


def run(code: str, label: str) -> None:
    marks.clear()
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})
    ended = time.monotonic()
    answered = marks["answered"] - marks["submit"]
    print(
        f"{label}: every answer {answered:.1f} s after submit; example ended {ended - marks['submit']:.1f} s after"
    )


def main() -> None:
    RolloutPlane.submit_group = stamped_submit
    GroupHandle.__await__ = stamped_await
    with StandinServer(StandinOptions()) as standin:
        code = (
            block("Using it from an orchestrator", "python")
            .code.replace('"http://vllm:8000/v1"', repr(standin.base_url))
            .replace('"Qwen/Qwen3-8B"', repr(BUNDLED_MODEL))
        )
        os.environ["VLLM_KEY"] = "sk-readme-example"  # before the example's `ray.init()`: its workers read it
        try:
            run(code, "VLLM_KEY set")
            print(f"cluster: {ray.cluster_resources().get('CPU', 0):g} CPUs")
        finally:
            ray.shutdown()
        os.environ.pop("VLLM_KEY")
        try:
            run(code, "VLLM_KEY unset")
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
