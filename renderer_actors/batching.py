"""Coalesce this process's concurrent renderer-side calls, per event-loop tick: one `acquire_many` for every
slot asked for in the tick, one `ready` call per renderer, one `release_many` per tick, and one
`call_many` per renderer for every start / parse / bridge asked of it in the tick.

Why: a rollout worker runs thousands of rollouts at once, and every Ray call costs about half a
millisecond of CPU on each side on a small machine, more than a parse or a bridge itself. Issued one by
one, 2,048 slot requests queue for seconds and the last rollout to ask waits several times longer than the
first; turns that finish together (a wave, or a busy loop whose ticks hold many answers) pay the hop
once per tick instead of once per rollout. A quiet loop sends batches of one: no call waits for company.

Ownership: one `BatchedCalls` per event loop owns its flushes (the kernel's `TickCoalescer`, the same
skeleton the env sessions' direct calls use): the hot `call_many` is answered by a loop callback
(`answer_when`), the pool calls by tasks it owns; each is bounded, and each waiter bounds its own wait
with its deadline. A waiter that gives up before its slot arrives cancels its future; the
flush sees that and returns the slot to the pool, so nothing leaks. A render call whose waiter gave up
still runs (it is short and stateless); its answer is dropped.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace
from typing import Any

from renderer_actors.calls import RendererSlot
from rollout_actors.kernel import Failure, process_owner
from rollout_actors.kernel.coalescer import (
    KnownHandles,
    TickBatch,
    TickCoalescer,
    actor_key,
    answer_when,
    per_loop,
)
from rollout_actors.kernel.tasks import holds_value

BATCH_CALL_TIMEOUT_S = 60.0  # one pool call for many waiters: each waiter's own deadline is usually shorter
READY_CALL_TIMEOUT_S = 600.0  # tokenizer loads can be slow (hub downloads); the pool's own bound is 300 s
MAX_READY_ENTRIES = 1024  # renderers this process has waited on; finished entries are pruned past this
CALL_SLACK_S = 5.0  # a `call_many` waits for its slowest waiter's deadline plus this, then gives up

RENDERERS = KnownHandles()
"""renderer id -> the handle this process's sessions share (ids name one incarnation: `new_id`). Slots on
a renderer held here arrive without a handle; before, thousands of sessions waiting on their model calls
held thousands of copies of the same few handles, one per slot."""


class RenderCallFailed(Exception):
    """A call inside a batch failed on the renderer; the batch and the renderer are fine."""

    def __init__(self, failure: Failure, rejected: bool) -> None:
        super().__init__(f"{failure.type}: {failure.message}")
        self.failure = failure
        self.rejected = rejected


class BatchedCalls:
    """Per-event-loop coalescer of renderer-side calls, on the kernel's `TickCoalescer`. Get it with
    `batched_calls()`."""

    def __init__(self) -> None:
        self._ticks = TickCoalescer()
        self._ready: dict[str, asyncio.Task[Any]] = {}

    async def call(
        self, renderer_id: str, handle: Any, method: str, args: tuple[Any, ...], timeout: float
    ) -> Any:
        """`handle.<method>(*args)`, sent in one `call_many` with every call asked of this renderer in this
        tick. Raises what the whole batch raised (`RayActorError`: the renderer died), `RenderCallFailed`
        for this call alone, or `TimeoutError` past `timeout`."""
        deadline = asyncio.get_running_loop().time() + timeout
        waiter = self._ticks.add(("call", renderer_id), handle, (method, args), _send_calls, deadline)
        # A timeout cancels the waiter, which tells the flush to drop its answer.
        async with asyncio.timeout(timeout):
            return await waiter

    async def acquire(self, pool: Any, key_json: str, multiplex: int, timeout: float) -> RendererSlot:
        """One slot, from an `acquire_many` shared with every other slot asked for in this tick."""
        key = ("acquire", actor_key(pool), key_json, multiplex)
        waiter = self._ticks.add(key, pool, None, functools.partial(_send_acquires, key_json, multiplex))
        # Not shielded: a timeout cancels the waiter, which tells the flush to hand its slot back.
        async with asyncio.timeout(timeout):
            return await waiter

    async def ready(self, renderer_id: str, handle: Any, timeout: float) -> Any:
        """The renderer's `ready` answer; one remote call per renderer, shared by every session here."""
        task = self._ready.get(renderer_id)
        if task is None:
            if len(self._ready) >= MAX_READY_ENTRIES:
                self._ready = {k: t for k, t in self._ready.items() if not t.done()}
            task = self._ready[renderer_id] = self._ticks.own(self._ready_call(renderer_id, handle))
        elif holds_value(task):  # every session but the renderer's first few here: no timer, no future
            return task.result()
        # Shielded: one session's deadline must not cancel the answer others wait on.
        return await asyncio.wait_for(asyncio.shield(task), timeout)

    async def _ready_call(self, renderer_id: str, handle: Any) -> Any:
        try:
            return await asyncio.wait_for(handle.ready.remote(), READY_CALL_TIMEOUT_S)
        except BaseException:
            self._ready.pop(renderer_id, None)  # failures are not cached: the next session asks afresh
            raise

    async def release(self, pool: Any, slot_id: str, timeout: float) -> None:
        """Return a slot, in one `release_many` with every release asked for in this tick."""
        waiter = self._ticks.add(("release", actor_key(pool)), pool, slot_id, _send_releases)
        async with asyncio.timeout(timeout):  # a scope, not `wait_for`: no task or extra future per slot
            await asyncio.shield(waiter)


