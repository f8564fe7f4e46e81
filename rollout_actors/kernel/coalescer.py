"""Per-event-loop coalescing: the calls one tick makes to one actor travel as one batch. Used by the
renderer calls and the env sessions' direct calls alike; imports nothing else of the project."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class TickBatch:
    """What the callers of one event-loop tick asked of one target: items in order, one waiter each."""

    target: Any
    """What the flush calls (an actor handle)."""
    items: list[Any] = field(default_factory=list)
    waiters: list[asyncio.Future[Any]] = field(default_factory=list)
    deadline: float = 0.0
    """The latest deadline any caller gave, a time on the loop's clock (`loop.time()`); 0: none given."""


class TickCoalescer:
    """Coalesce a process's concurrent calls per event-loop tick: every caller that asks the same key in
    one tick joins one batch, flushed once. A quiet loop flushes batches of one.

    Under load a batch also waits up to the process's batch window (`set_batch_window`) for company: a
    key whose last batch carried more than one call has concurrent callers, and every Ray call costs
    about 0.6 ms of CPU on each side on a small machine, far more than an item in it. A key whose
    calls come one at a time (one rollout, or a quiet loop) keeps flushing on the next tick: a window
    cannot batch a caller with itself.

        coalescer = per_loop(TickCoalescer)
        waiter = coalescer.add(("step", actor_key(server)), server, call, flush_steps)
        answer = await waiter

    `flush(batch)` runs as a loop callback when the batch leaves. It either answers the batch itself
    through callbacks (`answer_when`: the hot calls, whose round trip then costs no task and no event-loop
    hand-off beyond the caller's own wake-up) or returns a coroutine, which runs as a task this coalescer
    owns. If it raises, every waiter still waiting gets that exception. A waiter whose caller gave up is
    done (cancelled): the flush drops its answer. Futures belong to one loop, so each loop has its own
    (`per_loop`).
    """

    def __init__(self) -> None:
        self._open: dict[Any, TickBatch] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._company: dict[Any, bool] = {}
        """Key -> its last batch carried more than one call (so the next one may wait for company)."""

    def add(self, key: Any, target: Any, item: Any, flush: Any, deadline: float = 0.0) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = TickBatch(target)
            # Every caller of this tick joins the batch; under load, every caller of the window.
            if _window_s and self._company.get(key):
                loop.call_later(_window_s, self._flush, key, flush)
            else:
                loop.call_soon(self._flush, key, flush)
        waiter = loop.create_future()
        batch.items.append(item)
        batch.waiters.append(waiter)
        if deadline > batch.deadline:
            batch.deadline = deadline
        return waiter

    def _flush(self, key: Any, flush: Any) -> None:
        batch = self._open.pop(key)
        if len(self._company) >= MAX_KEYS and key not in self._company:
            self._company.clear()  # keys of actors long gone (replaced renderers); rebuilt in a batch
        self._company[key] = len(batch.items) > 1
        _count(flush, len(batch.items))
        try:
            sent = flush(batch)
        except Exception as exc:  # the target is gone: nothing was sent
            fail_all(batch.waiters, exc)
            return
        if sent is not None:  # a flush that awaits: a task this coalescer owns
            self.own(_awaited(batch, sent))

    def own(self, coro: Any) -> asyncio.Task[Any]:
        """Run `coro` as a task this coalescer holds until it ends (nothing fire-and-forget is lost)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _awaited(batch: TickBatch, sent: Any) -> None:
    try:
        await sent
    except BaseException as exc:  # the target died, or the batch outlived its deadline
        fail_all(batch.waiters, exc)
        if isinstance(exc, asyncio.CancelledError):
            raise


Deliver = Callable[[TickBatch, Any], None]


def answer_when(answer: Any, deadline: float, batch: TickBatch, deliver: Deliver) -> None:
    """Hand `batch` to `deliver(batch, value)` on the loop once `answer` (a Ray `ObjectRef`, or any
    awaitable) has its value; every waiter gets the exception instead if the call failed, if `deliver`
    raised, or at `deadline` (the loop's clock) if no answer came by then (`TimeoutError`, as an
    `asyncio.timeout` scope would raise). Exactly one of these happens, once.

    A callback, not a task awaiting the ref: a Ray answer arrives on Ray's own thread, and one loop
    callback from it answers the waiters. Awaiting it in a task costs two more event-loop hand-offs (the
    wrapped future, then the task's wake-up) per round trip, and on a loaded worker each hand-off waits a
    whole loop cycle: the idle gap between a rollout's model calls grows past its connection's keep-alive
    and the next call reconnects."""
    _Pending(asyncio.get_running_loop(), answer, deadline, batch, deliver)


class _Pending:
    """One batch's outstanding answer: settled once, by the answer or by the deadline's timer."""

    __slots__ = ("_loop", "_batch", "_deliver", "_timer", "_settled", "_awaiting")

    def __init__(self, loop: Any, answer: Any, deadline: float, batch: TickBatch, deliver: Deliver) -> None:
        self._loop, self._batch, self._deliver, self._settled = loop, batch, deliver, False
        self._timer = loop.call_at(deadline, self._expire)
        to_future = getattr(answer, "future", None)
        if callable(to_future):  # a Ray ObjectRef: a concurrent future, set on Ray's thread
            to_future().add_done_callback(self._from_thread)
        else:  # an awaitable on this loop (a coroutine in tests, an asyncio future); held until settled,
            # since the loop keeps only a weak reference to a task
            self._awaiting = asyncio.ensure_future(answer)
            self._awaiting.add_done_callback(self._settle)

    def _from_thread(self, future: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._settle, future)
        except RuntimeError:  # the loop is closed: nobody is left to answer
            pass

    def _settle(self, future: Any) -> None:
        if self._settled:  # the deadline came first: the late answer is dropped
            if not future.cancelled():
                future.exception()  # retrieved: a late failure logs nothing
            return
        self._settled = True
        self._timer.cancel()
        batch = self._batch
        try:
            value = future.result()
        except BaseException as exc:  # the call failed (a dead actor: `RayActorError`); or was cancelled
            fail_all(batch.waiters, exc)
            return
        try:
            self._deliver(batch, value)
        except Exception as exc:  # a malformed answer (a count that does not match): all of it failed
            fail_all(batch.waiters, exc)

    def _expire(self) -> None:
        if not self._settled:
            self._settled = True
            fail_all(self._batch.waiters, TimeoutError())


MAX_KEYS = 4096  # keys whose load is remembered: actors this process calls, a few kinds each
DEFAULT_BATCH_WINDOW_S = 0.01
_window_s = 0.0
"""This process's batch window: 0 (the tick) unless its owner sets one (`RolloutWorker` does)."""


def set_batch_window(seconds: float) -> None:
    """How long a batch of a loaded key waits for company, for every coalescer in this process."""
    global _window_s
    if not 0 <= seconds <= 1:
        raise ValueError(f"batch window must be in [0, 1] s, got {seconds}")
    _window_s = seconds


def batch_window() -> float:
    """This process's batch window (seconds)."""
    return _window_s


_SENT: dict[Any, list[int]] = {}
"""Batches this process sent, by flush function: [calls, items]. Read with `batch_counts`."""


def count_sent(flush: Any, items: int) -> None:
    """Count one remote call carrying `items` under `flush`'s name: for a call a flush sends beyond its
    batch (a follow-up `collect`), so `batch_counts` holds every call the coalescers caused."""
    _count(flush, items)


def _count(flush: Any, items: int) -> None:
    fn = getattr(flush, "func", flush)  # a functools.partial counts as its function
    sent = _SENT.get(fn)
    if sent is None:
        _SENT[fn] = [1, items]
    else:
        sent[0] += 1
        sent[1] += items


def batch_counts() -> dict[str, tuple[int, int]]:
    """(remote calls, items they carried) this process's coalescers sent, by flush function
    (`module.function`): items per call is how much batching saved (each Ray call costs far more than
    an item in it)."""
    return {
        f"{fn.__module__.rpartition('.')[2]}.{fn.__name__}": (calls, items)
        for fn, (calls, items) in _SENT.items()
    }


def fail_all(waiters: list[asyncio.Future[Any]], exc: BaseException) -> None:
    """A batch failed as a whole: every waiter still waiting gets that failure. It is marked retrieved, so
    a waiter nobody awaits any more (a notice, a caller past its deadline) logs nothing."""
    for waiter in waiters:
        if not waiter.done():
            waiter.set_exception(exc)
            waiter.exception()


_PER_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[Any, Any]] = weakref.WeakKeyDictionary()


