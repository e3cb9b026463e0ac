"""Hits admitted while Redis failed are counted in Redis afterwards, exactly once: no
window holds fewer hits than were admitted (real redis-server)."""

from __future__ import annotations

import asyncio

import pytest

from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.exact import ExactHit
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.owed_hits import OwedHits
from ratelimit_service.storage.redis_store import RedisStore

pytestmark = pytest.mark.serial  # timing: run alone, after the parallel part

HIT = [ExactHit("k", 10, 60, 1)]
PROBE = [ExactHit("k", 10, 60, 0)]  # check only: reads the window


async def until_answered(store: RedisStore) -> int:
    """Hits in the window, once Redis answers again (the breaker may need a trial)."""

    async def before() -> list[int]:
        return [(await store.hit(PROBE, True))[0].before]  # a list: 0 is an answer too

    answered = await eventually_async(
        before, timeout=5, what="redis answering", ignore=(StoreUnavailable,)
    )
    return answered[0]


async def test_hits_admitted_while_redis_was_down_land_when_it_is_back(redis_server) -> None:
    store = RedisStore(redis_server.url, request_timeout=0.2)
    try:
        await store.hit(HIT, True)  # one hit in the window
        redis_server.stop()
        for _ in range(4):  # refused or circuit open: the caller admits them (owe)
            with pytest.raises(StoreUnavailable):
                await store.hit(HIT, True, owe=True)
        with pytest.raises(StoreUnavailable):
            await store.hit(HIT, True, owe=False)  # a rule that fails closed: not owed
        assert store.metrics().figures["exact_owed_entries"] == 1  # four hits on one key: one entry
        redis_server.start()
        await until_answered(store)
        # A fresh (empty) server: the four owed hits land with the first calls it answers.

        async def landed() -> bool:
            return (await store.hit(PROBE, True))[0].before == 4

        await eventually_async(
            landed, timeout=5, what="owed hits landed", ignore=(StoreUnavailable,)
        )
        assert store.metrics().figures["exact_owed_entries"] == 0
        assert store.metrics().figures["exact_owed_sent"] >= 1
    finally:
        await store.close()


async def test_a_late_reply_that_counted_the_hit_owes_nothing(redis_server) -> None:
    store = RedisStore(redis_server.url, request_timeout=0.1)
    try:
        await store.hit(HIT, True)
        redis_server.pause()
        with pytest.raises(StoreUnavailable, match="no answer"):
            await store.hit(HIT, True, owe=True)  # Redis runs it once resumed: counted
        redis_server.resume()
        assert await until_answered(store) == 2  # not 3: counted once
        assert store.metrics().figures["exact_owed_entries"] == 0
    finally:
        await store.close()


async def test_a_late_reply_that_denied_the_hit_owes_it(redis_server) -> None:
    full = [ExactHit("f", 2, 60, 1)]
    store = RedisStore(redis_server.url, request_timeout=0.1)
    try:
        await store.hit(full, True)
        await store.hit(full, True)  # the window is full
        redis_server.pause()
        with pytest.raises(StoreUnavailable, match="no answer"):
            await store.hit(full, True, owe=True)  # admitted by failure_mode: open
        redis_server.resume()
        # The late reply: denied by the script, so owed, and repaid once Redis answers.

        async def counted() -> bool:
            return (await store.hit([ExactHit("f", 2, 60, 0)], True))[0].before == 3

        # The first calls after resume() may still meet the silence and fail fast.
        await eventually_async(
            counted, timeout=5, what="the denied hit owed and repaid", ignore=(StoreUnavailable,)
        )
        assert store.metrics().figures["exact_owed_entries"] == 0
        assert store.metrics().figures["exact_owed_sent"] == 1
    finally:
        await store.close()


