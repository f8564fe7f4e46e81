"""A session's direct line to its `EnvServer`: handle lookup, the call itself, and telling the pool.

A session's steps and score go from the rollout's process straight to the server holding it, not through
the pool, and batched: every call this event loop makes of one server in one tick travels in one
`call_many`. The server answers each call that finished by the time the first did plus a short linger
(`server.BATCH_LINGER_S`); the rest come back from `collect`, so a slow step never holds a fast one back
for long. Turns that finish together (many rollouts' completions arriving in one tick) then cost one
Ray round trip, not one each. What the pool still has to know travels on the side:

- **Placement.** The pool picks the server (`place_many`, one call per pool per tick for every session
  this loop opens) and hands back its handle, unless this process holds it already (`SERVERS`); the
  session's reset then goes to the server directly.
- **A death.** Ray fails a dead actor's calls within milliseconds (`ActorDiedError`). The session then
  asks the pool why the server ended (`server_lost`): the supervisor may have killed it as wedged, and
  that reason is what the caller gets; if the supervisor had not noticed yet, it retires the server now.
- **A session ended by its scored step.** The pool drops it from placement (`forget_many`), one call
  per pool per event-loop tick, not awaited by the rollout: a lost notice only leaves the session to the
  pool's idle reaper, which asks the server before closing anything.

Everything here has a deadline; nothing raises except `EnvCallFailed` (and `CancelledError`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, Literal

from env_actors.failures import (
    EnvNoAnswer,
    EnvServerLost,
    EnvServerUnreachable,
    PoolUnreachable,
    UnexplainedEnvFailure,
)
from env_actors.interface import EnvCall, EnvResponse, SessionMethod
from rollout_actors.kernel import Failure, Loss, process_owner
from rollout_actors.kernel.coalescer import (
    KnownHandles,
    TickBatch,
    TickCoalescer,
    actor_key,
    answer_when,
    count_sent,
    per_loop,
)
from rollout_actors.kernel.faults import Fault, exit_detail, is_ray_error, ray_lost
from rollout_actors.kernel.renamed import warn_renamed
from rollout_actors.kernel.tasks import resolve

logger = logging.getLogger(__name__)

DIRECT_CALL_SLACK_S = 0.5
"""The server enforces each call's deadline itself; waiting this much longer only matters when it cannot
answer at all (a frozen process the supervisor has not retired yet)."""
POOL_NOTICE_TIMEOUT_S = 5.0  # asking the pool for a handle or why a server died; forgetting sessions
WHY_LOST_TIMEOUT_S = 15.0  # the pool's verdict on a lost server: worth waiting for, it decides poison
MAX_PLACE_WAIT_S = 60.0  # a placement waits at most this for a replacement server: a spawn's order of time

SERVERS = KnownHandles()
"""env server name -> the handle this process's sessions share (names are unique per incarnation:
`supervisor.Supervisor.create`); placements on a server held here arrive without a handle."""


FailureKind = Literal["env", "infrastructure", "caller"]


class EnvCallFailed(Fault):
    """An env call failed; `.failure` (typed where it failed: `env_actors.failures`, or the environment's
    own exception) says how and where (its `fault` and, for a lost env server, its `lost`), `.kind`
    whose fault it was: `caller`, `env` (environment code) or `infrastructure` (ours)."""

    def __init__(
        self, failure: Failure, kind: FailureKind = "infrastructure", server_exit: str | None = None
    ):
        super().__init__(f"{failure.type}: {failure.message}", kind=kind, carries=failure)
        self.server_exit = server_exit

    @classmethod
    def of(cls, fault: Fault, server_exit: str | None = None) -> EnvCallFailed:
        """`fault`, raised on the rollout's side as its class says (its kind)."""
        return cls(fault.failure, fault.kind, server_exit)  # type: ignore[arg-type]

    @property
    def worker_exit(self) -> str | None:
        """The old name of `server_exit` (docs/design.md, "Words": a worker is a rollout worker)."""
        warn_renamed("EnvCallFailed.worker_exit", "server_exit")
        return self.server_exit


def unwrap(response: EnvResponse, method: str) -> Any:
    """The value of a successful `EnvResponse`; a failed one raised as `EnvCallFailed`."""
    if not response.success:
        failure = response.error or UnexplainedEnvFailure(f"{method} failed").failure
        kind: FailureKind = response.kind if response.kind in ("caller", "env") else "infrastructure"  # type: ignore[assignment]
        raise EnvCallFailed(failure, kind, response.server_exit)
    return response.value


