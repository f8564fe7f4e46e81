"""Coalesced pool calls: one call per tick, answers routed to the right waiters, nothing leaked when a
waiter gives up. A stand-in pool object (no Ray) makes the timing deterministic."""

from __future__ import annotations

import asyncio
import itertools

from renderer_actors.batching import batched_calls
from renderer_actors.calls import CallOutcome, RendererSlot
from rollout_actors.kernel.coalescer import batch_counts, set_batch_window


class _Method:
    def __init__(self, fn):
        self.remote = fn


class FakePool:
    """Answers `acquire_many` after `delay` seconds; records every call."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls: list[tuple] = []
        self.released: list[str] = []
        self._ids = itertools.count()
        self.acquire_many = _Method(self._acquire_many)
        self.release_many = _Method(self._release_many)

    async def _acquire_many(self, key_json, multiplex, count, owner=None, known=None):
        self.calls.append(("acquire_many", key_json, multiplex, count))
        await asyncio.sleep(self.delay)
        return [RendererSlot(f"l{next(self._ids)}", None, "r", True) for _ in range(count)]

    async def _release_many(self, slot_ids):
        self.calls.append(("release_many", list(slot_ids)))
        self.released += slot_ids
        return len(slot_ids)


def test_concurrent_leases_in_one_tick_become_one_pool_call_per_key():
    pool = FakePool()

    async def scenario():
        calls = batched_calls()
        leases = await asyncio.gather(
            *(calls.acquire(pool, "k1", 4, timeout=5) for _ in range(5)),
            *(calls.acquire(pool, "k2", 4, timeout=5) for _ in range(2)),
        )
        assert len({lease.slot_id for lease in leases}) == 7
        assert sorted(c for c in pool.calls) == [("acquire_many", "k1", 4, 5), ("acquire_many", "k2", 4, 2)]
        await asyncio.gather(*(calls.release(pool, lease.slot_id, timeout=5) for lease in leases))
        assert pool.calls[-1][0] == "release_many" and sorted(pool.released) == sorted(
            lease.slot_id for lease in leases
        )

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_lease_whose_waiter_gave_up_is_handed_back():
    pool = FakePool(delay=0.3)

    async def scenario():
        calls = batched_calls()
        patient = asyncio.ensure_future(calls.acquire(pool, "k", 4, timeout=5))
        impatient = asyncio.ensure_future(calls.acquire(pool, "k", 4, timeout=0.05))
        lease = await patient
        try:
            await impatient
            raise AssertionError("the impatient waiter should have timed out")
        except TimeoutError:
            pass
        for _ in range(50):
            if pool.released:
                break
            await asyncio.sleep(0.02)
        assert len(pool.released) == 1 and pool.released[0] != lease.slot_id

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_readiness_is_asked_once_per_renderer_and_failures_are_not_cached():
    asked: list[str] = []

    class Handle:
        def __init__(self, name: str, fail: bool) -> None:
            self.ready = _Method(lambda: self._ready(name, fail))

        async def _ready(self, name: str, fail: bool):
            asked.append(name)
            await asyncio.sleep(0.01)
            if fail:
                raise OSError(f"{name} cannot load")
            return name

    async def scenario():
        calls = batched_calls()
        good, bad = Handle("good", False), Handle("bad", True)
        answers = await asyncio.gather(*(calls.ready("good", good, timeout=5) for _ in range(20)))
        assert answers == ["good"] * 20 and asked == ["good"]
        for _ in range(2):
            try:
                await calls.ready("bad", bad, timeout=5)
                raise AssertionError("expected the load failure")
            except OSError:
                pass
        assert asked == ["good", "bad", "bad"]

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_render_calls_in_one_tick_become_one_call_many_per_renderer():
    from renderer_actors.batching import RenderCallFailed
    from renderer_actors.calls import CallOutcome
    from rollout_actors.wire import Failure

    sent: list[tuple[str, list]] = []

    class Renderer:
        def __init__(self, name: str) -> None:
            self.call_many = _Method(lambda calls: self._call_many(name, calls))

        async def _call_many(self, name, calls):
            sent.append((name, list(calls)))
            return [
                CallOutcome(failure=Failure(type="ValueError", message="bad"), rejected=True)
                if args == ("bad",)
                else CallOutcome(value=(name, method, args))
                for method, args in calls
            ]

    async def scenario():
        calls = batched_calls()
        r1, r2 = Renderer("r1"), Renderer("r2")
        counted = batch_counts().get("batching._send_calls", (0, 0))
        answers = await asyncio.gather(
            *(calls.call("r1", r1, "parse", (i,), timeout=5) for i in range(6)),
            calls.call("r2", r2, "bridge", ("x",), timeout=5),
            calls.call("r1", r1, "parse", ("bad",), timeout=5),
            return_exceptions=True,
        )
        assert sorted((name, len(batch)) for name, batch in sent) == [("r1", 7), ("r2", 1)]
        assert answers[:7] == [("r1", "parse", (i,)) for i in range(6)] + [("r2", "bridge", ("x",))]
        assert isinstance(answers[7], RenderCallFailed) and answers[7].rejected
        # A call made after the batch went out travels in the next one: nothing waits for company.
        assert await calls.call("r1", r1, "parse", (9,), timeout=5) == ("r1", "parse", (9,))
        assert len(sent) == 3
        # What the process counts for operators (`RolloutWorker.debug_resources`): 3 calls, 9 items.
        calls_sent, items_sent = batch_counts()["batching._send_calls"]
        assert (calls_sent - counted[0], items_sent - counted[1]) == (3, 9)

    asyncio.run(asyncio.wait_for(scenario(), 10))


def test_a_loaded_key_waits_its_batch_window_for_company_and_a_lone_caller_never_waits():
    sent: list[list] = []

    class Renderer:
        def __init__(self) -> None:
            self.call_many = _Method(self._call_many)

        async def _call_many(self, calls):
            sent.append([args[0] for _, args in calls])
            return [CallOutcome(value=args[0]) for _, args in calls]

    async def scenario():
        calls, renderer = batched_calls(), Renderer()

        def call(i):
            return asyncio.ensure_future(calls.call("w", renderer, "parse", (i,), timeout=5))

        # One caller at a time: every batch leaves on the next tick, the window never applies.
        for i in range(3):
            assert await asyncio.wait_for(call(i), 0.5) == i  # far inside the 1 s window
        # Concurrent callers: a batch of two marks the key loaded ...
        assert await asyncio.gather(call(3), call(4)) == [3, 4]
        # ... so the next batch waits for company: a call made 50 ms later (another tick) joins it.
        first = call(5)
        await asyncio.sleep(0.05)
        assert len(sent) == 4  # held, not sent
        second = call(6)
        assert await asyncio.gather(first, second) == [5, 6]
        assert sent == [[0], [1], [2], [3, 4], [5, 6]]

    set_batch_window(1.0)
    try:
        asyncio.run(asyncio.wait_for(scenario(), 20))
    finally:
        set_batch_window(0.0)


def test_call_many_on_a_real_renderer_answers_each_call_on_its_own():
    from renderer_actors.actor import RendererActor
    from renderer_actors.key import RendererKey
    from renderer_actors.tokenizer import BUNDLED_MODEL
    from rollout_actors.wire import RendererConfig

    actor = RendererActor(RendererKey.from_config(BUNDLED_MODEL, RendererConfig()).to_json(), "r")
    messages = [{"role": "user", "content": "What is 2 + 2?"}]

    async def scenario():
        start, rejected, unknown = await actor.call_many(
            [("start", (messages, None)), ("start", ([{"role": "nobody"}], None)), ("health", ())]
        )
        assert start.failure is None and start.value.prompt_ids
        assert rejected.failure is not None and rejected.rejected and rejected.failure.traceback
        assert unknown.failure is not None and unknown.rejected
        (parsed,) = await actor.call_many([("parse", (start.value.prompt_ids[-3:], None))])
        assert parsed.failure is None

    asyncio.run(asyncio.wait_for(scenario(), 60))
