"""`RendererSession`: the in-process client a rollout uses to render, parse and bridge its turns.

Usage (inside a rollout; every call has a deadline, `close` runs in `finally`)::

    session = await RendererSession.open(pool, model, config, timeout=30)
    try:
        prompt = await session.start(messages, tools, timeout=30)
        ...                                             # sample `completion` from the server
        parsed = await session.parse(completion, tools, timeout=30)
        step = await session.bridge(completion, finish_reason, env_messages, tools, timeout=30)
        prompt = step.prompt_ids                        # == prompt + completion + delta, unless forked
    finally:
        await session.close()

The session keeps the trajectory (prompt ids, messages, branch) in this process and sends the renderer
only what a turn adds, so a call costs the same at turn 100 as at turn 1. The whole history travels only
when a renderer asks for it (the library cannot bridge the turn, or `fork_on_rewrite`).

Renderers hold no rollout state: when the renderer a call went to has died, the session re-leases (the
pool replaces the dead one) and retries the call once, within the caller's timeout. Anything else that
keeps a call from answering raises `RendererUnavailable` (classified `infrastructure`, with the
renderer-side traceback); a request the renderer rejects raises `RendererCallerError` (`caller`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError, RayTaskError

from renderer_actors.batching import RenderCallFailed, batched_calls
from renderer_actors.calls import BridgeReply, BridgeRequest, History, RendererInfo, StartReply
from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.parse import ParsedCompletion
from renderer_actors.renderer import check_new_messages
from rollout_actors.kernel import CallerError, Failure, process_owner

CLOSE_TIMEOUT_S = 5.0  # returning a lease must not hold a finished rollout hostage


class RendererUnavailable(Exception):
    """No renderer answered in time (or its replacement died too, or it failed to start)."""

    kind = "infrastructure"

    def __init__(self, message: str, traceback: str | None = None) -> None:
        super().__init__(message)
        self.failure = Failure(type="RendererUnavailable", message=message, traceback=traceback)


class RendererCallerError(CallerError):
    """The renderer refused the request itself (an assistant message to bridge, a bad message shape)."""

    kind = "caller"

    def __init__(self, message: str, traceback: str | None = None) -> None:
        super().__init__(message)
        self.failure = Failure(type="RendererCallerError", message=message, traceback=traceback)


@dataclass(frozen=True)
class BridgeStep:
    """What one `bridge` did to the trajectory (an in-process answer: it never crosses a process)."""

    added_ids: list[int]
    """What this step added after the sampled completion: the (synthetic close and) rendered new messages
    and generation prompt; when forked, the whole new prompt. Costs what the turn added."""
    branch: int = 0
    forked: bool = False
    """This step started a new branch: the prompt is a full re-render, not an extension."""
    synthetic_close: bool = False
    """The completion had no stop token (cut by `length`): the ids after it begin with the close the
    family defines, appended by the renderer (prompt, never sampled; never trained on)."""
    synthetic_ids: int = 0
    """How many ids that close took: the first `synthetic_ids` ids after the completion."""
    fork_reason: str | None = None
    """Why this step forked: where the template's full render departed from the trajectory."""
    _prompt: list[int] = field(default_factory=list, repr=False)
    """The session's prompt list (not a copy): the session only ever appends to it or replaces it."""
    _prompt_len: int = field(default=0, repr=False)

    @property
    def prompt_ids(self) -> list[int]:
        """The full next prompt: previous prompt + completion + `added_ids`, unless forked. A copy, made
        here (linear in the context); the prefix this step saw never changes."""
        return self._prompt[: self._prompt_len]