async def call_server(
    pool: Any,
    server: Any,
    server_name: str,
    method: SessionMethod,
    session_id: str,
    args: tuple,
    timeout: float,
    score_if_done: bool = False,
    step: int | None = None,
) -> Any:
    """`server.<method>(session_id, *args, timeout)` straight to the server, in one `call_many` with every
    call this loop makes of that server in the same tick; every failure an `EnvCallFailed`, a lost server
    one whose `failure.lost` names the call and the session's `step`. A caller that gives up stops
    waiting; the call itself ends with its session (`close`)."""
    call = EnvCall(method, session_id, args, timeout, score_if_done)
    try:
        async with asyncio.timeout(timeout + DIRECT_CALL_SLACK_S):  # a scope: no task per call
            response: EnvResponse = await _call(server, call)
    except TimeoutError:
        # The server enforces the call's deadline itself (an `env` failure). No answer at all past it:
        # the rollout's own time ran out, or the server cannot answer; the supervisor judges the server
        # (a wedge it kills reaches the sessions on it as a loss), the rollout stops here.
        message = (
            f"env server {server_name} gave no answer to {method} within {timeout + DIRECT_CALL_SLACK_S:g} s"
        )
        raise EnvCallFailed.of(EnvNoAnswer(message)) from None
    except Exception as exc:
        lost = ray_lost(exc, "env server", server_name, call=method, step=step)
        if lost is None:
            if not is_ray_error(exc):
                raise
            raise EnvCallFailed(Failure.from_exception(exc)) from None  # anything else Ray says: not judged
        raise await _server_lost(pool, lost, exit_detail(exc), session_id) from None
    return unwrap(response, method)


async def _server_lost(pool: Any, lost: Loss, detail: str, session_id: str) -> EnvCallFailed:
    """The session's server, which Ray says was lost (`lost`), as the rollout is told of it."""
    server_name = lost.name or ""
    if lost.how == "unreachable":
        # Its node is unreachable (lost, or not yet declared dead, which takes Ray tens of seconds): the
        # session cannot go on. Whether the server is dead is the supervisor's call (hang_timeout_s);
        # for the rollout it is a lost part, and the pool places nothing more on it.
        _notice_unreachable(pool, server_name)
        reason, cls = detail, EnvServerUnreachable
    else:
        # The supervisor may have killed it as wedged: that, not Ray's "killed", is how it was lost.
        reason, how, culprit = await why_lost(pool, server_name, detail, session_id)
        lost, cls = lost.model_copy(update={"how": how, "culprit": culprit}), EnvServerLost
    message = f"env server {server_name} was lost during {lost.call}: {reason}"
    return EnvCallFailed.of(cls(message, lost=lost), server_exit=reason)


async def place(pool: Any, session_id: str, timeout: float, alone: bool = False) -> tuple[str, Any]:
    """(server name, handle) the pool placed the new session on; `EnvCallFailed` if it could not. `alone`:
    on a server started for it alone (quarantine: rare, so asked on its own, not batched)."""
    if not alone:
        value = await pool_call(_place(pool, session_id, timeout), timeout, "place")
        return value["server_name"], value["handle"]
    wait_s = min(timeout, MAX_PLACE_WAIT_S)
    answer = resolve(pool.place_alone.remote(session_id, process_owner(), wait_s))
    value = await pool_call(answer, wait_s + POOL_NOTICE_TIMEOUT_S, "place")
    return value["server_name"], SERVERS.keep(value["server_name"], value["handle"], {})


async def pool_call(answer: Awaitable[EnvResponse], wait_s: float, method: str) -> Any:
    """Await one answer of the pool within `wait_s`; every way it can fail is an `EnvCallFailed`."""
    try:
        response = await asyncio.wait_for(answer, wait_s)
    except TimeoutError:
        message = f"env pool gave no answer to {method} within {wait_s:g} s"
        raise EnvCallFailed.of(EnvNoAnswer(message)) from None
    except Exception as exc:  # the pool actor itself died or is unreachable
        if not is_ray_error(exc):
            raise
        failure = Failure.from_exception(exc)
        lost = ray_lost(exc, "env pool", call=method)
        raise EnvCallFailed.of(
            PoolUnreachable(failure.message, traceback=failure.traceback, lost=lost)
        ) from exc
    return unwrap(response, method)


def forget_later(pool: Any, session_id: str) -> None:
    """Tell the pool, with every other session this loop ended in this tick, that the session is over."""
    _forget(pool, session_id)


def _notice_unreachable(pool: Any, server_name: str) -> None:
    try:
        pool.server_unreachable.remote(server_name)  # a notice: nobody waits for its answer
    except Exception:  # the pool is gone: nothing to tell
        pass


