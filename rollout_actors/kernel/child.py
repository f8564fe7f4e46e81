"""A child actor as its supervisor sees it (`Child`), and what a kind declares of its children as data
(`ChildSpec`, Erlang/OTP's child spec): how one is started, how it says it is ready, how it shows life,
how it is stopped. The supervisor (`supervisor.py`) composes a spec with the behaviour that is the kind's
own (`ChildKind`); it imports nothing else of the project."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from rollout_actors.kernel.supervision import Health, Liveness, Supervision
from rollout_actors.kernel.tasks import retrieve_exception

RetireCause = Literal["died", "wedged", "spawn_failed", "shrunk", "shutdown"]


@dataclass(eq=False)
class Child:
    """One child actor as its supervisor sees it. Kinds subclass it for what their placement reads."""

    name: str
    handle: Any
    state: Literal["starting", "ready", "retired"] = "starting"
    linger: bool = False
    """Killed `ChildSpec.kill_linger_s` after it is retired, not at once (its load failed: whoever waits on
    it reads that failure from it meanwhile)."""
    life: Liveness = field(default_factory=lambda: Liveness(hang_timeout_s=float("inf")))
    born: float = field(default_factory=time.monotonic)
    up: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    """Resolved once ready, or failed with its spawn's typed failure."""
    gone: asyncio.Future[tuple[str, RetireCause]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    """Resolved with `(reason, cause)` at retirement: in-flight calls wait on it beside their answer."""

    def __post_init__(self) -> None:
        self.up.add_done_callback(retrieve_exception)


C = TypeVar("C", bound=Child)


class ChildExited(Exception):
    """What a spec's `read_probe` raises when an answer says the child is gone (its process exited): the
    child is retired as dead, with this message as the reason."""


def _no_args(_: Any) -> tuple[Any, ...]:
    return ()


@dataclass(frozen=True, kw_only=True)
class ChildSpec(Generic[C]):
    """What a kind's children are, as data (Erlang/OTP's child spec): how one is started, how it says it is
    ready, how it shows life, how it is stopped. Every `ChildKind` hook defaults to what this says."""

    kind: str
    """What the children are, for logs and gauges: `rollout worker`, `env server`, ..."""
    actor: Any = None
    """The Ray actor class (anything with `.options(**options).remote(*args)`); None when the kind's own
    `handshake` starts the actor (its `handle` is set there)."""
    options: Callable[[str], Mapping[str, Any]] = lambda name: {}
    """Each child's actor options, from its name (read at every spawn: options may change between spawns)."""
    args: Callable[[str], tuple[Any, ...]] = _no_args
    """Its constructor's arguments, from its name."""
    name: Callable[[int], str] = str
    """Its name, from the supervisor's spawn number (0, 1, ...)."""
    record: type[C] = Child  # type: ignore[assignment]
    """The record of one child the supervisor keeps (a kind's subclass of `Child`, for its placement)."""
    ready: str = "health"
    """The method that answers once the child loaded what it serves (its readiness handshake)."""
    read_ready: Callable[[C, Any], None] | None = None
    """What to read from that answer onto the child's record."""
    liveness: Literal["probe", "stream"] = "probe"
    """`probe`: a sign of life is an answer to `probe` every `probe_interval_s`; `stream`: `probe` is one
    long-lived streaming call whose items are signs of life (never queued behind the child's work)."""
    probe: str = "health"
    probe_args: Callable[[Supervision], tuple[Any, ...]] = _no_args
    read_probe: Callable[[C, Any], Health] | None = None
    """A sign of life from one answer (an item, for `stream`): a `Health`, or `ChildExited` raised when it
    says the child is gone. None: the answer is a `Health` (for `stream`: a loop stall in seconds)."""
    stop: str | None = None
    """The method that stops a child gracefully before it is killed (within `stop_timeout_s`), or None."""
    stop_only_at_close: bool = False
    """Stop gracefully only at `close`: a lost child is killed at once (what is left of it is not asked)."""
    stop_timeout_s: float = 10.0
    kill_linger_s: float = 0.0
    """How long a child marked `linger` (e.g. its load failed) lives on before it is killed, so those
    waiting on it read its own failure."""
    crash_loop_stops: bool = False
    """Stop spawning for good once more spawns failed in a row than the budget allows restarts (an
    environment that fails every load); otherwise spawns resume when the budget's window has room."""