class RendererSession:
    """One rollout's lease on a renderer plus its trajectory. Not shared between rollouts."""

    def __init__(self, pool: Any, key: RendererKey, multiplex: int) -> None:
        self._pool = pool
        self._key = key
        self._key_json = key.to_json()
        self._multiplex = multiplex
        self._lease_id: str | None = None
        self._renderer: Any = None
        self.renderer_id: str | None = None
        self._info: RendererInfo | None = None
        # The trajectory: kept here, never shipped whole unless a renderer asks.
        self._prompt: list[int] | None = None
        self._messages: list[dict[str, Any]] = []
        self._tail: list[int] = []
        """The prompt after the last sampled completion: all a library bridge reads of the prompt."""
        self._parsed: tuple[list[int], dict[str, Any]] | None = None
        """The last `parse` answer, handed to the next `bridge` of the same completion."""
        self.branch = 0
        self._history_roles: set[str] = set()
        """Roles of new messages whose bridge needed the history: sent up front for them from now on."""

    @classmethod
    async def open(cls, pool: Any, model: str, config: RendererConfig, timeout: float) -> RendererSession:
        """Lease a slot on the least-loaded renderer for (model, config) and wait until it is ready."""
        try:
            key = RendererKey.from_config(model, config)
        except CallerError as exc:
            raise RendererCallerError(str(exc)) from None
        session = cls(pool, key, config.multiplex)
        deadline = time.monotonic() + timeout
        try:
            try:
                await session._acquire(deadline)
            except RayActorError as exc:  # the renderer died while starting: one more, on a replacement
                await session._recover(exc, deadline)
        except BaseException:
            await session.close()
            raise
        return session

    @property
    def key(self) -> RendererKey:
        return self._key

    @property
    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size, once a renderer answered (None before)."""
        return self._info.vocab_size or None if self._info is not None else None

    @property
    def prompt_ids(self) -> list[int]:
        """The current prompt (a copy)."""
        return list(self._prompt or [])

    @property
    def messages(self) -> list[dict[str, Any]]:
        """Every message of the trajectory so far, parsed assistant turns included (a copy)."""
        return list(self._messages)

    async def start(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, timeout: float
    ) -> list[int]:
        """The first prompt (with the generation prompt); starts the trajectory."""
        reply: StartReply = await self._call("start", timeout, messages, tools)
        self._prompt = list(reply.prompt_ids)
        self._tail = list(reply.prompt_ids)
        self._messages = list(messages)
        self.branch = 0
        return list(self._prompt)

    async def parse(
        self, completion_ids: list[int], tools: list[dict[str, Any]] | None, timeout: float
    ) -> ParsedCompletion:
        parsed: ParsedCompletion = await self._call("parse", timeout, list(completion_ids), tools, self._tail)
        self._parsed = (list(completion_ids), parsed.message)
        return parsed

    async def bridge(
        self,
        completion_ids: list[int],
        finish_reason: str | None,
        new_messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        timeout: float,
    ) -> BridgeStep:
        """The next prompt: previous prompt + completion + (synthetic close) + rendered new messages."""
        if self._prompt is None:
            raise RuntimeError("bridge() before start(): the session has no trajectory yet")
        try:
            check_new_messages(new_messages)
        except ValueError as exc:
            raise RendererCallerError(str(exc)) from exc
        deadline = time.monotonic() + timeout
        # model_construct: every field is ours (ids from the server, already checked; messages the env
        # answered, checked above); validating them again per turn is waste.
        request = BridgeRequest.model_construct(
            completion_ids=list(completion_ids),
            finish_reason=finish_reason,
            new_messages=list(new_messages),
            tools=tools,
            prompt_tail=self._tail,
            history=None,
            assistant_message=None,
        )
        if self._parsed is not None and self._parsed[0] == request.completion_ids:
            request.assistant_message = self._parsed[1]
        if self._sends_history(new_messages):
            request.history = self._history()
        reply: BridgeReply = await self._call("bridge", deadline - time.monotonic(), request)
        if reply.needs_history:
            # Remembered: this session sends the history up front for such turns from now on, rather than
            # paying a second round trip every time (a template that drops past reasoning at a new user
            # turn cannot be bridged at any user turn).
            self._history_roles.update(_roles(new_messages))
            request.history = self._history()
            reply = await self._call("bridge", deadline - time.monotonic(), request)
            if reply.needs_history:
                raise RendererUnavailable("renderer asked for the history although it was sent")
        if reply.forked:
            assert reply.prompt_ids is not None
            self._prompt = list(reply.prompt_ids)
            self._tail = list(reply.prompt_ids)
            added = self._prompt
            self.branch += 1
        else:
            added = reply.appended_ids
            self._prompt.extend(completion_ids)
            self._prompt.extend(added)
            self._tail = list(added)
        self._messages.append(reply.assistant_message)
        self._messages.extend(new_messages)
        return BridgeStep(
            added_ids=list(added),
            branch=self.branch,
            forked=reply.forked,
            synthetic_close=reply.synthetic_close,
            synthetic_ids=reply.synthetic_ids,
            fork_reason=reply.fork_reason,
            _prompt=self._prompt,
            _prompt_len=len(self._prompt),
        )

    async def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Release the lease. Idempotent; never raises (the pool may already be gone)."""
        lease_id, self._lease_id = self._lease_id, None
        self._renderer = None
        if lease_id is None:
            return
        try:
            await batched_calls().release(self._pool, lease_id, timeout)
        except Exception:
            pass  # an unreleased lease expires in the pool (`max_lease_s`)

    # ------------------------------------------------------------------------------- internals

    def _history(self) -> History:
        # Not copied or validated: it is serialised for the call right away, and all of it is ours.
        return History.model_construct(messages=self._messages, prompt_ids=self._prompt or [])

    def _sends_history(self, new_messages: list[dict[str, Any]]) -> bool:
        if self._info is not None and self._info.always_needs_history:
            return True
        return bool(self._history_roles) and not self._history_roles.isdisjoint(_roles(new_messages))

    async def _acquire(self, deadline: float, dead_renderer_id: str | None = None) -> None:
        calls = batched_calls()
        try:
            if dead_renderer_id is None and self._lease_id is None:
                # The common case, batched with every other session this process opens in this tick.
                left = deadline - time.monotonic()
                lease = await self._remote(
                    calls.lease(self._pool, self._key_json, self._multiplex, left),
                    deadline,
                    "lease from the renderer pool",
                )
            else:
                ref = self._pool.lease.remote(
                    self._key_json,
                    self._multiplex,
                    dead_renderer_id=dead_renderer_id,
                    release_lease_id=self._lease_id,
                    owner=process_owner(),
                )
                lease = await self._remote(ref, deadline, "lease from the renderer pool")
        except RayActorError as exc:
            raise RendererUnavailable(f"the renderer pool is unavailable: {exc}") from exc
        self._lease_id = lease.lease_id
        self._renderer = lease.renderer
        self.renderer_id = lease.renderer_id
        # A startup failure is infrastructure (or a model name nobody can load), never a bad request.
        self._info = await self._remote(
            calls.ready(lease.renderer_id, lease.renderer, deadline - time.monotonic()),
            deadline,
            f"renderer {self.renderer_id} startup",
            caller_errors=False,
        )

    async def _recover(self, exc: RayActorError, deadline: float) -> None:
        """The renderer died: re-lease (the pool replaces it) and wait for the new one. A second death
        here is not retried: the caller gets `RendererUnavailable`."""
        dead = self.renderer_id
        try:
            await self._acquire(deadline, dead_renderer_id=dead)
        except RayActorError as again:
            raise RendererUnavailable(
                f"renderer {dead} died ({exc}) and its replacement {self.renderer_id} died too: {again}"
            ) from again

    async def _call(self, method: str, timeout: float | int, *args: Any) -> Any:
        """One renderer call; if the renderer died, once more on a replacement, within the same deadline."""
        deadline = time.monotonic() + timeout
        for attempt in range(2):
            if self._renderer is None or self.renderer_id is None:
                raise RendererUnavailable("renderer session is closed")
            left = deadline - time.monotonic()
            call = batched_calls().call(self.renderer_id, self._renderer, method, args, left)
            try:
                return await self._remote(call, deadline, f"renderer {method}")
            except RayActorError as exc:
                if attempt:
                    raise RendererUnavailable(
                        f"renderer {self.renderer_id} died during {method} after a retry: {exc}"
                    ) from exc
                await self._recover(exc, deadline)
        raise AssertionError("unreachable")

    async def _remote(self, call: Any, deadline: float, what: str, caller_errors: bool = True) -> Any:
        """Await one remote call (an ObjectRef, or a batched call's coroutine, which was given the same
        deadline and keeps it) within the deadline and classify what went wrong. RayActorError (the actor
        died) propagates for the caller to recover."""
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            if asyncio.iscoroutine(call):  # a batched call: bounded by the deadline it was given
                return await call
            async with asyncio.timeout(left):  # a scope, not `wait_for`: no task per call
                return await call
        except TimeoutError as exc:
            _cancel(call)
            raise RendererUnavailable(f"{what} did not answer within its deadline") from exc
        except RayActorError:
            raise
        except RenderCallFailed as exc:
            failure = exc.failure
            if caller_errors and exc.rejected:
                raise RendererCallerError(f"{what}: {failure.message}", traceback=failure.traceback) from None
            raise RendererUnavailable(
                f"{what} failed: {failure.type}: {failure.message}", traceback=failure.traceback
            ) from None
        except RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if caller_errors and isinstance(cause, ValueError):
                raise RendererCallerError(f"{what}: {cause}", traceback=str(exc)) from None
            raise RendererUnavailable(
                f"{what} failed: {type(cause).__name__}: {cause}", traceback=str(exc)
            ) from None


def _roles(messages: list[dict[str, Any]]) -> set[str]:
    return {message.get("role", "") for message in messages}


def _cancel(call: Any) -> None:
    if isinstance(call, ray.ObjectRef):
        try:
            ray.cancel(call)
        except Exception:
            pass  # already finished, or not cancellable: the late answer is dropped with the ref
    elif asyncio.iscoroutine(call):
        call.close()  # never started (deadline already passed): close it so it is not "never awaited"
