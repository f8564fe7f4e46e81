"""Coalesce this process's concurrent renderer-side calls, per event-loop tick: one `lease_many` for every
lease asked for in the tick, one `ready` call per renderer, one `release_many` per tick, and one
`call_many` per renderer for every start / parse / bridge asked of it in the tick.

Why: a rollout worker runs thousands of rollouts at once, and every Ray call costs about half a
millisecond of CPU on each side on a small machine, more than a parse or a bridge itself. Issued one by
one, 2,048 leases queue for seconds and the last rollout to ask waits several times longer than the
first; turns that finish together (a wave, or a busy loop whose ticks hold many answers) pay the hop
once per tick instead of once per rollout. A quiet loop sends batches of one: no call waits for company.

Ownership: one `BatchedCalls` per event loop owns its flush tasks; each is bounded, and each waiter bounds
its own wait with its deadline. A waiter that gives up before its lease arrives cancels its future; the
flush sees that and returns the lease to the pool, so nothing leaks. A render call whose waiter gave up
still runs (it is short and stateless); its answer is dropped.
"""

from __future__ import annotations

import asyncio
import weakref
from typing import Any

from rollout_actors.kernel import Failure, process_owner

BATCH_CALL_TIMEOUT_S = 60.0  # one pool call for many waiters: each waiter's own deadline is usually shorter
READY_CALL_TIMEOUT_S = 600.0  # tokenizer loads can be slow (hub downloads); the pool's own bound is 300 s
MAX_READY_ENTRIES = 1024  # renderers this process has waited on; finished entries are pruned past this
CALL_SLACK_S = 5.0  # a `call_many` waits for its slowest waiter's deadline plus this, then gives up


class RenderCallFailed(Exception):
    """A call inside a batch failed on the renderer; the batch and the renderer are fine."""

    def __init__(self, failure: Failure, rejected: bool) -> None:
        super().__init__(f"{failure.type}: {failure.message}")
        self.failure = failure
        self.rejected = rejected


def _pool_id(pool: Any) -> Any:
    actor_id = getattr(pool, "_actor_id", None)  # stable across handle copies of the same actor
    return actor_id.hex() if actor_id is not None else id(pool)


