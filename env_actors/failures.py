"""The env side's failures: one class each, raised or answered where it happens.

Each is a kernel fault (`rollout_actors.kernel.faults`), so its class fixes its fault and result kind;
an answer carries it as data (`EnvResponse.of(NoLiveEnvServer(...))`), and the rollout's side raises what
the answer carried (`direct.EnvCallFailed`). Environment code's own exceptions are not here: they are
answered as raised (`EnvResponse.from_exception`).
"""

from __future__ import annotations

from rollout_actors.kernel.failure import Failure
from rollout_actors.kernel.faults import CallerError, EnvError, LoadFailed, PartLost, Unavailable

# ----------------------------------------------------------------------------- a call's answer


class EnvDeadline(EnvError):
    """Environment code ran past its call's deadline; the env server answered so at once (the code may
    still be running: `env_calls`). The environment's fault: `env`."""


class EnvNoAnswer(Unavailable):
    """No answer at all from an env server or its pool within a call's deadline and slack: it cannot
    answer (a frozen process the supervisor has not retired yet), or the caller's own time ran out."""


class EnvServerLost(PartLost):
    """The env server holding the call died or was retired as wedged while it ran (`lost` says how and
    where, when the call's side saw it; a call the pool relayed says only that it was lost)."""


class EnvServerUnreachable(PartLost):
    """The env server's node cannot be reached: the session cannot go on, whatever becomes of the server."""


class PoolUnreachable(PartLost):
    """The env pool actor died or cannot be reached (`lost`), or its call failed in Ray (no `lost`)."""


class UnexplainedEnvFailure(Unavailable):
    """An answer that said it failed, and not why (no `error` on a failed `EnvResponse`)."""


# ----------------------------------------------------------------------------- sessions


class EnvSessionClosed(CallerError):
    """A call on an env session its caller already ended (closed, or ended while the call waited)."""


class DuplicateEnvSession(CallerError):
    """A new session named with an id the pool already holds."""


class OwnerLost(Unavailable):
    """The actor that asked for the placement was lost: nothing is placed for it."""


class NoLiveEnvServer(Unavailable):
    """No env server of the pool is live (all starting, or the restart budget spent): failing at once
    rather than queueing (docs/design.md contract 9)."""


class EnvPoolClosed(Unavailable):
    """The env pool is shut down."""


# ----------------------------------------------------------------------------- loading


class EnvReadinessTimeout(LoadFailed):
    """No env server was ready within the pool's readiness deadline."""


class EnvServerDied(LoadFailed):
    """Env servers kept dying while they loaded the environment (budget spent or deadline passed)."""


class EnvLoadTimeout(LoadFailed):
    """The environment's load outlived the time a caller could wait for it."""


class EnvStartupError(LoadFailed):
    """The environment could not be brought up: import or load failure (with its traceback), a server
    that died while loading past the restart budget, or the readiness deadline. `failure` is the far
    side's failure where there was one (carried as it was typed there), else this one."""

    def __init__(self, message: str, failure: Failure | None = None) -> None:
        super().__init__(message, carries=failure)


class LoadError(LoadFailed):
    """One env server could not load the environment: `failure` says why, with the environment's
    traceback (carried as typed where it failed)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.type}: {failure.message}", carries=failure)
