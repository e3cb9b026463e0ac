"""Concurrent exact-mode requests share one script call, and decide exactly as
separate calls would (real redis-server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from ratelimit_harness.fixtures import window_slices
from ratelimit_harness.forwarder import Forwarder
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.exact import ExactHit, ExactResult, HitRole
from ratelimit_service.storage import exact_batcher
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.redis_store import RedisStore

pytestmark = pytest.mark.serial  # timing: run alone, after the parallel part


@pytest.fixture
async def store(redis_server, monkeypatch):
    """One call in flight at a time and no gap between calls, so every test knows which
    requests share a call."""
    monkeypatch.setattr(exact_batcher, "MAX_IN_FLIGHT", 1)
    store = RedisStore(redis_server.url, request_timeout=0.5, batch_hold=0.0)
    yield store
    await store.close()


async def test_the_first_call_goes_at_once_then_requests_gather_for_the_gap(
    redis_server,
) -> None:
    store = RedisStore(redis_server.url, request_timeout=0.5, batch_hold=0.05)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        first = store.hit([ExactHit("k", 100, 60, 1)], True)
        assert store.metrics().figures["exact_batches"] == 1  # sent before hit() returned
        results = await asyncio.gather(
            first, *(store.hit([ExactHit("k", 100, 60, 1)], True) for _ in range(10))
        )
        # The ten that came within the gap after the first call left shared one call,
        # sent when the gap was over.
        assert store.metrics().figures["exact_batches"] == 2
        assert store.metrics().figures["exact_held_batches"] == 1
        assert loop.time() - started >= 0.04
        assert sorted(r[0].before for r in results) == list(range(11))
    finally:
        await store.close()


async def test_concurrent_requests_share_one_call_and_admit_the_limit(store: RedisStore) -> None:
    results = await asyncio.gather(*(store.hit([ExactHit("k", 7, 60, 1)], True) for _ in range(20)))
    # The first finds the line idle and goes alone; the 19 that queue behind it share one call.
    assert store.metrics().figures["exact_batches"] == 2
    assert store.metrics().figures["exact_batched_requests"] == 20
    assert [r[0].admitted for r in results] == [True] * 7 + [False] * 13
    # Decided in submission order, each seeing what the ones before it consumed.
    assert [r[0].before for r in results] == list(range(7)) + [7] * 13
    assert [r[0].remaining for r in results[:7]] == [6, 5, 4, 3, 2, 1, 0]
    after = await store.hit([ExactHit("k", 7, 60, 0)], True)
    assert after[0].before == 7


async def test_batch_mixes_keys_roles_and_check_only(store: RedisStore) -> None:
    await store.hit([ExactHit("full", 1, 60, 1)], True)
    calls_before = store.metrics().figures["exact_batches"]
    first, denied, check, shadow, plain = await asyncio.gather(
        store.hit([ExactHit("first", 1, 60, 1)], True),  # goes alone; the rest queue
        store.hit([ExactHit("roomy", 5, 60, 1), ExactHit("full", 1, 60, 1)], True),
        store.hit([ExactHit("roomy", 5, 60, 3)], False),
        store.hit([ExactHit("full", 1, 60, 1, HitRole.SHADOW), ExactHit("roomy", 5, 60, 2)], True),
        store.hit([ExactHit("other", 2, 1, 2)], True),
    )
    assert store.metrics().figures["exact_batches"] == calls_before + 2
    assert first[0].admitted
    assert [r.admitted for r in denied] == [True, False]
    assert check[0].admitted and check[0].before == 0  # the denied request took nothing
    assert [r.admitted for r in shadow] == [False, True]
    assert shadow[1].before == 0 and shadow[1].remaining == 3  # check-only consumed nothing
    assert plain[0].admitted and plain[0].remaining == 0
    roomy = await store.hit([ExactHit("roomy", 5, 60, 0)], True)
    assert roomy[0].before == 2


async def test_large_bursts_are_split_into_bounded_calls(store: RedisStore) -> None:
    size = exact_batcher.MAX_BATCH_DESCRIPTORS
    hits = [ExactHit(f"k{i % 3}", 1000, 60, 1) for i in range(5)]
    results = await asyncio.gather(*(store.hit(hits, True) for _ in range(size)))
    # The first request goes alone; then a batch leaves whenever it holds `size`
    # descriptors or more (52 requests of 5), and the rest when the line is free.
    per_batch = -(-size // 5)
    assert store.metrics().figures["exact_batches"] == 1 + -(-(size - 1) // per_batch)
    assert all(r.admitted for result in results for r in result)
    totals = await store.hit([ExactHit(f"k{i}", 1000, 60, 0) for i in range(3)], True)
    assert [t.before for t in totals] == [2 * size, 2 * size, size]


async def test_a_cancelled_caller_does_not_disturb_the_batch(store: RedisStore) -> None:
    tasks = [asyncio.ensure_future(store.hit([ExactHit("c", 5, 60, 1)], True)) for _ in range(3)]
    await asyncio.sleep(0)  # all submitted: the first is sent, the other two share a batch
    tasks[1].cancel()
    assert (await tasks[0])[0].admitted
    assert (await tasks[2])[0].admitted
    # The cancelled request was already in the batch, so Redis still decided it.
    assert (await store.hit([ExactHit("c", 5, 60, 0)], True))[0].before == 3


async def test_every_waiter_hears_a_failure(redis_server) -> None:
    store = RedisStore(redis_server.url, request_timeout=0.2)
    try:
        redis_server.pause()
        outcomes = await asyncio.gather(
            *(store.hit([ExactHit("p", 5, 60, 1)], True) for _ in range(5)),
            return_exceptions=True,
        )
        assert all(isinstance(o, StoreUnavailable) for o in outcomes)
        assert len({id(o) for o in outcomes}) == 5  # one exception object each
    finally:
        redis_server.resume()
        await store.close()


async def test_hits_held_back_in_a_call_count_when_slices_are_read(
    store: RedisStore, redis_server
) -> None:
    """The script writes a call's hits at its end. A denied hit reads the key's slices
    to work out its wait, and a recount reads them after a slice expired: both must
    see the hits the same call already took, and the bookkeeping must come out equal
    to the slices."""
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    key = store._exact_key("w", 1)
    decoy = [ExactHit("decoy", 100, 1, 1)]  # goes alone, so the rest share one call

    async def bookkeeping_total() -> int:
        return sum(window_slices(await raw.hgetall(key)).values())

    async def burst(count: int) -> list[ExactResult]:
        hit = [ExactHit("w", 5, 1, 1)]
        results = await asyncio.gather(
            store.hit(decoy, True), *(store.hit(hit, True) for _ in range(count))
        )
        return [r[0] for r in results[1:]]

    try:
        await store.hit([ExactHit("w", 5, 1, 3)], True)
        await asyncio.sleep(0.5)  # the subject: slices leaving a window on Redis's clock
        calls = store.metrics().figures["exact_batches"]
        results = await burst(6)  # two fit; the four denied read the slices
        assert store.metrics().figures["exact_batches"] == calls + 2
        assert [r.admitted for r in results] == [True, True] + [False] * 4
        assert [r.before for r in results] == [3, 4, 5, 5, 5, 5]
        for denied in results[2:]:
            assert denied.remaining == 0  # the call's own two hits are counted
            assert 0.2 < denied.reset_after <= 0.55  # when the first three leave
        assert await bookkeeping_total() == 5
        await asyncio.sleep(0.55)  # the first three have left: the next call recounts
        results = await burst(5)
        assert [r.before for r in results] == [2, 3, 4, 5, 5]
        assert [r.admitted for r in results] == [True, True, True, False, False]
        assert [r.remaining for r in results] == [2, 1, 0, 0, 0]
        assert await bookkeeping_total() == 5
    finally:
        await raw.aclose()


# -- the gap between calls ------------------------------------------------------------


async def spread_over_turns(
    store: RedisStore, hits: list[ExactHit], count: int
) -> list[list[ExactResult]]:
    """Submit ``count`` requests one loop turn apart, as grpc.aio starts RPCs under load."""
    calls: list[Awaitable[list[ExactResult]]] = []
    for _ in range(count):
        calls.append(store.hit(hits, True))
        await asyncio.sleep(0)
    return list(await asyncio.gather(*calls))


@pytest.fixture
async def make_store(redis_server) -> AsyncIterator[Callable[..., RedisStore]]:
    """RedisStores on the test's redis-server, closed at the end."""
    stores: list[RedisStore] = []

    def make(**options: Any) -> RedisStore:
        stores.append(RedisStore(redis_server.url, **options))
        return stores[-1]

    yield make
    for store in stores:
        await store.close()


