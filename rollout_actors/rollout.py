"""The rollout loop: one request in, exactly one `Result` out.

A rollout owns three things and releases all of them in `finally`, whatever the exit path (ok, error,
cancel, deadline): its OpenAI client, its env session, its renderer lease. Token mode keeps the trajectory
token-exact: turn k+1's prompt is turn k's prompt + sampled completion + the rendered delta (contract 7).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from env_actors.interface import ScoreOut
from env_actors.session import EnvSession
from renderer_actors.session import RendererSession
from rollout_actors.client import build_client
from rollout_actors.failures import classify
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


def _budget(scope: asyncio.Timeout, ceiling: float) -> float:
    """Seconds one remote call may take: its ceiling, capped by what is left of the rollout's deadline."""
    when = scope.when()
    assert when is not None
    return max(0.0, min(ceiling, when - asyncio.get_running_loop().time()))


async def run_rollout(
    request: RolloutRequest,
    pools: PoolDirectory,
    limits: LoopLimits = LoopLimits(),
) -> Result:
    """Run one rollout to its single result. Never raises, except `CancelledError` when cancelled
    (the caller turns that into a `cancelled` result after cleanup has run)."""
    started = time.time()
    state = _Trajectory()
    scope = asyncio.timeout(request.deadline_s)
    try:
        async with scope:
            await _run(request, pools, limits, state, scope)
        kind, error = "ok", None
    except TimeoutError as exc:
        if scope.expired():
            kind = "infrastructure"
            error = Failure(
                type="DeadlineExceeded", message=f"rollout exceeded its deadline of {request.deadline_s:g} s"
            )
        else:  # a call's own deadline, not the rollout's
            kind, error = classify(exc)
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
        policy_version_start=request.policy_version or 0,
        started_at=started,
        finished_at=time.time(),
    )


@dataclass
class _Trajectory:
    """What a rollout has gathered so far; kept outside `_run` so a failure still reports it."""

    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    components: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, Any] = field(default_factory=dict)
    forked: bool = False


async def _run(
    request: RolloutRequest,
    pools: PoolDirectory,
    limits: LoopLimits,
    state: _Trajectory,
    scope: asyncio.Timeout,
) -> None:
    ceiling = limits.call_timeout_s
    client = build_client(request.client, session_id=request.request_id)
    env: EnvSession | None = None
    renderer: RendererSession | None = None
    try:
        env = await EnvSession.open(
            pools.env_pool(request), request.task_index, request.task, timeout=_budget(scope, ceiling)
        )
        tools = env.tools or None
        state.messages = list(env.messages)
        prompt_ids: list[int] = []
        branch = 0
        final: ScoreOut | None = None
        if request.mode == "token":
            renderer = await RendererSession.open(
                pools.renderer_pool(), request.client.model, request.renderer, timeout=_budget(scope, ceiling)
            )
            prompt_ids = await renderer.start(state.messages, tools, timeout=_budget(scope, ceiling))
        for _ in range(request.max_turns):
            if request.mode == "token":
                assert renderer is not None
                sampled = await complete_tokens(client, request.client.model, prompt_ids, request.sampling)
                parsed = await renderer.parse(sampled.completion_ids, tools, timeout=_budget(scope, ceiling))
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
                    policy_version=request.policy_version or 0,
                )
            else:
                sampled = await complete_chat(
                    client, request.client.model, state.messages, tools, request.sampling
                )
                assistant = sampled.message
                turn = _chat_turn(sampled, request.policy_version or 0)
            state.turns.append(turn)
            state.messages.append(assistant)
            step = await env.step(assistant, timeout=_budget(scope, ceiling), score_if_done=True)
            state.messages.extend(step.messages)
            if step.done:
                final = step.score  # scored and ended on the env worker in the same call
                break
            if request.mode == "token":
                assert renderer is not None
                bridged = await renderer.bridge(
                    sampled.completion_ids,
                    sampled.finish_reason,
                    step.messages,
                    tools,
                    timeout=_budget(scope, ceiling),
                )
                prompt_ids, branch = bridged.prompt_ids, bridged.branch
                state.forked = state.forked or bridged.forked
        score = final if final is not None else await env.score(timeout=_budget(scope, ceiling))
        state.reward, state.components, state.metrics = (
            score.reward,
            dict(score.components),
            dict(score.metrics),
        )
        state.metrics.setdefault("turns", len(state.turns))
    finally:
        await _release(client, env, renderer)


def _chat_turn(sampled: Sampled, policy_version: int) -> Turn:
    message = sampled.message
    return Turn(
        prompt_ids=sampled.prompt_ids or [],
        completion_ids=sampled.completion_ids,
        logprobs=sampled.logprobs,
        finish_reason=sampled.finish_reason,
        content=message.get("content"),
        reasoning=message.get("reasoning_content"),
        tool_calls=[ToolCall(**view) for view in tool_call_views(message)],
        policy_version=policy_version,
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
