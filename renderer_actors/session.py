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

Every failure is a kernel fault (`rollout_actors.kernel.faults`), and none is retried here: a renderer
that died or did not answer is a `PartLost` naming the call and the step (the plane re-dispatches the
rollout, and answers it as poison if that happens twice at the same point); a renderer that could not
load what the key names is a `RendererLoadFailed` (`caller` for a name the request got wrong,
`infrastructure` otherwise; never re-dispatched: it would fail the same way); a call the renderer
failed outright, or a pool that cannot place a slot, is a `RendererUnavailable` (`infrastructure`); a
request the renderer rejects is a `RendererCallerError` (`caller`). Each carries the renderer-side
traceback.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from renderer_actors.batching import RenderCallFailed, batched_calls
from renderer_actors.calls import (
    BridgeReply,
    BridgeRequest,
    History,
    RendererInfo,
    StartReply,
    check_new_messages,
)
from renderer_actors.config import RendererConfig
from renderer_actors.key import RendererKey
from renderer_actors.parse import ParsedCompletion
from rollout_actors.kernel import CallerError, Loss, Part
from rollout_actors.kernel.faults import Fault, LoadFailed, PartLost, Unavailable, far_cause, ray_part_lost

CLOSE_TIMEOUT_S = 5.0  # returning a slot must not hold a finished rollout hostage
MAX_CACHED_KEYS = 256  # (model, renderer config) pairs one process resolves; a run uses a handful


class RendererUnavailable(Unavailable):
    """A renderer failed a call outright, or the pool could place no slot (its key's restart budget is
    spent, the pool is shut down): `infrastructure`, not re-dispatched."""


class RendererLoadFailed(LoadFailed):
    """A renderer for the key could not load it (tokenizer, template kwargs, renderer class)."""


class RendererCallerError(CallerError):
    """The renderer refused the request itself (an assistant message to bridge, a bad message shape)."""


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
    """One rollout's slot on a renderer plus its trajectory. Not shared between rollouts."""

    def __init__(self, pool: Any, key: RendererKey, multiplex: int, key_json: str | None = None) -> None:
        self._pool = pool
        self._key = key
        self._key_json = key_json or key.to_json()
        self._multiplex = multiplex
        self._slot_id: str | None = None
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
        self.step = 0
        """Bridges done: the point (`Loss.step`) a lost renderer is reported at."""
        self._history_roles: set[str] = set()
        """Roles of new messages whose bridge needed the history: sent up front for them from now on."""

    @classmethod
    async def open(cls, pool: Any, model: str, config: RendererConfig, timeout: float) -> RendererSession:
        """Take a slot on the least-loaded renderer for (model, config) and wait until it is ready."""
        key, key_json = _key_of(model, config)
        session = cls(pool, key, config.multiplex, key_json)
        deadline = time.monotonic() + timeout
        try:
            await session._acquire(deadline)
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
    def stop_token_ids(self) -> list[int]:
        """The renderer's stop ids to send with each token-mode call (empty before a renderer answered)."""
        return self._info.stop_token_ids if self._info is not None else []

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
        self.step += 1
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
        """Release the slot. Idempotent; never raises (the pool may already be gone)."""
        slot_id, self._slot_id = self._slot_id, None
        self._renderer = None
        if slot_id is None:
            return
        try:
            await batched_calls().release(self._pool, slot_id, timeout)
        except Exception:
            pass  # an unreleased slot expires in the pool (`slot_timeout_s`)

    # ------------------------------------------------------------------------------- internals

    def _history(self) -> History:
        # Not copied or validated: it is serialised for the call right away, and all of it is ours.
        return History.model_construct(messages=self._messages, prompt_ids=self._prompt or [])

    def _sends_history(self, new_messages: list[dict[str, Any]]) -> bool:
        if self._info is not None and self._info.always_needs_history:
            return True
        return bool(self._history_roles) and not self._history_roles.isdisjoint(_roles(new_messages))

    async def _acquire(self, deadline: float) -> None:
        calls = batched_calls()
        # Batched with every other session this process opens in this tick.
        slot = await self._remote(
            calls.acquire(self._pool, self._key_json, self._multiplex, deadline - time.monotonic()),
            deadline,
            "renderer pool",
            "acquire",
        )
        self._slot_id = slot.slot_id
        self._renderer = slot.renderer  # the process's one handle for it (`batching.RENDERERS`)
        self.renderer_id = slot.renderer_id
        self._info = await self._remote(
            calls.ready(slot.renderer_id, slot.renderer, deadline - time.monotonic()),
            deadline,
            "renderer",
            "ready",
            loads=True,
        )

    async def _call(self, method: str, timeout: float | int, *args: Any) -> Any:
        """One renderer call within the deadline. Not retried here: a lost renderer is the plane's to
        re-dispatch (contract 5), so a request that loses renderers every time is seen as poison."""
        deadline = time.monotonic() + timeout
        if self._renderer is None or self.renderer_id is None:
            raise RendererUnavailable("renderer session is closed")
        left = deadline - time.monotonic()
        call = batched_calls().call(self.renderer_id, self._renderer, method, args, left)
        return await self._remote(call, deadline, "renderer", method)

    async def _remote(self, call: Any, deadline: float, part: Part, method: str, loads: bool = False) -> Any:
        """Await one remote call (an ObjectRef, or a batched call's coroutine, which was given the same
        deadline and keeps it) within the deadline, every failure a kernel fault. `loads`: the call is the
        key's load (`ready`), which carries nothing of this request."""
        name = self.renderer_id if part == "renderer" else None
        what = f"{part} {name} {method}" if name else f"{part} {method}"
        # Whatever becomes of the renderer during a load is no evidence against the request (`culprit`
        # False): re-dispatched within its own bound, never poison. A load that hangs or fails is the
        # pool's to end (`ready_timeout_s`).
        culprit = False if loads else None
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            if asyncio.iscoroutine(call):  # a batched call: bounded by the deadline it was given
                return await call
            async with asyncio.timeout(left):  # a scope, not `wait_for`: no task per call
                return await call
        except TimeoutError:
            _cancel(call)
            lost = Loss(part=part, how="wedged", call=method, step=self.step, name=name, culprit=culprit)
            if loads:
                raise PartLost(f"{what}: still loading when the call's time ran out", lost=lost) from None
            raise PartLost(f"{what} did not answer within its deadline", lost=lost) from None
        except RenderCallFailed as exc:
            failure = exc.failure
            if exc.rejected:
                raise RendererCallerError(f"{what}: {failure.message}", traceback=failure.traceback) from None
            raise RendererUnavailable(
                f"{what} failed: {failure.type}: {failure.message}", traceback=failure.traceback
            ) from None
        except Exception as exc:
            lost = ray_part_lost(exc, part, name, call=method, step=self.step, culprit=culprit, what=what)
            if lost is not None:  # the renderer (or the pool) died or cannot be reached
                if part == "renderer" and lost.lost.how == "died" and name is not None:
                    _notice_dead(self._pool, name)
                raise lost from None
            if far_cause(exc) is None:  # not raised on the far side: not a fault of the call's
                raise
            raise _far_fault(exc, what, part, loads) from None


