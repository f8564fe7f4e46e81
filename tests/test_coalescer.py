"""The kernel's coalescer answering a batch by callback (`answer_when`): one answer per waiter, exactly
once, by the answer, its failure, or the batch's deadline; and `KnownHandles`, which lets a batch's answer
leave out the handles its asker holds. Ray-free: a concurrent future set from another
thread stands in for a Ray `ObjectRef` (whose answer arrives on Ray's own thread)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import threading

import pytest

from rollout_actors.kernel.coalescer import KnownHandles, TickBatch, TickCoalescer, answer_when


class FakeRef:
    """What `answer_when` reads of a Ray `ObjectRef`: `future()`, set on another thread."""

    def __init__(self) -> None:
        self.future_ = concurrent.futures.Future()

    def future(self) -> concurrent.futures.Future:
        return self.future_

    def answer(self, value: object = None, exc: BaseException | None = None) -> None:
        def settle() -> None:
            if exc is None:
                self.future_.set_result(value)
            else:
                self.future_.set_exception(exc)

        thread = threading.Thread(target=settle)
        thread.start()
        thread.join()


def _echo(batch: TickBatch, values: list) -> None:
    if len(values) != len(batch.waiters):
        raise ValueError(f"{len(values)} answers for {len(batch.waiters)} calls")
    for waiter, value in zip(batch.waiters, values, strict=True):
        if not waiter.done():
            waiter.set_result(value)


def _scenario(body) -> None:
    asyncio.run(asyncio.wait_for(body(), 10))


def test_a_batch_sent_in_one_tick_is_answered_from_another_thread_in_order():
    refs: list[FakeRef] = []

    def send(batch: TickBatch) -> None:
        refs.append(FakeRef())
        answer_when(refs[-1], asyncio.get_running_loop().time() + 5, batch, _echo)

    async def body():
        ticks = TickCoalescer()
        waiters = [ticks.add("k", None, i, send) for i in range(3)]
        await asyncio.sleep(0)  # the batch leaves on the next tick
        assert len(refs) == 1
        refs[0].answer([i * 10 for i in range(3)])
        assert await asyncio.gather(*waiters) == [0, 10, 20]

    _scenario(body)


def test_a_failed_call_or_a_malformed_answer_fails_every_waiter_still_waiting():
    refs: list[FakeRef] = []

    def send(batch: TickBatch) -> None:
        refs.append(FakeRef())
        answer_when(refs[-1], asyncio.get_running_loop().time() + 5, batch, _echo)

    async def body():
        ticks = TickCoalescer()
        first = [ticks.add("k", None, i, send) for i in range(2)]
        await asyncio.sleep(0)
        refs[0].answer(exc=ConnectionError("actor died"))
        for waiter in first:
            with pytest.raises(ConnectionError):
                await waiter
        second = [ticks.add("k", None, i, send) for i in range(2)]
        await asyncio.sleep(0)
        refs[1].answer([1])  # one answer for two calls: the whole batch failed, nobody gets a wrong one
        for waiter in second:
            with pytest.raises(ValueError):
                await waiter

    _scenario(body)


def test_no_answer_by_the_deadline_times_every_waiter_out_and_a_late_answer_is_dropped():
    refs: list[FakeRef] = []
    delivered: list[list] = []

    def deliver(batch: TickBatch, values: list) -> None:
        delivered.append(values)
        _echo(batch, values)

    def send(batch: TickBatch) -> None:
        refs.append(FakeRef())
        answer_when(refs[-1], asyncio.get_running_loop().time() + 0.05, batch, deliver)

    async def body():
        waiter = TickCoalescer().add("k", None, 1, send)
        with pytest.raises(TimeoutError):
            await waiter
        refs[0].answer([1])
        await asyncio.sleep(0.05)  # the late answer's callback has run by now
        assert delivered == []

    _scenario(body)


def test_a_flush_that_raises_before_sending_fails_its_waiters_and_an_awaiting_flush_still_runs():
    async def gone(batch: TickBatch) -> None:
        raise RuntimeError("pool is gone")

    def refused(batch: TickBatch) -> None:
        raise RuntimeError("actor handle is dead")

    async def body():
        ticks = TickCoalescer()
        for flush in (refused, gone):
            waiter = ticks.add(("k", flush.__name__), None, 1, flush)
            with pytest.raises(RuntimeError):
                await waiter

    _scenario(body)


class Handle:
    """Stands in for an actor handle: weakly referenceable, compared by identity."""


def test_known_handles_keep_one_handle_per_name_and_resolve_an_answer_of_none_from_the_ask():
    known = KnownHandles()
    first = Handle()
    assert known.keep("renderer-1", first, known.snapshot()) is first
    snapshot = known.snapshot()
    assert snapshot == {"renderer-1": first}
    # The pool answered None ("you hold it"): the handle is the one the ask named.
    assert known.keep("renderer-1", None, snapshot) is first
    # A second copy of the same actor's handle does not replace the one the process holds.
    assert known.keep("renderer-1", Handle(), snapshot) is first
    # The answer's None is read from the ask's snapshot itself, not from what is kept by then.
    named = Handle()
    assert KnownHandles().keep("renderer-3", None, {"renderer-3": named}) is named
    # A name the ask did not hold and an answer without a handle: nothing to resolve it from.
    assert known.keep("renderer-2", None, snapshot) is None
    assert "renderer-2" not in known.snapshot()


def test_known_handles_hold_a_handle_only_while_someone_else_does():
    known = KnownHandles()
    held = known.keep("env-server-1", Handle(), {})
    snapshot = known.snapshot()
    del held
    gc.collect()
    assert list(known.snapshot()) == ["env-server-1"]  # the in-flight ask's snapshot keeps it alive
    del snapshot
    gc.collect()
    assert known.snapshot() == {}  # nobody holds it: the process forgets it, the pool may let it go


def test_known_handles_pass_a_handle_that_cannot_be_weakly_held_through_unkept():
    known = KnownHandles()
    assert known.keep("double", "a-test-double", {}) == "a-test-double"
    assert known.snapshot() == {}
