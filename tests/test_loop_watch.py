"""`LoopWatch` tells a blocked event loop from a busy one, watching from another thread as a rollout
worker's probe loop does. Real threads and loops; the loop under watch is driven for ~2 s each time."""

from __future__ import annotations

import asyncio
import threading
import time

from rollout_actors.kernel.loop_watch import HEARTBEAT_S, LoopWatch

WATCHED_S = 2.0


def watch_while(work) -> float:
    """Run `work(loop)` on a watched loop in a thread for `WATCHED_S`; return the largest stall seen."""
    watch = LoopWatch()
    bound = threading.Event()
    loop = asyncio.new_event_loop()

    async def main():
        watch.bind()
        bound.set()
        await work()
        await asyncio.sleep(2 * HEARTBEAT_S)  # the heartbeat catches up before the loop ends

    thread = threading.Thread(target=lambda: loop.run_until_complete(main()))
    thread.start()
    assert bound.wait(10)
    worst = 0.0
    deadline = time.monotonic() + WATCHED_S
    while time.monotonic() < deadline:
        watch.sample()
        worst = max(worst, watch.stall_s())
        time.sleep(HEARTBEAT_S)
    thread.join(30)
    return worst


def test_a_loop_blocked_in_one_call_stalls():
    async def blocked():
        time.sleep(WATCHED_S)  # a synchronous call where an await belonged

    assert watch_while(blocked) > WATCHED_S / 2


def test_a_loop_running_one_long_iteration_of_many_callbacks_does_not_stall():
    """Thousands of short callbacks ready at once: one iteration of the loop lasts the whole time (its
    heartbeat is that late), yet it is making progress all along."""

    async def busy():
        def spin(seconds: float) -> None:
            until = time.monotonic() + seconds
            while time.monotonic() < until:
                pass

        loop = asyncio.get_running_loop()
        for _ in range(int(WATCHED_S / 0.002)):
            loop.call_soon(spin, 0.002)  # due at once: they run back to back in one iteration
        await asyncio.sleep(0)

    assert watch_while(busy) < WATCHED_S / 2


def test_an_idle_loop_does_not_stall():
    async def idle():
        await asyncio.sleep(WATCHED_S)

    assert watch_while(idle) < 4 * HEARTBEAT_S
