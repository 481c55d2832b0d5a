"""Turns on one shared model (``sandlot/_turns.py``): one call at a time, the waiting calls
served round robin by tenant."""

from __future__ import annotations

import asyncio

import pytest

from sandlot._turns import FairTurns


async def _served_order(queued: list[str], holder: str = "first") -> list[str]:
    """The order in which calls queued as ``queued`` (callers, in arrival order) behind
    one call of ``holder`` already holding the turn get it."""
    turns, served = FairTurns(), []
    await turns.acquire(holder)

    async def call(caller: str) -> None:
        await turns.acquire(caller)
        served.append(caller)
        await asyncio.sleep(0)
        turns.release()

    tasks = []
    for caller in queued:
        tasks.append(asyncio.create_task(call(caller)))
        await asyncio.sleep(0)  # queued in this order
    turns.release()
    await asyncio.gather(*tasks)
    assert not turns.locked() and turns.waiting() == {}
    return served


def test_a_tenant_with_many_calls_queued_does_not_hold_back_another() -> None:
    # Before (first come first served): bob's one call waited behind alice's five.
    served = asyncio.run(_served_order(["alice"] * 5 + ["bob"] + ["carol"] * 2))
    assert served == ["alice", "bob", "carol", "alice", "carol", "alice", "alice", "alice"]


def test_the_tenant_that_just_had_the_turn_goes_after_the_others() -> None:
    # Alice's first call held the turn while her next three queued before bob's one.
    served = asyncio.run(_served_order(["alice"] * 3 + ["bob"], holder="alice"))
    assert served == ["bob", "alice", "alice", "alice"]


def test_one_tenant_alone_is_served_in_order() -> None:
    turns, served = FairTurns(), []

    async def run() -> None:
        await turns.acquire("a")

        async def call(n: int) -> None:
            await turns.acquire("a")
            served.append(n)
            turns.release()

        tasks = [asyncio.create_task(call(n)) for n in range(6)]
        await asyncio.sleep(0)
        turns.release()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    assert served == list(range(6))


def test_a_cancelled_waiter_leaves_the_queue_and_a_cancelled_holder_passes_the_turn() -> None:
    async def run() -> None:
        turns = FairTurns()
        await turns.acquire("a")
        waiting = asyncio.create_task(turns.acquire("b"))
        later = asyncio.create_task(turns.acquire("c"))
        await asyncio.sleep(0)
        assert turns.waiting() == {"b": 1, "c": 1}
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert turns.waiting() == {"c": 1}
        # Handed the turn and cancelled before it resumed: it passes the turn on.
        handed = asyncio.create_task(turns.acquire("d"))
        await asyncio.sleep(0)
        turns.release()  # to c
        await later
        turns.release()  # to d, which is cancelled before it runs
        handed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handed
        assert not turns.locked() and turns.waiting() == {}
        await asyncio.wait_for(turns.acquire("e"), 1)  # free again, at once

    asyncio.run(run())


def test_only_another_callers_wait_asks_a_long_job_to_give_way() -> None:
    # A caller's own queued calls do not split its samples: that only made it read its
    # prompt again for each (red team, 2026-12-06).
    async def run() -> None:
        turns = FairTurns()
        await turns.acquire("a")
        own = asyncio.create_task(turns.acquire("a"))
        await asyncio.sleep(0)
        assert not turns.others_waiting("a")
        other = asyncio.create_task(turns.acquire("b"))
        await asyncio.sleep(0)
        assert turns.others_waiting("a") and turns.others_waiting("b")
        for task in (own, other):
            task.cancel()
        await asyncio.gather(own, other, return_exceptions=True)

    asyncio.run(run())


def test_with_several_places_none_is_given_twice_and_callers_take_turns() -> None:
    """Webhook deliveries hold a few places at once (``IN_FLIGHT``): never more than that,
    every place given back, and a waiting caller served after at most one call of each
    other caller."""

    async def run() -> list[str]:
        turns, served, inside = FairTurns(3), [], [0]
        gate = asyncio.Event()

        async def call(caller: str) -> None:
            async with turns.turn(caller):
                inside[0] += 1
                assert inside[0] <= 3
                served.append(caller)
                await gate.wait()
                inside[0] -= 1

        tasks = [asyncio.create_task(call("a")) for _ in range(8)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(call("b")), asyncio.create_task(call("c"))]
        await asyncio.sleep(0)
        assert turns.held == 3 and turns.waiting() == {"a": 5, "b": 1, "c": 1}
        tasks[4].cancel()  # a waiting call gone: its place is no one's
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert turns.held == 0 and turns.waiting() == {}
        return served

    served = asyncio.run(run())
    assert served[:3] == ["a", "a", "a"] and set(served[3:6]) == {"a", "b", "c"}
    assert len(served) == 9
