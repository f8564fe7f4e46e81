"""The rollout loop: one request in, exactly one `Result` out.

A rollout owns three things and releases all of them in `finally`, whatever the exit path (ok, error,
cancel, deadline): its OpenAI client, its env session, its renderer slot (held by its turn strategy,
`turns.py`: token mode or chat mode). The loop itself is the same for both modes.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from env_actors.interface import RAW_TEXT_KEY, ScoreOut
from env_actors.session import EnvSession
from rollout_actors.kernel.coalescer import DEFAULT_BATCH_WINDOW_S
from rollout_actors.kernel.faults import Cancelled, DeadlineExceeded
from rollout_actors.rollout.agent.episode import run_agent_episode
from rollout_actors.rollout.client import build_client
from rollout_actors.rollout.failures import classify
from rollout_actors.rollout.turns import TokenTurns, TurnStrategy, strategy_for
from rollout_actors.timings import RolloutTimings, clock, since
from rollout_actors.wire import CallerError, Result, RolloutRequest, Turn

CLEANUP_TIMEOUT_S = (
    5.0  # releasing a renderer slot or ending a session must not hold a finished rollout hostage
)


class PoolDirectory(Protocol):
    """Where a rollout finds the shared actors it talks to."""

    def renderer_pool(self) -> Any: ...

    def env_pool(self, request: RolloutRequest) -> Any: ...


class PolicyState(Protocol):
    """What a rollout reads of the policy where it runs: the full-weight version its worker was told of,
    and the pauses the plane holds for weight updates (a `RolloutWorker` answers all four)."""

    def policy_version(self) -> int | None: ...

    def pause_epoch(self) -> int: ...

    async def unpaused(self, timeout: float) -> None: ...

    async def planned_resume(self, since_epoch: int, timeout: float) -> bool: ...


class FixedPolicy:
    """A `PolicyState` with no weight updates and no pauses: a rollout run outside a worker (tests, the
    single-process bench)."""

    def policy_version(self) -> int | None:
        return None

    def pause_epoch(self) -> int:
        return 0

    async def unpaused(self, timeout: float) -> None:
        return None

    async def planned_resume(self, since_epoch: int, timeout: float) -> bool:
        return False


@dataclass(frozen=True)
class PoolHandles:
    """The live pools one dispatch of a rollout talks to: the incarnations the plane named for it (it
    supervises them), as the worker resolved them (`pool_lookup.PoolLookup`)."""

    renderer: Any
    """The renderer pool; None for a chat-mode rollout while the renderer pool is being restarted."""
    env: Any
    """The request's env pool."""

    def renderer_pool(self) -> Any:
        if self.renderer is None:
            raise RuntimeError("the renderer pool was not handed to this dispatch")
        return self.renderer

    def env_pool(self, request: RolloutRequest) -> Any:
        return self.env


@dataclass(frozen=True)
class LoopLimits:
    call_timeout_s: float = 120.0
    """Ceiling for one renderer or env call; the rollout's remaining deadline caps it further."""
    batch_window_s: float = DEFAULT_BATCH_WINDOW_S
    """How long a loaded worker's renderer and env calls wait to travel together (`TickCoalescer`)."""


def _budget(scope: asyncio.Timeout, ceiling: float) -> float:
    """Seconds one remote call may take: its ceiling, capped by what is left of the rollout's deadline."""
    when = scope.when()
    assert when is not None
    return max(0.0, min(ceiling, when - asyncio.get_running_loop().time()))


