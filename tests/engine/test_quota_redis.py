"""RLQS on a real redis-server: two service replicas, each with its own Envoys,
divide one limit over the whole fleet from the totals each publishes; the window's
allowed hits are counted fleet-wide."""

from __future__ import annotations

import pytest

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.engine.quota import DENY_ALL, CounterView, QuotaCoordinator, Usage
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


KEY = "q\x1ftenant\x1et\x1f1"


def view(quota: QuotaCoordinator) -> CounterView:
    """The replica's read-out of the counter (what /status.json and /metrics show)."""
    (found,) = [v for v in quota.view() if v is not None and v.key == KEY]
    return found


def part(quota: QuotaCoordinator) -> float:
    held = view(quota).part
    assert held is not None
    return held


async def test_two_replicas_divide_one_limit_from_totals(redis_server) -> None:
    config = load_config([ConfigFile("q.yaml", RULES)])
    clock = Clock()  # the replicas' own clocks measure demand; Redis's keeps the windows
    stores = [RedisStore(redis_server.url), RedisStore(redis_server.url)]
    # every round publishes (the waits of a counter steady over its limit: test_rlqs_waits.py)
    one, two = (
        QuotaCoordinator(lambda: config, Stats(), s, clock=clock, stretch=1) for s in stores
    )
    bucket = {"tenant": "t"}

    async def round_of(a_hits: int, b_hits: int) -> tuple[float, float]:
        clock.now += 5.0
        await one.report("a", "q", [Usage(bucket, a_hits, 0)])
        await two.report("b", "q", [Usage(bucket, b_hits, 0)])
        for replica in (one, two, one, two):  # publishes, each in turn
            await replica.tick()
        return part(one), part(two)

    try:
        (first,) = await one.report("a", "q", [Usage(bucket, 1, 0)])
        (second,) = await two.report("b", "q", [Usage(bucket, 1, 0)])
        assert first.token_bucket is not None and second.token_bucket is not None
        # The second replica's first answer already knows the first: half the limit.
        assert second.token_bucket.tokens_per_fill == 50
        # Over the limit (20/s and 250/s against 100/s): in proportion to demand.
        part_one, part_two = await round_of(100, 1250)
        assert part_one == pytest.approx(100 * 20 / 270, abs=0.01)
        assert part_one + part_two == pytest.approx(100, abs=0.01)
        totals = view(one).totals
        assert totals is not None and (totals.instances, totals.members) == (2, 2)
        # One counter: its first publish (at the first report), then two per round.
        assert (one.bucket_updates, one.last_updates) == (3, 1)
        # Under it (20/s and 50/s): each its demand, and half the 30 spare.
        part_one, part_two = await round_of(100, 250)
        assert (part_one, part_two) == (pytest.approx(35, abs=0.01), pytest.approx(65, abs=0.01))
        (a,) = await one.report("a", "q", [Usage(bucket, 100, 0)])
        assert a.token_bucket is not None and a.token_bucket.tokens_per_fill == 35
        # A daily window used up across both replicas: both deny.
        await one.report("a", "q", [Usage({"daily": "d"}, 30, 0)])
        (denied,) = await two.report("b", "q", [Usage({"daily": "d"}, 20, 0)])
        assert denied.kind == DENY_ALL and denied.ttl_seconds >= 1
    finally:
        for store in stores:
            await store.close()
