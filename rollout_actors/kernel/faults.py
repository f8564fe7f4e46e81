"""Typed failures: one small hierarchy every side raises, and the one place Ray's exceptions are mapped.

    Fault             result kind        raised when
    CallerError       caller             the request itself is invalid (bad Ref, task, sampling args)
    ModelError        model              the inference server failed or refused
    EnvError          env                environment code raised, returned garbage or missed its deadline
    PartLost          infrastructure     a part of ours died, wedged or became unreachable (`Loss`)
    LoadFailed        caller | infra     a part could not load what the request names (tokenizer, env)
    PoisonRequest     env | infra        the request lost a part the same way at the same point twice
    Unavailable       infrastructure     nothing live to serve it, a budget spent, a deadline passed
    Cancelled         cancelled          the caller or the plane cancelled it

Each failure a side reports is one subclass of these, named for it and constructed where it happens
(`NoLiveEnvServer("...")`), so its class, and with it its fault and result kind, is fixed in one place;
a `Failure` is built only here (`Fault.failure`), never typed by hand.

A fault is classified where it happens and crosses Ray as data: `fault.failure` is a `Failure` whose
`fault`, `lost` and `losses` fields say which class and which part; `Fault.from_failure` rebuilds the
exception on the far side. The plane decides re-dispatch and poison from those fields
(`rollout_actors.plane.redispatch`), never from `type` or `message`.

Ray's own exceptions are read here and nowhere else, as httpx maps its transport's errors in one place:
an actor Ray says is dead is `died`, one it cannot reach is `unreachable` (`ray_loss`); at a boundary a
Ray call crosses, that becomes the `Loss` of the part it went to (`ray_lost`, `ray_part_lost`, or the
`ray_errors` scope); an error raised on the far side is read back as the exception it was there
(`far_cause`); anything else Ray raises is not a loss and propagates (`is_ray_error` tells it apart).
"""

from __future__ import annotations

import traceback as traceback_module
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

from rollout_actors.kernel.failure import CarriesFailure, Failure, FaultName, How, Loss, Part

MAX_EXIT_DETAIL_CHARS = 500


class Fault(CarriesFailure):
    """Base of the hierarchy: a failure with its result kind, as data (`failure`) and as an exception."""

    fault: ClassVar[FaultName]
    kind: str = "infrastructure"
    """The result kind (`ok` never): a class default, set per instance where the class allows two."""
    carried: Failure | None = None
    """The far side's failure this fault stands for, when it carries one (`carries`)."""

    def __init__(
        self,
        message: str = "",
        *,
        type_name: str | None = None,
        traceback: str | None = None,
        status_code: int | None = None,
        lost: Loss | None = None,
        losses: Sequence[Loss] = (),
        kind: str | None = None,
        carries: Failure | None = None,
    ) -> None:
        """`carries`: the failure this fault stands for, typed where it happened (a far side's answer):
        its data, unchanged, is this fault's `failure`."""
        super().__init__(message)
        self.type_name = type_name or type(self).__name__
        self.traceback = traceback
        self.status_code = status_code
        self.lost = lost
        self.losses = list(losses)
        self.carried = carries
        if kind is not None:
            self.kind = kind

    def __reduce__(self):  # pickled whole (Ray ships a far side's exception as its cause), fields and all
        return (_restore, (type(self), self.args, dict(self.__dict__)))

    @property
    def failure(self) -> Failure:
        """This fault as data: the failure it carries, else its own, whose traceback is the one it was
        given (the far side's), else its own."""
        if self.carried is not None:
            return self.carried
        traceback = self.traceback
        if traceback is None and self.__traceback__ is not None:
            traceback = "".join(traceback_module.format_exception(type(self), self, self.__traceback__))
        return Failure(
            type=self.type_name,
            message=str(self) or self.type_name,
            status_code=self.status_code,
            traceback=traceback,
            fault=self.fault,
            lost=self.lost,
            losses=self.losses,
        )

    @staticmethod
    def from_failure(failure: Failure, kind: str | None = None) -> Fault:
        """The exception a `Failure` that crossed a boundary stands for (an untyped one: `Unavailable`,
        or `kind` where the far side said it)."""
        cls = _BY_NAME.get(failure.fault or "unavailable", Unavailable)
        return cls(
            failure.message,
            type_name=failure.type,
            traceback=failure.traceback,
            status_code=failure.status_code,
            lost=failure.lost,
            losses=failure.losses,
            kind=kind,
        )


def _restore(cls: type[Fault], args: tuple, state: dict) -> Fault:
    fault = cls.__new__(cls)
    Exception.__init__(fault, *args)
    fault.__dict__.update(state)
    return fault


class CallerError(Fault, ValueError):
    """The request itself is invalid (bad Ref, bad task, bad sampling args): a `caller` result."""

    fault = "caller"
    kind = "caller"


class ModelError(Fault):
    """The inference server failed or refused (timeouts, 4xx/5xx, malformed output): `model`."""

    fault = "model"
    kind = "model"


class EnvError(Fault):
    """Environment code failed: raised, returned something that is not its answer, missed its step or
    score deadline. The environment's bug, not our cluster's: `env`."""

    fault = "env"
    kind = "env"


class PartLost(Fault):
    """A part of ours the rollout depended on was lost (`lost` says which, how and where). Nothing the
    rollout did is lost that cannot be redone: the plane may re-dispatch it (docs/design.md contract 5)."""

    fault = "lost"

    def __init__(self, message: str = "", *, lost: Loss | None = None, **fields) -> None:
        super().__init__(message or (lost.describe() if lost else "a part was lost"), lost=lost, **fields)


