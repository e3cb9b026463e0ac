"""A probabilistic calendar budget held by a fleet: two real services on a real Redis,
each with its own reconciler (and, with zones, each the only replica of a zone of its
own, whose aggregator folds the zone's admissions into the global store's bucket of
the budget and brings back the zone's allotment). Both admit until the budget is spent;
the fleet admits no more than the budget and what it admits in one sync interval, and
nothing comes back within the day: a rolling bucket of the same limit would refill
10,000 hits a second, and the checks that follow would pass within a sync.

Progress is measured by the services' own loops (their reconcilers' syncs, the
aggregators' passes), not by sleeps."""

from __future__ import annotations

import asyncio
import functools
import math
import re
import time
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo

import pytest
import redis.asyncio as aioredis

from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.config_model import Mode
from ratelimit_service.storage.script_calls import fleet_state

BUDGET = 864_000_000
"""A day's budget: a rolling bucket of it refills 10,000 hits a second."""
HITS = 1_000_000
"""Per admission: the budget is 864 of them."""
SYNC = 0.1
ZONE_INTERVAL = 0.2
OK, OVER = 1, 2
TENANT = [("tenant", "acme")]
CHECK = {"entries": TENANT, "hits": 0}


def noon_zone() -> str:
    """A time zone where it is about noon now: its day ends hours after the test."""
    offset = 12 - datetime.now(UTC).hour  # -11 .. 12 hours east of UTC
    return "Etc/GMT" if offset == 0 else f"Etc/GMT{-offset:+d}"  # Etc/GMT-5 is UTC+5


def rules(zone: str) -> str:
    return f"""\
domain: ai
descriptors:
  - key: tenant
    mode: probabilistic
    failure_mode: closed  # a replica whose view is stale denies: nothing uncounted
    rate_limit: {{unit: day, requests_per_unit: {BUDGET}, calendar: {zone}}}
"""


class Replica:
    """One running service and what the test reads of it."""

    def __init__(self, running: Any) -> None:
        self.running = running
        self.service = running.service
        self.admitted: list[tuple[float, int]] = []
        """(monotonic time, hits) of each admission."""

    def progress(self) -> tuple[int, int]:
        """Its reconciler's syncs, and its zone aggregator's passes (0 without zones)."""
        aggregator = self.service.zone_aggregator
        return self.service.reconciler.syncs, aggregator.passes if aggregator else 0

    def moved_on(self, since: tuple[int, int], syncs: int, passes: int) -> bool:
        now = self.progress()
        zoned = self.service.zone_aggregator is not None
        return now[0] >= since[0] + syncs and (not zoned or now[1] >= since[1] + passes)

    async def call(self, *descriptors: Any, hits_addend: int = 0) -> Any:
        return await self.running.call("ai", *descriptors, hits_addend=hits_addend)

    async def spend(self) -> None:
        """Admissions of HITS until every one is denied for 3 syncs (and 3 passes)."""
        denied_since: tuple[int, int] | None = None
        while denied_since is None or not self.moved_on(denied_since, 3, 3):
            answer = await self.call(TENANT, hits_addend=HITS)
            if answer.overall_code == OK:
                self.admitted.append((time.monotonic(), HITS))
                denied_since = None
            elif denied_since is None:
                denied_since = self.progress()


async def zones_counted(url: str, db: int) -> bool:
    """Whether the zone store in database ``db`` holds the count of two zones."""
    client = aioredis.Redis.from_url(re.sub(r"/0$", f"/{db}", url))
    try:
        keys = await client.keys("rl:zone:*:zones")
        return bool(keys) and await client.mget(keys) == [b"2"]
    finally:
        await client.aclose()


def most_in_a_window(admissions: list[tuple[float, int]], seconds: float) -> int:
    """The most hits admitted within any ``seconds`` (the fleet's, all together)."""
    times = sorted(admissions)
    most = total = first = 0
    for moment, hits in times:
        total += hits
        while times[first][0] < moment - seconds:
            total -= times[first][1]
            first += 1
        most = max(most, total)
    return most


