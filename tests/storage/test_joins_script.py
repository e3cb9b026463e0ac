"""joins.lua and its twin (EmbeddedStore.joins): the count of members new to an RLQS
counter, read or added to, the same on Redis and in one process; several members of
one store see one count."""

from __future__ import annotations

from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore

CALLS = (False, True, False, True, True, False)
"""Whether each call adds one (a member's first publish of a counter) or only reads."""


async def test_redis_counts_as_its_twin(redis_server) -> None:  # type: ignore[no-untyped-def]
    twin = EmbeddedStore()
    one, two = RedisStore(redis_server.url), RedisStore(redis_server.url)
    try:
        redis = [await (one if n % 2 else two).joins(joined) for n, joined in enumerate(CALLS)]
        embedded = [await twin.joins(joined) for joined in CALLS]
    finally:
        await one.close()
        await two.close()
        await twin.close()
    assert redis == embedded == [0, 1, 1, 2, 3, 3]
