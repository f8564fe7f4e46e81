"""Classify a failure where it happens, before it crosses an actor boundary (DESIGN.md contract 3).

Ray strips exception causes at actor boundaries, so the worker turns every exception into a `Failure`
(type, message, status code, traceback text) and a result kind here, inside the actor.
"""

from __future__ import annotations

import asyncio

import openai
from pydantic import ValidationError

from rollout_actors.wire import CallerError, Failure, ResultKind


class MalformedResponse(Exception):
    """The server answered 200 with a body that is not the protocol (not JSON, missing ids, bad shapes,
    token ids outside the vocabulary)."""


class CallDeadlineExceeded(Exception):
    """A model call ran past its total deadline (`ClientConfig.call_deadline`): the server's fault."""


def classify(exc: BaseException) -> tuple[ResultKind, Failure]:
    """Map an exception raised while running a rollout to (result kind, failure)."""
    kind_attr = getattr(exc, "kind", None)
    failure_attr = getattr(exc, "failure", None)
    if isinstance(failure_attr, Failure) and kind_attr in ("infrastructure", "caller", "model"):
        # Already classified on the side that failed (env pool, renderer pool).
        return kind_attr, failure_attr
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled", Failure(type="Cancelled", message="rollout was cancelled")
    if isinstance(exc, openai.APIStatusError):
        return "model", Failure.from_exception(exc, status_code=exc.status_code)
    if isinstance(exc, openai.APITimeoutError):
        return "model", Failure.from_exception(exc)
    if isinstance(
        exc,
        (
            openai.APIConnectionError,
            openai.APIResponseValidationError,
            MalformedResponse,
            CallDeadlineExceeded,
        ),
    ):
        return "model", Failure.from_exception(exc)
    if isinstance(exc, (CallerError, ValidationError)):
        return "caller", Failure.from_exception(exc)
    return "infrastructure", Failure.from_exception(exc)
