"""Classify a failure where it happens, before it crosses an actor boundary (docs/design.md contract 3).

Ray strips exception causes at actor boundaries, so the worker turns every exception into a `Failure`
(type, message, status code, traceback text) and a result kind here, inside the actor.
"""

from __future__ import annotations

import logging
from typing import Any

import openai
from pydantic import ValidationError

from rollout_actors.kernel.faults import Fault, ModelError
from rollout_actors.wire import CallerError, Failure, ResultKind


class MalformedResponse(ModelError):
    """The server answered 200 with a body that is not the protocol (not JSON, missing ids, bad shapes,
    token ids outside the vocabulary)."""


class CallDeadlineExceeded(ModelError):
    """A model call ran past its total deadline (`ClientConfig.total_call_timeout_s`): the server's fault."""


class TurnAborted(ModelError):
    """The server ended a turn early (`finish_reason` "abort" or "error") and the plane did not ask for
    it: what it sampled is not a finished turn, never bridged on or trained on as one."""

    def __init__(self, finish_reason: str | None, completion_ids: list[int], sampled: Any = None) -> None:
        super().__init__(
            f"the server ended the turn with finish_reason={finish_reason!r} after {len(completion_ids)} tokens"
        )
        self.finish_reason = finish_reason
        self.sampled = sampled
        """The partial turn (`model_call.Sampled`): what a turn the plane paused resumes from."""


MODEL_FAILURES = (
    openai.APIConnectionError,
    openai.APIResponseValidationError,
    MalformedResponse,
    CallDeadlineExceeded,
    TurnAborted,
)


def classify(exc: Exception) -> tuple[ResultKind, Failure]:
    """Map an exception raised while running a rollout to (result kind, failure). Cancellation is not an
    exception here: the rollout answers `cancelled` itself (`rollout.py`)."""
    if isinstance(exc, Fault):  # typed where it was raised (env session, renderer session, model call)
        return exc.kind, exc.failure  # type: ignore[return-value]
    if isinstance(exc, openai.APIStatusError):
        return "model", _model_failure(exc, exc.status_code)
    if isinstance(exc, (openai.APITimeoutError, *MODEL_FAILURES)):
        return "model", _model_failure(exc)
    if isinstance(exc, (CallerError, ValidationError)):
        return "caller", Failure.from_exception(exc)
    return "infrastructure", Failure.from_exception(exc)


def _model_failure(exc: Exception, status_code: int | None = None) -> Failure:
    failure = Failure.from_exception(exc, status_code=status_code)
    failure.fault = "model"
    return failure


FAILED_KINDS = ("model", "env", "infrastructure", "caller")
FAILED_ROLLOUT_RECORD = "failed_rollout_kind"
"""The attribute `log_failure` puts on its log record (the result's kind): a front that reports failures
its own way (the command line's end-of-run table, one line per type with a count) filters on it."""


def log_failure(logger: logging.Logger, result: Any) -> None:
    """Log a failed result once, where it was classified: one line naming the rollout (request, lease,
    worker) and the failure; its traceback at debug level."""
    if result.kind not in FAILED_KINDS or result.error is None:
        return
    error = result.error
    logger.warning(
        "rollout %s (lease %s, worker %s) ended %s: %s: %s",
        result.request_id,
        result.lease_id,
        result.worker or "-",
        result.kind,
        error.type,
        error.message.splitlines()[0][:300] if error.message else "",
        extra={FAILED_ROLLOUT_RECORD: result.kind},
    )
    if error.traceback:
        logger.debug("rollout %s traceback:\n%s", result.request_id, error.traceback)
