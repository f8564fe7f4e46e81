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

Load alone never trips it: a call counts only while its own code executes (its frame is on a thread's
stack: one waiting for a free thread, or for a loop another call blocks, is not executing), and only for
the time past the later of its deadline and its start.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Coroutine
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CallTag:
    """The session call environment code runs for, and its deadline (`time.monotonic()`)."""

    session_id: str
    deadline: float


CALL: ContextVar[CallTag | None] = ContextVar("env_call", default=None)
"""The session call the running code serves: set by the server around each call, read where the call's
code leaves the env loop (a thread copies it; a framework loop is handed it by `on_loop`)."""


def in_thread(method: Callable[..., T], *args: Any) -> T:
    """Run `method(*args)` here (a worker thread), tagged with the call it serves while it executes."""
    _tag, _started = CALL.get(), time.monotonic()  # read from this frame by `stuck_call`
    return method(*args)


def on_loop(coro: Coroutine[Any, Any, T]) -> Coroutine[Any, Any, T]:
    """`coro` tagged with the call the caller serves (read here, in the caller's context), to be run on
    another loop (an adapter's `FrameworkLoop`)."""
    return _tagged(CALL.get(), coro)


async def _tagged(_tag: CallTag | None, coro: Coroutine[Any, Any, T]) -> T:
    _started = time.monotonic()  # this frame is on its loop thread's stack only while `coro` executes
    return await coro


_TAGGED_CODES = frozenset({in_thread.__code__, _tagged.__code__})


def stuck_call(now: float | None = None) -> tuple[str, float] | None:
    """(session, seconds) of the call whose environment code has executed longest past its deadline (and
    past its start: a call that waited for its thread is not held to a deadline that passed meanwhile),
    on any thread but this one; None when no executing code is past its deadline."""
    now = time.monotonic() if now is None else now
    worst: tuple[str, float] | None = None
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        if ident == me:
            continue
        while frame is not None and frame.f_code not in _TAGGED_CODES:
            frame = frame.f_back
        if frame is None:
            continue
        local = frame.f_locals
        tag, started = local.get("_tag"), local.get("_started")
        if not isinstance(tag, CallTag) or not isinstance(started, float):
            continue
        over = now - max(tag.deadline, started)
        if over > 0 and (worst is None or over > worst[1]):
            worst = (tag.session_id, over)
    return worst
