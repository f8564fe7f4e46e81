"""Deadlines for tests: a coroutine run under its global deadline, and polling under a deadline. A hang or a
condition that is never reached fails instead of waiting for pytest-timeout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


def run(coro: Awaitable[Any], deadline: float) -> Any:
    """Run `coro` on a fresh event loop under the test's global deadline (seconds), and return its value."""
    return asyncio.run(asyncio.wait_for(coro, deadline))


def runner(default_deadline: float) -> Callable[..., Any]:
    """`run` with a module's default deadline: `run = runner(DEADLINE_S)`, then `run(coro)` or
    `run(coro, 30)`."""

    def run_under(coro: Awaitable[Any], deadline: float = default_deadline) -> Any:
        return run(coro, deadline)

    return run_under


async def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> None:
    """Poll a plain predicate until it holds; `TimeoutError` at the deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(interval)


async def eventually(check: Callable[[], Awaitable[Any]], timeout: float, interval: float = 0.1) -> Any:
    """Poll an async check until it returns a truthy value, and return it; fail at the deadline."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)