async def why_lost(pool: Any, server_name: str, detail: str, session_id: str) -> tuple[str, Any, bool | None]:
    """(why, how, culprit) the server ended, as its pool's supervisor judged it: `died` or `wedged`, and
    whether this session's own call was the one that wedged it."""
    try:
        reason, how, culprit = await asyncio.wait_for(
            resolve(pool.server_lost.remote(server_name, detail, session_id)), WHY_LOST_TIMEOUT_S
        )
        return reason, how, culprit
    except Exception:  # the pool is gone or busy: Ray's word is all there is, and no verdict on the
        # request: the loss is not held against it (it cannot make it poison; its own bound still holds)
        return f"died: {detail} (its pool did not say why)", "died", False


def _send_calls(batch: TickBatch) -> None:
    """One `call_many` for a tick's calls to one server, then `collect` until every call is answered.
    Answered by callbacks (`answer_when`), not a task: see `batching._send_calls`."""
    live = [
        (call, waiter) for call, waiter in zip(batch.items, batch.waiters, strict=True) if not waiter.done()
    ]
    if not live:  # every caller gave up within the tick: nothing to send
        return
    server, calls = batch.target, [call for call, _ in live]
    deadline = asyncio.get_running_loop().time() + max(call.timeout_s for call in calls) + DIRECT_CALL_SLACK_S
    waiting = TickBatch(server, [], [waiter for _, waiter in live], deadline)
    answer_when(server.call_many.remote(calls), deadline, waiting, _deliver_replies)


def _deliver_replies(batch: TickBatch, replies: Any) -> None:
    """The `call_many` answer, one reply per call in order: it numbers the waiters by their tickets."""
    batch.items = [reply.ticket for reply in replies]
    _deliver_collected(batch, replies)


def _deliver_collected(batch: TickBatch, replies: Any) -> None:
    """Answer the calls `replies` answered (`batch.items`: the waiters' tickets); `collect` the rest."""
    by_ticket = dict(zip(batch.items, batch.waiters, strict=True))
    for reply in replies:
        if reply.response is None:
            continue
        waiter = by_ticket.pop(reply.ticket)
        if not waiter.done():  # else its caller gave up: the answer is dropped
            waiter.set_result(reply.response)
    if by_ticket:
        rest = TickBatch(batch.target, list(by_ticket), list(by_ticket.values()), batch.deadline)
        answer_when(_collect(batch.target, rest.items), batch.deadline, rest, _deliver_collected)


def _collect(server: Any, tickets: list[int]) -> Any:
    """The answers of a batch's calls that were still running when it answered (one Ray call)."""
    count_sent(_collect, len(tickets))
    return server.collect.remote(tickets)


async def _send_places(batch: TickBatch) -> None:
    """One `place_many` for every session this loop opens on one pool in the tick; until `deadline` the
    pool may wait for a replacement server."""
    pool, session_ids = batch.target, batch.items
    wait_s = max(0.0, batch.deadline - asyncio.get_running_loop().time())
    known = SERVERS.snapshot()  # placements on these servers come without their handles
    answers = await asyncio.wait_for(
        resolve(pool.place_many.remote(session_ids, process_owner(), wait_s, list(known))),
        wait_s + POOL_NOTICE_TIMEOUT_S,
    )
    for session_id, waiter, answer in zip(session_ids, batch.waiters, answers, strict=True):
        if answer.success:
            answer.value["handle"] = SERVERS.keep(answer.value["server_name"], answer.value["handle"], known)
        if not waiter.done():
            waiter.set_result(answer)
        elif answer.success:  # its opener gave up meanwhile: the placement is ended at once
            _forget(pool, session_id)


async def _send_forgets(batch: TickBatch) -> None:
    """One `forget_many` notice for every session this loop ended on one pool in the tick; nobody waits."""
    try:
        await asyncio.wait_for(resolve(batch.target.forget_many.remote(batch.items)), POOL_NOTICE_TIMEOUT_S)
    except Exception as exc:
        logger.debug("env pool did not take %d forget notices: %s", len(batch.items), exc)
    for waiter in batch.waiters:
        waiter.set_result(None)


async def _call(server: Any, call: EnvCall) -> EnvResponse:
    """One session call, sent with this tick's other calls to the same server."""
    return await per_loop(TickCoalescer).add(("call", actor_key(server)), server, call, _send_calls)


async def _place(pool: Any, session_id: str, timeout: float) -> EnvResponse:
    """One placement, asked with every other session this loop opens on the pool in this tick. The pool
    may wait up to `timeout` for a replacement server when none is ready."""
    deadline = asyncio.get_running_loop().time() + min(timeout, MAX_PLACE_WAIT_S)
    return await per_loop(TickCoalescer).add(
        ("place", actor_key(pool)), pool, session_id, _send_places, deadline
    )


def _forget(pool: Any, session_id: str) -> None:
    per_loop(TickCoalescer).add(("forget", actor_key(pool)), pool, session_id, _send_forgets)