def _send_calls(batch: TickBatch) -> None:
    # Answered by a callback (`answer_when`), not awaited in a task: each hand-off of a task costs an
    # event-loop cycle, seconds on a loaded worker, where a rollout's connection idles past its keep-alive
    # between turns (then the next model call reconnects).
    deadline = max(batch.deadline, asyncio.get_running_loop().time()) + CALL_SLACK_S
    answer_when(batch.target.call_many.remote(batch.items), deadline, batch, _deliver_calls)


def _deliver_calls(batch: TickBatch, outcomes: Any) -> None:
    if len(outcomes) != len(batch.waiters):  # nobody gets another call's answer: the whole batch failed
        raise ValueError(f"renderer answered {len(outcomes)} of {len(batch.waiters)} calls")
    for waiter, outcome in zip(batch.waiters, outcomes, strict=True):
        if waiter.done():  # its owner gave up (timeout, cancellation): the answer is dropped
            continue
        if outcome.failure is None:
            waiter.set_result(outcome.value)
        else:
            waiter.set_exception(RenderCallFailed(outcome.failure, outcome.rejected))


async def _send_acquires(key_json: str, multiplex: int, batch: TickBatch) -> None:
    pool, waiters = batch.target, batch.waiters
    known = RENDERERS.snapshot()  # slots on these renderers come without their handles
    slots = await asyncio.wait_for(
        pool.acquire_many.remote(key_json, multiplex, len(waiters), process_owner(), list(known)),
        BATCH_CALL_TIMEOUT_S,
    )
    unclaimed = []
    for waiter, slot in zip(waiters, slots, strict=True):
        if waiter.done():  # its owner gave up (timeout, cancellation) meanwhile
            unclaimed.append(slot.slot_id)
        else:
            waiter.set_result(replace(slot, renderer=RENDERERS.keep(slot.renderer_id, slot.renderer, known)))
    if unclaimed:
        try:
            await asyncio.wait_for(pool.release_many.remote(unclaimed), BATCH_CALL_TIMEOUT_S)
        except Exception:
            pass  # the pool expires slots nobody releases (`slot_timeout_s`)


async def _send_releases(batch: TickBatch) -> None:
    await asyncio.wait_for(batch.target.release_many.remote(batch.items), BATCH_CALL_TIMEOUT_S)
    for waiter in batch.waiters:
        if not waiter.done():
            waiter.set_result(None)


def batched_calls() -> BatchedCalls:
    """This event loop's coalescer (futures belong to one loop, so each loop gets its own)."""
    return per_loop(BatchedCalls)