_KEYS: dict[tuple[str, str], tuple[RendererKey, str]] = {}
"""(model, renderer config JSON) -> its key and the key's JSON: every rollout of a run asks the same few,
and resolving one validates the library's config (a measurable share of a rollout's own CPU)."""


def _key_of(model: str, config: RendererConfig) -> tuple[RendererKey, str]:
    """The key (and its JSON) of a rollout's renderer; `RendererCallerError` for a config the library
    refuses (never cached: each such rollout is told)."""
    cache_key = (model, config.model_dump_json())
    known = _KEYS.get(cache_key)
    if known is None:
        try:
            key = RendererKey.from_config(model, config)
        except CallerError as exc:
            raise RendererCallerError(str(exc)) from None
        if len(_KEYS) >= MAX_CACHED_KEYS:
            _KEYS.clear()
        known = _KEYS[cache_key] = (key, key.to_json())
    return known


def _far_fault(exc: BaseException, what: str, part: Part, loads: bool) -> Fault:
    """The fault a call raised on the renderer's (or the pool's) side (`exc`: Ray's word on it, the cause
    within), typed as it was raised there: a load's failure (or the pool's hold of one) a
    `RendererLoadFailed`, `caller` where the load refused what the key names; the pool's refusal a
    `RendererUnavailable`."""
    cause = far_cause(exc) or exc
    far_traceback = str(exc)
    if loads or (isinstance(cause, Fault) and cause.fault == "load"):
        caller = isinstance(cause, CallerError) or (isinstance(cause, Fault) and cause.kind == "caller")
        return RendererLoadFailed(
            f"{what}: {cause}"
            if isinstance(cause, Fault)
            else f"{what} failed: {type(cause).__name__}: {cause}",
            type_name=cause.type_name if isinstance(cause, Fault) else None,
            traceback=far_traceback,
            kind="caller" if caller else "infrastructure",
        )
    if isinstance(cause, Fault):
        by_class = {"unavailable": RendererUnavailable, "caller": RendererCallerError}.get(cause.fault)
        if by_class is not None:
            return by_class(str(cause), type_name=cause.type_name, traceback=far_traceback)
        fault = Fault.from_failure(cause.failure, kind=cause.kind)
        fault.traceback = fault.traceback or far_traceback
        return fault
    message = f"{what} failed: {type(cause).__name__}: {cause}"
    if part == "renderer" and isinstance(cause, ValueError):  # a renderer refusing what the request sent
        return RendererCallerError(message, traceback=far_traceback)
    return RendererUnavailable(message, traceback=far_traceback)


def _notice_dead(pool: Any, renderer_id: str) -> None:
    try:
        pool.renderer_lost.remote(renderer_id)  # a notice: the pool replaces it; nobody waits
    except Exception:  # the pool is gone: nothing to tell
        pass


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
