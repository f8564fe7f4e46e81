"""The rollout loop: one request in, exactly one `Result` out.

A rollout owns three things and releases all of them in `finally`, whatever the exit path (ok, error,
cancel, deadline): its OpenAI client, its env session, its renderer lease. Token mode keeps the trajectory
token-exact: turn k+1's prompt is turn k's prompt + sampled completion + the rendered delta (contract 7).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Protocol

from env_actors.session import EnvSession
from renderer_actors.session import RendererSession
from rollout_actors.client import build_client
from rollout_actors.failures import DeadlineExceeded, classify
from rollout_actors.model_call import Sampled, complete_chat, complete_tokens, tool_call_views
from rollout_actors.wire import Failure, Result, RolloutRequest, ToolCall, Turn

CLEANUP_TIMEOUT_S = 5.0  # releasing a lease or ending a session must not hold a finished rollout hostage


class PoolDirectory(Protocol):
    """Where a rollout finds the shared actors it talks to (the worker implements this)."""

    def renderer_pool(self) -> Any: ...

    def env_pool(self, request: RolloutRequest) -> Any: ...


@dataclass(frozen=True)
class LoopLimits:
    call_timeout_s: float = 120.0
    """Ceiling for one renderer or env call; the rollout's remaining deadline caps it further."""


class _Clock:
    def __init__(self, deadline_s: float) -> None:
        self.deadline = time.monotonic() + deadline_s
        self.deadline_s = deadline_s

    def budget(self, ceiling: float) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceeded(f"rollout exceeded its deadline of {self.deadline_s:g} s")
        return min(ceiling, left)


async def run_rollout(
    request: RolloutRequest,
    pools: PoolDirectory,
    limits: LoopLimits = LoopLimits(),
) -> Result:
    """Run one rollout to its single result. Never raises, except `CancelledError` when cancelled
    (the caller turns that into a `cancelled` result after cleanup has run)."""
    started = time.time()
    state = _Trajectory()
    try:
        async with asyncio.timeout(request.deadline_s):
            await _run(request, pools, limits, state)
        kind, error = "ok", None
    except TimeoutError:
        kind = "infrastructure"
        error = Failure(
            type="DeadlineExceeded", message=f"rollout exceeded its deadline of {request.deadline_s:g} s"
        )
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # every failure becomes data here, classified on this side
        kind, error = classify(exc)
    return Result(
        request_id=request.request_id,
        lease_id=request.lease_id,
        group_id=request.group_id,
        kind=kind,
        error=error,
        reward=state.reward if kind == "ok" else None,
        components=state.components,
        metrics=state.metrics,
        turns=state.turns,
        messages=state.messages,
        forked=state.forked,
        policy_version_start=request.policy_version,
        started_at=started,
        finished_at=time.time(),
    )


class _Trajectory:
    def __init__(self) -> None:
        self.turns: list[Turn] = []
        self.messages: list[dict[str, Any]] = []
        self.reward: float | None = None
        self.components: dict[str, float] = {}
        self.metrics: dict[str, Any] = {}
        self.forked = False


async def _run(request: RolloutRequest, pools: PoolDirectory, limits: LoopLimits, state: _Trajectory) -> None:
    clock = _Clock(request.deadline_s)
    ceiling = limits.call_timeout_s
    client = build_client(request.client, session_id=request.request_id)
    env: EnvSession | None = None
    renderer: RendererSession | None = None
    try:
        env = await EnvSession.open(
            pools.env_pool(request), request.task_index, request.task, timeout=clock.budget(ceiling)
        )
        tools = env.tools or None
        state.messages = list(env.messages)
        prompt_ids: list[int] = []
        branch = 0
        if request.mode == "token":
            renderer = await RendererSession.open(
                pools.renderer_pool(), request.client.model, request.renderer, timeout=clock.budget(ceiling)
            )
            prompt_ids = await renderer.start(state.messages, tools, timeout=clock.budget(ceiling))
        for _ in range(request.max_turns):
            if request.mode == "token":
                assert renderer is not None
                sampled = await complete_tokens(client, request.client.model, prompt_ids, request.sampling)
                parsed = await renderer.parse(sampled.completion_ids, tools, timeout=clock.budget(ceiling))
                assistant = parsed.message
                turn = Turn(
                    prompt_ids=prompt_ids,
                    completion_ids=sampled.completion_ids,
                    logprobs=sampled.logprobs,
                    finish_reason=sampled.finish_reason,
                    branch=branch,
                    content=parsed.content,
                    reasoning=parsed.reasoning,
                    tool_calls=parsed.tool_calls,
                )
            else:
                sampled = await complete_chat(
                    client, request.client.model, state.messages, tools, request.sampling
                )
                assistant = sampled.message
                turn = _chat_turn(sampled)
            state.turns.append(turn)
            state.messages.append(assistant)
            step = await env.step(assistant, timeout=clock.budget(ceiling))
            state.messages.extend(step.messages)
            if step.done:
                break
            if request.mode == "token":
                assert renderer is not None
                bridged = await renderer.bridge(
                    sampled.completion_ids,
                    sampled.finish_reason,
                    step.messages,
                    tools,
                    timeout=clock.budget(ceiling),
                )
                prompt_ids, branch = bridged.prompt_ids, bridged.branch
                state.forked = state.forked or bridged.forked
        score = await env.score(timeout=clock.budget(ceiling))
        state.reward, state.components, state.metrics = (
            score.reward,
            dict(score.components),
            dict(score.metrics),
        )
        state.metrics.setdefault("turns", len(state.turns))
    finally:
        await _release(client, env, renderer)


def _chat_turn(sampled: Sampled) -> Turn:
    message = sampled.message
    return Turn(
        prompt_ids=sampled.prompt_ids or [],
        completion_ids=sampled.completion_ids,
        logprobs=sampled.logprobs,
        finish_reason=sampled.finish_reason,
        content=message.get("content"),
        reasoning=message.get("reasoning_content"),
        tool_calls=[ToolCall(**view) for view in tool_call_views(message)],
    )


async def _release(client: Any, env: EnvSession | None, renderer: RendererSession | None) -> None:
    """Release everything the rollout owns. Shielded so a cancellation that lands mid-cleanup still lets
    the client close, the env session end and the lease return."""

    async def release_all() -> None:
        try:
            await asyncio.wait_for(client.close(), CLEANUP_TIMEOUT_S)
        except Exception:
            pass
        if env is not None:
            await env.close(timeout=CLEANUP_TIMEOUT_S)
        if renderer is not None:
            try:
                await asyncio.wait_for(renderer.close(), CLEANUP_TIMEOUT_S)
            except Exception:
                pass

    task = asyncio.ensure_future(release_all())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise
