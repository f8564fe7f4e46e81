"""One serve-env run against a fake pool and fake env servers (no Ray): the plane's exactly-once rules
as `runs.serve_run` applies them. A run lost before its first delta is dispatched again, at most twice,
and one lost the same way twice is poison, answered and not dispatched again; a run lost after it
streamed a delta is answered at once, the error naming the part; a run nobody can serve is answered."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgpack
from ray.exceptions import ActorDiedError

from env_actors.interface import EnvResponse
from rollout_actors.kernel import Failure, new_id
from rollout_actors.serve_env.runs import serve_run


class _Remote:
    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def remote(self, *args: Any) -> Any:
        return self.fn(*args)


async def _value(value: Any) -> Any:
    return value


class FakeServer:
    """An env server whose `serve_run` yields `frames`, then dies if `dies` (as Ray reports a death)."""

    def __init__(self, frames: list[tuple[str, Any]], dies: bool = False) -> None:
        self.frames, self.dies = frames, dies
        self.serve_run = _Remote(self._stream)

    def _stream(self, *_: Any) -> Any:
        frames, dies = list(self.frames), self.dies

        class Stream:
            async def __anext__(self) -> Any:
                if frames:
                    return _value(frames.pop(0))
                if dies:
                    raise ActorDiedError()
                raise StopAsyncIteration

        return Stream()


class FakePool:
    """Places each session on the next of `servers`; says each lost server simply died, naming the session
    only where it was placed alone (quarantine: the one session a server held is the one it names)."""

    def __init__(self, servers: list[FakeServer | None]) -> None:
        self.servers = servers
        self.placed = 0
        self.name = new_id("p")  # server names are unique per incarnation: handles are cached by name
        self.ended: list[str] = []
        self.alone: set[str] = set()
        self.place_many = _Remote(self._place_many)
        self.place_alone = _Remote(self._place_alone)
        self.server_lost = _Remote(
            lambda name, detail, sid: _value(
                (f"died: {detail}", "died", True if name in self.alone else None)
            )
        )
        self.forget_many = _Remote(lambda ids: _value(len(ids)))
        self.end_session = _Remote(lambda sid, timeout: self.ended.append(sid))

    def _place_many(self, session_ids: list[str], owner: Any, wait_s: float, known: list[str]) -> Any:
        return _value([self._next() for _ in session_ids])

    def _place_alone(self, session_id: str, owner: Any, wait_s: float) -> Any:
        answer = self._next()
        self.alone.add(answer.server_name)
        return _value(answer)

    def _next(self) -> EnvResponse:
        server = self.servers[min(self.placed, len(self.servers) - 1)]
        self.placed += 1
        if server is None:
            failure = Failure(type="NoLiveEnvServer", message="no live env server in pool 'p'")
            return EnvResponse.failed(failure)
        name = f"{self.name}.env{self.placed}"
        return EnvResponse.ok({"server_name": name, "handle": server}, name)


def _run(pool: FakePool) -> tuple[dict[str, Any], list[bytes]]:
    sent: list[bytes] = []

    async def send(frame: bytes) -> None:
        sent.append(frame)

    async def pools(timeout: float, verify: bool) -> FakePool:
        return pool

    reply = asyncio.run(serve_run(pools, b"payload", send, timeout_s=30.0))
    return msgpack.unpackb(reply, raw=False), sent


REPLY = msgpack.packb({"success": True, "error": None, "head": {}, "traces": []})


def test_a_run_lost_before_its_first_delta_is_dispatched_again_and_answered_by_the_next_server():
    pool = FakePool([FakeServer([], dies=True), FakeServer([("delta", b"d1"), ("reply", REPLY)])])
    reply, sent = _run(pool)
    assert reply["success"] is True and sent == [b"d1"]
    assert pool.placed == 2


def test_a_run_lost_after_a_delta_is_answered_at_once_naming_the_env_server():
    pool = FakePool([FakeServer([("delta", b"d1")], dies=True), FakeServer([("reply", REPLY)])])
    reply, sent = _run(pool)
    assert pool.placed == 1 and sent == [b"d1"]
    assert reply["success"] is False
    assert reply["error"].startswith(f"PartLost: env server {pool.name}.env1 died during the run")
    assert "streamed 1 delta(s), so it is not dispatched again" in reply["error"]


def test_a_run_that_kills_its_server_every_time_is_poison_once_a_death_alone_names_it():
    """Two deaths among other sessions name nobody (an outside kill looks the same): the run goes alone on a
    server of its own, and a death there is proof. Not dispatched again after it."""
    dies = [FakeServer([], dies=True) for _ in range(3)]
    pool = FakePool([*dies, FakeServer([("reply", REPLY)])])
    reply, _ = _run(pool)
    assert pool.placed == 3 and pool.alone == {f"{pool.name}.env3"}
    assert reply["success"] is False and reply["error"].startswith("PoisonRequest: poison request")


def test_a_run_whose_servers_were_killed_twice_from_outside_ends_on_its_own_merit_alone():
    pool = FakePool([FakeServer([], dies=True), FakeServer([], dies=True), FakeServer([("reply", REPLY)])])
    reply, _ = _run(pool)
    assert pool.placed == 3 and pool.alone == {f"{pool.name}.env3"}
    assert reply["success"] is True


def test_a_run_nobody_can_serve_is_answered_at_once():
    pool = FakePool([None])
    reply, sent = _run(pool)
    assert sent == [] and reply == {
        "success": False,
        "error": "NoLiveEnvServer: no live env server in pool 'p'",
    }


def test_an_episode_that_failed_on_its_server_is_answered_with_that_failure():
    failed = Failure(type="EnvDeadline", message="run exceeded its 30 s deadline", fault="env").model_dump()
    pool = FakePool([FakeServer([("delta", b"d1"), ("failed", failed)])])
    reply, _ = _run(pool)
    assert reply == {"success": False, "error": "EnvDeadline: run exceeded its 30 s deadline"}
    assert len(pool.ended) == 1  # the session is ended on its server


def test_a_run_whose_env_pool_is_not_restarted_is_answered_at_once():
    from rollout_actors.plane.pool_supervisor import PoolUnavailable

    async def pools(timeout: float, verify: bool) -> FakePool:
        raise PoolUnavailable("env pool is not restarted: restart budget spent")

    async def send(frame: bytes) -> None:
        raise AssertionError("nothing was dispatched: nothing to stream")

    reply = asyncio.run(serve_run(pools, b"payload", send, timeout_s=30.0))
    assert msgpack.unpackb(reply, raw=False) == {
        "success": False,
        "error": "PoolUnavailable: env pool is not restarted: restart budget spent",
    }
