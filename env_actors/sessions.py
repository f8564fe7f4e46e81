"""`OpenSessions`: the pool's one record of the sessions it placed and has not seen end.

Every pool-side question about sessions reads it: placement and growth (how many an env server holds),
idle shrinking (a server holding none), the reaper (which have been quiet), a lost owner's sessions, a
retired server's. The `EnvServer` keeps each session's state, which only it can hold; what the pool knows of
sessions lives here and nowhere else, so no two records can disagree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class OpenSession:
    server: str
    """The env server it was placed on."""
    last_used: float
    """When the pool last heard of it (placement, or its env server saying it is busy); set through
    `OpenSessions.touch`, which keeps the order."""
    owner: str | None = None
    """The actor that opened it (a rollout worker); the pool ends it when that actor is lost."""


class OpenSessions:
    """Session id -> where it lives and who opened it, with a per-server index kept in step. The ids are
    kept in the order of `last_used` (a session is added, or touched, at the newest time), so the quiet
    ones are found at the front, without a scan of the rest (`quiet_since`)."""

    def __init__(self) -> None:
        self._by_id: dict[str, OpenSession] = {}
        self._by_server: dict[str, set[str]] = {}

    def add(self, session_id: str, server: str, now: float, owner: str | None = None) -> None:
        self._by_id[session_id] = OpenSession(server, now, owner)
        self._by_server.setdefault(server, set()).add(session_id)

    def pop(self, session_id: str) -> OpenSession | None:
        """Forget a session; None if it was not open."""
        session = self._by_id.pop(session_id, None)
        if session is not None:
            on_server = self._by_server[session.server]
            on_server.discard(session_id)
            if not on_server:
                del self._by_server[session.server]
        return session

    def touch(self, session_id: str, now: float) -> None:
        """The pool heard of the session at `now` (the monotonic clock, not earlier than any time given
        before): it moves to the back of the order."""
        session = self._by_id.pop(session_id)
        session.last_used = now
        self._by_id[session_id] = session

    def quiet_since(self, cutoff: float) -> list[tuple[str, OpenSession]]:
        """The sessions not heard of since `cutoff`, oldest first."""
        quiet = []
        for session_id, session in self._by_id.items():
            if session.last_used >= cutoff:
                break
            quiet.append((session_id, session))
        return quiet

    def drop_server(self, server: str) -> list[str]:
        """Forget every session on an env server that is gone; returns their ids."""
        session_ids = list(self._by_server.pop(server, ()))
        for session_id in session_ids:
            del self._by_id[session_id]
        return session_ids

    def get(self, session_id: str) -> OpenSession | None:
        return self._by_id.get(session_id)

    def on(self, server: str) -> int:
        """How many open sessions env server `server` holds."""
        return len(self._by_server.get(server, ()))

    def only_one_on(self, server: str) -> str | None:
        """The one session env server `server` holds; None when it holds none or several."""
        on_server = self._by_server.get(server, ())
        return next(iter(on_server)) if len(on_server) == 1 else None

    def owned_by(self, owner: str) -> list[str]:
        return [sid for sid, session in self._by_id.items() if session.owner == owner]

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)
