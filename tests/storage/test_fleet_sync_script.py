"""fleet_sync.lua on a real redis-server, on a clock the test sets, against its Python
twin, the embedded store's fleet bucket (storage/embedded.py _FleetBucket): random
syncs of a few buckets, rolling ones (whose reports now and then give back credit
paid in advance: a negative count) and a calendar budget's (which does not refill,
and whose period ends during the run), sent and read as the Redis store sends and
reads them (sync_args, sync_reply). In a zone, the aggregator's writes between them go
through zone_write.lua (the count of zones, a bucket's part, a calendar budget's
allotment), and its read of the buckets (zone_read_fleet.lua) is checked at the end."""

from __future__ import annotations

import math
import random

import pytest
import redis.asyncio as aioredis

from ratelimit_harness.redis import script_on_test_clock, set_test_clock
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.zones import ZoneShare
from ratelimit_service.storage.embedded import _FleetBucket
from ratelimit_service.storage.redis_calls import script_text
from ratelimit_service.storage.script_calls import (
    COUNTER_STATE,
    FLEET_STATE,
    MEMBER_ENTRY,
    SYNC_REPORT,
    TIER_REPORT,
    fleet_state,
    sync_args,
    sync_reply,
    write_args,
    zone_read_fleet_reply,
    zone_write_reply,
)

BUCKETS = {"a": (1, 100, None), "b": (60, 600, 150), "c": (1, 40, 10), "d": (86_400, 500, None)}
"""Per bucket: window (seconds), limit, burst."""
ENDS = {"d": 150}
"""A calendar budget's bucket: when its period ends, in seconds from the run's start."""
KEEP_MS = 600_000


class Written:
    """What the script keeps beside the token bucket in a zone, as the test expects it."""

    def __init__(self) -> None:
        self.admitted = 0
        self.created_us: int | None = None
        self.forwarded = 0


async def zone_write(client: aioredis.Redis, write: str, zones: int | None,
                     shares: dict[str, ZoneShare], token: int) -> int:  # fmt: skip
    """One zone_write.lua call as the zone store makes it (write_args)."""
    keys = ["f:z", "f:fence", *(f"f:{name}" for name in shares)]
    args = write_args(list(shares.values()), zones, KEEP_MS, token)
    answer = zone_write_reply(await client.eval(write, len(keys), *keys, *args))
    assert isinstance(answer, int)
    return answer


