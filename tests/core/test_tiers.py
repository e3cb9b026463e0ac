"""Tiers: a member's part of a limit from totals (core/tiers.py), and quota_tier.lua on
a real redis-server, on a clock the test sets, kept equal to its Python twin."""

from __future__ import annotations

import random
import struct

import pytest
import redis.asyncio as aioredis

from ratelimit_harness.redis import script_on_test_clock, set_test_clock
from ratelimit_service.core.shares import water_level
from ratelimit_service.core.tiers import (
    EXPIRE_PER_CALL,
    MILLI,
    Fenced,
    TierReport,
    TierTable,
    TierTotals,
    member_demand,
    publish_fenced,
)
from ratelimit_service.core.zones import ZoneShare
from ratelimit_service.storage.redis_calls import script_text
from ratelimit_service.storage.redis_store import RedisStore
from ratelimit_service.storage.script_calls import (
    COUNTER_STATE,
    counter_state,
    member_entry,
    tier_args,
    tier_keys,
    tier_reply,
    write_args,
    zone_read_reply,
    zone_write_reply,
)

FORGET_US = 15_000_000


def publish_rounds(
    demands: dict[str, float], instances: dict[str, int], limit: float, rounds: int
) -> tuple[TierTable, dict[str, float]]:
    """Every member publishes ``rounds`` times, one after the other; the last parts."""
    table, parts, now = TierTable(), {}, 10**15
    for _ in range(rounds):
        for member in demands:
            now += 1000
            report = TierReport("k", member, demands[member], instances[member], 0, 1, limit)
            parts[member] = table.publish(report, now, FORGET_US).part
    return table, parts


@pytest.mark.parametrize(
    ("demands", "instances", "expected"),
    [
        # over the limit: in proportion to demand
        ({"a": 300.0, "b": 100.0}, {"a": 3, "b": 1}, {"a": 75.0, "b": 25.0}),
        # under it: each its demand, the spare by instance count
        ({"a": 30.0, "b": 10.0}, {"a": 3, "b": 1}, {"a": 75.0, "b": 25.0}),
        ({"a": 60.0, "b": 0.0}, {"a": 1, "b": 1}, {"a": 80.0, "b": 20.0}),
        # no demand anywhere yet: by instance count
        ({"a": 0.0, "b": 0.0}, {"a": 1, "b": 4}, {"a": 20.0, "b": 80.0}),
    ],
)
def test_parts_come_from_totals_and_add_up_to_the_limit(
    demands: dict[str, float], instances: dict[str, int], expected: dict[str, float]
) -> None:
    _, parts = publish_rounds(demands, instances, 100.0, rounds=2)
    assert parts == pytest.approx(expected, abs=0.002)
    assert sum(parts.values()) <= 100.0


def test_a_member_heard_first_gets_its_even_share_and_no_more() -> None:
    """a holds the whole limit; b arrives: b gets its share by instances at once (the
    one-interval overshoot), and a shrinks to its fair part at its next publish."""
    table, parts = publish_rounds({"a": 300.0, "b": 100.0}, {"a": 3, "b": 1}, 100.0, rounds=1)
    assert parts == {"a": 100.0, "b": 25.0}
    assert table.parts == 125 * MILLI


def test_random_fleets_never_hand_out_more_than_the_limit_once_heard() -> None:
    """Members publish with demands that jump; once every member has published twice,
    the parts held never add up to more than the limit, and with demands that stay
    put they reach the fair parts within three rounds (the first uses the others' old
    demands; in the second a part may wait for room another frees in it)."""
    rng = random.Random(7)
    for _ in range(200):
        names = [str(m) for m in range(rng.randint(1, 8))]
        instances = {m: rng.randint(1, 50) for m in names}
        limit = rng.uniform(1, 400)
        table, now = TierTable(), 10**15

        def demand() -> float:
            return rng.choice([0.0, rng.uniform(0, 80), rng.uniform(0, 400)])

        for _ in range(2):  # first heard (each gets at least its even share), then again
            for m in names:
                before = table.parts
                now += 1000
                report = TierReport("k", m, demand(), instances[m], 0, 1, limit)
                first = m not in table.members
                table.publish(report, now, FORGET_US)
                if not first:  # a part grows only into room: the sum never grows past it
                    assert table.parts <= max(before, round(limit * MILLI))
        assert table.parts <= round(limit * MILLI)
        for _ in range(30):
            m = rng.choice(names)
            now += 1000
            table.publish(TierReport("k", m, demand(), instances[m], 0, 1, limit), now, FORGET_US)
            assert table.parts <= round(limit * MILLI)
        demands = {m: demand() for m in names}
        for _ in range(3):
            for m in names:
                now += 1000
                report = TierReport("k", m, demands[m], instances[m], 0, 1, limit)
                table.publish(report, now, FORGET_US)
        d = sum(demands.values())
        everyone = sum(instances.values())
        for m in names:
            fair = (
                limit * instances[m] / everyone if d <= 0
                else demands[m] + (limit - d) * instances[m] / everyone if d <= limit
                else limit * demands[m] / d
            )  # fmt: skip
            assert table.members[m].part / MILLI == pytest.approx(fair, abs=0.01 + 1e-6 * fair)


