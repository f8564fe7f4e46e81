"""`SharedDeadline`: one timer for many calls that end at the same moment.

An `EnvServer` batch (`call_many`) carries a tick's worth of calls, most with the same deadline; each still
runs in its own `asyncio.timeout` scope (so a deadline ends exactly its call, and the environment's own
`TimeoutError` stays its own), but the scopes hold no timer each::

    deadline = SharedDeadline(loop, loop.time() + timeout_s)
    deadline.join()                      # once per call, before it starts
    ...                                  # in the call:
    scope = asyncio.timeout(None)
    try:
        async with scope:
            deadline.enter(scope)
            await work
    finally:
        deadline.leave(scope)
"""

from __future__ import annotations

import asyncio


class SharedDeadline:
    """One timer for the calls of a batch that share a deadline, in place of one timer each. Each call runs
    in an `asyncio.timeout` scope with no timer of its own; when the shared one fires, every scope still
    open is rescheduled to the deadline, so it expires exactly as its own timer would have made it."""

    __slots__ = ("_when", "_open", "_members", "_timer", "_fired")

    def __init__(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._when = when
        self._open: set[asyncio.Timeout] = set()
        self._members = 0
        """Calls that joined and have not ended; the timer is cancelled once none is left. A call
        cancelled before it started never ends here: the timer then fires over nothing."""
        self._fired = False
        self._timer = loop.call_at(when, self._expire)

    def join(self) -> None:
        self._members += 1

    def enter(self, scope: asyncio.Timeout) -> None:
        self._open.add(scope)
        if self._fired:  # it started past its deadline (a loop stalled that long): it expires at once
            scope.reschedule(self._when)

    def leave(self, scope: asyncio.Timeout) -> None:
        self._open.discard(scope)
        self._members -= 1
        if not self._members:
            self._timer.cancel()

    def _expire(self) -> None:
        self._fired = True
        for scope in self._open:
            scope.reschedule(self._when)