@pytest.mark.parametrize("zoned", [False, True], ids=["one-store", "zones"])
async def test_a_fleet_spends_a_calendar_budget_once_and_it_does_not_come_back(
    start_service, write_config, redis_server, zoned: bool
) -> None:
    zone = noon_zone()
    config = write_config(rules(zone))
    settings: list[dict[str, Any]] = [{"redis_url": redis_server.url}] * 2
    if zoned:  # zone a's store on database 1, b's on 2, the global store on 0
        settings = [
            {"redis_url": re.sub(r"/0$", f"/{db}", redis_server.url), "zone": name,
             "global_redis_url": redis_server.url, "zone_interval": ZONE_INTERVAL}
            for db, name in ((1, "a"), (2, "b"))
        ]  # fmt: skip
    replicas = [
        Replica(await start_service(config, mode=Mode.PROBABILISTIC, sync_interval=SYNC, **s))
        for s in settings
    ]
    if zoned:  # each zone has counted the two (as a deployment's have before traffic)
        for db in (1, 2):
            counted = functools.partial(zones_counted, redis_server.url, db)
            await eventually_async(counted, timeout=20, what=f"two zones counted in db {db}")
    await eventually_async(
        lambda: all(replica.service.reconciler.syncs >= 2 for replica in replicas),
        what="both replicas synced",
    )
    await asyncio.gather(*(replica.spend() for replica in replicas))
    admissions = [entry for replica in replicas for entry in replica.admitted]
    admitted = sum(hits for _, hits in admissions)
    per_sync = most_in_a_window(admissions, SYNC)
    # Within the budget but for what the fleet admits in one sync interval; all of it
    # but a tail smaller than two shares of half of it (a share is at least half the
    # fleet's: four admissions).
    assert BUDGET - 4 * HITS < admitted <= BUDGET + per_sync, (admitted, per_sync)
    assert all(replica.admitted for replica in replicas)  # both had their part

    # The store counted every admission, and nothing came back meanwhile. Every hit left
    # goes to one cost (counted in full, as a usage report is): the budget, in the
    # (global) store's bucket of it, is then spent to the last hit.
    store = aioredis.Redis.from_url(redis_server.url)
    try:
        (key,) = await store.keys("rl:p:*")
        state = fleet_state(await store.hget(key, "v"))
        left = state.tokens if state is not None else math.nan
        assert left == BUDGET - admitted
        if left >= 0:
            await replicas[0].call({"entries": TENANT, "hits": math.floor(left) + 1})
        midnight = datetime.now(ZoneInfo(zone)).replace(hour=0, minute=0, second=0, microsecond=0)
        until_midnight = (
            midnight + timedelta(days=1) - datetime.now(ZoneInfo(zone))
        ).total_seconds()
        assert abs(await store.pttl(key) / 1000 - (until_midnight + 60)) < 5  # gone after
    finally:
        await store.aclose()

    async def denied_everywhere() -> bool:
        answers = [await replica.call(CHECK) for replica in replicas]
        return all(answer.overall_code == OVER for answer in answers)

    await eventually_async(denied_everywhere, timeout=20, what="checks denied on both")
    # And they stay denied: 5 more syncs of each (and 3 more passes of each zone).
    since = [replica.progress() for replica in replicas]
    checks = 0
    while not all(r.moved_on(s, 5, 3) for r, s in zip(replicas, since, strict=True)):
        for replica in replicas:
            answer = await replica.call(CHECK)
            assert answer.overall_code == OVER, f"a check passed after {checks} denied"
            checks += 1
            # Its reset is the day's end in the rule's time zone.
            reset = answer.statuses[0].duration_until_reset.seconds
            assert abs(reset - until_midnight) < 30, (reset, until_midnight)
    admission = await replicas[1].call(TENANT, hits_addend=1)
    assert admission.overall_code == OVER