class BatchedCalls:
    """Per-event-loop coalescer. Get it with `batched_calls()`."""

    def __init__(self) -> None:
        self._leases: dict[tuple[Any, str, int], tuple[Any, list[asyncio.Future[Any]]]] = {}
        self._releases: dict[Any, tuple[Any, list[str], asyncio.Future[Any]]] = {}
        self._ready: dict[str, asyncio.Task[Any]] = {}
        self._calls: dict[str, tuple[Any, list[tuple[str, tuple[Any, ...]]], list[asyncio.Future[Any]]]] = {}
        self._call_deadline: dict[str, float] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def call(
        self, renderer_id: str, handle: Any, method: str, args: tuple[Any, ...], timeout: float
    ) -> Any:
        """`handle.<method>(*args)`, sent in one `call_many` with every call asked of this renderer in this
        tick. Raises what the whole batch raised (`RayActorError`: the renderer died), `RenderCallFailed`
        for this call alone, or `TimeoutError` past `timeout`."""
        loop = asyncio.get_running_loop()
        batch = self._calls.get(renderer_id)
        if batch is None:
            batch = self._calls[renderer_id] = (handle, [], [])
            self._call_deadline[renderer_id] = 0.0
            self._own(self._flush_calls(renderer_id))
        waiter = loop.create_future()
        batch[1].append((method, args))
        batch[2].append(waiter)
        self._call_deadline[renderer_id] = max(self._call_deadline[renderer_id], loop.time() + timeout)
        # A timeout cancels the waiter, which tells the flush to drop its answer.
        async with asyncio.timeout(timeout):
            return await waiter

    async def _flush_calls(self, renderer_id: str) -> None:
        await asyncio.sleep(0)  # every call asked of this renderer in this tick joins the batch
        handle, calls, waiters = self._calls.pop(renderer_id)
        wait_s = self._call_deadline.pop(renderer_id) - asyncio.get_running_loop().time() + CALL_SLACK_S
        try:
            outcomes = await asyncio.wait_for(handle.call_many.remote(calls), max(wait_s, CALL_SLACK_S))
        except BaseException as exc:
            _fail_all(waiters, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        for waiter, outcome in zip(waiters, outcomes, strict=True):
            if waiter.done():  # its owner gave up (timeout, cancellation): the answer is dropped
                continue
            if outcome.failure is None:
                waiter.set_result(outcome.value)
            else:
                waiter.set_exception(RenderCallFailed(outcome.failure, outcome.rejected))

    async def lease(self, pool: Any, key_json: str, multiplex: int, timeout: float) -> dict[str, Any]:
        """One lease, from a `lease_many` shared with every other lease asked for in this tick."""
        batch_key = (_pool_id(pool), key_json, multiplex)
        batch = self._leases.get(batch_key)
        if batch is None:
            batch = self._leases[batch_key] = (pool, [])
            self._own(self._flush_leases(batch_key))
        waiter = asyncio.get_running_loop().create_future()
        batch[1].append(waiter)
        # Not shielded: a timeout cancels the waiter, which tells the flush to hand its lease back.
        async with asyncio.timeout(timeout):
            return await waiter

    async def _flush_leases(self, batch_key: tuple[Any, str, int]) -> None:
        await asyncio.sleep(0)  # every lease asked for in this tick joins the batch
        pool, waiters = self._leases.pop(batch_key)
        _, key_json, multiplex = batch_key
        try:
            leases = await asyncio.wait_for(
                pool.lease_many.remote(key_json, multiplex, len(waiters), process_owner()),
                BATCH_CALL_TIMEOUT_S,
            )
        except BaseException as exc:
            _fail_all(waiters, exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        unclaimed = []
        for waiter, lease in zip(waiters, leases, strict=True):
            if waiter.done():  # its owner gave up (timeout, cancellation) meanwhile
                unclaimed.append(lease["lease_id"])
            else:
                waiter.set_result(lease)
        if unclaimed:
            try:
                await asyncio.wait_for(pool.release_many.remote(unclaimed), BATCH_CALL_TIMEOUT_S)
            except Exception:
                pass  # the pool expires leases nobody releases (`max_lease_s`)

    async def ready(self, renderer_id: str, handle: Any, timeout: float) -> Any:
        """The renderer's `ready` answer; one remote call per renderer, shared by every session here."""
        task = self._ready.get(renderer_id)
        if task is None:
            if len(self._ready) >= MAX_READY_ENTRIES:
                self._ready = {k: t for k, t in self._ready.items() if not t.done()}
            task = self._ready[renderer_id] = self._own(self._ready_call(renderer_id, handle))
        # Shielded: one session's deadline must not cancel the answer others wait on.
        return await asyncio.wait_for(asyncio.shield(task), timeout)

    async def _ready_call(self, renderer_id: str, handle: Any) -> Any:
        try:
            return await asyncio.wait_for(handle.ready.remote(), READY_CALL_TIMEOUT_S)
        except BaseException:
            self._ready.pop(renderer_id, None)  # failures are not cached: the next session asks afresh
            raise

    async def release(self, pool: Any, lease_id: str, timeout: float) -> None:
        """Return a lease, in one `release_many` with every release asked for in this tick."""
        pool_id = _pool_id(pool)
        batch = self._releases.get(pool_id)
        if batch is None:
            done = asyncio.get_running_loop().create_future()
            batch = self._releases[pool_id] = (pool, [], done)
            self._own(self._flush_releases(pool_id))
        batch[1].append(lease_id)
        await asyncio.wait_for(asyncio.shield(batch[2]), timeout)

    async def _flush_releases(self, pool_id: Any) -> None:
        await asyncio.sleep(0)
        pool, lease_ids, done = self._releases.pop(pool_id)
        try:
            await asyncio.wait_for(pool.release_many.remote(lease_ids), BATCH_CALL_TIMEOUT_S)
        except BaseException as exc:
            if not done.done():
                done.set_exception(exc)
                done.exception()  # retrieved here: a release nobody awaits must not log "never retrieved"
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        if not done.done():
            done.set_result(None)

    def _own(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _fail_all(waiters: list[asyncio.Future[Any]], exc: BaseException) -> None:
    """The batch call failed as a whole (the actor died, the call timed out): every waiter still waiting
    gets that failure."""
    for waiter in waiters:
        if not waiter.done():
            waiter.set_exception(exc)


_PER_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, BatchedCalls] = weakref.WeakKeyDictionary()


def batched_calls() -> BatchedCalls:
    """This event loop's coalescer (futures belong to one loop, so each loop gets its own)."""
    loop = asyncio.get_running_loop()
    calls = _PER_LOOP.get(loop)
    if calls is None:
        calls = _PER_LOOP[loop] = BatchedCalls()
    return calls
