"""Polling under a deadline, for tests: a condition that is never reached fails instead of hanging."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


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
