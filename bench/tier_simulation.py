"""What the tiers cost the stores at the design's scale, by simulation: the real Lua
scripts on real redis-servers, called at the rates a fleet of 100,000 Envoys behind
1,000 replicas in 10 zones would call them.

    python bench/tier_simulation.py               # ~2 minutes
    python bench/tier_simulation.py --hot 100 1000 --seconds 5 --no-flat
    python bench/tier_simulation.py --update-cost --baseline REV   # ~1 minute

--update-cost measures the store's time per bucket update for each script (this
tree's, and a git revision's in turns with it), and the part of it spent in the Redis
commands the script calls (the rest is the script's own Lua), which the table of calls
below turns into each store's CPU at any size (docs/scale.md).

Envoys never reach a store: their reports end at their replica (100 per replica
here). What the stores see, per hot bucket:

* one zone's store: every replica of the zone (100) publishes its RLQS totals every
  --rlqs-publish-interval (1 s; quota_tier.lua with the zone's index) and syncs its
  probabilistic buckets every --sync-interval (0.25 s; fleet_sync.lua); the zone's
  aggregator renews its lease four times per --zone-interval (1 s; lease.lua) and once
  per interval reads the zone (zone_read.lua, zone_read_fleet.lua) and writes back
  (zone_write.lua, with its fencing token);
* the global store: every zone (10) publishes once per --zone-interval, RLQS
  counters and probabilistic buckets alike (quota_tier.lua, the zones its members,
  each with its fencing token).

All ten zone stores do the same work, so one is simulated at one zone's rates; the
global store gets all ten zones. Each cell runs --seconds on fresh redis-servers,
open loop (calls leave on schedule, spread over the interval; each member's calls
packed once, so the driver's work per call is a write and a read), and reads each
server's CPU from ``INFO cpu`` (user + sys) and its script calls from
``INFO commandstats``. A replica's calls cover all its hot buckets at once (256 per
call at most), so the calls per second do not grow with hot buckets; the work per
call does.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import math
import random
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis
from throughput import BENCH, lab, start_redis

from ratelimit_service.core.drop_ratio import capacity
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.stretch import JOIN_SLOTS, STRETCH
from ratelimit_service.core.tiers import EXPIRE_PER_CALL, MILLI, TierReport
from ratelimit_service.core.zones import RENEW_SHARE, ZoneShare
from ratelimit_service.storage.redis_calls import script_text
from ratelimit_service.storage.redis_store import CALL_CHUNK
from ratelimit_service.storage.script_calls import (
    sync_args,
    tier_args,
    tier_keys,
    write_args,
    zone_read_fleet_reply,
    zone_read_reply,
)

ENVOYS, REPLICAS, ZONES = 100_000, 1_000, 10
PUBLISH, SYNC, ZONE = 1.0, 0.25, 1.0
LIMIT = 100_000
FORGET_US = 15_000_000
BATCH = CALL_CHUNK  # items per script call, as the stores send them
JOINS = f"rl:joins:{JOIN_SLOTS}"
"""The store's count of members new to a counter (joins.lua; storage/redis_store.py)."""
AGGREGATOR = (1 / RENEW_SHARE + 3) / ZONE
"""The aggregator's calls per second on its zone store: its lease renewals, and once
per interval its two reads and its write-back (one chunk)."""


@dataclass
class Cell:
    hot: int
    seconds: float
    zone_cpu: float = 0.0
    global_cpu: float = 0.0
    zone_calls: float = 0.0
    global_calls: float = 0.0
    flat_cpu: float = 0.0
    """The same fleet without zones: every replica on one store."""
    flat_calls: float = 0.0
    late: int = 0
    """Calls that left more than one interval behind schedule: the store (or this
    driver) could not keep up, and the calls per second fall short of the model."""


PACKED_REPORTS = "REPORT_SIZE"
"""Found in a script that takes its reports packed in one argument (this tree's); one of
a revision from before takes an argument per figure (the encoders below keep that
layout for --baseline)."""


