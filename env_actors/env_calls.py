"""Environment code running off the env loop, and which session's call is stuck in it past its deadline.

    token = CALL.set(CallTag(session_id, deadline))  # the server, around one session call (`_guard`)
    await asyncio.to_thread(in_thread, method, *args) # a plain method in a thread (`run_env_code`)
    await framework_loop.run(coro)                    # a framework's coroutine on its loop: `on_loop(coro)`
    stuck_call()                                      # from any other thread: (session, seconds stuck)

Why: a call past its deadline is answered `EnvDeadline` at once, but a thread cannot be stopped. Code that
blocks one (a `time.sleep` in a verifiers tool, a hung skyrl-gym step) holds it for good, and with it
every later call that needs it (an adapter's one framework loop, shared by every session; the default
thread pool's few threads), while the env loop keeps turning and the server answers its probes. So the
server reports such a call as a stall naming its session (`EnvServer.health`), and the supervisor judges
the server wedged at the call's deadline + `hang_timeout_s`, with that session as its culprit.

Load alone never trips it: a call counts only while its own code executes (a thread running its method;
the task its framework loop is running: one waiting for a free thread, or for a loop another call blocks,
is not executing), and only for the time past the later of its deadline and its start. What executes is
recorded where it starts and ends, never read off a stack.

A whole episode (`CallTag.whole_episode`: `serve_run`, verifiers' own episode code) is the exception on a
framework loop: its deadline is the episode's (an hour), which says nothing about how long one synchronous
stretch of it may hold the loop. It counts for as long as the loop it runs on has made no progress (the
`LoopWatch` rule, as for the env loop: a loop busy moving between coroutines is no stall), so an episode
that blocks verifiers' loop wedges its server at `hang_timeout_s`, named, not an hour later.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from rollout_actors.kernel.loop_watch import LoopWatch

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CallTag:
    """The session call environment code runs for, and its deadline (`time.monotonic()`)."""

    session_id: str
    deadline: float
    whole_episode: bool = False
    """A whole episode: on a framework loop it counts while that loop is stalled, not past its deadline."""


CALL: ContextVar[CallTag | None] = ContextVar("env_call", default=None)
"""The session call the running code serves: set by the server around each call, read where the call's
code leaves the env loop (a thread copies it; a framework loop is handed it by `on_loop`)."""


_IN_THREADS: dict[int, tuple[CallTag, float]] = {}
"""Worker threads executing a call's plain method now: thread id -> (its call, when it started)."""
_ON_LOOPS: dict[asyncio.Task[Any], tuple[CallTag, float]] = {}
"""Tasks on a framework loop serving a call: task -> (its call, when it started). A task counts only while
it is the one its loop is running (`asyncio.current_task(loop)`): one awaiting holds nothing."""


_WATCHED: dict[asyncio.AbstractEventLoop, LoopWatch] = {}
"""Framework loops -> how long each has gone without progress (`watch_loop`)."""


def watch_loop(loop: asyncio.AbstractEventLoop) -> None:
    """Watch a framework loop (running, on another thread, no task created yet) for stalls of the episodes
    it runs; and count the tasks a call's code starts there as the call's own (a framework scores, streams
    and calls tools in tasks of its own: the one blocking the loop is often not the call's first)."""
    watch = LoopWatch()
    loop.set_task_factory(_call_task)
    loop.call_soon_threadsafe(watch.bind)
    _WATCHED[loop] = watch


def _call_task(loop: asyncio.AbstractEventLoop, coro: Any, context: Any = None) -> asyncio.Task[Any]:
    """A framework loop's task factory: a task started in a call's context executes for that call."""
    task = asyncio.Task(coro, loop=loop, context=context)
    tag = CALL.get() if context is None else context.get(CALL)
    if tag is not None:
        _ON_LOOPS.setdefault(task, (tag, time.monotonic()))
        task.add_done_callback(_forget_task)
    return task


def _forget_task(task: asyncio.Task[Any]) -> None:
    _ON_LOOPS.pop(task, None)


def in_thread(method: Callable[..., T], *args: Any) -> T:
    """Run `method(*args)` here (a worker thread), tagged with the call it serves while it executes."""
    tag = CALL.get()
    if tag is None:
        return method(*args)
    me = threading.get_ident()
    _IN_THREADS[me] = (tag, time.monotonic())
    try:
        return method(*args)
    finally:
        _IN_THREADS.pop(me, None)


def on_loop(coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """`coro` tagged with the call the caller serves (read here, in the caller's context), to be run on
    another loop (an adapter's `FrameworkLoop`) as a task of its own."""
    return _tagged(CALL.get(), coro)


async def _tagged(tag: CallTag | None, coro: Coroutine[Any, Any, T]) -> T:
    task = asyncio.current_task()
    if tag is None or task is None:
        return await coro
    _ON_LOOPS[task] = (tag, time.monotonic())
    try:
        return await coro
    finally:
        _ON_LOOPS.pop(task, None)


def stuck_call(now: float | None = None) -> tuple[str, float] | None:
    """(session, seconds) of the call whose environment code has executed longest past its deadline (and
    past its start: a call that waited for its thread is not held to a deadline that passed meanwhile),
    or, for a whole episode, has held its framework loop without progress; on any thread but this one.
    None when no executing code is stuck."""
    now = time.monotonic() if now is None else now
    me = threading.get_ident()
    stuck = [
        (tag.session_id, now - max(tag.deadline, started))
        for ident, (tag, started) in dict(_IN_THREADS).items()
        if ident != me
    ]
    for task, (tag, started) in dict(_ON_LOOPS).items():
        loop = task.get_loop()
        if asyncio.current_task(loop) is not task:
            continue
        watch = _WATCHED.get(loop)
        if tag.whole_episode and watch is not None:
            watch.sample()
            stuck.append((tag.session_id, watch.stall_s()))
        else:
            stuck.append((tag.session_id, now - max(tag.deadline, started)))
    worst = max(stuck, key=lambda call: call[1], default=None)
    return worst if worst is not None and worst[1] > 0 else None
