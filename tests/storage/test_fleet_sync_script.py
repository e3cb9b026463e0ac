"""fleet_sync.lua on a real redis-server, on a clock the test sets, against its Python
twin (core/drop_ratio.py refill, take and zone_limit): random syncs of a few buckets,
with and without a zone part and a count of zones written between them."""

from __future__ import annotations

import random

import pytest
import redis.asyncio as aioredis

from ratelimit_service.core.drop_ratio import capacity, refill, take, zone_limit
from ratelimit_service.testing.redis import script_on_test_clock, set_test_clock


class Twin:
    """One bucket as fleet_sync.lua keeps it."""

    def __init__(self) -> None:
        self.tokens: float | None = None
        self.stamp_us = 0
        self.offered = 0
        self.admitted = 0
        self.zone_part: int | None = None
        self.created_us = 0

    def sync(self, now_us: int, window: int, limit: int, full: int, admitted: int,
             offered: int, zones: int | None) -> tuple[float, int, float]:  # fmt: skip
        rate, most = zone_limit(
            float(limit), float(full), self.zone_part, window * 1_000_000, zones
        )
        if self.tokens is None:
            tokens = most
            self.created_us = now_us
        else:
            elapsed = max(0, now_us - self.stamp_us) / 1_000_000
            tokens = refill(self.tokens, elapsed, rate, window, burst=most)
        tokens = take(tokens, admitted, rate)
        self.tokens, self.stamp_us = tokens, now_us
        self.offered += offered
        self.admitted += admitted
        return tokens, self.offered, rate


@pytest.mark.parametrize("zoned", [False, True])
async def test_the_script_keeps_the_bucket_its_twin_keeps(redis_server, zoned: bool) -> None:
    rng = random.Random(5)
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("fleet_sync.lua")
    buckets = {"a": (1, 100, None), "b": (60, 600, 150), "c": (1, 40, 10)}
    twins = {name: Twin() for name in buckets}
    now_us = 1_700_000_000_000_000
    zone_writes = 0
    zones: int | None = None
    await client.delete(*[f"f:{n}" for n in buckets], "f:i", "f:nodes", "f:z")
    try:
        for _ in range(300):
            now_us += rng.choice([0, rng.randrange(400_000), rng.randrange(5_000_000)])
            await set_test_clock(client, now_us)
            if zoned and rng.random() < 0.1:  # the aggregator's count of zones
                zones = rng.choice([1, 2, 3, 10])
                await client.set("f:z", zones)
            if zoned and rng.random() < 0.1:
                name = rng.choice(list(buckets))
                part = rng.choice([rng.randrange(0, 200_000), 10**9])
                await client.hset(f"f:{name}", "Z", part)
                twins[name].zone_part = part
                zone_writes += 1
            chosen = rng.sample(list(buckets), rng.randint(1, 3))
            keys = ["f:nodes", *[f"f:{n}" for n in chosen], *(["f:i", "f:z"] if zoned else [])]
            args: list[object] = ["node-1", 5_000_000, "1" if zoned else ""]
            calls = []
            for name in chosen:
                window, limit, burst = buckets[name]
                full = int(capacity(limit, burst))
                admitted, offered = rng.randrange(0, 2 * limit), rng.randrange(0, 3 * limit)
                args += (window * 1_000_000, limit, full, admitted, offered, name if zoned else "")
                calls.append((name, window, limit, full, admitted, offered))
            raw = await client.eval(source, len(keys), *keys, *args)
            assert raw[0] == 1
            for n, (name, window, limit, full, admitted, offered) in enumerate(calls):
                tokens, offered_total, rate = twins[name].sync(
                    now_us, window, limit, full, admitted, offered, zones if zoned else None
                )
                got_tokens, got_offered, got_rate = raw[1 + 3 * n : 4 + 3 * n]
                # The script returns thousandths, floored; Python sums seconds where
                # Lua sums microseconds (the last bit of a float may differ).
                assert abs(got_tokens - tokens * 1000) <= 1 + 1e-6, (name, got_tokens, tokens)
                assert got_offered == offered_total
                assert abs(got_rate - rate * 1000) <= 1 + 1e-6
                if zoned:
                    stored = await client.hmget(f"f:{name}", "K", "L", "W", "a", "c")
                    assert stored == [name.encode(), str(limit).encode(),
                                      str(window * 1_000_000).encode(),
                                      str(twins[name].admitted).encode(),
                                      str(twins[name].created_us).encode()]  # fmt: skip
        if zoned:
            assert zone_writes > 20
            assert await client.zcard("f:i") == len(buckets)
            # The aggregator's read of the same buckets (zone_read_fleet.lua).
            read = script_on_test_clock("zone_read_fleet.lua")
            raw = await client.eval(read, 2, "f:i", "f:nodes", 60_000_000, 100)
            assert raw[:2] == [now_us, 1]  # the store's time, the live replicas
            rows = {raw[i + 1].decode(): raw[i + 2 : i + 8] for i in range(2, len(raw), 8)}
            for name, twin in twins.items():
                window, limit, _ = buckets[name]
                assert rows[name] == [twin.offered, twin.admitted, limit, window * 1_000_000,
                                      0, twin.created_us]  # fmt: skip
    finally:
        await client.aclose()