def sync_call_args(
    script: Packed, reports: list[BucketReport], node: str, ttl_us: int, zoned: bool
) -> list[Any]:
    """fleet_sync.lua's arguments as ``script``'s revision takes them."""
    if PACKED_REPORTS in script.source:
        return sync_args(reports, node, ttl_us, zoned)
    args: list[Any] = [node, ttl_us, "1" if zoned else ""]
    for r in reports:
        args += (r.window_seconds * 1_000_000, r.limit, int(capacity(r.limit, r.burst)),
                 r.admitted, r.offered, r.key if zoned else "",
                 "" if r.ends_in is None else round(r.ends_in * 1_000_000))  # fmt: skip
    return args


def tier_call_args(
    script: Packed, reports: list[TierReport], forget_us: int, token: int | None, zoned: bool
) -> list[Any]:
    """quota_tier.lua's arguments as ``script``'s revision takes them."""
    if PACKED_REPORTS in script.source:
        return tier_args(reports, forget_us, token, zoned)
    args: list[Any] = [reports[0].member, forget_us, "" if token is None else token,
                       EXPIRE_PER_CALL]  # fmt: skip
    for r in reports:
        args += (round(r.demand * MILLI), r.instances, r.allowed, r.window_seconds * 1_000_000,
                 round(r.limit * MILLI), r.key if zoned else "")  # fmt: skip
    return args


class Packed:
    """A script's calls as RESP bytes packed once (EVALSHA), sent as they are: the
    driver's work per call is the write and the read, not encoding 2,000 arguments, so
    one Python process keeps up with the store (the arguments are those the services
    send: storage/redis_store.py's encoders)."""

    def __init__(self, client: aioredis.Redis, source: str) -> None:
        self.client = client
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self.source = source
        self._packer = aioredis.Connection()

    async def load(self) -> None:
        await self.client.script_load(self.source)

    def pack(self, keys: list[str], args: list[Any]) -> bytes:
        return b"".join(self._packer.pack_command("EVALSHA", self.sha, len(keys), *keys, *args))

    def counter_keys(self, key: str) -> tuple[str, ...]:
        """quota_tier.lua's KEYS for a counter: three (storage/script_calls.py
        tier_keys), or the two of a revision before the members' hash."""
        keys = tier_keys(key)
        return keys if "KEYS[3 * i" in self.source else keys[:2]

    async def __call__(self, packed: bytes) -> Any:
        pool = self.client.connection_pool
        connection = await pool.get_connection()
        try:
            await connection.send_packed_command(packed, check_health=False)
            return await connection.read_response()
        finally:
            await pool.release(connection)


Usage = tuple[float, int]
"""A store's CPU seconds and script calls so far (cpu_and_calls)."""


class Window:
    """When a cell's schedule runs: it begins once every store's driver has packed its
    calls (packing takes a second or more at 1,000 hot buckets: inside the window it
    would read as a store falling behind, and lower its CPU per second)."""

    def __init__(self, seconds: float, drivers: int) -> None:
        self.seconds = seconds
        self.waiting = drivers
        self.began = asyncio.Event()
        self.start = self.until = 0.0

    async def ready(self) -> None:
        """A driver's calls are packed: the window begins when the last one's are."""
        self.waiting -= 1
        if self.waiting == 0:
            self.start = time.monotonic()
            self.until = self.start + self.seconds
            self.began.set()
        await self.began.wait()

    async def measured(self, ports: tuple[int, ...]) -> tuple[float, list[Usage], list[Usage]]:
        """Each store's CPU and calls over the window: (seconds, before, after). It ends
        when the schedule does, not when its last calls come back (a tail of late
        answers would stretch it, and the CPU per second read lower than the schedule's)."""
        await self.began.wait()
        before, started = [cpu_and_calls(port) for port in ports], time.monotonic()
        await asyncio.sleep(max(0.0, self.until - time.monotonic()))
        ended = time.monotonic()
        return ended - started, before, [cpu_and_calls(port) for port in ports]


