"""Lanes: a bound on rollouts in flight, waiters served first come first served, a freed slot handed to
exactly one waiter, and no slot lost or leaked when a waiter is cancelled at any point."""

from __future__ import annotations

import asyncio

import pytest
from waiting import runner

from rollout_actors.plane.lanes import Lane

run = runner(10)


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


def test_waiters_get_freed_slots_in_arrival_order_one_per_release():
    async def scenario():
        lane = Lane("train", 2)
        order: list[int] = []

        async def take(i: int) -> None:
            await lane.acquire()
            order.append(i)

        tasks = [asyncio.ensure_future(take(i)) for i in range(6)]
        await settle()
        assert order == [0, 1] and lane.in_flight == 2
        for expected in ([0, 1, 2], [0, 1, 2, 3]):
            await lane.release()
            await settle()
            assert order == expected and lane.in_flight == 2
        assert not lane.try_acquire()  # two still wait: a newcomer does not jump them
        await lane.release()
        await lane.release()
        await asyncio.gather(*tasks)
        assert order == list(range(6)) and lane.in_flight == 2 and lane.peak == 2

    run(scenario())


def test_a_cancelled_waiter_takes_no_slot_and_one_handed_a_slot_gives_it_back():
    async def scenario():
        lane = Lane("train", 1)
        assert lane.try_acquire()
        gone, handed, last = (asyncio.ensure_future(lane.acquire()) for _ in range(3))
        await settle()
        gone.cancel()  # cancelled while waiting: skipped, holds nothing
        await lane.release()  # the slot goes to `handed` ...
        handed.cancel()  # ... which is cancelled before it runs: the slot passes on to `last`
        await settle()
        assert gone.cancelled() and handed.cancelled()
        assert last.done() and lane.in_flight == 1
        await lane.release()
        assert lane.in_flight == 0 and lane.try_acquire()

    run(scenario())


def test_set_limit_wakes_as_many_as_it_allows_and_a_lower_limit_holds_new_ones_until_drained():
    async def scenario():
        lane = Lane("eval", 1)
        assert lane.try_acquire()
        waiters = [asyncio.ensure_future(lane.acquire()) for _ in range(4)]
        await settle()
        await lane.set_limit(3)
        await settle()
        assert [w.done() for w in waiters] == [True, True, False, False] and lane.in_flight == 3
        await lane.set_limit(1)
        for _ in range(2):
            await lane.release()
        await settle()
        assert lane.in_flight == 1 and not any(w.done() for w in waiters[2:])  # still above the limit
        await lane.release()
        await settle()
        assert waiters[2].done() and not waiters[3].done() and lane.in_flight == 1
        with pytest.raises(ValueError):
            await lane.set_limit(0)
        waiters[3].cancel()

    run(scenario())