def test_an_unmeasured_instance_counts_as_an_even_share() -> None:
    assert member_demand([10.0, 5.0], 2, 20.0) == 55.0
    assert member_demand([], 0, 20.0) == 0.0


def test_the_water_level_divides_the_whole_limit_max_min() -> None:
    """Every share together is the limit; one gets less than it asked only when no one
    gets more than it does."""
    rng = random.Random(3)
    for _ in range(300):
        asked = {str(n): rng.choice([0.0, rng.uniform(0, 100)]) for n in range(rng.randint(1, 9))}
        limit = rng.uniform(1, 300)
        split = water_level(limit, asked)
        shares = {n: split.share(a) for n, a in asked.items()}
        assert sum(shares.values()) == pytest.approx(limit)
        for name, share in shares.items():
            if share < asked[name] - 1e-9:
                assert max(shares.values()) <= share + 1e-9, (asked, shares)


# -- the Lua script and its twin ----------------------------------------------------------


@pytest.mark.parametrize("kind", ["replicas", "zoned", "fenced"])
async def test_the_script_keeps_the_same_totals_as_its_twin(redis_server, kind: str) -> None:
    """Members come, publish, go silent and come back; counters with windows of 1 s
    and a minute; more members go silent at once than one call removes. In a zone,
    an aggregator now and then reads the zone (zone_read.lua) and writes back a part
    and the fleet's count (zone_write.lua). Fenced: the members are zones publishing
    with fencing tokens that now and then move on, and now and then one publishes with
    a token older than its last (a deposed aggregator's late write), which is refused
    whole. After every call the scripts' answers equal the twin's (TierTable,
    publish_fenced) on the same clock."""
    rng = random.Random(11)
    zoned, fenced = kind == "zoned", kind == "fenced"
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("quota_tier.lua")
    read = script_on_test_clock("zone_read.lua")
    write = script_text("zone_write.lua")
    counters = {"q\x1ftenant\x1e{a}\x1f1": 1, "q\x1fday\x1eb\x1f60": 60}
    tables = {key: TierTable() for key in counters}
    limits: dict[str, float] = {}
    names = [f"replica-{n}" for n in range(40)]
    tokens = {name: rng.randint(1, 5) for name in names}
    now_us = 1_700_000_000_000_000
    seen = {"expired": 0, "windows": 0, "zone": 0, "refused": 0, "accepted": 0}
    await client.delete(*[n for k in counters for n in tier_keys(f"t:{k}")], "t:i", "t:fence")
    try:
        for step in range(400):
            # Mostly quick steps, now and then a silence longer than the forget time.
            now_us += rng.choice([rng.randrange(300_000)] * 9 + [FORGET_US + rng.randrange(10**6)])
            await set_test_clock(client, now_us)
            member = rng.choice(names[: 5 + step // 10])
            token: int | None = None
            if fenced:
                if rng.random() < 0.2:
                    tokens[member] += rng.randint(1, 3)  # the lease changed hands
                token = tokens[member] - (rng.random() < 0.15) * rng.randint(1, 2)
            keys: list[str] = []
            reports = []
            for key, window in counters.items():
                report = TierReport(
                    key, member, rng.choice([0.0, rng.uniform(0, 500)]),
                    rng.randint(0, 30), rng.randint(0, 40), window,
                    rng.choice([100.0, 250.5, 1e6]),
                )  # fmt: skip
                reports.append(report)
                limits[key] = report.limit
                keys += tier_keys(f"t:{key}")
            if zoned:
                keys.append("t:i")
            args = tier_args(reports, FORGET_US, token, zoned)
            raw = await client.eval(source, len(keys), *keys, *args)
            counted = [tables[r.key] for r in reports]
            before = [(len(t.members), t.window) for t in counted]
            want = publish_fenced(counted, reports, now_us, FORGET_US, token)
            got = tier_reply(raw)
            assert got == want, (step, reports, token)
            if isinstance(want, Fenced):
                seen["refused"] += 1
                continue
            seen["accepted"] += token is not None
            for report, table in zip(reports, counted, strict=True):  # what it keeps
                state = counter_state(await client.hget(tier_keys(f"t:{report.key}")[0], "v"))
                assert state is not None
                assert (state.demand, state.instances, state.window_index, state.used) == (
                    table.demand, table.instances, table.window, table.used)  # fmt: skip
            for (members, window), table, totals in zip(before, counted, want, strict=True):
                seen["expired"] += totals.members < members
                seen["windows"] += window is not None and table.window != window
            if zoned and rng.random() < 0.2:
                zone = await check_zone(client, read, write, tables, limits, now_us, rng, step)
                seen["zone"] += zone
        assert seen["expired"] > 10 and seen["windows"] > 50  # both paths ran
        assert seen["zone"] > 10 or not zoned
        assert (seen["refused"] > 10 and seen["accepted"] > 100) or not fenced
    finally:
        await client.aclose()


def read_zone(table: TierTable, now_us: int, window_seconds: int) -> tuple[int, int, int]:
    """What zone_read.lua reads of a counter the table holds: the zone's allowed hits in
    the current window, how many of them the aggregator already forwarded, and the
    window's index."""
    index = now_us // (window_seconds * 1_000_000)
    used = table.used if table.window == index else 0
    forwarded = table.forwarded if table.global_window == index else 0
    return used, forwarded, index


async def check_zone(client, read, write, tables, limits, now_us: int, rng: random.Random,  # type: ignore[no-untyped-def]
                     token: int) -> int:  # fmt: skip
    """The aggregator's read (zone_read.lua) equals what the twin's tables hold; then a
    random write-back (zone_write.lua) that the tables take as the script's hash does
    (with a token that never goes back: the fence is zone_write's own test, in
    tests/core/test_zones.py)."""
    rows = {t.key: t for t in zone_read_reply(await client.eval(read, 1, "t:i", FORGET_US, 100))}
    assert sorted(rows) == sorted(tables)
    for key, table in tables.items():
        row = rows[key]
        demand, instances = round(row.demand * MILLI), row.instances
        assert (demand, instances) == (max(0, table.demand), max(0, table.instances))
        assert (row.used, row.forwarded, row.window) == read_zone(table, now_us, row.window_seconds)
        assert row.limit == round(limits[key] * MILLI) / MILLI  # the last publish's
        share = ZoneShare(
            part=rng.randrange(0, 300_000),
            global_used=row.used + rng.randrange(0, 500),
            window=row.window - rng.choice([0, 0, 1]),
            forwarded=rng.randint(0, row.used) if row.used else 0,
        )
        args = write_args([share], None, 1000, token)
        raw = await client.eval(write, 3, "t:zones", "t:fence", f"t:{key}", *args)
        assert zone_write_reply(raw) == 1
        table.zone_part, table.forwarded = share.part, share.forwarded
        table.global_used, table.global_window = share.global_used, share.window
    return 1


async def test_silent_members_leave_the_sums_a_bounded_number_per_call(redis_server) -> None:
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("quota_tier.lua")
    table = TierTable()
    now_us = 1_800_000_000_000_000

    async def publish(member: str, demand: float) -> TierTotals:
        await set_test_clock(client, now_us)
        report = TierReport("x", member, demand, 1, 0, 1, 100.0)
        args = tier_args([report], FORGET_US, None, zoned=False)
        raw = await client.eval(source, 3, *tier_keys("t:x"), *args)
        want = table.publish(report, now_us, FORGET_US)
        (got,) = tier_reply(raw)
        assert got == want
        return got

    try:
        for n in range(40):
            await publish(f"m{n:02d}", 1.5)
        now_us += FORGET_US + 1
        first = await publish("late", 2.0)
        assert first.members == 40 - EXPIRE_PER_CALL + 1  # 16 of the 40 silent ones went
        second = await publish("late", 2.0)
        third = await publish("late", 2.0)
        assert (second.members, third.members) == (9, 1)
        assert (third.demand, third.instances) == (2.0, 1)
    finally:
        await client.aclose()


async def test_members_entries_of_the_earlier_layout_are_read_and_moved(redis_server) -> None:
    """A counter written before the members' hash (each member's 'd:', 'n:', 'p:' in
    the counter's hash, as a replica of an earlier version leaves it): a member that
    publishes replaces its own entry, one that went silent leaves the sums, and both
    entries end in the members' hash or nowhere. An entry of the members' hash in its
    earlier text layout is read (its part holds room) and replaced when its member
    publishes."""
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("quota_tier.lua")
    now_us = 1_800_000_000_000_000
    hash_key, members, entries = tier_keys("t:old")
    await client.delete(hash_key, members, entries)
    try:
        await client.hset(hash_key, mapping={
            "D": 3_500, "N": 4, "P": 70_000, "d:a": 1_000, "n:a": 1, "p:a": 20_000,
            "d:b": 2_000, "n:b": 2, "p:b": 40_000,
        })  # fmt: skip
        await client.hset(entries, "c", "500 1 10000")
        await client.zadd(members, {"a": now_us - FORGET_US - 1, "b": now_us, "c": now_us})
        await set_test_clock(client, now_us)
        report = TierReport("old", "b", 5.0, 2, 0, 1, 100.0)
        raw = await client.eval(source, 3, hash_key, members, entries, *tier_args(
            [report], FORGET_US, None, zoned=False))  # fmt: skip
        (got,) = tier_reply(raw)
        # a (silent) left and b's old entry came off: b's new report and c's entry; c's
        # part (10 a second) holds room: b's is its demand and two thirds of the spare
        assert (got.demand, got.instances, got.members) == (5.5, 3, 2)
        assert got.part == 68.0
        assert set(await client.hkeys(hash_key)) == {b"v"}  # the sums moved into its state
        state = counter_state(await client.hget(hash_key, "v"))
        assert state is not None and (state.demand, state.instances, state.parts) == (
            5_500, 3, 78_000)  # fmt: skip
        assert member_entry(await client.hget(entries, "b")) == (5_000, 2, 68_000)
        report = TierReport("old", "c", 1.0, 1, 0, 1, 100.0)
        raw = await client.eval(source, 3, hash_key, members, entries, *tier_args(
            [report], FORGET_US, None, zoned=False))  # fmt: skip
        (got,) = tier_reply(raw)
        assert (got.demand, got.instances, got.members) == (6.0, 3, 2)  # c's text came off
        assert member_entry(await client.hget(entries, "c"))[:2] == (1_000, 1)
        for key in (hash_key, members, entries):  # each expires, a minute past 2 x forget
            assert 0 < await client.pttl(key) <= 2 * FORGET_US // 1000 + 60_000
    finally:
        await client.aclose()


async def test_a_counters_keys_expire_even_when_a_new_member_makes_them_anew(
    redis_server,
) -> None:
    """The three keys' expiry is pushed back when it comes within what they must outlive
    (its packed state notes it), not on every publish; and when a member new to the
    counter publishes after the only other one left (its sorted set and members' hash
    emptied, so made anew), they get an expiry again."""
    client = aioredis.Redis.from_url(redis_server.url)
    source = script_on_test_clock("quota_tier.lua")
    now_us = 1_800_000_000_000_000
    keys = tier_keys("t:y")
    keep_us = 2 * FORGET_US + 60_000_000
    await client.delete(*keys)

    async def publish(member: str) -> int:
        await set_test_clock(client, now_us)
        args = tier_args([TierReport("y", member, 1.0, 1, 0, 1, 100.0)], FORGET_US, None, False)
        await client.eval(source, 3, *keys, *args)
        state = counter_state(await client.hget(keys[0], "v"))
        return 0 if state is None else int(state.expires_at)

    try:
        first = await publish("a")
        assert first == now_us + keep_us
        for _ in range(6):  # while it is further off than 2 x forget: left as it is
            now_us += 10_000_000
            assert await publish("a") == first
        now_us += 2_000_000  # within it now: pushed back
        assert await publish("a") == now_us + keep_us
        now_us += FORGET_US + 1  # a goes silent; b is new, and a leaves as b publishes
        await client.persist(keys[1])  # as if made anew without an expiry
        await client.persist(keys[2])
        assert await publish("b") == now_us + keep_us
        for key in keys:
            assert 0 < await client.pttl(key) <= keep_us // 1000
        assert await client.zrange(keys[1], 0, -1) == [b"b"]
    finally:
        await client.aclose()


async def test_the_store_keeps_a_counters_keys_in_one_cluster_slot(redis_server) -> None:
    store = RedisStore(redis_server.url)
    try:
        from redis.crc import key_slot

        key = store._tier_key("q\x1ft\x1e{x}y\x1f1")
        assert {key_slot(k.encode()) for k in tier_keys(key)} == {key_slot(key.encode())}
        report = TierReport("q\x1ft\x1e{x}y\x1f1", "r1", 12.5, 3, 7, 1, 100.0)
        (answer,) = await store.publish([report], 15.0)
        assert answer == TierTotals(100.0, 12.5, 3, 1, 7, 100.0)
        second = TierReport(report.key, "r2", 2.5, 1, 1, 1, 100.0)
        (again,) = await store.publish([second], 15.0)
        assert (again.demand, again.instances, again.members) == (15.0, 4, 2)
        assert again.part == 23.75  # first heard: its fair part (2.5 and a quarter of 85)
    finally:
        await store.close()


async def test_the_aggregators_read_leaves_out_what_is_gone(redis_server) -> None:
    """zone_read.lua: a counter silent past the forget time leaves the index, a hash
    that expired or has no limit (another layout's) is left out, and a counter's fields
    of another window read as zero (its allowed and forwarded hits are the current
    window's only)."""
    client = aioredis.Redis.from_url(redis_server.url)
    read = script_on_test_clock("zone_read.lua")
    now_us = 1_700_000_000_000_000
    index = now_us // 1_000_000
    await client.delete("r:i", "r:old", "r:gone", "r:past", "r:now", "r:bare", "r:packed")
    try:
        await client.zadd("r:i", {"r:old": now_us - FORGET_US - 1, "r:gone": now_us,
                                  "r:past": now_us, "r:now": now_us, "r:bare": now_us,
                                  "r:packed": now_us})  # fmt: skip
        await client.hset("r:old", mapping={"K": "old", "W": 1_000_000})
        await client.hset("r:bare", mapping={"K": "bare", "W": 1_000_000, "L": 9000})
        counter = {"W": 1_000_000, "R": 9000, "u": 7, "g": 3}
        past = {"K": "past", "D": -5, "w": index - 1, "gw": index - 1}
        await client.hset("r:past", mapping={**counter, **past})
        current = {"K": "now", "D": 2500, "N": 4, "w": index, "gw": index}
        await client.hset("r:now", mapping={**counter, **current})  # the earlier layout's
        state = struct.pack(COUNTER_STATE, 1500, 2, 0, index, 5, 0, 0, 9000, 1_000_000)
        packed = {"K": "packed", "v": state, "gw": index}  # as quota_tier.lua keeps it now
        await client.hset("r:packed", mapping={**counter, **packed})
        await set_test_clock(client, now_us)
        rows = zone_read_reply(await client.eval(read, 1, "r:i", FORGET_US, 100))
        got = {row.key: (row.demand, row.instances, row.limit, row.used, row.forwarded,
                         row.window) for row in rows}  # fmt: skip
        assert got == {"past": (0.0, 0, 9.0, 0, 0, index), "now": (2.5, 4, 9.0, 7, 3, index),
                       "packed": (1.5, 2, 9.0, 5, 3, index)}  # fmt: skip
        assert [row.store_key for row in rows] == ["r:now", "r:packed", "r:past"]
        assert await client.zrange("r:i", 0, -1) == [
            b"r:bare", b"r:gone", b"r:now", b"r:packed", b"r:past"]  # fmt: skip
    finally:
        await client.aclose()
