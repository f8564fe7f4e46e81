"""The failure as data: `Failure` (why a request failed), `Loss` (which part of ours it lost, how, where)
and the words they use (`Part`, `How`, `FaultName`), with the secret redaction every `Failure` applies.

The exceptions these are the data of (`kernel.faults`) import this module, never the other way round, so
the kernel's modules import one another in one direction; `rollout_actors.kernel` re-exports all of it.
"""

from __future__ import annotations

import re
import threading
import traceback as traceback_module
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# ------------------------------------------------------------------------------------------ secrets

_secrets: set[str] = set()
_secrets_lock = threading.Lock()
_secret_pattern: re.Pattern[str] | None = None
REDACTED = "[redacted]"
MIN_SECRET_LEN = 6  # shorter values would redact ordinary words; a real key is far longer


def register_secret(value: str | None) -> None:
    """Remember a secret this process holds (an API key read from the environment): `redact` and every
    `Failure` built here blank it out, whatever echoed it (a server error body, a header in a traceback)."""
    global _secret_pattern
    if not value or len(value) < MIN_SECRET_LEN or value in _secrets:
        return
    with _secrets_lock:
        _secrets.add(value)
        ordered = sorted(_secrets, key=len, reverse=True)
        _secret_pattern = re.compile("|".join(re.escape(s) for s in ordered))


def redact(text: str | None) -> str | None:
    if not text or _secret_pattern is None:
        return text
    return _secret_pattern.sub(REDACTED, text)


# ------------------------------------------------------------------------------------------ failure


Part = Literal["worker", "env server", "renderer", "env pool", "renderer pool"]
"""A part of ours a rollout depends on (a rollout worker, an env server, a renderer, or a pool actor)."""
How = Literal["died", "wedged", "unreachable"]
"""How a part was lost: Ray says it died, it was judged wedged (alive, no progress past its hang
timeout), or its node cannot be reached."""
FaultName = Literal["caller", "model", "env", "lost", "load", "poison", "unavailable", "cancelled"]
"""Which class of the kernel's hierarchy (`kernel.faults`) a failure is: what decisions read."""


class Loss(BaseModel):
    """One part of ours a rollout lost, and where in the rollout: the data the re-dispatch and poison
    rules read (`Loss.point`), never a message string."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    part: Part
    how: How
    call: str | None = None
    """The call in flight when it was lost (`reset`, `step`, `score`, `start`, `bridge`, `parse`, ...);
    None when the part was lost between calls (a rollout worker)."""
    step: int | None = None
    """The rollout's step (0 = reset / first prompt, k = the k-th env step or bridge) the call belonged to."""
    name: str | None = None
    """Which actor (for people; no rule reads it: a replacement has another name)."""
    culprit: bool | None = None
    """Whether this request's own call wedged the part: True when the part named it; False when it named
    another request's call (this one was collateral) or the loss says nothing of this request (a
    renderer lost or still loading while the request waited for its load, a pool that gave no verdict);
    None when nobody can tell (a death, a frozen process). The poison rule never counts a loss whose
    culprit is False."""

    def point(self) -> tuple[str, str, str | None, int | None]:
        """What makes two losses "the same way at the same point": part, how, call, step."""
        return (self.part, self.how, self.call, self.step)

    def describe(self) -> str:
        where = f" during {self.call}" if self.call else ""
        where += f" of step {self.step}" if self.step is not None else ""
        return f"{self.part}{f' {self.name}' if self.name else ''} {self.how}{where}"


class Failure(BaseModel):
    """Why a request failed, classified on the side where it failed. Registered secrets never appear in it.

    `fault`, `lost` and `losses` are the typed half (`kernel.faults`): they survive the JSON hop, and
    every decision (re-dispatch, poison, masking) reads them; `type` and `message` are for people."""

    type: str
    """Exception type name, e.g. `APITimeoutError`, `ActorDiedError`, `CallerError`."""
    message: str
    status_code: int | None = None
    traceback: str | None = None
    """Traceback text from the failing side (Ray strips causes at actor boundaries)."""
    fault: FaultName | None = None
    """The class in the kernel's hierarchy this failure was raised as; None for one nobody typed."""
    lost: Loss | None = None
    """The part of ours this failure lost (`fault="lost"`): the request may be re-dispatched."""
    losses: list[Loss] = Field(default_factory=list)
    """Every loss of the request's dispatches, oldest first: the chain a poison or spent answer carries."""

    @model_validator(mode="after")
    def _redacted(self) -> Failure:
        if _secret_pattern is not None:
            self.message = redact(self.message) or ""
            self.traceback = redact(self.traceback)
        return self

    @classmethod
    def from_exception(cls, exc: BaseException, status_code: int | None = None) -> Failure:
        if isinstance(exc, CarriesFailure):  # a `Fault`, typed where it was raised: its data, not its name
            return exc.failure
        return cls(
            type=type(exc).__name__,
            message=str(exc) or type(exc).__name__,
            status_code=status_code,
            traceback="".join(traceback_module.format_exception(type(exc), exc, exc.__traceback__)),
        )


class CarriesFailure(Exception):
    """An exception that is a `Failure` already: the base of `kernel.faults.Fault`, declared here so that
    `Failure.from_exception` takes a fault's own data without this module importing the hierarchy."""

    @property
    def failure(self) -> Failure:
        raise NotImplementedError
