"""A session's direct line to its `EnvServer`: handle lookup, the call itself, and telling the pool.

A session's steps and score go from the rollout's process straight to the worker holding it, not through
the pool, and batched: every call this event loop makes of one worker in one tick travels in one
`call_many`. The worker answers each call that finished by the time the first did plus a short linger
(`server.BATCH_LINGER_S`); the rest come back from `collect`, so a slow step never holds a fast one back
for long. Turns that finish together (many rollouts' completions arriving in one tick) then cost one
Ray round trip, not one each. What the pool still has to know travels on the side:

- **The handle.** Asked of the pool once per worker per event loop (`server_handle`), then cached.
- **A death.** Ray fails a dead actor's calls within milliseconds (`ActorDiedError`). The session then
  asks the pool why the worker ended (`worker_lost`): the supervisor may have killed it as wedged, and
  that reason is what the caller gets; if the supervisor had not noticed yet, it retires the worker now.
- **A session ended by its scored step.** The pool drops it from placement (`forget_many`), one call
  per pool per event-loop tick, not awaited by the rollout: a lost notice only leaves the session to the
  pool's idle reaper, which asks the worker before closing anything.

Everything here has a deadline; nothing raises except `EnvCallFailed` (and `CancelledError`).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any, Literal

from ray.exceptions import ActorDiedError, RayError

from env_actors.interface import EnvResponse
from env_actors.server import DEADLINE_FAILURE
from env_actors.supervisor import exit_detail, resolve
from rollout_actors.wire import Failure

logger = logging.getLogger(__name__)

DIRECT_CALL_SLACK_S = 0.5
"""The worker enforces each call's deadline itself; waiting this much longer only matters when it cannot
answer at all (a frozen process the supervisor has not retired yet)."""
POOL_NOTICE_TIMEOUT_S = 5.0  # asking the pool for a handle or why a worker died; forgetting sessions


FailureKind = Literal["infrastructure", "caller"]


class EnvCallFailed(Exception):
    """An env call failed; `.failure` says how and where, `.kind` whose fault it was."""

    def __init__(
        self, failure: Failure, kind: FailureKind = "infrastructure", worker_exit: str | None = None
    ):
        super().__init__(f"{failure.type}: {failure.message}")
        self.failure = failure
        self.kind: FailureKind = kind
        self.worker_exit = worker_exit


def unwrap(response: EnvResponse, method: str) -> Any:
    """The value of a successful `EnvResponse`; a failed one raised as `EnvCallFailed`."""
    if not response.success:
        failure = response.error or Failure(type="EnvCallFailed", message=f"{method} failed")
        kind: FailureKind = "caller" if response.kind == "caller" else "infrastructure"
        raise EnvCallFailed(failure, kind, response.worker_exit)
    return response.value


async def call_server(
    pool: Any,
    server: Any,
    worker: str,
    method: str,
    session_id: str,
    args: tuple,
    timeout: float,
    **kwargs: Any,
) -> Any:
    """`server.<method>(session_id, *args, timeout, **kwargs)` straight to the worker, in one `call_many`
    with every call this loop makes of that worker in the same tick; every failure an `EnvCallFailed`.
    A caller that gives up stops waiting; the call itself ends with its session (`close`)."""
    call = (method, session_id, args, timeout, kwargs)
    try:
        response: EnvResponse = await asyncio.wait_for(
            _state().call(server, call), timeout + DIRECT_CALL_SLACK_S
        )
    except TimeoutError:
        message = f"env worker {worker} gave no answer to {method} within {timeout + DIRECT_CALL_SLACK_S:g} s"
        raise EnvCallFailed(Failure(type=DEADLINE_FAILURE, message=message)) from None
    except ActorDiedError as exc:
        reason = await _why_lost(pool, worker, exit_detail(exc))
        message = f"env worker {worker} was lost during {method}: {reason}"
        raise EnvCallFailed(Failure(type="EnvWorkerLost", message=message), worker_exit=reason) from None
    except RayError as exc:  # unreachable for now (a network blip, a node under pressure): not judged here
        failure = Failure.from_exception(exc)
        raise EnvCallFailed(failure) from None
    return unwrap(response, method)


async def server_handle(pool: Any, worker: str) -> Any | None:
    """The worker's handle, from this loop's cache or the pool; None when the pool has no such ready
    worker (the caller then relays through the pool, which answers for a lost worker)."""
    return await _state().handle(pool, worker)


def forget_later(pool: Any, session_id: str) -> None:
    """Tell the pool, with every other session this loop ended in this tick, that the session is over."""
    _state().forget(pool, session_id)


async def _why_lost(pool: Any, worker: str, detail: str) -> str:
    try:
        return await asyncio.wait_for(resolve(pool.worker_lost.remote(worker, detail)), POOL_NOTICE_TIMEOUT_S)
    except Exception:  # the pool is gone or busy: Ray's word is all there is
        return f"died: {detail}"


def _actor_key(handle: Any) -> Any:
    to_hex = getattr(getattr(handle, "_actor_id", None), "hex", None)  # stable across handle copies
    return to_hex() if callable(to_hex) else id(handle)


class _LoopState:
    """Per event loop (futures belong to one loop): cached handles and pending forget notices."""

    def __init__(self) -> None:
        self._handles: dict[tuple[Any, str], asyncio.Task[Any]] = {}
        self._forgets: dict[Any, tuple[Any, list[str]]] = {}
        self._calls: dict[Any, tuple[Any, list[tuple], list[asyncio.Future[Any]]]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    async def call(self, server: Any, call: tuple) -> EnvResponse:
        """One session call, sent with this tick's other calls to the same worker."""
        key = _actor_key(server)
        batch = self._calls.get(key)
        if batch is None:
            batch = self._calls[key] = (server, [], [])
            self._own(self._flush_calls(key))
        waiter = asyncio.get_running_loop().create_future()
        batch[1].append(call)
        batch[2].append(waiter)
        return await waiter

    async def _flush_calls(self, key: Any) -> None:
        await asyncio.sleep(0)  # every call asked of this worker in this tick joins the batch
        server, calls, waiters = self._calls.pop(key)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(call[3] for call in calls) + DIRECT_CALL_SLACK_S
        try:
            replies = await asyncio.wait_for(server.call_many.remote(calls), deadline - loop.time())
            by_ticket = {ticket: waiter for (ticket, _), waiter in zip(replies, waiters, strict=True)}
            while by_ticket:
                for ticket, answer in replies:
                    if answer is None:
                        continue
                    waiter = by_ticket.pop(ticket)
                    if not waiter.done():  # else its caller gave up: the answer is dropped
                        waiter.set_result(answer)
                if not by_ticket:
                    break
                replies = await asyncio.wait_for(
                    server.collect.remote(list(by_ticket)), deadline - loop.time()
                )
        except BaseException as exc:  # the worker died, or the batch outlived every call's deadline
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _own(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def handle(self, pool: Any, worker: str) -> Any | None:
        key = (_actor_key(pool), worker)
        task = self._handles.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() or task.result() is None)):
            task = self._handles[key] = asyncio.get_running_loop().create_task(self._ask(pool, worker))
        # Shielded: one session's deadline must not cancel the answer others wait on.
        return await asyncio.wait_for(asyncio.shield(task), POOL_NOTICE_TIMEOUT_S + 1.0)

    @staticmethod
    async def _ask(pool: Any, worker: str) -> Any | None:
        try:
            response: EnvResponse = await asyncio.wait_for(
                resolve(pool.server_handle.remote(worker)), POOL_NOTICE_TIMEOUT_S
            )
        except Exception:  # no handle is not fatal: the session relays through the pool
            return None
        return response.value if response.success else None

    def forget(self, pool: Any, session_id: str) -> None:
        key = _actor_key(pool)
        batch = self._forgets.get(key)
        if batch is None:
            batch = self._forgets[key] = (pool, [])
            self._own(self._flush(key))
        batch[1].append(session_id)

    async def _flush(self, key: Any) -> None:
        await asyncio.sleep(0)  # every session ended in this tick joins the notice
        pool, session_ids = self._forgets.pop(key)
        try:
            await asyncio.wait_for(resolve(pool.forget_many.remote(session_ids)), POOL_NOTICE_TIMEOUT_S)
        except Exception as exc:
            logger.debug("env pool did not take %d forget notices: %s", len(session_ids), exc)


_PER_LOOP: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopState] = weakref.WeakKeyDictionary()


def _state() -> _LoopState:
    loop = asyncio.get_running_loop()
    state = _PER_LOOP.get(loop)
    if state is None:
        state = _PER_LOOP[loop] = _LoopState()
    return state
