"""`EnvPool`: one environment served by supervised `EnvServer` actors, and how to start, find and stop one.

    pool = await start_env_pool("math", Ref("env_actors.examples.math_env:MathEnv"), EnvPoolConfig(), 120)
    session = await EnvSession.open(pool, task_index=3, task=None, timeout=60)   # see session.py
    ...
    await close_env_pool(pool)

The pool is an async actor that only waits (num_cpus=0). It places each new session on the least-busy ready
env server (`place_many`) and ends sessions (`end_session`), answering each call with an `EnvResponse` within the
call's deadline, whatever happens to the env server meanwhile. A session's reset, steps and score go straight
to its env server (`direct.py`): a relay would double every call's Ray round trips. The pool still hears of
everything it must know: a session that ended with its scored step (`forget_many`), an env server a session
saw die (`server_lost`), and, for its idle reaper, which sessions their env server has seen no call from.
Worker lifecycle (readiness, probes, budget, scaling) is the supervisor's job (`supervisor.py`).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import ray

from env_actors.config import EnvPoolConfig, EnvPoolStats
from env_actors.failures import (
    DuplicateEnvSession,
    EnvNoAnswer,
    EnvPoolClosed,
    EnvServerLost,
    EnvStartupError,
    NoLiveEnvServer,
    OwnerLost,
    UnexplainedEnvFailure,
)
from env_actors.interface import EnvResponse
from env_actors.sessions import OpenSessions
from env_actors.supervisor import EnvServers, ServerSlot
from rollout_actors.kernel import Failure, Ref
from rollout_actors.kernel.faults import exit_detail, ray_loss
from rollout_actors.kernel.renamed import warn_renamed
from rollout_actors.kernel.supervision import Health, Recent
from rollout_actors.kernel.tasks import kill_actor, resolve

__all__ = [
    "EnvPool",
    "EnvPoolConfig",
    "EnvStartupError",
    "close_env_pool",
    "get_env_pool",
    "start_env_pool",
    "stop_env_pool",  # the old name of close_env_pool
]

POOL_CALL_SLACK_S = 0.5
"""The server enforces each call's deadline itself; the pool waits this much longer, which only matters
when the server cannot answer at all (blocked loop, frozen process)."""
DEAD_SERVER_GRACE_S = 1.0
"""Ray fails a dead actor's in-flight calls itself within ~10-60 ms, and its answer is authoritative (a
value the env server returned before dying is kept), so a call whose env server died waits this long for it."""
POOL_MAX_CONCURRENCY = 10_000  # every in-flight env call of every rollout waits inside this actor
POOL_ACTOR_START_TIMEOUT_S = 60.0  # the pool actor's process start and first answer
POOL_STARTUP_SLACK_S = 10.0  # the pool's own answer, on top of the environment's readiness deadline
RETIRED_SHOWN = 32  # the newest retired servers `stats` names, with why they left
LOST_OWNER_MEMORY = 1_000  # lost owners remembered, so a placement one sent before dying is refused
SESSION_REAP_EVERY_S = 1.0


class EnvPool:
    """The supervisor actor of one environment. Use it through `start_env_pool` and `EnvSession`."""

    def __init__(self, name: str, env: Ref, config: EnvPoolConfig):
        self._name, self._config = name, config
        self._sessions = OpenSessions()
        """The one pool-side record of open sessions; the supervisor reads its per-server counts."""
        self._lost_owners: Recent[str, None] = Recent(LOST_OWNER_MEMORY)
        self._servers = EnvServers(name, env, config, self._sessions)
        self._supervisor = self._servers.supervisor
        self._started = False
        self._closed = False

    async def start(self, ready_timeout: float) -> EnvResponse:
        """Bring up the first env server (readiness handshake) and start supervising. Idempotent."""
        if not self._started and not self._closed:
            failure = await self._servers.start_first(ready_timeout)
            if failure is not None:
                self._closed = True
                return EnvResponse.failed(failure)
            self._started = True
            self._supervisor.tasks.keep(self._reap_idle_sessions, "reap idle sessions")
        if self._closed:
            return self._closed_response()
        return EnvResponse.ok({"num_tasks": self._servers.num_tasks})

    # ----------------------------------------------------------------------------- session calls

    async def end_session(self, session_id: str, timeout: float) -> EnvResponse:
        """End the session on its env server (which also stops a call of it still running there). Idempotent;
        a lost or unknown session is already ended."""
        session = self._sessions.get(session_id)
        if session is None:
            return EnvResponse.ok()
        self._forget(session_id)
        slot = self._supervisor.children.get(session.server)
        if slot is None or slot.state != "ready":
            return EnvResponse.ok()
        return await self._call(
            slot, "end_session", (session_id,), min(timeout, self._config.close_timeout_s)
        )

    async def place_many(
        self,
        session_ids: list[str],
        owner: str | None = None,
        wait_s: float = 0.0,
        known: list[str] | None = None,
    ) -> list[EnvResponse]:
        """Place new sessions on the least-busy ready env servers without starting them; each value is
        `{"server_name": name, "handle": handle}`. The opener then sends `reset` to the env server itself (batched
        with that env server's other calls, see `direct.py`), and ends the session with `end_session` if the reset
        fails. A placed session counts toward placement at once. With no ready env server but a replacement
        starting, placement waits for it up to `wait_s`; with none coming it fails at once. `owner`: the
        opening actor (see `close_owned`); one already lost gets nothing. `known`: servers whose handles the
        opener holds; a placement on one of them comes with `"handle": None`."""
        held = frozenset(known or ())
        answers = []
        for session_id in session_ids:
            if (refused := self._refused(session_id, owner)) is not None:
                answers.append(refused)
                continue
            slot = await self._supervisor.wait_for(self._servers.least_busy, wait_s)
            if slot is None:
                answers.append(self._no_live_server())
                continue
            self._sessions.add(session_id, slot.name, time.monotonic(), owner)
            handle = None if slot.name in held else slot.handle
            answers.append(EnvResponse.ok({"server_name": slot.name, "handle": handle}, slot.name))
        return answers

    async def place_alone(self, session_id: str, owner: str | None, wait_s: float) -> EnvResponse:
        """Place a new session alone on a server started for it (quarantine: the request's earlier
        dispatches lost env servers at one point among other sessions, so a loss here names it). That
        server takes no other session while this one is open, then serves like any other; its spawn is
        the request's cost, bounded by its dispatches, not the restart budget's. Waits for it up to
        `wait_s`; the value is as `place_many`'s, with the handle."""
        if (refused := self._refused(session_id, owner)) is not None:
            return refused
        slot = self._servers.spawn_alone(session_id)
        if slot is None:
            return self._no_live_server()
        await asyncio.wait({slot.up}, timeout=wait_s)
        if (refused := self._refused(session_id, owner)) is not None or slot.state != "ready":
            slot.alone_for = None  # it serves like any other server, once it is ready
            return refused or self._no_live_server()
        self._sessions.add(session_id, slot.name, time.monotonic(), owner)
        return EnvResponse.ok({"server_name": slot.name, "handle": slot.handle}, slot.name)

    def _refused(self, session_id: str, owner: str | None) -> EnvResponse | None:
        """Why a new session cannot be placed (the pool closed, its opener lost, its id taken), or None."""
        if self._closed:
            return self._closed_response()
        if owner is not None and owner in self._lost_owners:
            return EnvResponse.of(OwnerLost(f"the opener {owner} was lost; nothing is placed"))
        if session_id in self._sessions:
            return EnvResponse.of(DuplicateEnvSession(f"session id {session_id!r} is in use"))
        return None

    async def close_owned(self, owner: str) -> int:
        """The actor `owner` was lost (a rollout worker killed or dead): end every session it opened, on
        its env server (the environment's `close` runs), now rather than at the idle timeout. A placement it
        sent before dying and that arrives later is refused. Returns how many sessions were ended."""
        self._lost_owners[owner] = None
        owned = self._sessions.owned_by(owner)
        await asyncio.gather(*(self.end_session(sid, self._config.close_timeout_s) for sid in owned))
        return len(owned)

    async def forget_many(self, session_ids: list[str]) -> int:
        """Sessions that ended on their env server with a scored step: drop them from placement."""
        known = [sid for sid in session_ids if sid in self._sessions]
        for session_id in known:
            self._forget(session_id)
        return len(known)

    async def server_lost(self, server_name: str, detail: str, session_id: str | None = None) -> tuple:
        """A session's direct call found env server `server_name` dead: retire it now if the supervisor has
        not yet (its replacement starts at once), and say why and how it ended: (why, `wedged` where the supervisor
        judged it so and killed it, else `died`, whether `session_id`'s own call wedged it: None when the
        server named no call)."""
        slot = self._supervisor.children.get(server_name)
        if slot is not None:
            self._supervisor.retire(slot, f"died: {detail}", "died")
        retired = self._supervisor.retired.get(server_name)
        reason, cause = retired.gone.result() if retired else (f"died: {detail}", "died")
        how = "wedged" if cause == "wedged" else "died"
        named = None  # the call that wedged it, else the one session it held (alone, it lost it)
        if retired is not None:
            named = (retired.blocking if how == "wedged" else None) or retired.only_session
        culprit = None if named is None or session_id is None else named == session_id
        return reason, how, culprit

    async def server_unreachable(self, server_name: str) -> None:
        """A session's direct call could not reach env server `server_name` (its node lost or cut off): place
        nothing more on it until it answers a probe again; the supervisor judges it wedged if it never does."""
        slot = self._supervisor.children.get(server_name)
        if slot is not None:
            slot.unreachable_at = time.monotonic()

    async def num_tasks(self) -> EnvResponse:
        """How many tasks the environment has (learned at readiness)."""
        if self._servers.num_tasks is None:
            return self._no_live_server()
        return EnvResponse.ok(self._servers.num_tasks)

    async def health(self) -> Health:
        """Liveness for the plane's supervisor: answered on the loop that serves every placement, so an
        answer means that loop turns (`loop_stall_s` is 0 by construction)."""
        return Health(pid=os.getpid(), node_id=ray.get_runtime_context().get_node_id())

    async def stats(self) -> EnvPoolStats:
        sup = self._supervisor
        return EnvPoolStats(
            name=self._name,
            servers=[w.info(self._sessions.on(w.name)) for w in sup.children.values()],
            ready=len(sup.ready()),
            starting=len(sup.starting()),
            sessions=len(self._sessions),
            num_tasks=self._servers.num_tasks,
            spawns=sup.spawns,
            spawn_failures=sup.spawn_failures,
            deaths=sup.deaths,
            restarts_left=sup.budget.remaining(),
            budget_denials=sup.budget_denials,
            culprit_replacements=sup.spawned_for["blamed"],
            quarantined=sup.spawned_for["quarantine"],
            spawning_stopped=sup.stopped,
            retired=[
                f"{name}: {c.gone.result()[0]}" for name, c in list(sup.retired.items())[-RETIRED_SHOWN:]
            ],
        )

    async def close(self) -> EnvPoolStats:
        """Stop supervising and kill every env server; in-flight calls fail at once. Idempotent."""
        self._closed = True
        await self._supervisor.close()
        return await self.stats()

    # ---------------------------------------------------------------------------------- internals

    async def _call(self, slot: ServerSlot, method: str, args: tuple, timeout_s: float) -> EnvResponse:
        """One call on one env server, answered within `timeout_s` + slack whatever the server does."""
        ref = getattr(slot.handle, method).remote(*args, timeout_s)
        call = asyncio.ensure_future(resolve(ref))
        slot.inflight += 1
        try:
            await asyncio.wait(
                {call, slot.gone}, timeout=timeout_s + POOL_CALL_SLACK_S, return_when=asyncio.FIRST_COMPLETED
            )
            if not call.done() and slot.gone.done() and slot.gone.result()[1] == "died":
                await asyncio.wait({call}, timeout=DEAD_SERVER_GRACE_S)
            if call.done():
                return self._answer(slot, method, call)
            call.cancel()
            if slot.gone.done():
                reason = slot.gone.result()[0]
                message = f"env server {slot.name} was retired during {method}: {reason}"
                return EnvResponse.of(EnvServerLost(message), server_name=slot.name, server_exit=reason)
            message = (
                f"{method} got no answer from env server {slot.name} within its {timeout_s:g} s deadline"
            )
            return EnvResponse.of(EnvNoAnswer(message), server_name=slot.name)
        finally:
            slot.inflight -= 1

    def _answer(self, slot: ServerSlot, method: str, call: asyncio.Future) -> EnvResponse:
        exc = call.exception()
        if exc is None:
            return call.result()
        if ray_loss(exc) == "died":
            detail = exit_detail(exc)
            self._supervisor.retire(slot, f"died: {detail}", "died")
            died = EnvServerLost(
                f"env server {slot.name} died during {method}: {detail}", type_name=type(exc).__name__
            )
            return EnvResponse.of(died, server_name=slot.name, server_exit=detail)
        return EnvResponse.failed(Failure.from_exception(exc), server_name=slot.name)

    def _forget(self, session_id: str) -> None:
        session = self._sessions.pop(session_id)
        slot = self._supervisor.children.get(session.server) if session else None
        if slot is not None and slot.alone_for == session_id:
            slot.alone_for = None  # its quarantine is over: it serves like any other server
        if slot is not None and not self._sessions.on(slot.name):
            slot.idle_since = time.monotonic()

    async def _reap_idle_sessions(self) -> None:
        """Close sessions untouched for `session_idle_timeout_s`: their owner is gone without closing. Steps
        bypass the pool, so a session idle here is only a candidate: its env server says whether it is."""
        idle_s = self._config.session_idle_timeout_s
        while not self._closed:
            await asyncio.sleep(SESSION_REAP_EVERY_S)
            cutoff = time.monotonic() - idle_s
            candidates: dict[str, list[str]] = {}
            for session_id, session in self._sessions.quiet_since(cutoff):
                candidates.setdefault(session.server, []).append(session_id)
            for server_name, session_ids in candidates.items():
                slot = self._supervisor.children.get(server_name)
                if slot is None or slot.state != "ready":
                    continue
                try:
                    idle = await asyncio.wait_for(
                        resolve(slot.handle.idle_sessions.remote(session_ids, idle_s)),
                        self._config.probe_timeout_s,
                    )
                except (
                    Exception
                ):  # dead or wedged: the supervisor deals with the env server, and its sessions
                    continue
                now = time.monotonic()
                for session_id in session_ids:
                    if session_id not in self._sessions:
                        continue
                    if session_id in idle:
                        self._supervisor.tasks.own(self.end_session(session_id, self._config.close_timeout_s))
                    else:
                        self._sessions.touch(
                            session_id, now
                        )  # busy on its env server: asked again a timeout later

    def _no_live_server(self) -> EnvResponse:
        sup = self._supervisor
        detail = f"{len(sup.starting())} starting, {sup.budget.remaining()} restarts left"
        if sup.stopped:
            detail += f"; spawning stopped: {sup.stopped}"
        message = (
            f"no live env server in pool {self._name!r} ({detail}); failing at once rather than queueing"
        )
        return EnvResponse.of(NoLiveEnvServer(message))

    def _closed_response(self) -> EnvResponse:
        return EnvResponse.of(EnvPoolClosed(f"env pool {self._name!r} is shut down"))


_EnvPoolActor = ray.remote(max_restarts=0, max_task_retries=0)(EnvPool)


async def start_env_pool(
    name: str,
    env: Ref | dict,
    config: EnvPoolConfig | None = None,
    ready_timeout: float = 300.0,
    scheduling_strategy: Any = None,
) -> Any:
    """Create the named EnvPool actor and wait until its first env server is ready; return its handle.
    `scheduling_strategy`: where the pool actor itself goes (Ray's default when None).

    Raises `EnvStartupError` (the environment's own traceback in the message) on an import or load
    failure, as soon as it happens, or when nothing is ready within `ready_timeout`.
    """
    env = env if isinstance(env, Ref) else Ref.model_validate(env)
    config = config or EnvPoolConfig()
    try:
        handle = _EnvPoolActor.options(
            name=name,
            num_cpus=0,
            max_concurrency=POOL_MAX_CONCURRENCY,
            scheduling_strategy=scheduling_strategy,
        ).remote(name, env, config)
    except ValueError as exc:  # the name is taken
        raise EnvStartupError(f"cannot create env pool {name!r}: {exc}") from exc
    try:
        # The pool actor's own process start (slow on a loaded node) is bounded apart from the
        # environment's readiness deadline, which starts once the pool runs.
        await asyncio.wait_for(resolve(handle.health.remote()), POOL_ACTOR_START_TIMEOUT_S)
        response = await asyncio.wait_for(
            resolve(handle.start.remote(ready_timeout)), ready_timeout + POOL_STARTUP_SLACK_S
        )
    except asyncio.CancelledError:
        kill_actor(handle)
        raise
    except Exception as exc:
        kill_actor(handle)
        message = f"env pool {name!r} ({env.target}) did not start: {exc!r}"
        raise EnvStartupError(message, Failure.from_exception(exc)) from exc
    if not response.success:
        kill_actor(handle)
        failure = response.error or UnexplainedEnvFailure("the pool did not say why").failure
        message = f"env pool {name!r} could not start {env.target}: {failure.type}: {failure.message}"
        if failure.traceback:
            message += f"\n--- environment traceback ---\n{failure.traceback}"
        raise EnvStartupError(message, failure)
    return handle


def get_env_pool(name: str) -> Any:
    """The handle of a running env pool, by its actor name."""
    return ray.get_actor(name)


async def close_env_pool(handle: Any, timeout: float = 10.0) -> EnvPoolStats | None:
    """Close the pool (its env servers are killed) and kill the pool actor. Never raises."""
    stats = None
    try:
        stats = await asyncio.wait_for(resolve(handle.close.remote()), timeout)
    except Exception:  # a dead or wedged pool is killed below all the same
        pass
    kill_actor(handle)
    return stats


async def stop_env_pool(handle: Any, timeout: float = 10.0) -> EnvPoolStats | None:
    """The old name of `close_env_pool` (docs/design.md, "Words": close is the one stop verb)."""
    warn_renamed("stop_env_pool", "close_env_pool")
    return await close_env_pool(handle, timeout)
