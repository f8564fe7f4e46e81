"""One `run` of the serve protocol: one supervised episode on the env pool, answered by exactly one reply.

    reply = await serve_run(pools, payload, send_delta, timeout_s=3600.0)   # packed RunResponse bytes

`pools(timeout, verify)` answers the serving env pool's handle for each dispatch (the front's supervised
pool: one lost is restarted, and a re-dispatch waits for it, `verify` asking that it be checked alive).

Why not `RolloutPlane.submit`: a plane rollout answers one `Result` at its end, from a rollout worker
that drives the environment step by step; here verifiers' own code drives the episode on the env server
and the client must see its trace deltas as they are produced (its assembly is built from them). So a
run goes straight to the env pool, the way a rollout worker's `EnvSession` does (`env_actors.direct`:
the same placement, the same verdict on a lost server from its supervisor), and keeps the plane's
exactly-once rules by calling the plane's own rule (`plane.redispatch.REDISPATCH`):

- A run lost before it streamed a delta (its env server died, wedged or became unreachable) is
  dispatched again under the same lease, at most twice; one lost the same way at the same point twice is
  poison, answered and not dispatched again; a run nobody is left to serve is answered at once.
- A run that has streamed a delta is never dispatched again: the client's assembly would mix two
  episodes. Its loss is its answer: `success=False`, the error naming the part and the cause.

Every frame is awaited under the run's deadline; whatever happens, the caller gets reply bytes (or the
run's `CancelledError`, which the front answers as verifiers does).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from env_actors.direct import EnvCallFailed, forget_later, place, why_lost
from rollout_actors.kernel import Failure, Loss, new_id
from rollout_actors.kernel.faults import PartLost, Unavailable, exit_detail, ray_errors
from rollout_actors.plane.pool_supervisor import PoolUnavailable
from rollout_actors.plane.redispatch import REDISPATCH, RedispatchRule

logger = logging.getLogger(__name__)

FRAME_SLACK_S = 5.0
"""Past the episode's deadline (which the env server enforces itself, answering a `failed` frame), how
long the front waits for a frame: only a server that cannot answer at all needs it, and its supervisor
kills one that is wedged well within `hang_timeout_s`."""
CLOSE_TIMEOUT_S = 5.0  # ending an abandoned session on its server
RUN_CALL = "run"
"""`Loss.call` of a lost run: a run lost before its first delta is lost at step 0."""

SendDelta = Callable[[bytes], Awaitable[None]]
Pools = Callable[[float, bool], Awaitable[Any]]
"""(timeout, verify) -> the serving env pool's handle, or `PoolUnavailable`."""


def failure_reply(failure: Failure) -> bytes:
    """A `success=False` reply (verifiers' `BaseResponse`) whose error is a typed failure rendered as text."""
    return pack_reply({"success": False, "error": f"{failure.type}: {failure.message}"})


def pack_reply(response: dict[str, Any]) -> bytes:
    return msgpack.packb(response, use_bin_type=True)


@dataclass
class _Attempt:
    """What one dispatch of the run produced."""

    reply: bytes | None = None
    failure: Failure | None = None
    lost: Loss | None = None
    deltas: int = 0


async def serve_run(
    pools: Pools,
    payload: bytes,
    send_delta: SendDelta,
    *,
    timeout_s: float,
    rule: RedispatchRule = REDISPATCH,
) -> bytes:
    """Run one `run` request's episode on `pool` and return its reply (packed). Never raises but
    `CancelledError`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    lease_id = new_id("serve")
    losses: list[Loss] = []
    alone = False
    while True:
        try:
            pool = await pools(max(0.0, deadline - loop.time()), bool(losses))
        except PoolUnavailable as exc:  # no pool serving (its restart budget spent): answered at once
            return failure_reply(exc.failure)
        attempt = await _dispatch(pool, payload, send_delta, deadline, alone)
        if attempt.reply is not None:
            return attempt.reply
        assert attempt.failure is not None
        if attempt.lost is None:
            return failure_reply(attempt.failure)
        if attempt.deltas:
            message = (
                f"{attempt.failure.message}; it had streamed {attempt.deltas} delta(s), so it is not "
                "dispatched again (the client's assembly would mix two episodes)"
            )
            return failure_reply(PartLost(message, lost=attempt.lost, type_name=attempt.failure.type).failure)
        losses.append(attempt.lost)
        decision = rule.decide(losses)
        if decision == "poison":
            return failure_reply(rule.poison(losses, attempt.failure)[1])
        if decision == "spent" or loop.time() >= deadline:
            chain = "; ".join(loss.describe() for loss in losses)
            return failure_reply(
                Unavailable(f"run {lease_id} lost its env server {len(losses)} time(s) ({chain})").failure
            )
        alone = (
            decision == "quarantine"
        )  # suspected, not proven: alone on a server of its own, a death names it
        logger.info("serve-env run %s re-dispatched after %s", lease_id, attempt.lost.describe())


async def _dispatch(
    pool: Any, payload: bytes, send_delta: SendDelta, deadline: float, alone: bool = False
) -> _Attempt:
    loop = asyncio.get_running_loop()
    session_id = new_id("envsess")
    attempt = _Attempt()
    try:
        server_name, server = await place(pool, session_id, max(0.0, deadline - loop.time()), alone)
    except EnvCallFailed as exc:  # no live server, the pool closed or gone: nothing to dispatch to
        attempt.failure = exc.failure
        return attempt
    try:
        await _stream(server, server_name, session_id, payload, send_delta, deadline, attempt)
    except PartLost as exc:
        detail = exit_detail(exc.__cause__ or exc)
        reason, how, culprit = await why_lost(pool, server_name, detail, session_id)
        attempt.lost = Loss(
            part="env server", how=how, call=RUN_CALL, step=0, name=server_name, culprit=culprit
        )
        attempt.failure = PartLost(
            f"env server {server_name} {how} during the run: {reason}", lost=attempt.lost
        ).failure
    except TimeoutError:
        message = f"env server {server_name} sent no frame of the run before its deadline"
        attempt.failure = Unavailable(message).failure
    except StopAsyncIteration:  # the server's stream always ends with a reply or failed frame
        attempt.failure = Unavailable(f"env server {server_name} ended the run's stream unanswered").failure
    finally:
        if attempt.reply is not None:
            forget_later(pool, session_id)  # ended on its server with the episode
        else:  # failed, lost or cancelled: the session (and an episode still running) is ended there
            _end_session(pool, session_id)
    return attempt


async def _stream(
    server: Any,
    server_name: str,
    session_id: str,
    payload: bytes,
    send_delta: SendDelta,
    deadline: float,
    attempt: _Attempt,
) -> None:
    loop = asyncio.get_running_loop()
    with ray_errors("env server", server_name, call=RUN_CALL, step=0):
        stream = server.serve_run.remote(session_id, payload, max(0.0, deadline - loop.time()))
        while True:
            wait_s = max(0.0, deadline - loop.time()) + FRAME_SLACK_S
            ref = await asyncio.wait_for(stream.__anext__(), wait_s)
            kind, frame = await asyncio.wait_for(ref, wait_s)
            if kind == "delta":
                await send_delta(frame)
                attempt.deltas += 1
            elif kind == "reply":
                attempt.reply = frame
                return
            else:
                attempt.failure = Failure.model_validate(frame)
                return


def _end_session(pool: Any, session_id: str) -> None:
    try:
        pool.end_session.remote(session_id, CLOSE_TIMEOUT_S)  # a notice: the caller has its answer already
    except Exception:  # a dead pool has no sessions to end
        pass
