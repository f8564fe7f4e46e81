"""An env server holds one record per session (`env_actors.held_sessions`): its state, its calls in flight,
when it was last used. The wedge's culprit is read from those records, never off a thread's stack. Ray-free:
the server runs in-process, its env loop on a thread of its own as in the actor."""

from __future__ import annotations

import asyncio
import time

import pytest
from waiting import runner, wait_until

from env_actors.faults.envs import BlocksLoopEnv
from env_actors.held_sessions import ENDED_MEMORY, HeldSessions
from env_actors.interface import EnvCall
from env_actors.server import EnvServer
from rollout_actors.kernel import CallerError, Ref

run = runner(30)


def test_a_record_lives_while_its_session_is_open_or_has_a_call_in_flight():
    async def body():
        sessions, task = HeldSessions("env-test"), asyncio.current_task()
        sessions.call_started("s1", task)  # its reset
        assert sessions.calls_in_flight() == 1 and sessions.open_count() == 0
        sessions.open("s1", {"turn": 0}, now=10.0)
        sessions.call_ended("s1", task, now=11.0)
        assert sessions.state("s1") == {"turn": 0} and sessions.idle(["s1"], cutoff=11.5) == ["s1"]
        assert sessions.idle(["s1"], cutoff=10.5) == []  # used after the cutoff
        sessions.call_started("s1", task)
        assert sessions.idle(["s1"], cutoff=99.0) == []  # in a call: never idle
        assert sessions.close("s1") == (True, {"turn": 0})
        with pytest.raises(CallerError, match="closed or never started"):
            sessions.state("s1")
        assert sessions.holding(task) == "s1"  # its last call still runs: the record stays
        sessions.call_ended("s1", task, now=12.0)
        assert sessions.holding(task) is None and sessions.calls_in_flight() == 0

    run(body())


def test_a_session_closed_before_its_reset_cannot_be_opened_by_that_reset():
    sessions = HeldSessions("env-test")
    assert sessions.close("late") == (False, None)
    with pytest.raises(CallerError, match="closed before it started"):
        sessions.refuse_reset("late")
    for i in range(ENDED_MEMORY):
        sessions.close(f"other-{i}")
    sessions.refuse_reset("late")  # forgotten, oldest first


def test_the_session_whose_call_holds_the_env_loop_is_named_from_its_record():
    """Two sessions on one server; one's step blocks the env loop (a synchronous sleep where an await
    belonged). A probe on another thread names that session, not the one that only shares the server."""

    async def body():
        server = EnvServer(Ref(target="env_actors.faults.envs:BlocksLoopEnv"), "env-test")
        server._env, server._phase = (
            BlocksLoopEnv(block_s=2.0, blocking_tasks=1, num_tasks=2, turns=5),
            "ready",
        )
        server._env_loop.start()
        server._loop = server._env_loop._loop  # what `start` records, minus Ray's bookkeeping
        replies = await server.call_many(
            [EnvCall("reset", sid, (i, None), 5.0) for i, sid in enumerate("ab")]
        )
        assert all(reply.response.success for reply in replies)
        assert server._blocking_session() is None  # the loop runs nothing of theirs now
        said = {"role": "assistant", "content": "hi"}
        steps = asyncio.ensure_future(server.call_many([EnvCall("step", sid, (said,), 5.0) for sid in "ba"]))
        started = time.monotonic()
        await wait_until(lambda: server._blocking_session() is not None, 1.5)
        assert server._blocking_session() == "a" and time.monotonic() - started < 2.0
        await steps

    run(body())
