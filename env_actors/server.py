"""`EnvServer`: the actor that loads one environment and holds the sessions placed on it.

It is "let it crash" code: it classifies every failure of environment code into an `EnvResponse` (the
traceback is formatted here, before Ray strips it at the actor boundary) and otherwise makes no decisions.
Deciding what a death or a stall means belongs to the supervisor (`supervisor.py`).

Three event loops, by design: calls arrive on Ray's default concurrency group and run their environment
code on the server's own loop (`env_loop.py` says why); `health` runs on the `probe` group, whose loop is
its own thread. A probe therefore answers while environment code blocks the env loop, and reports how
long that loop has been stalled (`loop_stall_s`): the supervisor treats a stall past `hang_timeout_s`
like a frozen process. Environment code stuck in a thread past its call's deadline (`env_calls`) is
reported the same way, its session named. A frozen (SIGSTOPped) or lost process answers nothing.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import ray

from env_actors.agent import AGENT_GUARD_SLACK_S, AgentEndpoint, run_agent_session
from env_actors.config import EnvCallLimits, EnvServerHealth
from env_actors.env_calls import CALL, CallTag, stuck_call
from env_actors.env_loop import EnvLoop, run_env_code
from env_actors.episode_stream import Frame, serving_env, stream_episode
from env_actors.failures import EnvDeadline, EnvSessionClosed
from env_actors.held_sessions import HeldSessions
from env_actors.interface import (
    EnvAnswer,
    EnvCall,
    EnvResponse,
    ResetOut,
    ScoreOut,
    StepOut,
    check_index,
)
from env_actors.shared_deadline import SharedDeadline
from rollout_actors.kernel import DEFAULT_ALLOWED_PREFIXES, CallerError, Ref, RefResolver
from rollout_actors.kernel.collector import settle_actor
from rollout_actors.kernel.loop_watch import HEARTBEAT_S, LoopWatch

PROBE_GROUP = "probe"
BATCH_LINGER_S = 0.02
"""Once one call of a batch has answered, how long the others may take to join its reply. Slower ones are
answered by a later `collect`, so a slow step never holds a fast one back by more than this."""
BLOCKING_AFTER_S = 0.5  # a stall this long is worth naming the call that holds the loop
UNCOLLECTED_TTL_S = 60.0  # an answer nobody collected (its caller gave up) is dropped after this

_SESSION_METHODS = ("reset", "step", "score", "close")
_BATCHED_METHODS = frozenset({"reset", "step", "score", "agent"})

logger = logging.getLogger(__name__)


class EnvServer:
    """Serves one environment to many sessions. Created (unready) by the supervisor, which then awaits
    `start()` (construct + load) and one `health()` answer: only then does the server take traffic.

    Every call takes the deadline the pool computed and answers an `EnvResponse`; it never raises.
    """

    def __init__(
        self,
        env: Ref,
        name: str,
        allowed_prefixes: tuple[str, ...] = DEFAULT_ALLOWED_PREFIXES,
        limits: EnvCallLimits = EnvCallLimits(),
        env_packages: tuple[str, ...] = (),
    ):
        self._ref = env
        self._name = name
        self._resolver = RefResolver(allowed_prefixes)
        """The allowlist is the pool's configuration, fixed here: nothing a request carries reaches it."""
        self._limits = limits
        self._env_packages = tuple(env_packages)
        """Module prefixes an adapter may import as the user's environment package (`allow_packages`);
        like the Ref allowlist, the pool's configuration: nothing a request carries reaches it."""
        self._sessions = HeldSessions(name)
        """One record per session: its state, its calls in flight, when it was last used."""
        self._tickets = itertools.count()
        self._batched: dict[int, asyncio.Task[EnvResponse]] = {}
        """Ticket -> call of batched calls not yet collected (`call_many` / `collect`)."""
        self._env: Any = None
        self._phase = "created"
        """created -> constructing -> loading -> ready | failed; shown in readiness diagnostics."""
        self._watch = LoopWatch()
        """How long the env loop has gone without progress (the `LoopWatch` rule: load is no stall)."""
        self._sampler: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        """The env loop, once loading: a probe asks it which task it is running when it stalls."""
        self._env_loop = EnvLoop()

    async def start(self) -> EnvResponse:
        """Construct the environment from its Ref and load it, on the env loop. Idempotent once ready."""
        if self._env is not None:
            return EnvResponse.ok(self._ready_info(), self._name)
        self._env_loop.start()
        response = await self._env_loop.run(self._load())
        if response.success:
            settle_actor()  # the environment is loaded: it lives as long as this process
        return response

    async def _load(self) -> EnvResponse:
        self._loop = asyncio.get_running_loop()
        self._watch.bind()
        try:
            self._phase = "constructing"
            env = self._resolver.resolve(self._ref, role="environment")
            missing = [m for m in ("num_tasks", "task", *_SESSION_METHODS[:3]) if not hasattr(env, m)]
            if missing:
                raise CallerError(f"{self._ref.target} is not an environment: it lacks {', '.join(missing)}")
            allow = getattr(env, "allow_packages", None)
            if callable(allow):  # an adapter: it imports the user's package, within the pool's allowlist
                allow(self._env_packages)
            self._phase = "loading"
            if hasattr(env, "load"):
                await run_env_code(env.load)
            self._env = env
            info = self._ready_info()
        except Exception as exc:
            self._phase = "failed"
            self._env = None
            return EnvResponse.from_exception(exc, self._name)
        self._phase = "ready"
        return EnvResponse.ok(info, self._name)

    def _ready_info(self) -> dict[str, Any]:
        return {
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "num_tasks": int(self._env.num_tasks()),
        }

    @ray.method(concurrency_group=PROBE_GROUP)
    async def health(self) -> EnvServerHealth:
        """Liveness, answered from the probe loop even while env code blocks the default loop. `calls`: env
        calls running now (an operator, or a test, sees a call start without guessing)."""
        if self._sampler is None and self._loop is not None:
            self._sampler = asyncio.create_task(self._sample())  # on this, the probe group's loop
        stall = self._watch.stall_s() if self._loop is not None else 0.0
        blocking = self._blocking_session() if stall > BLOCKING_AFTER_S else None
        if (stuck := stuck_call()) is not None and stuck[1] > stall:
            # Env code stuck in a thread past its call's deadline: that thread is lost for good (and with
            # it, for an adapter's framework loop, every session's calls), while the env loop turns.
            blocking, stall = stuck
        return EnvServerHealth(
            phase=self._phase,
            loop_stall_s=stall,
            blocking=blocking,
            sessions=self._sessions.open_count(),
            calls=self._sessions.calls_in_flight(),
            pid=os.getpid(),
        )

    async def _sample(self) -> None:
        while True:
            self._watch.sample()
            await asyncio.sleep(HEARTBEAT_S)

    def _blocking_session(self) -> str | None:
        """The session whose call holds the env loop now: the task the loop is running is one of its calls
        (its record says so). The supervisor keeps it when it retires the server as wedged, so the one
        request that wedged it is told apart from the sessions that only shared its server (`Loss.culprit`)."""
        return self._sessions.holding(asyncio.current_task(self._loop) if self._loop is not None else None)

    # ------------------------------------------------------------------------------ session calls

    async def reset(
        self, session_id: str, task_index: int | None, task: dict[str, Any] | None, timeout: float
    ) -> EnvResponse:
        return await self._env_loop.run(self._run(EnvCall("reset", session_id, (task_index, task), timeout)))

    async def step(
        self, session_id: str, message: dict[str, Any], timeout: float, score_if_done: bool = False
    ) -> EnvResponse:
        """One step. With `score_if_done`, a step that ends the episode also scores it and ends the session
        in the same call (two calls fewer per rollout); `timeout` bounds the whole of it."""
        return await self._env_loop.run(
            self._run(EnvCall("step", session_id, (message,), timeout, score_if_done))
        )

    async def score(self, session_id: str, timeout: float) -> EnvResponse:
        return await self._env_loop.run(self._run(EnvCall("score", session_id, (), timeout)))

    async def agent(self, session_id: str, endpoint: dict[str, Any], timeout: float) -> EnvResponse:
        """Run an agent environment's agent for the session against its rollout's endpoint (`agent.py`);
        ended early, like a step, when the session is closed."""
        return await self._env_loop.run(self._run(EnvCall("agent", session_id, (endpoint,), timeout)))

    async def serve_run(self, session_id: str, payload: bytes, timeout: float) -> AsyncIterator[Frame]:
        """A whole episode of an environment that runs episodes itself (`serve_run`), streamed frame by
        frame as a Ray streaming generator (`episode_stream.py`); `timeout` bounds the episode."""
        async for frame in stream_episode(
            lambda send: self._run_episode(session_id, payload, send, timeout), session_id
        ):
            yield frame

    async def _run_episode(self, session_id: str, payload: bytes, send: Any, timeout: float) -> EnvResponse:
        return await self._env_loop.run(self._episode(session_id, payload, send, timeout))

    async def _episode(self, session_id: str, payload: bytes, send: Any, timeout: float) -> EnvResponse:
        task = asyncio.current_task()
        assert task is not None
        self._sessions.stop_with_session(session_id, task)  # the session's call: `end_session` stops it
        return await self._guard("run", timeout, self._serve(session_id, payload, send), session_id)

    async def _serve(self, session_id: str, payload: bytes, send: Any) -> bytes:
        return await serving_env(self._loaded())(payload, send)

    async def call_many(self, calls: list[EnvCall]) -> list[EnvAnswer]:
        return await self._env_loop.run(self._call_many(calls))

    async def _call_many(self, calls: list[EnvCall]) -> list[EnvAnswer]:
        """Several `reset` / `step` / `score` calls sent by one process in one Ray call (`direct.py`
        batches a tick's worth). They run concurrently, each under its own deadline; the reply answers
        each call that finished by the time the first one did plus `BATCH_LINGER_S`, and carries no
        response for the rest, which `collect` answers later."""
        loop = asyncio.get_running_loop()
        now, tickets = loop.time(), []
        deadlines: dict[float, SharedDeadline] = {}  # calls with the same deadline share its timer
        for call in calls:
            if call.method in _BATCHED_METHODS:
                timeout = self._limits.timeout_s_of(call.method, call.timeout_s, call.score_if_done)
                if (deadline := deadlines.get(timeout)) is None:
                    deadline = deadlines[timeout] = SharedDeadline(loop, now + timeout)
                deadline.join()
                work = self._run(call, deadline)
            else:
                refused = CallerError(f"{call.method!r} cannot be batched")
                work = _answer(EnvResponse.of(refused, self._name))
            ticket = next(self._tickets)
            self._batched[ticket] = task = loop.create_task(work)
            self._sessions.stop_with_session(call.session_id, task)
            tickets.append(ticket)
        # One timer per batch, not one per call: most answers are collected at once and it finds nothing.
        loop.call_later(UNCOLLECTED_TTL_S, self._drop_uncollected, tickets, ())
        await asyncio.sleep(0)  # the calls' first steps run now; most (a quick step) finish in it
        return await self._collect(tickets)

    def _drop_uncollected(self, tickets: list[int], seen_done: tuple[int, ...]) -> None:
        """Drop answers nobody collected: each one the sweep before found finished, so it has waited at least
        `UNCOLLECTED_TTL_S`. Calls still running are looked at again a TTL later."""
        for ticket in seen_done:
            self._batched.pop(ticket, None)
        running, done = [], []
        for ticket in tickets:
            task = self._batched.get(ticket)
            if task is not None:
                (done if task.done() else running).append(ticket)
        if running or done:
            asyncio.get_running_loop().call_later(
                UNCOLLECTED_TTL_S, self._drop_uncollected, running, tuple(done)
            )

    async def _run(self, call: EnvCall, deadline: SharedDeadline | None = None) -> EnvResponse:
        """One session call, answered as an `EnvResponse` within its time (`EnvCallLimits.timeout_s_of`);
        `deadline`: the timer it shares with the calls of its batch that have the same one."""
        session_id, args = call.session_id, call.args
        if call.method == "step":
            label = "step (scoring if done)" if call.score_if_done else "step"
            work = self._step(session_id, *args, call.score_if_done)
        elif call.method == "reset":
            label, work = "reset", self._reset(session_id, *args)
        elif call.method == "score":
            label, work = "score", self._score(session_id, *args)
        else:  # its own failure, with its tail, comes before the call's deadline
            agent_timeout = max(0.0, call.timeout_s - AGENT_GUARD_SLACK_S)
            label, work = "agent", self._agent(session_id, *args, agent_timeout)
        return await self._guard(
            label,
            self._limits.timeout_s_of(call.method, call.timeout_s, call.score_if_done),
            work,
            session_id,
            deadline,
        )

    async def collect(self, tickets: list[int]) -> list[EnvAnswer]:
        return await self._env_loop.run(self._collect(tickets))

    async def _collect(self, tickets: list[int]) -> list[EnvAnswer]:
        """Answers of batched calls: each one finished within `BATCH_LINGER_S` of the first to finish;
        None for those still running (ask again). A ticket nobody holds any more answers a failure."""
        calls = [call for t in tickets if (call := self._batched.get(t)) is not None]
        if calls and not any(call.done() for call in calls):
            await asyncio.wait(calls, return_when=asyncio.FIRST_COMPLETED)
        if pending := [call for call in calls if not call.done()]:
            await asyncio.wait(pending, timeout=BATCH_LINGER_S)
        answers: list[EnvAnswer] = []
        for ticket in tickets:
            call = self._batched.get(ticket)
            if call is not None and not call.done():
                answers.append(EnvAnswer(ticket, None))
                continue
            self._batched.pop(ticket, None)
            if call is None or call.cancelled():
                message = f"batched call {ticket} was ended before it answered (its session closed)"
                answers.append(EnvAnswer(ticket, EnvResponse.of(EnvSessionClosed(message))))
            else:
                answers.append(EnvAnswer(ticket, call.result()))
        return answers

    async def idle_sessions(self, session_ids: list[str], idle_s: float) -> list[str]:
        """Which of these sessions have had no call for `idle_s` and none in flight (the pool's reaper
        asks: steps come here directly, so only this server knows). Unknown ids count as idle."""
        return self._sessions.idle(session_ids, time.monotonic() - idle_s)

    async def end_session(self, session_id: str, timeout: float) -> EnvResponse:
        return await self._env_loop.run(self._end_session(session_id, timeout))

    async def _end_session(self, session_id: str, timeout: float) -> EnvResponse:
        self._sessions.stop_calls(session_id)  # its step or score still running stops here
        return await self._guard("close", timeout, self._close(session_id))

    async def _guard(
        self,
        method: str,
        timeout: float,
        work: Awaitable[Any],
        session_id: str | None = None,
        deadline: SharedDeadline | None = None,
    ) -> EnvResponse:
        """Run one call under its deadline (`timeout` from now, or the shared `deadline`) and answer it as
        an `EnvResponse`. A session's call counts as busy while it runs (the reaper never takes it for
        idle) and marks the session used when it ends."""
        tagged, task = None, asyncio.current_task()
        if session_id is not None and task is not None:
            self._sessions.call_started(session_id, task)
            tagged = CALL.set(CallTag(session_id, time.monotonic() + timeout))  # this call's task only
        # A scope, not `wait_for`: no second task per call.
        scope = asyncio.timeout(timeout if deadline is None else None)
        try:
            async with scope:
                if deadline is not None:
                    deadline.enter(scope)
                value = await work
            return EnvResponse.ok(value, self._name)
        except TimeoutError as exc:
            if not scope.expired():  # the environment's own TimeoutError, not our deadline
                return EnvResponse.from_exception(exc, self._name)
            message = f"{method} exceeded its {timeout:g} s deadline on env server {self._name}"
            return EnvResponse.of(EnvDeadline(message), server_name=self._name)  # the environment's
        except Exception as exc:
            return EnvResponse.from_exception(exc, self._name)
        finally:
            if deadline is not None:
                deadline.leave(scope)
            if tagged is not None:
                CALL.reset(tagged)
                self._sessions.call_ended(session_id, task, time.monotonic())  # type: ignore[arg-type]

    def _loaded(self) -> Any:
        if self._env is None:
            raise RuntimeError(f"env server {self._name} is not loaded (phase {self._phase})")
        return self._env

    async def _reset(self, session_id: str, task_index: int | None, task: dict[str, Any] | None) -> dict:
        env = self._loaded()
        self._sessions.refuse_reset(session_id)
        if (task_index is None) == (task is None):
            raise CallerError("give exactly one of task_index and task")
        if task is None:
            task = env.task(check_index(task_index, env.num_tasks()))
        elif not isinstance(task, dict):
            raise CallerError(f"a task is a JSON object, got {type(task).__name__}")
        start = await run_env_code(env.reset, task)
        out = ResetOut(
            session_id=session_id, messages=start.messages, tools=start.tools, server_name=self._name
        )
        self._sessions.open(session_id, start.state, time.monotonic())
        return out.model_dump()

    async def _step(self, session_id: str, message: dict[str, Any], score_if_done: bool = False) -> dict:
        state = self._sessions.state(session_id)
        if not isinstance(message, dict) or message.get("role") != "assistant":
            raise CallerError("step takes an assistant message: a dict with role 'assistant'")
        out = StepOut.model_validate(await run_env_code(self._loaded().step, state, message))
        score = None
        if score_if_done and out.done:
            # A raising score is this call's answer and leaves the session here: the caller's close ends it.
            score = ScoreOut.model_validate(await run_env_code(self._loaded().score, state))
            await self._end_scored(session_id)
        # Validated once, above, and dumped once (a second `StepOut` would check every message again).
        # `score` is the server's to set: whatever the environment put there does not travel.
        answer = out.model_dump()
        answer["score"] = score.model_dump() if score is not None else None
        return answer

    async def _agent(self, session_id: str, endpoint: dict[str, Any], timeout: float) -> dict:
        state = self._sessions.state(session_id)
        return await run_agent_session(self._loaded(), state, AgentEndpoint.from_wire(endpoint), timeout)

    async def _score(self, session_id: str) -> dict:
        state = self._sessions.state(session_id)
        return ScoreOut.model_validate(await run_env_code(self._loaded().score, state)).model_dump()

    async def _close(self, session_id: str) -> None:
        # Idempotent (`HeldSessions.close`): a retried or late close is harmless.
        was_open, state = self._sessions.close(session_id)
        if not was_open:
            return None
        if hasattr(self._env, "close"):
            await run_env_code(self._env.close, state)
        return None

    async def _end_scored(self, session_id: str) -> None:
        """Close a session its step just scored. The state is dropped before `env.close` runs, so a raising
        close still ends the session; like a failed `close` call (which the rollout only logs), it costs
        the rollout nothing: the score stands."""
        try:
            await self._close(session_id)
        except Exception:
            logger.warning(
                "env server %s: close of scored session %s raised", self._name, session_id, exc_info=True
            )


async def _answer(response: EnvResponse) -> EnvResponse:
    return response
