"""Groups: `n` rollouts of one task, handled as one object (GRPO-style training consumes whole groups).

    handle = await plane.submit_group(request, n=8, stragglers=Stragglers(after_s=120, min_ok=6))
    handle.request_ids                      # assigned at once, before any member waits for its lane
    await handle.admitted()                 # optional back-pressure: every member holds a lane slot
    async for result in handle: ...         # members as they finish
    group = await handle                    # the complete group (also: `async for g in plane.groups()`)
    await handle.cancel()                   # every member still open answers `cancelled`

A group is complete when every member has answered; with a straggler rule, also once `after_s` has passed
since submission and at least `min_ok` members finished `ok`: the plane then cancels the rest (each still
answers, `cancelled`, with the turns it had). A complete group reaches the caller once: through its handle
if that was awaited first, otherwise through the lane's group stream (`plane.groups(lane)`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Coroutine, Generator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from rollout_actors.samples import OK_ONLY, TrainerSample, Use, trainer_samples
from rollout_actors.wire import Result

STRAGGLER = "Straggler"
"""`Failure.type` of a member cancelled by its group's straggler rule."""


@dataclass(frozen=True)
class Stragglers:
    """When a group stops waiting for its slowest members."""

    after_s: float
    """Seconds after the group was submitted."""
    min_ok: int
    """Members that must have finished `ok` by then (or, if fewer had, as soon as that many have)."""

    def __post_init__(self) -> None:
        if self.after_s < 0 or self.min_ok < 1:
            raise ValueError("Stragglers needs after_s >= 0 and min_ok >= 1")


@dataclass
class Group:
    """A complete group: one result per member, in member order."""

    group_id: str
    lane: str
    results: list[Result]
    submitted_at: float
    completed_at: float

    @property
    def ok(self) -> list[Result]:
        return [r for r in self.results if r.kind == "ok"]

    @property
    def rewards(self) -> list[float]:
        """Rewards of the `ok` members."""
        return [r.reward for r in self.ok if r.reward is not None]

    @property
    def policy_versions(self) -> list[int]:
        """The distinct start versions of the members that reached a policy, ascending."""
        return sorted({r.policy_version_start for r in self.results if r.policy_version_start is not None})

    def by_kind(self, kind: str) -> list[Result]:
        """The members whose result is of this kind (`env`, `infrastructure`, ...), in member order."""
        return [r for r in self.results if r.kind == kind]

    def samples(self, use: Mapping[str, Use] = OK_ONLY) -> list[TrainerSample]:
        """Trainer samples of the members (one per branch), in member order: by default of the `ok`
        ones only; `use` decides each kind (`{"ok": "train", "infrastructure": "mask"}`: see
        `trainer_samples`)."""
        return [sample for r in self.results for sample in trainer_samples(r, use)]


class GroupOwner(Protocol):
    """What a handle needs from the plane that owns it."""

    def cancel_members(self, request_ids: list[str], why: str, failure_type: str = ...) -> Awaitable[int]: ...

    def spawn(self, work: Coroutine[Any, Any, Any]) -> None:
        """Run `work` as a task the plane owns (waited for or cancelled in its `close`)."""

    def claim(self, handle: GroupHandle) -> None:
        """The handle delivered its group: take it off the lane's group stream."""


class GroupHandle:
    """A group in flight; returned by `RolloutPlane.submit_group` before any member waits for its lane."""

    def __init__(
        self,
        owner: GroupOwner,
        group_id: str,
        lane: str,
        request_ids: list[str],
        stragglers: Stragglers | None = None,
        one_policy: bool = False,
    ) -> None:
        self.group_id = group_id
        self.lane = lane
        self.request_ids = tuple(request_ids)
        self.stragglers = stragglers
        self.one_policy = one_policy
        """Every member samples from one policy version: the one active when the first was admitted."""
        self.pinned_version: int | None = None
        self.submitted_at = time.time()
        self._owner = owner
        self._results: dict[str, Result] = {}
        self._arrived: list[Result] = []
        self._progress = asyncio.Event()
        self._complete = asyncio.Event()
        self._admitted = asyncio.Event()
        self._admitted_count = 0
        self._deadline_passed = False
        self._group: Group | None = None
        self._timer = (
            asyncio.get_running_loop().call_later(stragglers.after_s, self._on_deadline)
            if stragglers is not None
            else None
        )

    def __len__(self) -> int:
        return len(self.request_ids)

    # waiting ---------------------------------------------------------------------------------------
    def done(self) -> bool:
        return self._complete.is_set()

    @property
    def results(self) -> list[Result]:
        """Members answered so far, in the order they finished."""
        return list(self._arrived)

    async def admitted(self) -> None:
        """Wait until every member has passed its lane (or answered without needing it)."""
        await self._admitted.wait()

    async def wait(self, timeout: float | None = None) -> Group:
        """The complete group. Claims it: it will not also come out of `plane.groups()`."""
        await asyncio.wait_for(self._complete.wait(), timeout)
        assert self._group is not None
        self._owner.claim(self)
        return self._group

    def __await__(self) -> Generator[Any, None, Group]:
        return self.wait().__await__()

    async def __aiter__(self) -> AsyncIterator[Result]:
        """Members as they finish, until the last one."""
        seen = 0
        while True:
            while seen < len(self._arrived):
                seen += 1
                yield self._arrived[seen - 1]
            if self.done():
                return
            self._progress.clear()
            await self._progress.wait()

    async def cancel(self) -> int:
        """Cancel every member that has not answered; returns how many. Each still answers `cancelled`."""
        return await self._owner.cancel_members(self._open(), "its group was cancelled")

    # fed by the plane ------------------------------------------------------------------------------
    def _member_admitted(self) -> None:
        self._admitted_count += 1
        if self._admitted_count >= len(self.request_ids):
            self._admitted.set()

    def _answer(self, result: Result) -> Group | None:
        """A member's result. Returns the group when this completed it."""
        if result.request_id in self._results or self.done():
            return None
        self._results[result.request_id] = result
        self._arrived.append(result)
        self._progress.set()
        if len(self._results) == len(self.request_ids):
            return self._finish()
        if self._deadline_passed:
            self._cut_stragglers()
        return None

    def _finish(self) -> Group:
        if self._timer is not None:
            self._timer.cancel()
        self._admitted.set()  # nothing is left to wait for a lane
        self._group = Group(
            group_id=self.group_id,
            lane=self.lane,
            results=[self._results[rid] for rid in self.request_ids],
            submitted_at=self.submitted_at,
            completed_at=time.time(),
        )
        self._complete.set()
        self._progress.set()
        return self._group

    def _open(self) -> list[str]:
        return [rid for rid in self.request_ids if rid not in self._results]

    def _on_deadline(self) -> None:
        self._deadline_passed = True
        self._cut_stragglers()

    def _cut_stragglers(self) -> None:
        assert self.stragglers is not None
        ok = sum(1 for r in self._arrived if r.kind == "ok")
        if ok >= self.stragglers.min_ok and self._open():
            why = f"straggler: {ok} of {len(self)} members were ok {self.stragglers.after_s:g} s after submission"
            self._owner.spawn(self._owner.cancel_members(self._open(), why, STRAGGLER))
            self._deadline_passed = False  # asked once; the cancelled members now answer
