"""The coalescer's round trip, Ray-free: event-loop iterations and loop-thread CPU per batched call.

    python scripts/bench_coalescer.py

A fake renderer answers `call_many` the way Ray does: `.remote()` returns a ref whose `future()` is set on
another thread. Two flushes of the same batches, side by side in one run:

- callback: the renderer calls' own flush (`batching._send_calls`): the batch leaves by a loop callback
  and is answered by one (`coalescer.answer_when`).
- awaiting: a flush that awaits the ref in a task the coalescer owns (what every flush did before).

On a loaded rollout worker each loop iteration takes a long time, and a rollout's renderer and env round
trips between two model calls decide whether its connection outlives its keep-alive (conn/ro in
`bench_plane.py`): iterations per round trip is the figure that matters there, CPU per call the one here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from typing import Any

from renderer_actors import batching
from renderer_actors.calls import CallOutcome
from rollout_actors.kernel.coalescer import TickBatch, set_batch_window

CASES = ((1, 2000), (64, 100), (1024, 10))  # (concurrent callers, sequential calls each)


class CountingLoop(asyncio.SelectorEventLoop):
    iterations = 0

    def _run_once(self) -> None:
        self.iterations += 1
        super()._run_once()


class FakeRayThread:
    """Sets the refs' futures on a thread of its own, as Ray's core worker does."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            future, value = job
            future.set_result(value)

    def answer(self, value: Any) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._queue.put((future, value))
        return future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


class FakeRef:
    def __init__(self, ray: FakeRayThread, value: Any) -> None:
        self._ray, self._value = ray, value

    def future(self) -> concurrent.futures.Future[Any]:
        return self._ray.answer(self._value)

    def __await__(self) -> Any:
        return asyncio.wrap_future(self.future()).__await__()


class FakeCallMany:
    """A renderer's `call_many`: every call answered with its first argument."""

    def __init__(self, ray: FakeRayThread) -> None:
        self._ray = ray

    def remote(self, calls: list[tuple[str, tuple[Any, ...]]]) -> FakeRef:
        return FakeRef(self._ray, [CallOutcome(value=args[0]) for _, args in calls])


class FakeRenderer:
    def __init__(self, ray: FakeRayThread) -> None:
        self.call_many = FakeCallMany(ray)


async def _awaiting_flush(batch: TickBatch) -> None:
    outcomes = await batch.target.call_many.remote(batch.items)
    batching._deliver_calls(batch, outcomes)


async def _wave(callers: int, calls: int, ray: FakeRayThread) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    assert isinstance(loop, CountingLoop)
    batched, renderer = batching.batched_calls(), FakeRenderer(ray)
    spent: list[int] = []

    async def caller() -> None:
        for i in range(calls):
            before = loop.iterations
            assert await batched.call("r", renderer, "parse", (i,), timeout=30) == i
            spent.append(loop.iterations - before)

    cpu = time.thread_time()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return (time.thread_time() - cpu) / (callers * calls) * 1e6, sum(spent) / len(spent)


def main() -> None:
    ray, real_flush = FakeRayThread(), batching._send_calls
    print(f"{'flush':10s} {'window':>7s} {'callers':>8s} {'calls':>7s} {'iter/trip':>10s} {'us/call':>8s}")
    try:
        for window in (0.0, 0.01):
            set_batch_window(window)
            for callers, calls in CASES:
                row = {}
                for name, flush in (("callback", real_flush), ("awaiting", _awaiting_flush)):
                    batching._send_calls = flush  # the name `BatchedCalls.call` flushes with
                    loop = CountingLoop()
                    try:
                        row[name] = loop.run_until_complete(_wave(callers, calls, ray))
                    finally:
                        loop.close()
                    us, iterations = row[name]
                    print(
                        f"{name:10s} {window * 1e3:5.0f}ms {callers:8d} {callers * calls:7d} "
                        f"{iterations:10.2f} {us:8.1f}"
                    )
                ratio = row["callback"][1] / row["awaiting"][1]
                print(f"{'':10s} iterations per round trip, callback / awaiting: {ratio:.2f}")
    finally:
        batching._send_calls = real_flush
        set_batch_window(0.0)
        ray.close()


if __name__ == "__main__":
    main()
