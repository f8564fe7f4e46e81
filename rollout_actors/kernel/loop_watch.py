"""`LoopWatch`: how long an event loop has gone without progress, seen from another thread.

    watch = LoopWatch()
    watch.bind()            # on the watched loop: start its heartbeat (a task that ticks every 0.1 s)
    ...
    watch.sample()          # from any other thread, every ~0.1 s
    watch.stall_s()         # 0 while the loop makes progress; grows while it is blocked

Why not the heartbeat's lateness alone: a loop that starts a thousand rollouts in one iteration runs
that iteration for seconds on a loaded machine (measured: 6 s on two cores), and its heartbeat is late
by as much, although the loop is making progress all along. Load must not look like a wedge (docs/design.md
contract 5), so the stall counts only while the loop thread also stays in one Python frame: busy, it
moves from coroutine to coroutine between samples; blocked (a synchronous call, a tight loop inside one
function, a lock), it does not. A frozen process is no business of this class: nothing it sends arrives.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from types import FrameType

HEARTBEAT_S = 0.1  # resolution of the stall; far below any sane hang timeout


class LoopWatch:
    def __init__(self) -> None:
        self._thread: int | None = None
        self._last_beat = time.monotonic()
        self._frame: FrameType | None = None
        """The loop thread's innermost frame at the last sample. Held, so its identity cannot be reused."""
        self._moved = time.monotonic()
        """When a sample last found the loop thread in another frame than the one before."""
        self._heartbeat: asyncio.Task[None] | None = None

    def bind(self) -> None:
        """Watch the running loop (call on it, once; later calls are no-ops)."""
        if self._heartbeat is None:
            self._thread = threading.get_ident()
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            self._last_beat = time.monotonic()
            await asyncio.sleep(HEARTBEAT_S)

    def sample(self) -> None:
        """Look at where the loop thread is now (from another thread)."""
        frame = sys._current_frames().get(self._thread) if self._thread is not None else None
        if frame is not self._frame:
            self._frame = frame
            self._moved = time.monotonic()

    def stall_s(self) -> float:
        """Seconds the loop has gone without running its heartbeat and without leaving its frame."""
        now = time.monotonic()
        late = now - self._last_beat - HEARTBEAT_S
        stuck = now - self._moved
        return max(0.0, min(late, stuck))
