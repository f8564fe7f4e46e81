"""The sessions one `EnvServer` holds: one record per session (`HeldSession`), as the plane keeps one per
request (`plane.inflight.InFlight`).

    sessions = HeldSessions("pool.env0-1")
    sessions.call_started("s1", task)      # around each session call (`EnvServer._guard`)
    sessions.open("s1", state, now)        # its reset answered
    sessions.holding(task)                 # "s1": the session whose call the env loop is running
    sessions.call_ended("s1", task, now)   # the call answered: the session was used now

Invariants: a record exists while its session is open or has a call in flight, and only then; a session
closed before its reset arrived is remembered (`ENDED_MEMORY` ids), so that reset cannot open it. The
env loop alone writes; a probe (another thread) reads counts and `holding`, from copies.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollout_actors.kernel import CallerError

ENDED_MEMORY = 10_000  # ids of sessions closed before they started, oldest forgotten first


@dataclass(eq=False)
class HeldSession:
    """One session on this server, from its first call until it is closed and its last call answered."""

    state: Any = None
    """The environment's state for it (what its reset returned); None until then and once closed."""
    opened: bool = False
    """Its reset answered and it is not closed: its calls find `state`."""
    last_used: float = -math.inf
    """When its last call ended (`time.monotonic()`): the pool's reaper asks whether it is idle."""
    calls: set[asyncio.Task[Any]] = field(default_factory=set)
    """Its calls in flight, each a task on the env loop: a session in a call is never idle, and the one
    whose task the env loop is running when the loop stalls is what wedged the server (`Loss.culprit`)."""
    stoppable: set[asyncio.Task[Any]] = field(default_factory=set)
    """Its batched calls and its episode: what ending the session stops (a direct call runs to its end)."""


class HeldSessions:
    """Every `HeldSession` of one env server, by session id."""

    def __init__(self, server_name: str) -> None:
        self._server_name = server_name
        self._held: dict[str, HeldSession] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        """Sessions closed before their reset arrived (a cancelled open): their late reset is refused, so
        it cannot start a session nobody will close."""

    def _record(self, session_id: str) -> HeldSession:
        held = self._held.get(session_id)
        if held is None:
            held = self._held[session_id] = HeldSession()
        return held

    def _drop_if_done(self, session_id: str, held: HeldSession) -> None:
        if not held.opened and not held.calls and not held.stoppable:
            self._held.pop(session_id, None)

    # ------------------------------------------------------------------------------------- calls

    def call_started(self, session_id: str, task: asyncio.Task[Any]) -> None:
        self._record(session_id).calls.add(task)

    def call_ended(self, session_id: str, task: asyncio.Task[Any], now: float) -> None:
        held = self._held.get(session_id)
        if held is None:
            return
        held.calls.discard(task)
        if held.opened:
            held.last_used = now
        self._drop_if_done(session_id, held)

    def stop_with_session(self, session_id: str, task: asyncio.Task[Any]) -> None:
        """`task` (a batched call, an episode) is cancelled when the session is ended, until it is done."""
        held = self._record(session_id)
        held.stoppable.add(task)

        def done(_: asyncio.Task[Any]) -> None:
            held.stoppable.discard(task)
            self._drop_if_done(session_id, held)

        task.add_done_callback(done)

    def stop_calls(self, session_id: str) -> None:
        """Cancel the session's stoppable calls (its step or score still running stops here)."""
        held = self._held.get(session_id)
        for task in list(held.stoppable) if held is not None else ():
            task.cancel()

    # ------------------------------------------------------------------------------------ state

    def open(self, session_id: str, state: Any, now: float) -> None:
        held = self._record(session_id)
        held.state, held.opened, held.last_used = state, True, now

    def refuse_reset(self, session_id: str) -> None:
        """`CallerError` when `session_id` cannot be opened: it is open, or was closed before it started."""
        held = self._held.get(session_id)
        if held is not None and held.opened:
            raise CallerError(f"session {session_id!r} already exists")
        if session_id in self._ended:
            raise CallerError(f"session {session_id!r} was closed before it started")

    def state(self, session_id: str) -> Any:
        held = self._held.get(session_id)
        if held is None or not held.opened:
            raise CallerError(
                f"no session {session_id!r} on env server {self._server_name} (closed or never started)"
            )
        return held.state

    def close(self, session_id: str) -> tuple[bool, Any]:
        """(was open, its state). Idempotent: closing an unknown session only remembers it as ended, so a
        reset still on its way (the opener was cancelled) does not start it afterwards."""
        held = self._held.get(session_id)
        if held is None or not held.opened:
            self._ended[session_id] = None
            while len(self._ended) > ENDED_MEMORY:
                self._ended.popitem(last=False)
            return False, None
        state, held.state, held.opened = held.state, None, False
        self._drop_if_done(session_id, held)
        return True, state

    # ---------------------------------------------------------------------------------- reading

    def idle(self, session_ids: list[str], cutoff: float) -> list[str]:
        """Those with no call in flight and none ended after `cutoff`; unknown ids count as idle."""
        held = self._held
        return [
            sid
            for sid in session_ids
            if (h := held.get(sid)) is None or (not h.calls and h.last_used < cutoff)
        ]

    def open_count(self) -> int:
        return sum(1 for held in list(self._held.values()) if held.opened)

    def calls_in_flight(self) -> int:
        return sum(len(held.calls) for held in list(self._held.values()))

    def holding(self, task: asyncio.Task[Any] | None) -> str | None:
        """The session `task` (the one the env loop is running) is a call of, or None."""
        if task is None:
            return None
        for session_id, held in list(self._held.items()):
            if task in held.calls:
                return session_id
        return None
