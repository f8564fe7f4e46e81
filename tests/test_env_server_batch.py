"""The env server's batch path without Ray: `call_many` / `collect` driven in-process on an `EnvServer`, so
deadlines, linger and cleanup are checked call by call. The same paths on real actors are in
test_env_pool.py and test_env_finish.py."""

from __future__ import annotations

import asyncio
import pickle

import pytest
from waiting import runner

import env_actors.server as server_module
from env_actors.failures import EnvDeadline
from env_actors.faults.envs import SleepsOnRequestEnv
from env_actors.interface import EnvAnswer, EnvCall, EnvResponse
from env_actors.server import EnvServer
from env_actors.shared_deadline import SharedDeadline
from rollout_actors.kernel import Failure, Ref

run = runner(30)


class OwnTimeoutEnv(SleepsOnRequestEnv):
    """A step whose message says `own-timeout` raises the environment's own `TimeoutError`."""

    async def step(self, state, assistant_message):
        if assistant_message.get("content") == "own-timeout":
            raise TimeoutError("the sandbox did not answer")
        return await super().step(state, assistant_message)


def loaded_server(**limits: float) -> EnvServer:
    """An EnvServer with its environment loaded in-process (what `start` does, minus the Ray bookkeeping)."""
    server = EnvServer(Ref(target="env_actors.faults.envs:SleepsOnRequestEnv"), "env-test")
    server._env, server._phase = OwnTimeoutEnv(num_tasks=8, turns=100), "ready"
    if limits:
        server._limits = server_module.EnvCallLimits(**limits)
    return server


def says(content: str) -> dict:
    return {"role": "assistant", "content": content}


async def open_sessions(server: EnvServer, n: int) -> list[str]:
    ids = [f"envsess-{i}" for i in range(n)]
    replies = await server.call_many([EnvCall("reset", sid, (i, None), 5.0) for i, sid in enumerate(ids)])
    assert all(reply.response.success for reply in replies)
    return ids


async def answers_of(server: EnvServer, replies: list[EnvAnswer]) -> dict[int, EnvResponse]:
    """Every answer of a batch, collecting those that were still running."""
    got = {reply.ticket: reply.response for reply in replies if reply.response is not None}
    while missing := [reply.ticket for reply in replies if reply.ticket not in got]:
        got.update({r.ticket: r.response for r in await server.collect(missing) if r.response is not None})
    return got


def test_calls_of_one_batch_keep_their_own_deadlines_and_the_environments_timeout_stays_its_own():
    async def body():
        server = loaded_server()
        a, b, c, d = await open_sessions(server, 4)
        replies = await server.call_many(
            [
                EnvCall("step", a, (says("now"),), 5.0),
                EnvCall("step", b, (says("sleep:5"),), 0.3),  # past its deadline
                EnvCall("step", c, (says("sleep:3"),), 5.0),  # far slower than the linger, within its own
                EnvCall("step", d, (says("own-timeout"),), 0.3),
            ]
        )
        assert replies[0].response.success and replies[2].response is None
        got = await answers_of(server, replies)
        fast, missed, slow, own = (got[reply.ticket] for reply in replies)
        assert fast.success and slow.success
        assert not missed.success and missed.kind == "env" and missed.error.type == EnvDeadline.__name__
        assert "0.3 s deadline" in missed.error.message
        assert not own.success and own.error.type == "TimeoutError" and own.kind == "env"
        assert server._sessions.calls_in_flight() == 0  # nothing counts as in flight once answered

    run(body())


def test_the_pools_limit_caps_a_batched_calls_deadline():
    async def body():
        server = loaded_server(step_s=0.2)
        (sid,) = await open_sessions(server, 1)
        (reply,) = await server.call_many([EnvCall("step", sid, (says("sleep:5"),), 30.0)])
        missed = (await answers_of(server, [reply]))[reply.ticket]
        assert missed.error.type == EnvDeadline.__name__ and "0.2 s deadline" in missed.error.message

    run(body())


def test_a_call_that_starts_after_its_shared_deadline_passed_expires_at_once():
    async def body():
        loop = asyncio.get_running_loop()
        deadline = SharedDeadline(loop, loop.time())
        deadline.join()
        await asyncio.sleep(0.01)  # the shared timer fires before the call enters its scope
        scope = asyncio.timeout(None)
        with pytest.raises(TimeoutError):
            async with scope:
                deadline.enter(scope)
                await asyncio.sleep(5)
        deadline.leave(scope)
        assert scope.expired()

    run(body())


def test_a_cancellation_inside_a_shared_deadline_stays_a_cancellation():
    async def body():
        loop = asyncio.get_running_loop()
        deadline = SharedDeadline(loop, loop.time() + 5)

        async def call():
            deadline.join()
            scope = asyncio.timeout(None)
            try:
                async with scope:
                    deadline.enter(scope)
                    await asyncio.sleep(5)
            finally:
                deadline.leave(scope)

        task = asyncio.ensure_future(call())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert deadline._timer.cancelled()  # its last call ended: the timer is gone with it

    run(body())


async def slow_beside_quick(server, slow: str):
    """A batch of a slow step and a quick one: the reply answers the quick one only. Returns the slow
    step's session and its (unanswered) reply."""
    sid, other = await open_sessions(server, 2)
    reply, _ = await server.call_many(
        [EnvCall("step", sid, (says(slow),), 10.0), EnvCall("step", other, (says("now"),), 10.0)]
    )
    assert reply.response is None
    return sid, reply


def test_a_session_closed_while_its_batched_call_runs_answers_closed():
    async def body():
        server = loaded_server()
        sid, reply = await slow_beside_quick(server, "sleep:5")
        assert (await server.end_session(sid, 5.0)).success
        (closed,) = await server.collect([reply.ticket])
        assert closed.response.error.type == "EnvSessionClosed"

    run(body())


def test_an_answer_nobody_collected_is_kept_a_ttl_after_it_finished_then_dropped(monkeypatch):
    monkeypatch.setattr(server_module, "UNCOLLECTED_TTL_S", 0.4)

    async def body():
        server = loaded_server()
        _, reply = await slow_beside_quick(server, "sleep:0.5")
        await asyncio.sleep(0.7)  # it finished at 0.5, the sweep at 0.4 saw it running
        assert reply.ticket in server._batched
        await asyncio.sleep(0.6)  # the sweep at 0.8 saw it done; the one at 1.2 dropped it
        assert reply.ticket not in server._batched
        (gone,) = await server.collect([reply.ticket])
        assert gone.response.error.type == "EnvSessionClosed"

    run(body())


def test_a_method_a_batch_cannot_carry_is_refused_as_the_callers():
    async def body():
        server = loaded_server()
        (reply,) = await server.call_many([EnvCall("close", "envsess-0", (), 5.0)])  # type: ignore[arg-type]
        assert reply.response.kind == "caller" and "cannot be batched" in reply.response.error.message

    run(body())


def test_the_batch_wire_types_survive_pickling_unchanged():
    failed = EnvResponse.failed(Failure(type="EnvDeadline", message="late"), "env", "env-1", "exit")
    for value in (
        EnvCall("step", "envsess-1", (says("hi"),), 5.0, True),
        EnvAnswer(3, EnvResponse.ok({"messages": [], "done": True}, "env-1")),
        EnvAnswer(4, failed),
        EnvAnswer(5, None),
        failed,
    ):
        again = pickle.loads(pickle.dumps(value))
        assert again == value and type(again) is type(value)
