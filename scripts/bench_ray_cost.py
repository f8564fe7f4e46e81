"""Benchmark: what Ray itself costs the plane per rollout, the part no code of ours can remove.

    python scripts/bench_ray_cost.py [--calls 4000]

Two measurements against one async actor on local Ray. Each is the CPU of the calling process and of
the actor, per call or per item, for concurrent calls (as a wave sends them):

1. **One actor task per rollout** (docs/design.md: each rollout is one Ray actor task). The call carries a
   three-turn rollout's `RolloutRequest` and answers its `Result`, once as pydantic models (Ray pickles
   them class by class) and once as their JSON, which is what `RolloutWorker.run` takes and answers.
2. **A batched call's items** (renderers and env servers are actors: ~14 items per three-turn rollout).
   A parse-sized item (60 completion ids, a 20-id prompt tail) is sent in batches of 1, 8 and 32, as
   the coalescers send them.

The last line is the floor these two put under the plane's CPU per turn, at three turns and 14 items
per rollout, with items at the batch size of 32, caller and callee together:
`Ray floor per turn at 3 turns: x ms`. Compare it with the single process's whole CPU per turn from
`bench_plane.py` (about 2 ms on a 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import ray

from renderer_actors.tokenizer import BUNDLED_MODEL
from rollout_actors.wire import ClientConfig, Ref, Result, RolloutRequest, SamplingConfig, Turn

TURNS = 3
ITEMS_PER_ROLLOUT = 14  # lease, ready, start, 3 parses, 2 bridges, release; place, reset, 3 steps, forget
BATCH_SIZES = (1, 8, 32)


def rollout(seed: int = 0) -> tuple[RolloutRequest, Result]:
    """A request and result shaped like `bench_plane.py`'s: three turns of ~60 sampled tokens."""
    rng = random.Random(seed)
    request = RolloutRequest(
        env=Ref(target="env_actors.faults.envs:EchoEnv", config={"num_tasks": 64, "turns": TURNS}),
        task_index=3,
        client=ClientConfig(base_url="http://127.0.0.1:8000/v1", model=BUNDLED_MODEL),
        sampling=SamplingConfig(max_tokens=256),
        max_turns=TURNS + 1,
    )
    turns = [
        Turn(
            new_prompt_ids=[rng.randrange(150_000) for _ in range(40)],
            completion_ids=[rng.randrange(150_000) for _ in range(60)],
            finish_reason="stop",
            content="word " * 40,
        )
        for _ in range(TURNS)
    ]
    result = Result.of(request, "ok", reward=1.0, turns=turns, metrics={"turns": TURNS}, started_at=1.0)
    return request, result


@ray.remote
class Callee:
    def __init__(self) -> None:
        _, self._result = rollout()

    async def run_models(self, request: RolloutRequest) -> Result:
        return self._result

    async def run_json(self, request_json: bytes) -> str:
        RolloutRequest.model_validate_json(request_json)
        return self._result.model_dump_json()

    async def call_many(self, items: list[Any]) -> list[Any]:
        return [("ok", len(item[1][0])) for item in items]

    def cpu(self) -> float:
        return time.process_time()


async def measured(callee: Any, work: Any) -> tuple[float, float]:
    """(caller CPU s, callee CPU s) spent on `work()`."""
    callee_before = await callee.cpu.remote()
    before = time.process_time()
    await work()
    caller = time.process_time() - before
    return caller, await callee.cpu.remote() - callee_before


async def main_async(args: argparse.Namespace) -> None:
    callee = Callee.remote()
    await callee.cpu.remote()
    request, _ = rollout()
    n = args.calls

    async def models() -> None:
        await asyncio.gather(*(callee.run_models.remote(request) for _ in range(n)))

    async def as_json() -> None:
        answers = await asyncio.gather(
            *(callee.run_json.remote(request.model_dump_json().encode()) for _ in range(n))
        )
        for answer in answers:
            Result.model_validate_json(answer)

    print(f"1. one actor task per rollout, {n} concurrent calls (CPU us per call)")
    print(f"   {'as':<18}{'caller':>8}{'callee':>8}")
    task_cost = 0.0
    for name, work in (("pydantic models", models), ("JSON", as_json)):
        await work()  # warm
        caller, actor = await measured(callee, work)
        print(f"   {name:<18}{caller / n * 1e6:8.0f}{actor / n * 1e6:8.0f}")
        task_cost = (caller + actor) / n  # the JSON row, which is what the plane sends

    rng = random.Random(1)
    item = (
        "parse",
        ([rng.randrange(150_000) for _ in range(60)], None, [rng.randrange(150_000) for _ in range(20)]),
    )
    items = n  # at batch 1, as many calls as part 1: Ray warns past 5,000 pending on one actor
    print(f"\n2. batched items, {items} items in concurrent batches (CPU us per item)")
    print(f"   {'batch':<18}{'caller':>8}{'callee':>8}")
    item_cost = 0.0
    for size in BATCH_SIZES:

        async def batches(size: int = size) -> None:
            await asyncio.gather(*(callee.call_many.remote([item] * size) for _ in range(items // size)))

        await batches()
        caller, actor = await measured(callee, batches)
        print(f"   {size:<18}{caller / items * 1e6:8.0f}{actor / items * 1e6:8.0f}")
        item_cost = (caller + actor) / items

    floor = (task_cost + ITEMS_PER_ROLLOUT * item_cost) / TURNS
    print(
        f"\nper rollout: one task {task_cost * 1e3:.2f} ms + {ITEMS_PER_ROLLOUT} items at batch "
        f"{BATCH_SIZES[-1]} {ITEMS_PER_ROLLOUT * item_cost * 1e3:.2f} ms"
    )
    print(f"Ray floor per turn at {TURNS} turns: {floor * 1e3:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        started = time.monotonic()
        asyncio.run(main_async(args))
        print(f"(took {time.monotonic() - started:.0f} s)")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
