"""`EnvSession`: the in-process client a rollout uses to run one episode on an `EnvPool`.

    session = await EnvSession.open(pool, task_index=3, task=None, timeout=60)
    try:
        messages = session.messages            # opening messages; session.tools: OpenAI tools or None
        while True:
            out = await session.step(assistant_message, timeout=120, score_if_done=True)
            ...                                 # StepOut(messages, done, score)
            if out.done:
                break
        score = out.score or await session.score(timeout=60)  # ScoreOut(reward, components, metrics)
    finally:
        await session.close()                   # idempotent, never raises

`score_if_done=True` folds the last step, the score and the close into one call: a step that ends the
episode comes back with its score, and the session has already ended on its server (`close` is then a
no-op; `score` fails as on any closed session). Without it, or while not done, a step is just a step.

The pool places the session (`place_many`); its reset, steps and score then go straight to the server,
batched per event-loop tick (`direct.py`); close goes through the pool. Every call has a deadline. A
failed call raises `EnvCallFailed` carrying the `Failure` and its kind: `caller` when the request was at
fault (a `CallerError` in the environment: bad task index, malformed task), `env` when the environment's
code raised, answered garbage or missed its deadline, `infrastructure` for ours (its env server died or
wedged: `failure.lost` says where; no live server; the pool itself is gone). A rollout maps the kind onto
its `Result`.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from env_actors.direct import EnvCallFailed, call_server, forget_later, place, pool_call
from env_actors.failures import EnvSessionClosed
from env_actors.interface import EnvResponse, ResetOut, ScoreOut, SessionMethod, StepOut
from rollout_actors.kernel import Failure, new_id
from rollout_actors.kernel.renamed import warn_renamed
from rollout_actors.kernel.tasks import resolve

logger = logging.getLogger(__name__)

Answer = TypeVar("Answer", bound=BaseModel)

SESSION_CALL_SLACK_S = 3.0
"""Beyond the pool's own deadline (which already has its slack): only a dead or wedged pool needs it."""


@dataclass
class EnvSession:
    """One episode of one environment, pinned to one env server for its whole life."""

    pool: Any
    """The EnvPool actor handle."""
    session_id: str
    messages: list[dict[str, Any]]
    """The opening messages from `reset`."""
    tools: list[dict[str, Any]] | None
    server_name: str
    """The env server holding this session (its actor name)."""
    server: Any
    """Its handle: reset, steps and score go to it directly."""
    closed: bool = False
    steps: int = 0
    """Steps taken: the point (`Loss.step`) a lost env server is reported at (0 is the reset)."""
    _inflight: set[Any] = field(default_factory=set, init=False, repr=False)
    """Agent runs in flight (asyncio tasks), cancelled by `close`."""

    @property
    def worker(self) -> str:
        """The old name of `server_name` (docs/design.md, "Words": a worker is a rollout worker)."""
        warn_renamed("EnvSession.worker", "server_name")
        return self.server_name

    @classmethod
    async def open(
        cls,
        pool: Any,
        task_index: int | None = None,
        task: dict[str, Any] | None = None,
        timeout: float = 60.0,
        alone: bool = False,
    ) -> EnvSession:
        """Start a session for a task (by index, or the task itself) on the least-busy ready server; with
        `alone`, on a server started for it that takes no other session while it is open (quarantine)."""
        session_id = new_id("envsess")
        server_name, server = await place(pool, session_id, timeout, alone)
        try:
            value = await call_server(
                pool, server, server_name, "reset", session_id, (task_index, task), timeout, step=0
            )
            out = _answer_of(ResetOut, value, "reset")
        except BaseException:  # failed, timed out or cancelled: the placement (or a late reset) is ended
            _submit_close(pool, session_id)
            raise
        return cls(
            pool=pool,
            session_id=session_id,
            messages=out.messages,
            tools=out.tools,
            server_name=out.server_name,
            server=server,
        )

    async def step(
        self, assistant_message: dict[str, Any], timeout: float, score_if_done: bool = False
    ) -> StepOut:
        """One turn. With `score_if_done`, a done step also scores and ends the session (`out.score`)."""
        self._check_open("step")
        self.steps += 1
        value = await self._direct("step", (assistant_message,), timeout, score_if_done)
        out = _answer_of(StepOut, value, "step")
        if out.score is not None:
            self.closed = True  # the server ended the session with this step; nothing is left to close
            forget_later(self.pool, self.session_id)
        return out

    async def run_agent(self, endpoint: dict[str, Any], timeout: float) -> str:
        """Agent mode: the environment runs its agent against `endpoint` (`env_actors.agent`) within
        `timeout`; returns the agent program's output tail. `close` stops the agent."""
        self._check_open("agent")
        value = await self._direct("agent", (endpoint,), timeout)
        return str((value or {}).get("output_tail", ""))

    async def score(self, timeout: float) -> ScoreOut:
        self._check_open("score")
        return _answer_of(ScoreOut, await self._direct("score", (), timeout), "score")

    async def close(self, timeout: float = 5.0) -> None:
        """End the session on its server. Idempotent; never raises. The close request is submitted before
        the first await, so a rollout cancelled while closing still ends its session."""
        if self.closed:
            return
        self.closed = True
        for task in list(self._inflight):  # an agent still running on the server stops there too
            task.cancel()
        try:
            await _call(
                lambda: self.pool.end_session.remote(self.session_id, timeout), timeout, "end_session"
            )
        except EnvCallFailed as exc:
            logger.debug("closing env session %s failed: %s", self.session_id, exc)

    async def __aenter__(self) -> EnvSession:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @staticmethod
    async def num_tasks(pool: Any, timeout: float) -> int:
        return int(await _call(lambda: pool.num_tasks.remote(), timeout, "num_tasks"))

    async def _direct(
        self, method: SessionMethod, args: tuple, timeout: float, score_if_done: bool = False
    ) -> Any:
        """One call straight to the server. An agent run is cancellable by `close` from another task (the
        rollout serves the agent's endpoint meanwhile); a reset, step or score is awaited by the rollout's
        own task, which a cancellation or its deadline reaches directly: no task of its own per turn."""
        call = call_server(
            self.pool,
            self.server,
            self.server_name,
            method,
            self.session_id,
            args,
            timeout,
            score_if_done,
            step=self.steps,
        )
        if method != "agent":
            return await call
        task = asyncio.ensure_future(call)
        self._inflight.add(task)
        try:
            return await task
        finally:
            self._inflight.discard(task)

    def _check_open(self, method: str) -> None:
        if self.closed:
            raise EnvCallFailed.of(EnvSessionClosed(f"{method} on closed env session {self.session_id}"))


async def _call(submit: Any, timeout: float, method: str) -> Any:
    """Submit one pool call (inside the deadline, so a failing submit is caught too) and await it."""

    async def answer() -> EnvResponse:
        return await resolve(submit())

    return await pool_call(answer(), timeout + SESSION_CALL_SLACK_S, method)


def _answer_of(model: type[Answer], value: Any, method: str) -> Answer:
    """The env server's answer as its model. One that does not fit is the environment's fault, never the
    request's: `env`, not the `caller` a bare ValidationError would read as."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        failure = Failure.from_exception(exc)
        failure.message = f"env {method} answered something that is not a {model.__name__}: {failure.message}"
        failure.fault = "env"
        raise EnvCallFailed(failure, "env") from None


def _submit_close(pool: Any, session_id: str) -> None:
    try:
        pool.end_session.remote(session_id, 5.0)
    except Exception:  # a dead pool has no sessions to end
        pass
