"""The Redis store against a real redis-server: exact windows, fleet sync, failures."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from ratelimit_harness.fixtures import window_slices
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.exact import ExactHit, HitRole
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.storage import redis_store
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.redis_store import RedisStore
from ratelimit_service.storage.script_calls import fleet_state

pytestmark = pytest.mark.serial  # timing: run alone, after the parallel part


@pytest.fixture
async def store(redis_server):
    store = RedisStore(redis_server.url, request_timeout=0.2)
    yield store
    await store.close()


async def test_exact_admits_exactly_the_limit(store: RedisStore) -> None:
    results = [await store.hit([ExactHit("k", 3, 60, 1)], True) for _ in range(5)]
    assert [r[0].admitted for r in results] == [True, True, True, False, False]
    assert [r[0].remaining for r in results] == [2, 1, 0, 0, 0]
    assert [r[0].before for r in results] == [0, 1, 2, 3, 3]
    # The first hit's slice leaves the 60 s window 60 to 61 s after it: a reset is at
    # most the window. Denied: the wait is until that first hit leaves.
    assert results[0][0].reset_after == 60.0
    assert 59.0 < results[-1][0].reset_after <= 60.0


async def test_prepared_hits_are_kept_per_tuple_and_bounded(store: RedisStore, monkeypatch) -> None:
    """A plan's hits tuple comes back for every repeat of a request: its keys and
    arguments are prepared once. Lists (hits made for one request) are not kept."""
    monkeypatch.setattr(redis_store, "MAX_PREPARED", 2)
    planned = (ExactHit("a", 3, 60, 1), ExactHit("b", 10, 60, 2))
    results = [await store.hit(planned, True) for _ in range(3)]
    assert [[r.admitted for r in each] for each in results] == [[True, True]] * 3
    assert [(each[0].before, each[1].before) for each in results] == [(0, 0), (1, 2), (2, 4)]
    assert store._prepared[id(planned)][1] == ("rl:e:60:a", "rl:e:60:b")
    await store.hit([ExactHit("c", 3, 60, 1)], True)
    assert len(store._prepared) == 1  # the list was not kept
    others = [(ExactHit(f"k{i}", 3, 60, 1),) for i in range(3)]
    for hits in others:
        await store.hit(hits, True)
    assert len(store._prepared) <= 2
    # an equal tuple elsewhere is a different entry, and answers the same
    fourth = await store.hit((ExactHit("a", 3, 60, 1), ExactHit("b", 10, 60, 2)), True)
    assert [r.admitted for r in fourth] == [False, True] and fourth[1].before == 6


async def test_hits_addend_and_check_only(store: RedisStore) -> None:
    first = await store.hit([ExactHit("k", 10, 60, 7)], True)
    assert first[0].admitted and first[0].remaining == 3
    too_many = await store.hit([ExactHit("k", 10, 60, 4)], True)
    assert not too_many[0].admitted and too_many[0].before == 7
    check = await store.hit([ExactHit("k", 10, 60, 0)], True)
    assert check[0].admitted and check[0].remaining == 3  # consumed nothing
    fits = await store.hit([ExactHit("k", 10, 60, 3)], True)
    assert fits[0].admitted and fits[0].remaining == 0
    full_check = await store.hit([ExactHit("k", 10, 60, 0)], True)
    assert not full_check[0].admitted


async def test_denied_request_consumes_no_other_descriptor(store: RedisStore) -> None:
    await store.hit([ExactHit("full", 1, 60, 1)], True)
    result = await store.hit([ExactHit("roomy", 5, 60, 1), ExactHit("full", 1, 60, 1)], True)
    assert [r.admitted for r in result] == [True, False]
    again = await store.hit([ExactHit("roomy", 5, 60, 1)], True)
    assert again[0].before == 0  # the denied request did not consume "roomy"


async def test_shadow_and_quota_roles(store: RedisStore) -> None:
    await store.hit([ExactHit("s", 1, 60, 1)], True)
    shadowed = await store.hit(
        [ExactHit("s", 1, 60, 1, HitRole.SHADOW), ExactHit("e", 5, 60, 1)], True
    )
    assert [r.admitted for r in shadowed] == [False, True]
    assert (await store.hit([ExactHit("e", 5, 60, 0)], True))[0].before == 1  # consumed
    await store.hit([ExactHit("q1", 1, 60, 1)], True)
    quota = await store.hit(
        [ExactHit("q1", 1, 60, 1, HitRole.QUOTA), ExactHit("q2", 1, 60, 1, HitRole.QUOTA)], True
    )
    assert [r.admitted for r in quota] == [False, True]
    assert (await store.hit([ExactHit("q2", 1, 60, 0)], True))[0].before == 1


async def test_commit_false_checks_only(store: RedisStore) -> None:
    result = await store.hit([ExactHit("k", 2, 60, 1)], False)
    assert result[0].admitted
    assert (await store.hit([ExactHit("k", 2, 60, 0)], True))[0].before == 0


async def test_sliding_window_has_no_edge_burst(store: RedisStore) -> None:
    """A 1 s window: hits admitted late in one second block the start of the next."""
    admitted = [(await store.hit([ExactHit("edge", 5, 1, 1)], True))[0].admitted for _ in range(5)]
    assert admitted == [True] * 5
    # The subject is the window on Redis's clock (TIME), so real time passes: here a
    # fixed window aligned to seconds may have rolled over.
    await asyncio.sleep(0.5)
    later = [(await store.hit([ExactHit("edge", 5, 1, 1)], True))[0].admitted for _ in range(3)]
    assert later == [False, False, False]
    await asyncio.sleep(0.6)  # now more than a window (plus one slice) after the first hits
    assert (await store.hit([ExactHit("edge", 5, 1, 1)], True))[0].admitted


async def test_script_reloaded_after_flush(store: RedisStore, redis_server) -> None:
    await store.hit([ExactHit("k", 5, 60, 1)], True)
    raw = aioredis.Redis.from_url(redis_server.url)
    await raw.script_flush()
    await raw.aclose()
    result = await store.hit([ExactHit("k", 5, 60, 1)], True)
    assert result[0].before == 1


async def test_fleet_sync_token_bucket(store: RedisStore) -> None:
    first = await store.sync([BucketReport("b", 100, 1, offered=150, admitted=90)])
    assert first.nodes == 1
    # a new bucket holds its capacity: the whole limit
    assert 9.0 <= first.views[0].tokens <= 11.5  # 100 - 90, plus a few ms of refill
    assert first.views[0].offered_total == 150
    await asyncio.sleep(0.2)  # the subject: a refill on Redis's clock (TIME)
    second = await store.sync([BucketReport("b", 100, 1, offered=10, admitted=0)])
    assert 25.0 <= second.views[0].tokens <= 45.0  # refilled at 100/s for ~0.2 s
    await asyncio.sleep(1.0)  # a whole window on Redis's clock: refilled to the brim
    full = await store.sync([BucketReport("b", 100, 1, offered=0, admitted=0)])
    assert full.views[0].tokens == 100.0  # never above the capacity
    assert second.views[0].offered_total == 160
    debt = await store.sync([BucketReport("b", 100, 1, offered=0, admitted=1000)])
    assert debt.views[0].tokens == -100.0  # debt is bounded by one window
    # a rule's burst caps its bucket below the limit
    small = await store.sync([BucketReport("s", 100, 1, 1, 1, burst=20)])
    assert small.views[0].tokens == 19.0


async def test_fleet_sync_stamps_keep_every_microsecond(store: RedisStore, redis_server) -> None:
    """The bucket's time stamp and the node registry's scores are written as whole
    microseconds (16 digits), not as Lua's 14-digit rendering of a number: the stamp
    packed as a double (exact to 2**53), the scores formatted."""
    await store.sync([BucketReport("b", 100, 1, offered=1, admitted=1)])
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    packed = aioredis.Redis.from_url(redis_server.url)  # the state is binary
    try:
        state = fleet_state(await packed.hget(store._fleet_key("b", 1), "v"))
        scores = await raw.zrange(store.prefix + "nodes", 0, -1, withscores=True)
        seconds, micros = await raw.time()
    finally:
        await raw.aclose()
        await packed.aclose()
    assert state is not None and state.stamp == int(state.stamp)
    stamp = int(state.stamp)
    assert len(str(stamp)) == 16
    now_us = seconds * 1_000_000 + micros
    assert 0 <= now_us - stamp < 5_000_000
    assert [abs(score - stamp) for _, score in scores] == [0]


async def test_nodes_are_counted_by_heartbeat(redis_server) -> None:
    stores = [RedisStore(redis_server.url) for _ in range(3)]
    try:
        for store in stores:
            await store.sync([])
        result = await stores[0].sync([])
        assert result.nodes == 3
        assert result.views == []
    finally:
        for store in stores:
            await store.close()


async def test_paused_redis_times_out_within_bound(redis_server) -> None:
    """A call waits its timeout (100 ms here) for a paused Redis; once Redis has been
    silent longer than a call can wait, calls fail at once (well under the timeout, with
    room for a busy machine), and past the silence bound the circuit opens."""
    store = RedisStore(redis_server.url, request_timeout=0.1, sync_timeout=0.15, silence=0.5)
    try:
        await store.hit([ExactHit("k", 5, 60, 1)], True)  # connection established
        redis_server.pause()
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match=r"no answer in 1[0-9][0-9] ms"):
            await store.hit([ExactHit("k", 5, 60, 1)], True)
        assert time.monotonic() - started < 0.5
        for _ in range(2):  # silent for longer than they can wait: answered at once
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="silent for longer"):
                await store.hit([ExactHit("k", 5, 60, 1)], True)
            assert time.monotonic() - started < 0.05
        assert not store.redis.breaker.open  # late replies are not evidence: still closed
        # Calls go on failing until nothing has come back for 0.5 s: then the
        # connection counts as dead, and the circuit opens.

        async def failed_until_open() -> bool:
            with pytest.raises(StoreUnavailable):
                await store.hit([ExactHit("k", 5, 60, 1)], True)
            return store.redis.breaker.open

        await eventually_async(failed_until_open, timeout=2, what="the circuit open")
        assert store.metrics().figures["silences"] == 1
        # The circuit is open now: the next call fails at once, without waiting.
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="circuit open"):
            await store.hit([ExactHit("k", 5, 60, 1)], True)
        assert time.monotonic() - started < 0.05
        with pytest.raises(StoreUnavailable):
            await store.sync([])
    finally:
        redis_server.resume()
        await store.close()


async def test_recovers_after_restart(redis_server) -> None:
    store = RedisStore(redis_server.url, request_timeout=0.05)
    try:
        await store.hit([ExactHit("k", 5, 60, 1)], True)
        redis_server.stop()

        async def unhealthy() -> bool:
            with pytest.raises(StoreUnavailable):
                await store.hit([ExactHit("k", 5, 60, 1)], True)
            return not store.healthy()

        await eventually_async(unhealthy, timeout=5, what="the store marked unhealthy")
        redis_server.start()
        result = await eventually_async(
            lambda: store.hit([ExactHit("k", 5, 60, 1)], True),
            timeout=10,
            what="the store recovered",
            ignore=(StoreUnavailable,),
        )
        assert result[0].admitted
        for _ in range(3):
            await store.hit([ExactHit("k2", 50, 60, 1)], True)
        assert store.healthy()
    finally:
        await store.close()


async def test_memory_per_window_key(store: RedisStore, redis_server) -> None:
    """A busy exact key holds at most 61 slices (plus its three bookkeeping fields: sum,
    first and last); its memory stays small (README figure)."""
    for _ in range(200):
        await store.hit([ExactHit("busy", 10**6, 1, 1)], True)
        await asyncio.sleep(0.005)  # pacing: the hits spread over the window's slices
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        key = store._exact_key("busy", 1)
        fields = await raw.hlen(key) - 3
        usage = await raw.memory_usage(key)
        meta = await raw.hmget(key, "sum", "first", "last")
        ttl_ms = await raw.pttl(key)
    finally:
        await raw.aclose()
    assert 1 <= fields <= 61
    assert usage is not None and usage < 2048
    assert meta[0] is not None and 0 < int(meta[0]) <= 200
    assert meta[2] is not None and int(meta[1]) <= int(meta[2])  # oldest <= newest slice
    assert 0 < ttl_ms <= 1000 + 2 * 1000 // store.slices + 1  # window + 2 slice widths


async def test_a_timeout_keeps_the_connection(redis_server) -> None:
    """A command that outlives its deadline finishes in the background: the connection
    is not dropped, so the next call does not pay for a new one (no reconnect spiral)."""
    store = RedisStore(redis_server.url, request_timeout=0.05, sync_timeout=2)
    raw = aioredis.Redis.from_url(redis_server.url)
    try:
        await store.hit([ExactHit("k", 5, 60, 1)], True)
        before = int((await raw.info("stats"))["total_connections_received"])
        redis_server.pause()
        with pytest.raises(StoreUnavailable):
            await store.hit([ExactHit("k", 5, 60, 1)], True)
        redis_server.resume()

        async def counted() -> int:
            return (await store.hit([ExactHit("k", 5, 60, 0)], True))[0].before

        # the shielded command completes now: the late command did run, once. Until the
        # connection has read a byte since the resume, a call with this 50 ms timeout
        # may be refused at once as hopeless (the connection silent for longer).
        late = await eventually_async(
            counted, timeout=5, what="the late command", ignore=(StoreUnavailable,)
        )
        assert late == 2
        after = int((await raw.info("stats"))["total_connections_received"])
        assert after - before <= 1  # at most our own INFO connection was added
    finally:
        await raw.aclose()
        await store.close()


async def test_bookkeeping_follows_expiry(store: RedisStore, redis_server) -> None:
    """The running total (n), oldest slice (o) and newest slice (c) stay equal to the
    slices themselves as slices expire, so decisions that read only them stay exact."""
    raw = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    key = store._exact_key("exp", 1)

    async def check() -> int:
        slices = window_slices(await raw.hgetall(key))
        # The expiry, renewed only when a slice opens, outlives the newest slice.
        seconds, micros = await raw.time()
        now_us = seconds * 1_000_000 + micros
        width_us = 1_000_000 / store.slices
        leaves_at_us = (max(slices) + store.slices + 1) * width_us
        assert await raw.pttl(key) * 1000 >= leaves_at_us - now_us - 2000
        return sum(slices.values())

    try:
        for _ in range(5):
            await store.hit([ExactHit("exp", 100, 1, 1)], True)
        assert await check() == 5
        await asyncio.sleep(0.4)  # the subject: slices expiring on Redis's clock (TIME)
        for _ in range(3):
            await store.hit([ExactHit("exp", 100, 1, 2)], True)
        assert await check() == 11
        await asyncio.sleep(0.7)  # the first five have left the window; the rest have not
        result = await store.hit([ExactHit("exp", 100, 1, 1)], True)
        assert result[0].before == 6
        assert await check() == 7
        await asyncio.sleep(1.1)  # everything has left: nothing is kept
        result = await store.hit([ExactHit("exp", 100, 1, 0)], True)
        assert result[0].before == 0 and result[0].admitted
        assert await raw.exists(key) == 0
    finally:
        await raw.aclose()
