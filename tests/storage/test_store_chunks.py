"""The Redis store splits every batched call itself, CALL_CHUNK items per script call:
a sync's buckets, a publish's counters (fenced or not), a zone's write-back. On a
real redis-server: the answers come back whole and in order, in as many calls as
the chunks, and a fenced publish stops at its first refused chunk."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.tiers import Fenced, TierReport
from ratelimit_service.core.zones import ZoneShare
from ratelimit_service.storage.redis_store import CALL_CHUNK, RedisStore
from ratelimit_service.storage.zoned import ZoneRedisStore

ITEMS = 2 * CALL_CHUNK + 3  # three calls


def reports(member: str) -> list[TierReport]:
    return [TierReport(f"q{n}", member, 1.0, 1, n, 60, 1000.0) for n in range(ITEMS)]


async def test_sync_and_publish_go_in_chunks_in_order(redis_server) -> None:
    store = RedisStore(redis_server.url)
    try:
        buckets = [BucketReport(f"b{n}", 1000, 60, n, n) for n in range(ITEMS)]
        before = store.redis.calls
        result = await store.sync(buckets)
        assert store.redis.calls - before == 3 and result.nodes == 1
        assert [view.tokens for view in result.views] == [1000.0 - n for n in range(ITEMS)]
        before = store.redis.calls
        answers = await store.publish(reports("r1"), 15.0)
        assert store.redis.calls - before == 3
        assert [answer.used for answer in answers] == list(range(ITEMS))  # each its own
    finally:
        await store.close()


async def test_a_fenced_publish_stops_at_the_first_refused_chunk(redis_server) -> None:
    store = RedisStore(redis_server.url)
    try:
        # A later token reached the third chunk's counters only.
        later = reports("zone-a")[2 * CALL_CHUNK :]
        assert len(await store.publish_fenced(later, 15.0, 7, deadline=_far())) == 3
        before = store.redis.calls
        got = await store.publish_fenced(reports("zone-a"), 15.0, 5, deadline=_far())
        assert got == Fenced(7) and store.redis.calls - before == 3
        # The first two chunks were written; the refused one was not.
        answers = await store.publish_fenced(reports("zone-a"), 15.0, 8, deadline=_far())
        assert [a.used for a in answers[:3]] == [0, 2, 4]  # published twice
        assert [a.used for a in answers[-3:]] == [2 * n for n in range(2 * CALL_CHUNK, ITEMS)]
    finally:
        await store.close()


async def test_a_zones_write_back_goes_in_chunks(redis_server) -> None:
    store = ZoneRedisStore(redis_server.url, "z")
    client = aioredis.Redis.from_url(redis_server.url)
    try:
        keys = [f"rl:zone-test:{n}" for n in range(ITEMS)]
        for key in keys[:-1]:  # the last has expired: not written
            await client.hset(key, "K", key)
        shares = [(key, ZoneShare(n, 0, 0, 0)) for n, key in enumerate(keys)]
        before = store.redis.calls
        assert await store.write_back(shares, 4, 1, deadline=_far()) == ITEMS - 1
        assert store.redis.calls - before == 3
        assert int(await client.get(store.keys.zones) or 0) == 4
        assert [int(z) for z in await client.hmget(keys[-2], "Z")] == [ITEMS - 2]
        assert not await client.exists(keys[-1])
    finally:
        await client.aclose()
        await store.close()


def _far() -> float:
    """A deadline far enough (the event loop's time)."""
    return asyncio.get_running_loop().time() + 5.0