def per_loop(factory: Any) -> Any:
    """The running loop's one instance of `factory` (built on first use, dropped with the loop)."""
    instances = _PER_LOOP.setdefault(asyncio.get_running_loop(), {})
    instance = instances.get(factory)
    if instance is None:
        instance = instances[factory] = factory()
    return instance


def actor_key(handle: Any) -> Any:
    """A key for an actor that is the same across copies of its handle."""
    to_hex = getattr(getattr(handle, "_actor_id", None), "hex", None)
    return to_hex() if callable(to_hex) else id(handle)


class KnownHandles:
    """The actor handles this process holds, by actor name, so a pool's batched answer need not carry a
    handle the caller already has (each handle in an answer is pickled on the pool's side and rebuilt on
    the caller's, with a descriptor and a method shell per actor method).

        snapshot = known.snapshot()                    # held until the answer is in
        answers = await pool.place_many.remote(..., list(snapshot))
        handle = known.keep(name, answer_handle, snapshot)   # None in an answer: "you have it"

    Weak: a handle lives only as long as someone in the process holds it, so no actor outlives its pool's
    wish to let it go because a cache here remembered it. Names must name one incarnation, never reused."""

    def __init__(self) -> None:
        self._handles: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()

    def snapshot(self) -> dict[str, Any]:
        """The handles held now, strongly: a batch keeps them alive until its answer has been read."""
        return dict(self._handles.items())

    def keep(self, name: str, handle: Any, snapshot: dict[str, Any]) -> Any:
        """The process's one handle for `name`: the one kept already, else `handle` (kept from now on). An
        answer's `handle` of None means the asker holds it: the one in `snapshot`, which the ask named."""
        if handle is None:
            handle = snapshot.get(name)
        try:
            return self._handles.setdefault(name, handle)
        except TypeError:  # not weakly referenceable (a test double): used as given, not kept
            return handle