class Driver:
    """Calls scripts at fixed rates, open loop."""

    def __init__(self, client: aioredis.Redis, scripts: dict[str, Any]) -> None:
        self.client = client
        self.scripts = scripts
        self.late = 0

    async def every(self, interval: float, phase: float, window: Window, call: Any) -> None:
        next_at = time.monotonic() + phase
        while next_at < window.until:
            delay = next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            elif -delay > interval:
                self.late += 1
            await call()
            next_at += interval


def counters(hot: int) -> list[str]:
    return [f"bench\x1fk\x1ehot-{n}\x1f1" for n in range(hot)]


@dataclass(frozen=True)
class Mix:
    """Which hot buckets are of which kind, and which wait (core/stretch.py)."""

    half: bool = False
    """Half the hot buckets RLQS counters, half probabilistic buckets; otherwise each is
    both (twice the updates)."""
    far: float = 0.0
    """The share of the probabilistic buckets far below their limits: a replica reports
    each of those once every STRETCH syncs, staggered over the rounds."""
    steady: float = 0.0
    """The share of the RLQS counters steady well over their limits: a replica publishes
    each of those once every STRETCH rounds, and a zone's aggregator to the global store
    once every STRETCH passes, staggered; a member with counters that may wait reads the
    store's count of joins (joins.lua) once a round."""
    over: float = 0.0
    """The share of the probabilistic buckets steady well over their limits (of those not
    far below): a replica syncs each of those once every STRETCH intervals (its wait paid
    in advance), a zone's aggregator publishes each once every STRETCH passes to the
    global store."""

    @property
    def waiting(self) -> float:
        """The share of the probabilistic buckets a replica syncs once every STRETCH
        intervals: far below their limits, or steady well over them."""
        return self.far + self.over

    def kinds(self, hot: int) -> tuple[list[str], list[str]]:
        """The RLQS counters' keys and the probabilistic buckets' keys."""
        keys = counters(hot)
        return (keys[: hot // 2], keys[hot // 2 :]) if self.half else (keys, keys)

    @staticmethod
    def rounds(keys: list[str], waiting: float, phase: int) -> list[list[str]]:
        """The keys a replica sends in each of STRETCH successive rounds: each of the
        ``waiting`` share (the last keys) in one round of STRETCH, the others every round."""
        every = len(keys) - round(waiting * len(keys))
        if every == len(keys):
            return [keys]
        return [
            keys[:every] + [k for i, k in enumerate(keys[every:]) if (i + phase) % STRETCH == r]
            for r in range(STRETCH)
        ]

    @staticmethod
    def updates(count: int, waiting: float) -> float:
        """Keys of ``count`` a replica sends per round, on average, ``waiting`` of them
        one round in STRETCH."""
        waits = round(waiting * count)
        return count - waits + waits / STRETCH


def cycling(calls: list[list[bytes]], script: Packed) -> Any:
    """A member's call for each round in turn (each round's calls packed once)."""
    turn = [0]

    async def call() -> None:
        for packed in calls[turn[0] % len(calls)]:
            await script(packed)
        turn[0] += 1

    return call


async def zone_store(
    client: aioredis.Redis, hot: int, window: Window, replicas: int = REPLICAS // ZONES,
    aggregator: bool = True, mix: Mix = Mix(),
) -> int:  # fmt: skip
    """One zone: its replicas publishing and syncing, and the aggregator (without it,
    ``replicas`` on one store is the design without zones)."""
    tier = Packed(client, SCRIPTS["quota_tier.lua"])
    sync = Packed(client, SCRIPTS["fleet_sync.lua"])
    joins = Packed(client, script_text("joins.lua"))
    await tier.load()
    await sync.load()
    await joins.load()
    lease = client.register_script(script_text("lease.lua"))
    read = client.register_script(script_text("zone_read.lua"))
    read_fleet = client.register_script(script_text("zone_read_fleet.lua"))
    write = client.register_script(script_text("zone_write.lua"))
    driver = Driver(client, {})
    quota_keys, fleet_keys = mix.kinds(hot)
    rng = random.Random(1)
    per_zone = replicas
    index, buckets = "rl:zone:z:counters", "rl:zone:z:buckets"
    zones_key, lease_key, fence_key = "rl:zone:z:zones", "rl:zone:z:lease", "rl:zone:z:fence"

    # Each member's calls are the same every time: built once, so that the driver's
    # own work per call is the sending, and it keeps up with the stores.
    def publish(member: str, demand: int, phase: int) -> Any:
        rounds: list[list[bytes]] = []
        for sent in mix.rounds(quota_keys, mix.steady, phase):
            calls = []
            for start in range(0, len(sent), BATCH):
                chunk = sent[start : start + BATCH]
                reports = [TierReport(key, member, demand / MILLI, ENVOYS // REPLICAS,
                                      demand // 10, 1, LIMIT) for key in chunk]  # fmt: skip
                call_keys: list[str] = []
                for key in chunk:
                    call_keys += tier.counter_keys(f"rl:qt{{{key}}}")
                args = tier_call_args(tier, reports, FORGET_US, None, zoned=True)
                calls.append(tier.pack([*call_keys, index], args))
            rounds.append(calls)
        publishing = cycling(rounds, tier)
        if not mix.steady:
            return publishing
        read = joins.pack([JOINS], [JOIN_SLOTS])

        async def call() -> None:  # the count of joins first, as engine/quota.py reads it
            await joins(read)
            await publishing()

        return call

    def synced(member: str, offered: int, phase: int) -> Any:
        rounds = []
        for sent in mix.rounds(fleet_keys, mix.waiting, phase):
            calls = []
            # a sync with no bucket due still goes: the replica's heartbeat
            for start in range(0, max(1, len(sent)), BATCH):
                chunk = sent[start : start + BATCH]
                reports = [BucketReport(key, LIMIT, 1, offered, offered // 2) for key in chunk]
                bucket_keys = [f"rl:f:{k}" for k in chunk]
                args = sync_call_args(sync, reports, member, 5_000_000, zoned=True)
                calls.append(sync.pack(["rl:nodes", *bucket_keys, buckets, zones_key], args))
            rounds.append(calls)
        return cycling(rounds, sync)

    async def aggregate() -> None:
        rows = await read(keys=[index], args=[FORGET_US, 10_000])
        fleet = await read_fleet(keys=[buckets, "rl:nodes"], args=[FORGET_US, 10_000])
        written = [t.store_key for t in zone_read_reply(rows)]
        written += [b.store_key for b in zone_read_fleet_reply(fleet).buckets]
        for start in range(0, max(1, len(written)), BATCH):
            chunk = written[start : start + BATCH]
            count = None if start else ZONES  # the zones, written once per pass
            shares = [ZoneShare(5_000_000, 0, 0, 0)] * len(chunk)
            await write(keys=[zones_key, fence_key, *chunk],
                        args=write_args(shares, count, 120_000, 1))  # fmt: skip

    async def renew() -> None:
        await lease(keys=[lease_key, fence_key], args=["replica-0", int(ZONE * 1e6), ""])

    tasks = []
    for n in range(per_zone):
        member = f"replica-{n}"
        demand = rng.randrange(50_000, 150_000)  # thousandths of a hit per second
        phase = rng.randrange(STRETCH)  # where the replica's waiting keys' turns start
        first = rng.uniform(0, PUBLISH)
        tasks.append(driver.every(PUBLISH, first, window, publish(member, demand, phase)))
        tasks.append(driver.every(SYNC, rng.uniform(0, SYNC), window, synced(member, 200, phase)))
    if aggregator:
        tasks.append(driver.every(ZONE, 0.0, window, aggregate))
        tasks.append(driver.every(RENEW_SHARE * ZONE, ZONE / 8, window, renew))
    await window.ready()
    await asyncio.gather(*tasks)
    return driver.late


async def global_store(client: aioredis.Redis, hot: int, window: Window, mix: Mix = Mix()) -> int:
    """Ten zones, each publishing its RLQS counters and its probabilistic buckets each
    pass (the zone's aggregator sends what its store holds), but those steady well over
    their limits (``mix.steady``, ``mix.over``): once every STRETCH passes, the count of
    joins read first."""
    tier = Packed(client, SCRIPTS["quota_tier.lua"])
    joins = Packed(client, script_text("joins.lua"))
    await tier.load()
    await joins.load()
    driver = Driver(client, {})
    quota_keys, fleet_keys = mix.kinds(hot)
    rng = random.Random(2)
    read = [joins.pack([JOINS], [JOIN_SLOTS])] if mix.steady or mix.over else []

    def publish(zone: str, demand: int, phase: int) -> Any:
        rounds = []
        quota_rounds = mix.rounds(quota_keys, mix.steady, phase)
        fleet_rounds = mix.rounds(fleet_keys, mix.over, phase)
        for turn in range(STRETCH):
            quota = quota_rounds[turn % len(quota_rounds)]
            fleet = fleet_rounds[turn % len(fleet_rounds)]
            # and the zone's presence (every pass: the global store counts the zones)
            reports = [(k, "q") for k in quota] + [(k, "f") for k in fleet] + [("zones", "z")]
            calls = []
            for start in range(0, len(reports), BATCH):
                chunk = reports[start : start + BATCH]
                call_keys: list[str] = []
                for key, kind in chunk:
                    call_keys += tier.counter_keys(f"rl:qt{{{kind}{key}}}")
                totals = [TierReport(key, zone, demand / MILLI, ENVOYS // ZONES, demand // 10,
                                     1, LIMIT) for key, _ in chunk]  # fmt: skip
                # 1: its fencing token
                args = tier_call_args(tier, totals, FORGET_US, 1, zoned=False)
                calls.append(tier.pack(call_keys, args))
            rounds.append(calls)
        passes = cycling(rounds, tier)

        async def call() -> None:
            for packed in read:
                await joins(packed)
            await passes()

        return call

    tasks = [
        driver.every(ZONE, rng.uniform(0, ZONE), window,
                     publish(f"zone-{z}", 10_000_000, rng.randrange(STRETCH)))
        for z in range(ZONES)
    ]  # fmt: skip
    await window.ready()
    await asyncio.gather(*tasks)
    return driver.late


def connect(port: int) -> aioredis.Redis:
    """A client whose calls wait for one of 64 connections (a thousand simulated
    replicas would otherwise open one each when Redis falls behind)."""
    pool = aioredis.BlockingConnectionPool(port=port, max_connections=64, timeout=None)
    return aioredis.Redis(connection_pool=pool)


def cpu_and_calls(port: int) -> tuple[float, int]:
    client = redis.Redis(port=port)
    try:
        cpu = client.info("cpu")
        stats = client.info("commandstats")
    finally:
        client.close()
    calls = sum(int(v.get("calls", 0)) for k, v in stats.items() if k.startswith("cmdstat_evals"))
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]), calls


async def run_flat(hot: int, seconds: float, port: int, cell: Cell, mix: Mix) -> None:
    """Every replica on one store (no zones): what the single tier costs at this scale."""
    client = connect(port)
    try:
        await zone_store(client, hot, Window(3.0, 1), REPLICAS, False, mix)
        window = Window(seconds, 1)
        measured = asyncio.ensure_future(window.measured((port,)))
        late = await zone_store(client, hot, window, REPLICAS, False, mix)
        elapsed, (before,), (after,) = await measured
    finally:
        await client.aclose()
    cell.flat_cpu = 100 * (after[0] - before[0]) / elapsed
    cell.flat_calls = (after[1] - before[1]) / elapsed
    cell.late += late


async def run_cell(hot: int, seconds: float, zone_port: int, global_port: int, mix: Mix) -> Cell:
    zone = connect(zone_port)
    glob = connect(global_port)
    try:
        warm = Window(3.0, 2)  # every member heard once, keys created
        await asyncio.gather(
            zone_store(zone, hot, warm, mix=mix), global_store(glob, hot, warm, mix)
        )
        window = Window(seconds, 2)
        measured = asyncio.ensure_future(window.measured((zone_port, global_port)))
        late = await asyncio.gather(
            zone_store(zone, hot, window, mix=mix), global_store(glob, hot, window, mix)
        )
        elapsed, before, after = await measured
    finally:
        await zone.aclose()
        await glob.aclose()
    cell = Cell(hot, seconds, late=sum(late))
    cell.zone_cpu = 100 * (after[0][0] - before[0][0]) / elapsed
    cell.global_cpu = 100 * (after[1][0] - before[1][0]) / elapsed
    cell.zone_calls = (after[0][1] - before[0][1]) / elapsed
    cell.global_calls = (after[1][1] - before[1][1]) / elapsed
    return cell


def scripts_at(revision: str | None) -> dict[str, str]:
    """fleet_sync.lua and quota_tier.lua as this tree has them, or as git ``revision``
    had them (sync_call_args and tier_call_args give each its arguments)."""
    names = ("fleet_sync.lua", "quota_tier.lua")
    if revision is None:
        return {name: script_text(name) for name in names}
    return {
        name: subprocess.run(
            ["git", "show", f"{revision}:ratelimit_service/resources/{name}"],
            capture_output=True, text=True, check=True, cwd=BENCH,
        ).stdout
        for name in names
    }  # fmt: skip


@dataclass(frozen=True)
class UpdateCost:
    """The store's time per bucket update (microseconds): the script's whole, and of it
    the Redis commands the script called (the rest is the script's own Lua: its
    arithmetic, strings and tables, and passing the commands their arguments)."""

    whole: float
    commands: float


async def update_cost(
    port: int, sources: dict[str, str], hot: int = BATCH, members: int = REPLICAS // ZONES
) -> dict[str, UpdateCost]:
    """The store's time per bucket update, per script and tier: each member's calls of
    ``hot`` buckets (one call each; a zone store's members are its 100 replicas, the
    global store's its 10 zones), repeated, closed loop, timed by the store itself
    (``INFO commandstats``: usec of EVALSHA, and of the commands scripts call, which
    Redis counts too, over the buckets the calls carried)."""
    client = connect(port)
    costs: dict[str, UpdateCost] = {}
    try:
        keys = counters(hot)
        sync = Packed(client, sources["fleet_sync.lua"])
        tier = Packed(client, sources["quota_tier.lua"])
        await sync.load()
        await tier.load()
        zone_keys = ["rl:zone:z:buckets", "rl:zone:z:zones"]
        syncs, zone_publishes, global_publishes = [], [], []
        for n in range(members):
            member = f"replica-{n}"
            reports = [BucketReport(k, LIMIT, 1, 200, 100) for k in keys]
            args = sync_call_args(sync, reports, member, 5_000_000, zoned=True)
            syncs.append(sync.pack(["rl:nodes", *(f"rl:f:{k}" for k in keys), *zone_keys], args))
            totals = [TierReport(k, member, 100.0, 100, 10_000, 1, LIMIT) for k in keys]
            pair = [x for k in keys for x in tier.counter_keys(f"rl:qt{{{k}}}")]
            args = tier_call_args(tier, totals, FORGET_US, None, zoned=True)
            zone_publishes.append(tier.pack([*pair, "rl:zone:z:counters"], args))
            if n < ZONES:  # the global store's members are the zones, with their tokens
                pair = [x for k in keys for x in tier.counter_keys(f"rl:qt{{g{k}}}")]
                args = tier_call_args(tier, totals, FORGET_US, 1, zoned=False)
                global_publishes.append(tier.pack(pair, args))
        cases = {
            "fleet_sync.lua (zone store)": syncs,
            "quota_tier.lua (zone store)": zone_publishes,
            "quota_tier.lua (global store)": global_publishes,
        }
        for name, calls in cases.items():
            for packed in calls:  # every member heard once, keys created
                await (sync if "fleet" in name else tier)(packed)
            sync_client = redis.Redis(port=port)
            sync_client.config_resetstat()
            for _ in range(5):
                for packed in calls:
                    await (sync if "fleet" in name else tier)(packed)
            stats = sync_client.info("commandstats")
            sync_client.close()
            script = stats.pop("cmdstat_evalsha")
            updates = int(script["calls"]) * hot
            inside = sum(v["usec"] for k, v in stats.items() if not k.startswith("cmdstat_config"))
            costs[name] = UpdateCost(float(script["usec"]) / updates, float(inside) / updates)
    finally:
        await client.aclose()
    return costs


def model(
    hot: int, mix: Mix = Mix(), envoys: int = ENVOYS, replicas: int = REPLICAS,
    zones: int = ZONES,
) -> dict[str, float]:  # fmt: skip
    """Store operations per second per tier, from the intervals: script calls, and the
    counters they update (the work inside a call grows with those)."""
    per_zone = replicas / zones
    quota, fleet = (len(keys) for keys in mix.kinds(hot))
    sent_quota, sent_fleet = mix.updates(quota, mix.steady), mix.updates(fleet, mix.waiting)
    calls = math.ceil(sent_quota / BATCH) / PUBLISH + max(1, math.ceil(sent_fleet / BATCH)) / SYNC
    calls += (1 if mix.steady else 0) / PUBLISH  # the count of joins, read once a round
    to_global = mix.updates(quota, mix.steady) + mix.updates(fleet, mix.over) + 1
    global_calls = math.ceil(to_global / BATCH) + (1 if mix.steady or mix.over else 0)
    return {
        "Envoy reports/s (at the replicas)": envoys / 5.0,
        "zone store calls/s": per_zone * calls + AGGREGATOR,
        "zone store counter updates/s": per_zone * (sent_quota / PUBLISH + sent_fleet / SYNC),
        "global store calls/s": zones * global_calls / ZONE,
        "global store counter updates/s": zones * to_global / ZONE,
    }


SCRIPTS: dict[str, str] = {}
"""The replicas' scripts the cells call: this tree's, or --baseline's."""


def update_costs(baseline: str | None, rounds: int = 5) -> None:
    """The store's time per bucket update, this tree's scripts and (when given) the
    baseline's, in turns on fresh redis-servers (a busy machine slows both alike):
    the median of ``rounds`` per script, whole and its commands' part."""
    trees = {"this tree": scripts_at(None)}
    if baseline is not None:
        trees[baseline] = scripts_at(baseline)
    seen: dict[tuple[str, str], list[UpdateCost]] = {}
    for _ in range(rounds):
        for tree, sources in trees.items():
            with lab() as (directory, _, redis_servers):
                port = start_redis(directory, redis_servers).port
                for name, cost in asyncio.run(update_cost(port, sources)).items():
                    seen.setdefault((name, tree), []).append(cost)
    print("| script (store) | scripts of | µs per bucket update (median) | of which its"
          " commands | all rounds |")  # fmt: skip
    print("|---|---|---|---|---|")
    for (name, tree), costs in seen.items():
        whole = statistics.median(c.whole for c in costs)
        commands = statistics.median(c.commands for c in costs)
        every = ", ".join(f"{c.whole:.1f}" for c in costs)
        print(f"| {name} | {tree} | {whole:.2f} | {commands:.2f} | {every} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hot", type=int, nargs="+", default=[1, 10, 100])
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    parser.add_argument("--no-flat", action="store_true", help="skip the store without zones")
    parser.add_argument(
        "--baseline",
        help="a git revision whose fleet_sync.lua and quota_tier.lua the cells call (with"
        " --update-cost: in turns with this tree's)",
    )
    parser.add_argument("--update-cost", action="store_true",
                        help="only the store's time per bucket update, per script")  # fmt: skip
    parser.add_argument(
        "--half",
        action="store_true",
        help="half the hot buckets RLQS, half probabilistic (default: each both)",
    )
    parser.add_argument("--far", type=float, default=0.0,
                        help="share of the probabilistic buckets far below their limits,"
                        f" reported every {STRETCH} syncs (core/stretch.py)")  # fmt: skip
    parser.add_argument("--steady", type=float, default=0.0,
                        help="share of the RLQS counters steady well over their limits,"
                        f" published every {STRETCH} rounds (core/stretch.py)")  # fmt: skip
    parser.add_argument("--over", type=float, default=0.0,
                        help="share of the probabilistic buckets steady well over their limits"
                        f" (of those not far below), synced every {STRETCH} intervals and"
                        f" published to the global store every {STRETCH} passes")  # fmt: skip
    args = parser.parse_args()
    if args.far + args.over > 1:
        parser.error("--far and --over are shares of the same buckets: at most 1 together")
    mix = Mix(args.half, args.far, args.steady, args.over)
    SCRIPTS.update(scripts_at(None))
    if args.update_cost:
        update_costs(args.baseline)
        return
    if args.baseline is not None:
        SCRIPTS.update(scripts_at(args.baseline))
    cells = []
    for hot in args.hot:
        with lab() as (directory, _, redis_servers):
            zone = start_redis(directory, redis_servers)
            glob = start_redis(directory, redis_servers)
            cell = asyncio.run(run_cell(hot, args.seconds, zone.port, glob.port, mix))
            if not args.no_flat:
                flat = start_redis(directory, redis_servers)
                asyncio.run(run_flat(hot, args.seconds, flat.port, cell, mix))
        print(json.dumps(cell.__dict__), flush=True)
        cells.append(cell)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tier_simulation.json").write_text(json.dumps([c.__dict__ for c in cells]))
    print(f"\n{ENVOYS:,} Envoys, {REPLICAS:,} replicas in {ZONES} zones; replicas publish every"
          f" {PUBLISH:g} s and sync every {SYNC:g} s, zones every {ZONE:g} s\n")  # fmt: skip
    print("| hot buckets | each zone store: calls/s (model) | its CPU | global store:"
          " calls/s (model) | its CPU | without zones, one store: calls/s | its CPU"
          " | late calls |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for cell in cells:
        m = model(cell.hot, mix)
        zone_model, global_model = m["zone store calls/s"], m["global store calls/s"]
        print(f"| {cell.hot} | {cell.zone_calls:.0f} ({zone_model:.0f})"
              f" | {cell.zone_cpu:.1f} % | {cell.global_calls:.0f} ({global_model:.0f})"
              f" | {cell.global_cpu:.2f} % | {cell.flat_calls:.0f} | {cell.flat_cpu:.1f} %"
              f" | {cell.late} |")  # fmt: skip
    print("\nOperations per second per tier (the model, per hot bucket count):\n")
    print("| hot buckets | " + " | ".join(model(1)) + " |")
    print("|---" * (len(model(1)) + 1) + "|")
    for hot in args.hot:
        print(f"| {hot} | " + " | ".join(f"{v:,.0f}" for v in model(hot, mix).values()) + " |")


if __name__ == "__main__":
    main()
