"""Benchmark: the driver's cuts of `bench_driver.py`, each beside the code it replaced, in one process (no Ray).

    python scripts/bench_driver_cuts.py

- wait: how a dispatch waits on its worker's answer, its loss or a cancel. `asyncio.wait` over the answer,
  the worker's shared `gone` future and a task waiting on the cancel event (before) against
  `dispatcher._first_of` (now), with 1,024 and 64 dispatches in flight per worker (each adds and removes a
  callback on the one `gone` future, so its cost grows with what the worker runs).
- members: admitting a group of 8. Every member validated from its dict (before) against the request
  validated once and each further member a copy with its own ids and seed (`Intake._check_members`).

Printed: CPU microseconds per dispatch or member, best of 3, and new/old.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rollout_actors.plane.dispatcher import _first_of
from rollout_actors.plane.submission import _member
from rollout_actors.wire import ClientConfig, Ref, RolloutRequest, SamplingConfig, new_id

ROUNDS = 3
GROUP = 8


async def _old_wait(answer: asyncio.Future[Any], lost: asyncio.Future[Any], cancelled: asyncio.Event) -> None:
    cancel = asyncio.ensure_future(cancelled.wait())
    try:
        await asyncio.wait({answer, lost, cancel}, timeout=60, return_when="FIRST_COMPLETED")
    finally:
        cancel.cancel()


async def _wave(way: str, n: int) -> float:
    loop = asyncio.get_running_loop()
    lost: asyncio.Future[Any] = loop.create_future()
    wakers: dict[str, Any] = {}
    answers = [loop.create_future() for _ in range(n)]
    started = time.process_time()
    if way == "old":
        tasks = [asyncio.ensure_future(_old_wait(a, lost, asyncio.Event())) for a in answers]
    else:
        tasks = [
            asyncio.ensure_future(_first_of((a, lost), 60, wakers, str(i))) for i, a in enumerate(answers)
        ]
    await asyncio.sleep(0)
    for answer in answers:
        answer.set_result(None)
    await asyncio.gather(*tasks)
    return (time.process_time() - started) / n * 1e6


def _members_old(raw: dict[str, Any]) -> list[RolloutRequest]:
    return [RolloutRequest.model_validate(_member(raw, "group", i)) for i in range(GROUP)]


def _members_new(raw: dict[str, Any]) -> list[RolloutRequest]:
    first = RolloutRequest.model_validate(_member(raw, "group", 0))
    seed = first.sampling.seed or 0
    return [first] + [
        first.model_copy(
            update={
                "request_id": new_id("req"),
                "lease_id": new_id("lease"),
                "sampling": first.sampling.model_copy(update={"seed": seed + i}),
            }
        )
        for i in range(1, GROUP)
    ]


def _admit(make: Any, raw: dict[str, Any], groups: int = 2000) -> float:
    started = time.process_time()
    for _ in range(groups):
        make(raw)
    return (time.process_time() - started) / (groups * GROUP) * 1e6


def main() -> None:
    for n in (1024, 64):
        best = {way: min(asyncio.run(_wave(way, n)) for _ in range(ROUNDS)) for way in ("old", "new")}
        print(f"wait, {n:>5} in flight per worker: old {best['old']:.1f} us, new {best['new']:.1f} us, "
              f"new/old {best['new'] / best['old']:.2f}")  # fmt: skip
    raw = RolloutRequest(
        env=Ref(target="env_actors.faults.envs:EchoEnv", config={"num_tasks": 64, "turns": 1}),
        task_index=3,
        client=ClientConfig(base_url="http://127.0.0.1:9/v1", model="m"),
        sampling=SamplingConfig(max_tokens=16, seed=5),
    ).model_dump()
    old = min(_admit(_members_old, raw) for _ in range(ROUNDS))
    new = min(_admit(_members_new, raw) for _ in range(ROUNDS))
    print(f"members of a group of {GROUP}: old {old:.1f} us, new {new:.1f} us, new/old {new / old:.2f}")


if __name__ == "__main__":
    main()