async def run_rollout(
    request: RolloutRequest,
    pools: PoolDirectory,
    limits: LoopLimits = LoopLimits(),
    policy: PolicyState = FixedPolicy(),
    quarantine: bool = False,
) -> Result:
    """Run one rollout to its single result. Never raises: a cancelled rollout releases what it holds and
    answers `cancelled` with the turns it had sampled. `quarantine`: its env session runs alone on an env
    server of its own (`wire.Dispatch.quarantine`)."""
    started = time.time()
    state = _Trajectory()
    scope = asyncio.timeout(request.timeout_s)
    try:
        async with scope:
            await _run(request, pools, policy, limits, state, scope, quarantine)
        kind, error = "ok", None
    except TimeoutError as exc:
        if scope.expired():
            kind = "infrastructure"
            error = DeadlineExceeded(f"rollout exceeded its timeout_s of {request.timeout_s:g} s").failure
        else:  # a call's own deadline, not the rollout's
            kind, error = classify(exc)
    except asyncio.CancelledError:
        # Cleanup already ran (shielded, in `_run`'s finally); what was sampled is still reported.
        kind, error = "cancelled", Cancelled("rollout was cancelled").failure
    except Exception as exc:  # every failure becomes data here, classified on this side
        kind, error = classify(exc)
    return Result.of(
        request,
        kind,
        error=error,
        reward=state.reward if kind == "ok" else None,
        components=state.components,
        metrics=state.metrics,
        turns=state.turns,
        messages=state.messages if request.return_messages else [],
        forked=state.forked,
        policy_version_start=request.policy_version or 0,
        started_at=started,
        finished_at=time.time(),
        timings=state.timings,
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
    timings: RolloutTimings = field(default_factory=RolloutTimings)


async def _run(
    request: RolloutRequest,
    pools: PoolDirectory,
    policy: PolicyState,
    limits: LoopLimits,
    state: _Trajectory,
    scope: asyncio.Timeout,
    quarantine: bool = False,
) -> None:
    if request.client.base_url is None:
        # Without this the SDK would fall back to $OPENAI_BASE_URL or api.openai.com.
        raise CallerError("client.base_url is not set and the plane has no endpoints to give it one")
    ceiling = limits.call_timeout_s
    client = build_client(request.client, session_id=request.request_id)
    turns = strategy_for(request, client, pools, policy, lambda: _budget(scope, ceiling))
    env: EnvSession | None = None
    waits, started = state.timings, clock()
    try:
        env = await EnvSession.open(
            pools.env_pool(request),
            request.task_index,
            request.task,
            timeout=_budget(scope, ceiling),
            alone=quarantine,
        )
        waits.env_open_s = since(started)
        tools = env.tools or None
        state.messages = list(env.messages)
        final: ScoreOut | None = None
        if (
            request.mode == "agent"
        ):  # the environment's agent drives the turns (`rollout_actors.rollout.agent`)
            assert isinstance(turns, TokenTurns)
            left = lambda: _budget(scope, request.timeout_s)  # noqa: E731 - what remains of the rollout's deadline
            await run_agent_episode(request, env, turns, state.turns, state.messages, left)
        else:
            await turns.open(state.messages, tools)
        for _ in range(request.max_turns if request.mode != "agent" else 0):
            turn, for_env = await turns.sample(state.messages)
            state.turns.append(turn)
            state.messages.append({k: v for k, v in for_env.items() if k != RAW_TEXT_KEY})
            started = clock()
            step = await env.step(for_env, timeout=_budget(scope, ceiling), score_if_done=True)
            turn.timings.env_s = since(started)
            turn.reward = step.reward
            state.messages.extend(step.messages)
            if step.done:
                final = step.score  # scored and ended on the env worker in the same call
                break
            await turns.advance(step.messages)
        started = clock()
        score = final if final is not None else await env.score(timeout=_budget(scope, ceiling))
        waits.score_s = since(started) if final is None else 0.0
        state.reward, state.components, state.metrics = (
            score.reward,
            dict(score.components),
            dict(score.metrics),
        )
        state.metrics.setdefault("turns", len(state.turns))
    finally:
        state.forked = turns.forked
        waits.renderer_s, started = turns.slot_s, clock()
        try:
            await _release(client, env, turns)
        finally:
            waits.teardown_s = since(started)


async def _release(client: Any, env: EnvSession | None, turns: TurnStrategy) -> None:
    """Release everything the rollout owns. Shielded so a cancellation that lands mid-cleanup still lets
    the client close, the env session end and the renderer slot return."""

    async def release_all() -> None:
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT_S):  # a scope, not `wait_for`: no task per close
                await client.close()
        except Exception:
            pass
        if env is not None:
            await env.close(timeout=CLEANUP_TIMEOUT_S)
        try:
            async with asyncio.timeout(CLEANUP_TIMEOUT_S):
                await turns.close()
        except Exception:
            pass

    task = asyncio.ensure_future(release_all())
    try:
        await asyncio.shield(task)
    except asyncio.CancelledError:
        await task
        raise