async def test_without_a_gap_requests_in_separate_turns_go_alone(make_store) -> None:
    store = make_store(request_timeout=0.5, batch_hold=0.0)
    assert store.metrics().figures["exact_batch_gap_seconds"] == 0
    results = await spread_over_turns(store, [ExactHit("t", 9, 60, 1)], 6)
    # A call slot was free each time: every request went at once, in its own call.
    assert store.metrics().figures["exact_batches"] == 6
    assert store.metrics().figures["exact_held_batches"] == 0
    assert sorted(r[0].before for r in results) == list(range(6))


async def test_requests_in_separate_turns_within_the_gap_share_a_call(make_store) -> None:
    """grpc.aio starts about one RPC per loop turn, and Redis answers within a turn:
    without the gap each would have a call of its own however high the load."""
    store = make_store(request_timeout=1.0, batch_hold=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await spread_over_turns(store, [ExactHit("h", 3, 60, 1)], 6)
    waited = loop.time() - started
    # The first went at once; the five after it, within the gap, left together.
    assert store.metrics().figures["exact_batches"] == 2
    assert store.metrics().figures["exact_held_batches"] == 1
    assert store.metrics().figures["exact_batched_requests"] == 6
    assert [r[0].admitted for r in results] == [True] * 3 + [False] * 3
    assert [r[0].before for r in results] == [0, 1, 2, 3, 3, 3]
    assert waited >= 0.19  # the batch left when the gap was over, not before


async def test_a_request_after_a_quiet_gap_goes_at_once(make_store) -> None:
    """At a low rate nothing waits: a request that comes when the last call left a gap
    ago or more is sent before hit() returns."""
    store = make_store(request_timeout=1.0, batch_hold=0.05)
    hit = [ExactHit("q", 100, 60, 1)]
    loop = asyncio.get_running_loop()
    await store.hit(hit, True)
    sent_at = loop.time()
    await eventually_async(lambda: loop.time() - sent_at > 0.05, timeout=1, what="gap over")
    calls = store.metrics().figures["exact_batches"]
    answer = store.hit(hit, True)
    assert store.metrics().figures["exact_batches"] == calls + 1  # sent at once, not held
    assert (await answer)[0].before == 1
    assert store.metrics().figures["exact_held_batches"] == 0


async def test_the_gap_stays_well_inside_the_timeout(make_store) -> None:
    store = make_store(request_timeout=0.02, batch_hold=1.0)
    assert store.batch_hold == 0.005
    assert store.metrics().figures["exact_batch_gap_seconds"] == 0.005
    results = await spread_over_turns(store, [ExactHit("q", 10, 60, 1)], 3)
    assert [r[0].before for r in results] == [0, 1, 2]  # answered, not timed out


async def test_a_full_batch_does_not_wait_for_the_gap(make_store) -> None:
    store = make_store(request_timeout=5.0, batch_hold=2.0)
    size = exact_batcher.MAX_BATCH_DESCRIPTORS
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(
        *(store.hit([ExactHit("f", 10 * size, 60, 1)], True) for _ in range(size + 1))
    )
    assert asyncio.get_running_loop().time() - started < 1.0
    # The first at once, then the next `size` as soon as they filled a batch.
    assert store.metrics().figures["exact_batches"] == 2
    assert sorted(r[0].before for r in results) == list(range(size + 1))


async def test_closing_the_store_fails_a_held_batch_instead_of_sending_it(
    make_store, redis_server
) -> None:
    store = make_store(request_timeout=1.0, batch_hold=0.1)
    await store.hit([ExactHit("first", 5, 60, 1)], True)  # the gap starts
    held = store.hit([ExactHit("gone", 5, 60, 1)], True)
    assert store.metrics().figures["exact_held_batches"] == 1
    await store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        await held
    await asyncio.sleep(0.2)  # past the gap (an absence: no condition to await)
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await raw.exists(store._exact_key("gone", 60)) == 0
    finally:
        await raw.aclose()


def test_a_deadline_already_past_arms_the_timer_under_uvloop() -> None:
    """uvloop's call_at for a time already past returns a plain Handle (no when()):
    arming for it, then for another time, must work (it crashed a batch once)."""
    uvloop = pytest.importorskip("uvloop")

    async def arm_twice() -> int:
        loop = asyncio.get_running_loop()
        batcher = exact_batcher.ExactBatcher(None, 60, 0.01)  # type: ignore[arg-type]
        fired: list[float] = []
        batcher._check_deadlines = lambda: fired.append(loop.time())  # type: ignore[method-assign]
        batcher._arm(loop, loop.time() - 1.0)  # past: a plain Handle
        batcher._arm(loop, loop.time() - 2.0)  # earlier still: replaces it
        batcher._arm(loop, loop.time() + 5.0)  # later: kept as it is
        await eventually_async(lambda: fired, timeout=5, what="the timer fired")
        return len(fired)

    assert uvloop.run(arm_twice()) == 1


# -- too late to ask Redis -------------------------------------------------------------


async def test_a_request_with_less_time_left_than_redis_takes_is_answered_at_once(
    redis_server,
) -> None:
    """Behind a Redis that takes 0.1 s, a request that can wait 20 ms would only be given
    up at its deadline: it is answered StoreUnavailable before hit() returns, counted,
    and its hits owed (its rules fail open). Only while a call is in flight: with none,
    a request goes and its reply keeps the figure current."""
    with Forwarder(redis_server.port) as forwarder:
        store = RedisStore(forwarder.url, request_timeout=1.0, batch_hold=0.0)
        try:
            hit = [ExactHit("slow", 100, 60, 1)]
            forwarder.delay(0.1)
            await store.hit(hit, True)  # the first reply sets the figure
            assert store.metrics().figures["exact_prompt_seconds"] >= 0.1
            loop = asyncio.get_running_loop()
            out = store.hit(hit, True)  # in flight for 0.1 s
            with pytest.raises(StoreUnavailable, match="lately"):
                store.hit(hit, True, owe=True, deadline=loop.time() + 0.02)
            assert store.metrics().figures["exact_late"] == 1
            assert store.metrics().figures["exact_owed_entries"] == 1
            assert (await out)[0].before == 1  # the one in flight is decided by Redis
            # Its reply sent the owed hit; the next call lands after it.
            assert (await store.hit(hit, True))[0].before == 3
            # Nothing in flight: the next request goes, though it cannot be answered in
            # time; given up at its deadline.
            with pytest.raises(StoreUnavailable, match="no answer"):
                await store.hit(hit, True, deadline=loop.time() + 0.02)
            assert store.metrics().figures["exact_late"] == 1
            # Redis quick again: the first quick reply brings the figure down at once.
            forwarder.delay(0.0)
            await store.hit(hit, True)  # its reply comes after the given-up one's
            await store.hit(hit, True)
            assert store.metrics().figures["exact_prompt_seconds"] < 0.05
            out = store.hit(hit, True)
            quick = store.hit(hit, True, deadline=loop.time() + 0.02)
            assert [r[0].admitted for r in await asyncio.gather(out, quick)] == [True, True]
        finally:
            await store.close()


async def test_a_request_past_its_deadline_is_answered_at_once(make_store) -> None:
    store = make_store(request_timeout=1.0)
    loop = asyncio.get_running_loop()
    with pytest.raises(StoreUnavailable, match=r"0\.0 ms left"):
        store.hit([ExactHit("past", 5, 60, 1)], True, deadline=loop.time() - 0.001)
    assert store.metrics().figures["exact_late"] == 1
    assert store.metrics().figures["exact_batches"] == 0
