"""RLQS on a real redis-server: two service replicas, each with its own Envoys,
divide one limit over the whole fleet and agree on the split; the window's allowed
hits are counted fleet-wide."""

from __future__ import annotations

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.engine.quota import DENY_ALL, QuotaCoordinator, Usage
from ratelimit_service.engine.stats import Stats
from ratelimit_service.storage.redis_store import RedisStore

RULES = """\
domain: q
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: daily
    rate_limit: {unit: day, requests_per_unit: 50}
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_two_replicas_compute_the_same_split(redis_server) -> None:
    config = load_config([ConfigFile("q.yaml", RULES)])
    clock = Clock()  # the replicas' own clocks measure demand; Redis's keeps the windows
    stores = [RedisStore(redis_server.url), RedisStore(redis_server.url)]
    one, two = (QuotaCoordinator(lambda: config, Stats(), s, clock=clock) for s in stores)
    bucket = {"tenant": "t"}
    try:
        await one.report("a", "q", [Usage(bucket, 1, 0)])
        await two.report("b", "q", [Usage(bucket, 1, 0)])
        clock.now += 5.0
        (b,) = await two.report("b", "q", [Usage(bucket, 1250, 0)])  # 250/s
        (a,) = await one.report("a", "q", [Usage(bucket, 100, 0)])  # 20/s
        assert a.token_bucket is not None and b.token_bucket is not None
        # Replica one knows b's demand from Redis: a gets its 20 (b wants the rest).
        assert a.token_bucket.tokens_per_fill == 20
        (b,) = await two.report("b", "q", [Usage(bucket, 0, 0)])
        assert one.demands() == {"q\x1ftenant\x1et\x1f1": {"a": 20.0, "b": 250.0}}
        # A daily window used up across both replicas: both deny.
        await one.report("a", "q", [Usage({"daily": "d"}, 30, 0)])
        (denied,) = await two.report("b", "q", [Usage({"daily": "d"}, 20, 0)])
        assert denied.kind == DENY_ALL and denied.ttl_seconds >= 1
    finally:
        for store in stores:
            await store.close()
