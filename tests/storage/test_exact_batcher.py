"""Concurrent exact-mode requests share one script call, and decide exactly as
separate calls would (real redis-server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from ratelimit_harness.fixtures import window_slices
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.exact import ExactHit, ExactResult, HitRole
from ratelimit_service.storage import exact_batcher
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.redis_store import RedisStore

pytestmark = pytest.mark.serial  # timing: run alone, after the parallel part


@pytest.fixture
async def store(redis_server, monkeypatch):
    """One call in flight at a time, so every test knows which requests share a call."""
    monkeypatch.setattr(exact_batcher, "MAX_IN_FLIGHT", 1)
    store = RedisStore(redis_server.url, request_timeout=0.5)
    yield store
    await store.close()


async def test_a_few_calls_go_out_at_once_then_requests_queue(redis_server) -> None:
    store = RedisStore(redis_server.url, request_timeout=0.5)
    try:
        slots = exact_batcher.MAX_IN_FLIGHT
        results = await asyncio.gather(
            *(store.hit([ExactHit("k", 100, 60, 1)], True) for _ in range(slots + 10))
        )
        # One call per free slot, then the ten that queued behind them share one.
        assert store.metrics().figures["exact_batches"] == slots + 1
        assert sorted(r[0].before for r in results) == list(range(slots + 10))
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


# -- holding while the event loop is saturated ------------------------------------


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


async def test_requests_in_separate_turns_go_alone_when_not_held(make_store) -> None:
    store = make_store(request_timeout=0.5)
    results = await spread_over_turns(store, [ExactHit("t", 9, 60, 1)], 6)
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0
    # A call slot was free each time: every request went at once, in its own call.
    assert store.metrics().figures["exact_batches"] == 6
    assert store.metrics().figures["exact_held_batches"] == 0
    assert sorted(r[0].before for r in results) == list(range(6))


async def test_saturated_loop_holds_calls_so_requests_share_them(make_store) -> None:
    store = make_store(request_timeout=1.0, batch_hold=0.2)
    store.loop_saturated(True)
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0.2
    loop = asyncio.get_running_loop()
    started = loop.time()
    results = await spread_over_turns(store, [ExactHit("h", 3, 60, 1)], 5)
    waited = loop.time() - started
    assert store.metrics().figures["exact_batches"] == 1  # one call for the five
    assert store.metrics().figures["exact_held_batches"] == 1
    assert [r[0].admitted for r in results] == [True] * 3 + [False] * 2
    assert [r[0].before for r in results] == [0, 1, 2, 3, 3]
    assert waited >= 0.19  # the batch left when its hold was over, not before

    store.loop_saturated(False)
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0
    started = loop.time()
    again = await store.hit([ExactHit("h", 3, 60, 0)], True)
    assert loop.time() - started < 0.1  # not held any more
    assert again[0].before == 3


async def test_the_hold_stays_well_inside_the_timeout(make_store) -> None:
    store = make_store(request_timeout=0.02, batch_hold=1.0)
    assert store.batch_hold == 0.005
    store.loop_saturated(True)
    results = await spread_over_turns(store, [ExactHit("q", 10, 60, 1)], 3)
    assert [r[0].before for r in results] == [0, 1, 2]  # answered, not timed out


async def test_a_full_batch_does_not_wait_for_its_hold(make_store) -> None:
    store = make_store(request_timeout=5.0, batch_hold=2.0)
    store.loop_saturated(True)
    size = exact_batcher.MAX_BATCH_DESCRIPTORS
    started = asyncio.get_running_loop().time()
    results = await asyncio.gather(
        *(store.hit([ExactHit("f", 10 * size, 60, 1)], True) for _ in range(size))
    )
    assert asyncio.get_running_loop().time() - started < 1.0
    assert store.metrics().figures["exact_batches"] == 1
    assert sorted(r[0].before for r in results) == list(range(size))


async def test_a_batch_queued_for_a_free_slot_is_not_held_when_holding_starts(
    store: RedisStore,
) -> None:
    """A batch that opened while nothing was held waits only for a call slot, even if
    holding is switched on before the slot frees."""
    store.batch_hold = 2.0
    first = asyncio.ensure_future(store.hit([ExactHit("s", 10, 60, 1)], True))
    await asyncio.sleep(0)  # sent: the only slot is busy
    queued = asyncio.ensure_future(store.hit([ExactHit("s", 10, 60, 1)], True))
    await asyncio.sleep(0)
    store.loop_saturated(True)
    joined = asyncio.ensure_future(store.hit([ExactHit("s", 10, 60, 1)], True))
    done, _ = await asyncio.wait([first, queued, joined], timeout=1.0)
    assert len(done) == 3  # not held for 2 s behind the first call
    assert store.metrics().figures["exact_batches"] == 2
    assert sorted(t.result()[0].before for t in (first, queued, joined)) == [0, 1, 2]


async def test_holding_stops_when_held_calls_leave_alone(make_store) -> None:
    """Saturated in the sensor's last sample, but requests now come one at a time
    (the load has just dropped): after LONE_BATCHES held calls with nobody to share
    them, calls go at once again, until the sensor reports saturation again."""
    store = make_store(request_timeout=1.0, batch_hold=0.2)
    hit = [ExactHit("l", 100, 60, 1)]
    loop = asyncio.get_running_loop()

    async def timed() -> float:
        started = loop.time()
        await store.hit(hit, True)
        return loop.time() - started

    lone = exact_batcher.LONE_BATCHES
    store.loop_saturated(True)
    waits = [await timed() for _ in range(lone + 2)]
    assert all(wait >= 0.19 for wait in waits[:lone]), waits
    assert all(wait < 0.1 for wait in waits[lone:]), waits
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0
    # The next report brings the hold back, with a fresh count of lone calls.
    store.loop_saturated(True)
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0.2
    for _ in range(lone - 1):
        assert await timed() >= 0.19
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0.2
    # A shared held call starts the count again too.
    await spread_over_turns(store, hit, 3)
    for _ in range(lone - 1):
        await timed()
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0.2
    await timed()
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0


async def test_closing_the_store_fails_a_held_batch_instead_of_sending_it(
    make_store, redis_server
) -> None:
    store = make_store(request_timeout=1.0, batch_hold=0.1)
    store.loop_saturated(True)
    held = store.hit([ExactHit("gone", 5, 60, 1)], True)
    await store.close()
    with pytest.raises(StoreUnavailable, match="closed"):
        await held
    await asyncio.sleep(0.2)  # past the hold (an absence: no condition to await)
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        assert await raw.exists(store._exact_key("gone", 60)) == 0
    finally:
        await raw.aclose()


async def test_no_hold_without_a_single_server_or_with_a_hold_of_zero(make_store) -> None:
    assert make_store().wants_saturation
    store = make_store(batch_hold=0.0)
    assert not store.wants_saturation
    store.loop_saturated(True)
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0


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