@pytest.mark.parametrize("zoned", [False, True])
async def test_the_script_keeps_the_bucket_its_twin_keeps(redis_server, zoned: bool) -> None:
    rng = random.Random(5)
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("fleet_sync.lua")
    write = script_text("zone_write.lua")
    twins = {name: _FleetBucket(window, 0.0) for name, (window, _, _) in BUCKETS.items()}
    written = {name: Written() for name in BUCKETS}
    start_us = now_us = 1_700_000_000_000_000
    seen = {"parts": 0, "counts": 0, "allotments": 0, "after the end": 0, "given back": 0}
    zones: int | None = None
    await client.delete(*[f"f:{n}" for n in BUCKETS], "f:i", "f:nodes", "f:z", "f:fence")
    try:
        if zoned:  # a part for a bucket not synced yet: not written (it would not expire)
            assert await zone_write(client, write, None, {"a": ZoneShare(5, 0, 0, 0)}, 1) == 0
        for _ in range(300):
            now_us += rng.choice([0, rng.randrange(400_000), rng.randrange(5_000_000)])
            await set_test_clock(client, now_us)
            if zoned and rng.random() < 0.1:  # the aggregator's count of zones
                zones = rng.choice([1, 2, 3, 10])
                assert await zone_write(client, write, zones, {}, 1) == 0
                seen["counts"] += 1
            if zoned and rng.random() < 0.1:  # the aggregator's part of one bucket
                name = rng.choice(list(BUCKETS))
                part = rng.choice([rng.randrange(0, 200_000), 10**9])
                allot = None
                if name in ENDS and rng.random() < 0.7:
                    allot = written[name].admitted + rng.uniform(-50, 400)
                share = ZoneShare(part, 0, 0, rng.randrange(0, 50), allot)
                exists = twins[name].tokens is not None
                assert await zone_write(client, write, None, {name: share}, 1) == exists
                if exists:
                    twins[name].zone_part, written[name].forwarded = part, share.forwarded
                    if allot is not None:
                        twins[name].allot = allot
                        seen["allotments"] += 1
                    seen["parts"] += 1
            chosen = rng.sample(list(BUCKETS), rng.randint(1, 3))
            # The twin's clock starts with the test's: seconds since then are exact to
            # the microsecond, as the script's are.
            now = (now_us - start_us) / 1e6
            reports = []
            for name in chosen:
                window, limit, burst = BUCKETS[name]
                admitted, offered = rng.randrange(0, 2 * limit), rng.randrange(0, 3 * limit)
                if name in ENDS:
                    admitted //= 10  # spent over many syncs
                    seen["after the end"] += now >= ENDS[name]
                elif rng.random() < 0.2:  # credit paid in advance and given back unspent
                    admitted = -rng.randrange(0, limit // 2)
                    seen["given back"] += 1
                ends_in = max(0.0, ENDS[name] - now) if name in ENDS else None
                reports.append(
                    BucketReport(
                        name, limit, window, offered, admitted, burst=burst, ends_in=ends_in
                    )
                )
            # Now and then no heartbeat (as a Cluster's bucket calls: the registry is
            # in another slot): the live nodes are not counted.
            heartbeat = rng.random() < 0.8
            keys = [*(["f:nodes"] if heartbeat else []), *[f"f:{n}" for n in chosen],
                    *(["f:i", "f:z"] if zoned else [])]  # fmt: skip
            args = sync_args(reports, "node-1" if heartbeat else "", 5_000_000, zoned)
            got = sync_reply(await client.eval(source, len(keys), *keys, *args))
            assert got.nodes == (1 if heartbeat else -1)
            for report, view in zip(reports, got.views, strict=True):
                want = twins[report.key].update(report, now, zones if zoned else None, zoned)
                # The script returns thousandths, floored.
                assert abs(view.tokens - want.tokens) <= 0.001 + 1e-9, (report, view, want)
                assert view.offered_total == want.offered_total
                assert view.limit is not None and want.limit is not None
                assert abs(view.limit - want.limit) <= 0.001 + 1e-9
                state = fleet_state(await client.hget(f"f:{report.key}", "v"))
                assert state is not None  # what it keeps is what it answered
                assert (state.stamp, state.offered) == (now_us, want.offered_total)
                assert math.floor(state.tokens * 1000) / 1000 == view.tokens
                if zoned:
                    mine = written[report.key]
                    mine.admitted += report.admitted
                    mine.created_us = mine.created_us or now_us
                    assert state.admitted == mine.admitted
        # The calendar budget's bucket never refilled (the twin says so) and lives a
        # minute past its period's end, which came during the run.
        assert seen["after the end"] > 5 and seen["given back"] > 20
        assert 55_000 <= await client.pttl("f:d") <= 60_000
        if zoned:
            assert seen["parts"] > 15 and seen["counts"] > 15 and seen["allotments"] > 3
            assert await client.zcard("f:i") == len(BUCKETS)
            # The aggregator's read of the same buckets (zone_read_fleet.lua).
            read = script_on_test_clock("zone_read_fleet.lua")
            raw = await client.eval(read, 2, "f:i", "f:nodes", 60_000_000, 100)
            fleet = zone_read_fleet_reply(raw)
            assert (fleet.now_us, fleet.replicas) == (now_us, 1)
            rows = {bucket.key: bucket for bucket in fleet.buckets}
            for name, twin in twins.items():
                window, limit, _ = BUCKETS[name]
                row, mine = rows[name], written[name]
                assert (row.store_key, row.offered, row.admitted, row.limit) == (
                    f"f:{name}", twin.offered_total, mine.admitted, limit)  # fmt: skip
                assert (row.window_seconds, row.forwarded, row.created_us) == (
                    window, mine.forwarded, mine.created_us)  # fmt: skip
                ends = start_us + ENDS[name] * 1_000_000 if name in ENDS else None
                assert row.ends_us == ends
    finally:
        await client.aclose()


async def test_the_aggregators_read_leaves_out_what_is_gone(redis_server) -> None:
    """zone_read_fleet.lua: a bucket silent past the forget time leaves the index, a
    hash that expired is left out, a bucket whose fields the replicas never wrote
    reads as zeros, and the live replicas are the registry's."""
    client = aioredis.Redis.from_url(redis_server.url)
    read = script_on_test_clock("zone_read_fleet.lua")
    now_us = 1_700_000_000_000_000
    await client.delete("g:i", "g:nodes", "g:old", "g:gone", "g:bare")
    try:
        await client.zadd("g:nodes", {"r1": now_us, "r2": now_us})
        await client.zadd("g:i", {"g:old": now_us - 20_000_000, "g:gone": now_us,
                                  "g:bare": now_us})  # fmt: skip
        await client.hset("g:old", mapping={"K": "old", "W": 1_000_000})
        await client.hset("g:bare", mapping={"K": "bare", "W": 2_000_000})
        await set_test_clock(client, now_us)
        fleet = zone_read_fleet_reply(await client.eval(read, 2, "g:i", "g:nodes", 15_000_000, 100))
        assert (fleet.now_us, fleet.replicas) == (now_us, 2)
        rows = [(b.key, b.offered, b.admitted, b.limit, b.window_seconds, b.forwarded,
                 b.created_us) for b in fleet.buckets]  # fmt: skip
        assert rows == [("bare", 0, 0, 0, 2, 0, now_us)]
        assert await client.zrange("g:i", 0, -1) == [b"g:bare", b"g:gone"]  # old: forgotten
    finally:
        await client.aclose()


async def test_a_rolling_buckets_expiry_is_pushed_back_only_when_it_comes_near(
    redis_server,
) -> None:
    """A sync sets a new bucket's expiry a minute past what it must outlive (two windows
    and a minute) and notes when that is (in its packed state); the syncs after leave it while it is
    further off than that, and push it back once it comes within it."""
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("fleet_sync.lua")
    now_us = 1_700_000_000_000_000
    keep_us = (2 * 1 + 60) * 1_000_000  # a 1 s window: two windows and a minute
    await client.delete("f:e")

    async def sync() -> int:
        await set_test_clock(client, now_us)
        args = sync_args([BucketReport("e", 100, 1, 3, 2)], "", 10**6, zoned=False)
        await client.eval(source, 1, "f:e", *args)
        state = fleet_state(await client.hget("f:e", "v"))
        return 0 if state is None else int(state.expires_at)

    try:
        first = await sync()
        assert first == now_us + keep_us + 60_000_000
        assert keep_us // 1000 < await client.pttl("f:e") <= keep_us // 1000 + 60_000
        now_us += 59_000_000  # still more than keep_us off: left as it is
        assert await sync() == first
        now_us += 2_000_000  # now within keep_us of it: pushed back
        assert await sync() == now_us + keep_us + 60_000_000
    finally:
        await client.aclose()


def test_the_packed_layouts_are_the_ones_the_encoders_and_decoders_use() -> None:
    """Each script packs and reads the struct layouts storage/script_calls.py encodes
    and decodes: a bucket's state (fleet_sync.lua, zone_read_fleet.lua), a counter's
    state (quota_tier.lua, zone_read.lua) and member entry, and the reports."""
    layouts = {
        FLEET_STATE: ("fleet_sync.lua", "zone_read_fleet.lua"),
        COUNTER_STATE: ("quota_tier.lua", "zone_read.lua"),
        MEMBER_ENTRY: ("quota_tier.lua",),
        SYNC_REPORT.format: ("fleet_sync.lua",),
        TIER_REPORT.format: ("quota_tier.lua",),
    }
    for layout, scripts in layouts.items():
        for script in scripts:
            assert f"'{layout}'" in script_text(script), (layout, script)


@pytest.mark.parametrize("zoned", [False, True])
async def test_a_bucket_of_the_earlier_layout_is_read_once_and_moved(
    redis_server, zoned: bool
) -> None:
    """A bucket a replica of an earlier version kept (a field per figure) goes on where
    it was: its tokens refilled since its stamp, its counts added to, its figures moved
    into the packed state and their fields gone; the aggregator's read finds its counts
    either way (before its next sync, and after)."""
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("fleet_sync.lua")
    read = script_on_test_clock("zone_read_fleet.lua")
    now_us = 1_700_000_000_000_000
    await client.delete("h:b", "h:i", "h:z", "h:nodes")
    old = {"tk": "10.5", "ts": now_us - 500_000, "o": 70, "a": 40, "x": now_us + 10**9,
           "i": now_us, "K": "b", "L": 100, "W": 1_000_000, "c": now_us - 10**7}  # fmt: skip
    try:
        await client.hset("h:b", mapping=old)
        await client.zadd("h:i", {"h:b": now_us})
        await set_test_clock(client, now_us)

        async def aggregator_read() -> tuple[int, int]:
            raw = await client.eval(read, 2, "h:i", "h:nodes", 60_000_000, 100)
            (bucket,) = zone_read_fleet_reply(raw).buckets
            return bucket.offered, bucket.admitted

        if zoned:
            assert await aggregator_read() == (70, 40)
        keys = ["h:b", *(["h:i", "h:z"] if zoned else [])]
        args = sync_args([BucketReport("b", 100, 1, 5, 3)], "", 5_000_000, zoned)
        got = sync_reply(await client.eval(source, len(keys), *keys, *args))
        # Half a second at 100 a second refilled 50 (to the capacity, 100), then 3 taken.
        assert (got.views[0].tokens, got.views[0].offered_total) == (60.5 - 3, 75)
        state = fleet_state(await client.hget("h:b", "v"))
        assert state is not None
        assert (state.tokens, state.stamp, state.offered, state.admitted) == (57.5, now_us, 75, 43)
        assert (state.limit, state.window_us) == (100, 1_000_000)
        left = set(await client.hkeys("h:b"))
        assert left.isdisjoint({b"tk", b"ts", b"o", b"a", b"x", b"i"}), left
        assert {b"v", b"K", b"L", b"W", b"c"} <= left
        if zoned:
            assert await aggregator_read() == (75, 43)
    finally:
        await client.aclose()
