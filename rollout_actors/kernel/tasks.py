"""Owned background tasks (Trio's rule: every task has an owner that waits for it or cancels it; none dies
silently), and the few future and actor helpers every owner needs. Imports nothing else of the project."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

CLOSE_GRACE_S = 2.0  # for cancelled tasks to unwind
RESTART_PAUSE_S = 0.5  # before a kept loop that died is started again: a bug must not spin the loop


class TaskOwner:
    """Owns background tasks (Trio's rule): each is waited for or cancelled by `close`. A task that dies
    of an exception is never silent: it is logged with its traceback and `on_death` is told (an owner
    that cannot go on without it goes down); a `keep` loop is restarted instead."""

    def __init__(self, name: str, on_death: Callable[[str, BaseException], None] | None = None) -> None:
        self.name = name
        self.closed = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._on_death = on_death

    def own(self, coro: Coroutine[Any, Any, Any], name: str = "task") -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}: {name}")
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def keep(self, loop: Callable[[], Coroutine[Any, Any, Any]], name: str) -> None:
        """Run `loop()` until it returns or `close`; started again (loudly) whenever it dies."""

        async def kept() -> None:
            while not self.closed:
                try:
                    return await loop()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    log.exception("%s: background loop %r died; restarting it", self.name, name)
                    await asyncio.sleep(RESTART_PAUSE_S)

        self.own(kept(), name)

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or (exc := task.exception()) is None:
            return
        log.error("%s: task %s died", self.name, task.get_name(), exc_info=exc)
        if self._on_death is not None and not self.closed:
            self._on_death(task.get_name(), exc)

    async def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """Cancel every task (but the caller's own) and wait up to `grace_s` for them to unwind."""
        self.closed = True
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=grace_s)


async def resolve(ref: Any) -> Any:
    """Await an ObjectRef inside a task (so it can sit in `asyncio.wait` next to other futures). Here, not
    beside a server, so a client (an env session on a rollout worker) awaits one without importing it."""
    return await ref


def retrieve_exception(future: asyncio.Future[Any]) -> None:
    """A future that failed with nobody waiting must not log 'exception was never retrieved'."""
    if not future.cancelled():
        future.exception()


def holds_value(future: asyncio.Future[Any]) -> bool:
    """`future` already holds a value (not pending, cancelled or failed)."""
    return future.done() and not future.cancelled() and future.exception() is None


def kill_actor(handle: Any) -> None:
    """Kill a Ray actor for good; best effort by nature (it may be gone already)."""
    import ray  # Ray is the engine, not the kernel's dependency

    if handle is None or not ray.is_initialized():  # no actor without Ray; `ray.kill` would start one
        return
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already gone
        pass