class LoadFailed(Fault):
    """A part could not load what the request names (a tokenizer, a template kwarg, an environment):
    `caller` where the name itself cannot load, `infrastructure` otherwise. Never re-dispatched: a load
    that failed fails the same way on the next part (docs/design.md contract 8)."""

    fault = "load"


class PoisonRequest(Fault):
    """The request's dispatches lost a part the same way at the same point twice (`losses`): the failure
    follows the request, not the part, so it is answered instead of spending more of a pool's restart
    budget. `env` when environment code wedged or killed its own server, `infrastructure` otherwise."""

    fault = "poison"


class Unavailable(Fault):
    """Nothing live can serve the request (no live worker, a restart budget spent, a pool shut down) or
    its deadline passed before a result stood: `infrastructure`, not re-dispatched."""

    fault = "unavailable"


class Cancelled(Fault):
    """The caller, or the plane on its behalf (a group, a stale policy, an overload), cancelled the
    request before its result stood: `cancelled`."""

    fault = "cancelled"
    kind = "cancelled"


class DeadlineExceeded(Unavailable):
    """The request's own `timeout_s` passed before its result stood."""


_BY_NAME: dict[str, type[Fault]] = {
    cls.fault: cls
    for cls in (
        CallerError,
        ModelError,
        EnvError,
        PartLost,
        LoadFailed,
        PoisonRequest,
        Unavailable,
        Cancelled,
    )
}


# ------------------------------------------------------------------------------------ Ray's errors


def ray_loss(exc: BaseException) -> How | None:
    """How the actor a call went to was lost, as Ray's exception says, or None when it is no loss (an
    application error raised on the far side, a timeout, anything not about the actor's life)."""
    from ray.exceptions import ActorUnavailableError, RayActorError  # Ray is the engine, not the project

    if isinstance(exc, ActorUnavailableError):
        return "unreachable"
    if isinstance(exc, RayActorError):
        return "died"
    return None


def runtime_env_failed(exc: BaseException) -> bool:
    """Whether Ray says an actor's `runtime_env` could not be built (a pip failure, a missing package):
    the configuration's fault, not a loss."""
    from ray.exceptions import RuntimeEnvSetupError

    return isinstance(exc, RuntimeEnvSetupError)


def runtime_env_setup_error(message: str) -> Exception:
    """Ray's own `RuntimeEnvSetupError`, for a build seen failing before Ray says so (pip's verdict):
    what `runtime_env_failed` reads, whoever saw it first."""
    from ray.exceptions import RuntimeEnvSetupError

    return RuntimeEnvSetupError(message)


def exit_detail(exc: BaseException) -> str:
    """The useful part of Ray's actor-death message: why the process ended."""
    text = str(exc)
    start = text.find("The actor is dead because")
    text = text[start:] if start >= 0 else text
    end = text.find(" Some common causes")  # Ray's generic troubleshooting advice follows
    return " ".join((text[:end] if end >= 0 else text).split())[:MAX_EXIT_DETAIL_CHARS]


def start_error(exc: BaseException) -> str:
    """What ended an actor's start, in one line: the exception its constructor raised (the last line of
    the traceback Ray carries), or why its process ended."""
    text = str(exc)
    if "creation task" in text:
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        return lines[-1][:MAX_EXIT_DETAIL_CHARS]
    return exit_detail(exc)


def remote_cause(exc: BaseException) -> BaseException:
    """What a `RayTaskError` carries from the far side (its cause), or the exception itself."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def is_ray_error(exc: BaseException) -> bool:
    """Whether Ray raised it (of a call, an actor, a task), rather than the code awaiting the call."""
    from ray.exceptions import RayError

    return isinstance(exc, RayError)


def far_cause(exc: BaseException) -> BaseException | None:
    """The exception the far side of a Ray call raised (what `RayTaskError` carries as its cause), or
    None when `exc` is not one raised over there."""
    from ray.exceptions import RayTaskError

    return remote_cause(exc) if isinstance(exc, RayTaskError) else None


def ray_lost(
    exc: BaseException,
    part: Part,
    name: str | None = None,
    *,
    call: str | None = None,
    step: int | None = None,
    culprit: bool | None = None,
) -> Loss | None:
    """The part a Ray call went to, lost as Ray's `exc` says (`ray_loss`), or None when it is no loss."""
    how = ray_loss(exc)
    if how is None:
        return None
    return Loss(part=part, how=how, call=call, step=step, name=name, culprit=culprit)


def ray_part_lost(
    exc: BaseException, part: Part, name: str | None = None, *, what: str = "", **where: Any
) -> PartLost | None:
    """`ray_lost` (`where`: its call, step, culprit) as the `PartLost` to raise, or None; `what`: the
    call, for the message."""
    lost = ray_lost(exc, part, name, **where)
    if lost is None:
        return None
    prefix = f"{what}: " if what else ""
    return PartLost(f"{prefix}{lost.describe()}: {exit_detail(exc)}", lost=lost, type_name=type(exc).__name__)


@contextmanager
def ray_errors(
    part: Part,
    name: str | None = None,
    call: str | None = None,
    step: int | None = None,
    culprit: bool | None = None,
) -> Iterator[None]:
    """Map Ray's word on the actor a call went to into `PartLost`, here and only here:

    with ray_errors("renderer", renderer_id, call="bridge", step=3):
        reply = await handle.bridge.remote(request)
    """
    try:
        yield
    except Exception as exc:
        lost = ray_part_lost(exc, part, name, call=call, step=step, culprit=culprit)
        if lost is None:
            raise
        raise lost from exc
