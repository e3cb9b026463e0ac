"""The Lua script (real redis-server) decides exactly as the Python core does.

exact_window.lua re-implements core/exact.py and core/window.py for Redis. Random
traffic (shared keys, repeated keys within a request, every role, check-only
requests, hits of 0) goes to both, the script's side batched several requests to a
call; every descriptor's admitted, before and remaining must agree. Windows are an
hour long, so nothing leaves them while the test runs and both see the same counts.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from ratelimit_service.core.exact import ExactHit, ExactResult, HitRole
from ratelimit_service.storage import exact_batcher
from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore

WINDOW = 3600
ROLES = [HitRole.ENFORCE, HitRole.ENFORCE, HitRole.SHADOW, HitRole.QUOTA]


def random_request(rng: random.Random) -> tuple[list[ExactHit], bool]:
    hits = [
        ExactHit(
            key=rng.choice("abcd"),
            limit=rng.randint(3, 15),
            window_seconds=WINDOW,
            hits=rng.choice([0, 1, 1, 1, 2, 3]),
            role=rng.choice(ROLES),
        )
        for _ in range(rng.randint(1, 4))
    ]
    return hits, rng.random() < 0.85


def counts(results: list[ExactResult]) -> list[tuple[bool, int, int]]:
    return [(r.admitted, r.before, r.remaining) for r in results]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_script_agrees_with_core(redis_server, monkeypatch, seed: int) -> None:
    # One call in flight: the requests of a group queue behind it and share calls.
    monkeypatch.setattr(exact_batcher, "MAX_IN_FLIGHT", 1)
    rng = random.Random(seed)
    redis = RedisStore(redis_server.url, request_timeout=2)
    model = EmbeddedStore()
    try:
        compared = denied = 0
        for _ in range(40):
            group = [random_request(rng) for _ in range(rng.randint(1, 8))]
            # Keys of one seed only: a rerun of the module on the same server starts afresh.
            group = [
                ([ExactHit(f"{seed}:{h.key}", h.limit, h.window_seconds, h.hits, h.role)
                  for h in hits], commit)
                for hits, commit in group
            ]  # fmt: skip
            got = await asyncio.gather(*(redis.hit(hits, commit) for hits, commit in group))
            for (hits, commit), results in zip(group, got, strict=True):
                want = await model.hit(hits, commit)
                assert counts(results) == counts(want), (hits, commit)
                for result in results:
                    assert 0 <= result.reset_after <= WINDOW + WINDOW / 60
                compared += len(results)
                denied += sum(not r.admitted for r in results)
        assert redis.stats()["exact_batches"] < redis.stats()["exact_batched_requests"]
        assert compared > 300 and denied > 50  # the traffic did reach the limits
    finally:
        await redis.close()
