"""Where answered results go, per lane: each result reaches the caller exactly once, by one road.

- A group member's result goes to its `GroupHandle`; a complete group goes to its lane's group stream
  (`plane.groups(lane)`, `plane.next_group(lane)`) unless its handle was awaited first.
- Any other result (a single `submit`) goes to its lane's result stream (`plane.drain(lane)`,
  `plane.next_result(lane)`).

So train and eval come out separately without sorting by hand, and a consumer that only reads groups
holds no queue of loose results. With `lane=None` a reader takes whichever lane's item is oldest.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from typing import Generic, TypeVar

from rollout_actors.plane.groups import Group, GroupHandle
from rollout_actors.wire import Result

T = TypeVar("T")


class _Stream(Generic[T]):
    """Items per lane in arrival order, and how many more each lane still expects."""

    def __init__(self) -> None:
        self.items: defaultdict[str, deque[tuple[int, T]]] = defaultdict(deque)
        self.open: Counter[str] = Counter()

    def pending(self, lane: str | None) -> bool:
        """Something is queued or still expected (in `lane`, or anywhere)."""
        if lane is None:
            return any(self.items.values()) or any(n > 0 for n in self.open.values())
        return bool(self.items.get(lane)) or self.open[lane] > 0

    def pop(self, lane: str | None) -> T | None:
        if lane is not None:
            queue = self.items.get(lane)
            return queue.popleft()[1] if queue else None
        heads = [queue for queue in self.items.values() if queue]
        if not heads:
            return None
        return min(heads, key=lambda queue: queue[0][0]).popleft()[1]


class ResultStreams:
    def __init__(self) -> None:
        self._results: _Stream[Result] = _Stream()
        self._groups: _Stream[GroupHandle] = _Stream()
        self._members: dict[str, GroupHandle] = {}
        self._order = itertools.count()
        self._changed = asyncio.Event()
        """Pulsed (set, then replaced) whenever an item arrives."""

    # what is expected ------------------------------------------------------------------------------
    def expect_result(self, lane: str, count: int = 1) -> None:
        self._results.open[lane] += count

    def expect_group(self, handle: GroupHandle) -> None:
        self._groups.open[handle.lane] += 1
        for request_id in handle.request_ids:
            self._members[request_id] = handle

    def group_of(self, request_id: str) -> GroupHandle | None:
        return self._members.get(request_id)

    # delivery --------------------------------------------------------------------------------------
    def deliver(self, result: Result) -> None:
        handle = self._members.pop(result.request_id, None)
        if handle is None:
            self._results.open[result.lane] -= 1
            self._results.items[result.lane].append((next(self._order), result))
        elif handle._answer(result) is not None:  # the group is complete
            self._groups.open[handle.lane] -= 1
            self._groups.items[handle.lane].append((next(self._order), handle))
        self._pulse()

    def claim(self, handle: GroupHandle) -> None:
        queue = self._groups.items.get(handle.lane)
        if queue:
            for entry in queue:
                if entry[1] is handle:
                    queue.remove(entry)
                    break

    # reading ---------------------------------------------------------------------------------------
    async def next_result(self, lane: str | None, timeout: float | None) -> Result:
        return await self._next(lambda: self._results.pop(lane), timeout)

    async def next_group(self, lane: str | None, timeout: float | None) -> Group:
        handle = await self._next(lambda: self._groups.pop(lane), timeout)
        return await handle.wait()

    def results_pending(self, lane: str | None) -> bool:
        return self._results.pending(lane)

    def groups_pending(self, lane: str | None) -> bool:
        return self._groups.pending(lane)

    async def _next(self, pop: Callable[[], T | None], timeout: float | None) -> T:
        async with asyncio.timeout(timeout):
            while (item := pop()) is None:
                await self._changed.wait()
            return item

    def _pulse(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
