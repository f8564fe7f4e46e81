"""Which session's environment code is stuck past its deadline (`env_actors.env_calls`), seen from another
thread as a server's probe sees it: code executing in a thread or on a framework loop past its call's
deadline is named; code within its deadline, code suspended on an await and code that waited for its
thread is not. Ray-free: real threads and loops, blocked on events the test releases."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from env_actors.adapters import FrameworkLoop
from env_actors.env_calls import CALL, CallTag, in_thread, stuck_call

WAIT_S = 30.0  # every wait here is released by the test; this bounds a bug


def _in_a_thread(pool: ThreadPoolExecutor, tag: CallTag, release: threading.Event, entered: threading.Event):
    def blocks() -> None:
        entered.set()
        release.wait(WAIT_S)

    def tagged() -> None:
        CALL.set(tag)  # what the server's `_guard` sets and `asyncio.to_thread` copies into the thread
        in_thread(blocks)

    return pool.submit(tagged)


def test_code_blocking_its_thread_past_its_deadline_is_named_with_the_time_past_it():
    release, entered = threading.Event(), threading.Event()
    with ThreadPoolExecutor(2) as pool:
        future = _in_a_thread(pool, CallTag("stuck", time.monotonic() - 5.0), release, entered)
        try:
            assert entered.wait(WAIT_S)
            session, over = stuck_call()
            assert session == "stuck" and 0 < over < 5.0 + WAIT_S  # counted from its start, not earlier
        finally:
            release.set()
        future.result(WAIT_S)
    assert stuck_call() is None  # it ended: nothing is stuck


def test_code_within_its_deadline_is_not_stuck():
    release, entered = threading.Event(), threading.Event()
    with ThreadPoolExecutor(1) as pool:
        future = _in_a_thread(pool, CallTag("busy", time.monotonic() + 600.0), release, entered)
        try:
            assert entered.wait(WAIT_S)
            assert stuck_call() is None
        finally:
            release.set()
        future.result(WAIT_S)


def test_the_longest_stuck_of_several_threads_is_named():
    release = threading.Event()
    entered = [threading.Event(), threading.Event()]
    now = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        futures = [_in_a_thread(pool, CallTag("late", now + 0.01), release, entered[0])]
        assert entered[0].wait(WAIT_S)
        futures.append(_in_a_thread(pool, CallTag("later", now + 0.02), release, entered[1]))
        try:
            assert entered[1].wait(WAIT_S)
            time.sleep(0.05)
            assert stuck_call()[0] == "late"
        finally:
            release.set()
        for future in futures:
            future.result(WAIT_S)


def test_on_a_framework_loop_only_the_coroutine_blocking_it_is_named():
    """Two sessions on one framework loop, both past their deadlines: one awaits (suspended: it would
    take its cancellation), the other blocks the loop thread. Only the blocker is the culprit."""
    loop = FrameworkLoop("test-framework-loop")
    release, blocked, awaiting = threading.Event(), threading.Event(), threading.Event()
    past = time.monotonic() - 1.0

    async def suspended() -> None:
        awaiting.set()
        await asyncio.sleep(WAIT_S)

    async def blocking() -> None:
        blocked.set()
        release.wait(WAIT_S)  # a classic tool's time.sleep

    async def caller(session: str, coro) -> None:
        CALL.set(CallTag(session, past))
        await loop.run(coro)

    async def scenario() -> tuple[str, float] | None:
        waiter = asyncio.ensure_future(caller("awaits", suspended()))
        await asyncio.to_thread(awaiting.wait, WAIT_S)
        blocker = asyncio.ensure_future(caller("blocks", blocking()))
        await asyncio.to_thread(blocked.wait, WAIT_S)
        try:
            return stuck_call()
        finally:
            release.set()
            waiter.cancel()
            await asyncio.wait_for(blocker, WAIT_S)
            with pytest.raises(asyncio.CancelledError):
                await waiter

    session, _ = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    assert session == "blocks"


@pytest.mark.parametrize(
    "whole_episode, in_a_task_of_its_own", [(True, False), (True, True), (False, False), (False, True)]
)
def test_a_whole_episode_blocking_its_framework_loop_is_named_long_before_its_deadline(
    whole_episode, in_a_task_of_its_own
):
    """verifiers' own episode code (`serve_run`) runs under the episode's deadline (an hour): blocking its
    framework loop counts while the loop makes no progress, also from a task the episode started (a reward
    scored in a task of verifiers' own). A step's call keeps the deadline rule."""
    loop = FrameworkLoop("test-episode-loop")
    release, blocked = threading.Event(), threading.Event()
    tag = CallTag("episode", time.monotonic() + 3600.0, whole_episode=whole_episode)

    async def blocks() -> None:
        blocked.set()
        release.wait(WAIT_S)  # a grader's time.sleep

    async def blocking() -> None:
        if in_a_task_of_its_own:
            await asyncio.gather(asyncio.sleep(0), asyncio.ensure_future(blocks()))
        else:
            await blocks()

    async def caller() -> None:
        CALL.set(tag)
        await loop.run(blocking())

    async def scenario() -> tuple[str, float] | None:
        task = asyncio.ensure_future(caller())
        try:
            await asyncio.to_thread(blocked.wait, WAIT_S)
            stuck_call()  # a probe's sample: the loop thread sits in the blocking frame
            await asyncio.sleep(0.6)
            return stuck_call()
        finally:
            release.set()
            await task

    stuck = asyncio.run(scenario())
    if whole_episode:
        assert stuck is not None and stuck[0] == "episode" and 0.5 <= stuck[1] < WAIT_S, stuck
    else:
        assert stuck is None
    assert stuck_call() is None  # it ended: nothing is stuck
