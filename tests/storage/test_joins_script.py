"""joins.lua and its twin (EmbeddedStore.joins): the counts of members new to an RLQS
counter per slot, read or added to, the same on Redis and in one process; several
members of one store see one set of counts."""

from __future__ import annotations

from ratelimit_service.core.stretch import JOIN_SLOTS
from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore

CALLS: tuple[tuple[int, ...], ...] = ((), (3,), (), (3, 63), (0,), ())
"""The slots each call adds one to (none: a read)."""


async def test_redis_counts_as_its_twin(redis_server) -> None:  # type: ignore[no-untyped-def]
    twin = EmbeddedStore()
    one, two = RedisStore(redis_server.url), RedisStore(redis_server.url)
    try:
        redis = [await (one if n % 2 else two).joins(add) for n, add in enumerate(CALLS)]
        embedded = [await twin.joins(add) for add in CALLS]
    finally:
        await one.close()
        await two.close()
        await twin.close()
    assert redis == embedded
    assert all(len(counts) == JOIN_SLOTS for counts in redis)
    last = redis[-1]
    assert (last[0], last[3], last[63], sum(last)) == (1, 2, 1, 4)
