"""Where an env server runs environment code: `EnvLoop`, an event loop in a thread of its own, apart from
the loops Ray delivers the server's calls on; and `run_env_code`, one environment method on it.

Why a loop of its own: Ray answers an async actor call only after the call's coroutine has returned *and*
its loop has run the task's completion callback. Environment code that blocks the loop in between (a
synchronous call where an await belonged, in a call that was ready in the same iteration) leaves Ray's
executor thread waiting for that callback for good, and from then on the process answers no probe either
(Ray 2.60; seen as a server silent for its whole wedge). A silent server names no culprit, so its wedge
spends the pool's restart budget (`supervisor.py`: blame). With environment code here, a blocked loop
only holds back the answers of the calls on it: Ray's loops keep turning, and probes name the call.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from env_actors.env_calls import in_thread

try:
    from uvloop import new_event_loop  # as Ray's own loops, where it is installed
except ImportError:  # pragma: no cover - platforms without uvloop
    from asyncio import new_event_loop

T = TypeVar("T")


class EnvLoop:
    """loop = EnvLoop()
    loop.start()                      # once, on the actor's start: the thread and its loop
    answer = await loop.run(work())   # from any other loop; `work` runs on this one

    Not started (an `EnvServer` used in process, as in tests), `run` awaits the work where it is."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self) -> None:
        if self._loop is None:
            self._loop = new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="env-loop", daemon=True).start()

    async def run(self, work: Coroutine[Any, Any, T]) -> T:
        if self._loop is None:
            return await work
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(work, self._loop))


async def run_env_code(method: Callable[..., Any], *args: Any) -> Any:
    """Call one environment method: a coroutine function on this loop, a plain function in a thread, so
    synchronous environment code (a CPU-bound reward) leaves the loop turning and the server answering.
    A thread cannot be stopped: past its deadline the call is answered as failed and the thread runs on,
    tagged with its call (`env_calls`), so a thread stuck for good wedges the server, named."""
    if inspect.iscoroutinefunction(method):
        return await method(*args)
    value = await asyncio.to_thread(in_thread, method, *args)
    return await value if inspect.isawaitable(value) else value