async def test_a_late_reply_that_denied_a_request_with_a_cost_owes_the_cost_no_more(
    redis_server,
) -> None:
    """Redis, deciding late, denied the request (its full key) and counted its cost, as
    a cost always counts: the plain hit admitted by failure_mode is owed, the cost not
    again."""
    full, budget = ExactHit("f2", 2, 60, 1), ExactHit("c2", 10, 60, 3, cost=True)
    store = RedisStore(redis_server.url, request_timeout=0.1)
    try:
        await store.hit([full], True)
        await store.hit([full], True)  # the window is full
        redis_server.pause()
        with pytest.raises(StoreUnavailable, match="no answer"):
            await store.hit([full, budget], True, owe=True)  # admitted by failure_mode
        redis_server.resume()

        async def repaid() -> bool:
            stats = store.metrics().figures
            return stats["exact_owed_sent"] == 1 and stats["exact_owed_entries"] == 0

        await eventually_async(repaid, timeout=5, what="the owed hit repaid")
        look = [ExactHit("f2", 2, 60, 0), ExactHit("c2", 10, 60, 0)]
        assert [r.before for r in await store.hit(look, False)] == [3, 3]
    finally:
        await store.close()


def test_owed_hits_are_bounded_and_expire_with_their_window() -> None:
    owed = OwedHits(max_entries=2)
    args = (10, 60_000_000, 1, 0)  # limit, window_us, hits, role
    owed.add(["a"], args, since=0.0)
    owed.add(["b"], args, since=1.0)
    owed.add(["c"], (10, 1_000_000, 1, 0), since=1.0)  # past the bound: dropped
    assert owed.dropped == 1 and len(owed) == 2
    assert owed.take(descriptors=1, now=2.0) == [(("a",), args, 0.0)]  # one at a time
    assert owed.take(descriptors=10, now=61.0) == []  # "b" is older than its window
    assert (owed.dropped, owed.sent, len(owed)) == (2, 1, 0)


def test_owed_hits_of_one_request_shape_add_up() -> None:
    """Requests with the same keys and limits are one entry whose hits add up, so an
    outage costs memory and work by the keys it touched, not by its length; hits older
    than their window are dropped as newer ones come."""
    owed = OwedHits()
    two = (10, 60_000_000, 1, 0, 5, 1_000_000, 2, 1)  # two descriptors
    for at in (0.0, 0.5, 0.9):
        owed.add(["a", "b"], two, since=at)
    owed.add(["a", "b"], (10, 60_000_000, 1, 0, 6, 1_000_000, 2, 1), since=0.2)  # other limit
    assert len(owed) == 2 and owed.added == 4
    owed.add(["a", "b"], two, since=1.5)  # the 1 s window of the first three is over
    assert owed.dropped == 1
    taken = owed.take(descriptors=100, now=1.6)
    assert (("a", "b"), (10, 60_000_000, 1, 0, 5, 1_000_000, 2, 1), 1.5) in taken
    assert len(taken) == 1  # the other entry's window ended at 1.2


async def test_owed_hits_sent_again_keep_their_first_time(redis_server) -> None:
    """Redis away for longer than a window: owed hits keep the time they were admitted
    (they ride on no call while the circuit is open, and one that fails owes them again
    with that time), so they are dropped once their window has passed instead of
    landing in a later one."""
    short = [ExactHit("s", 10, 1, 1)]  # a 1 s window
    store = RedisStore(redis_server.url, request_timeout=0.2)
    try:
        await store.hit(short, True)
        redis_server.stop()
        with pytest.raises(StoreUnavailable):
            await store.hit(short, True, owe=True)
        for _ in range(12):  # 1.2 s of failing calls, each carrying the owed hit again
            await asyncio.sleep(0.1)  # the subject: the hit's 1 s window passes meanwhile
            with pytest.raises(StoreUnavailable):
                await store.hit(short, False)
        redis_server.start()
        assert await until_answered(store) == 0  # dropped, not counted a window later
        assert store.metrics().figures["exact_owed_dropped"] >= 1
    finally:
        await store.close()
