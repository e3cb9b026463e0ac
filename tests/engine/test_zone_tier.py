"""The zone tier on three real redis-servers (two zone stores, one global store): the
replicas' coordinators in this process, the aggregators' lease calls and passes made by
the test.

Zone a: replicas a1, a2, each with one Envoy asking 60/s; zone b: b1, b2 with 30/s
each; one limit of 100/s over them all. The global store sees two members (the
zones), each zone store two (its replicas)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from ratelimit_harness.redis import RedisServer
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.drop_ratio import SyncResult
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.stretch import STRETCH, join_slot
from ratelimit_service.core.tiers import Fenced
from ratelimit_service.engine.quota import FORGET_AFTER, CounterView, QuotaCoordinator, Usage
from ratelimit_service.engine.stats import Stats
from ratelimit_service.engine.zone_aggregator import ZoneAggregator
from ratelimit_service.storage.redis_store import RedisStore
from ratelimit_service.storage.zoned import ZonedStore, ZoneRedisStore

pytestmark = pytest.mark.slow  # starts three redis-servers per test

RULES = """\
domain: q
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
"""
KEY = "q\x1ftenant\x1et\x1f1"
BUCKET = {"tenant": "t"}
DEMAND = {"a1": 60, "a2": 60, "b1": 30, "b2": 30}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[dict[str, RedisServer]]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    started = {name: RedisServer(tmp_path) for name in ("a", "b", "global")}
    try:
        for server in started.values():
            server.start()
        yield started
    finally:
        for server in started.values():
            server.stop()


class Replica:
    """One replica's stores and its zone's aggregator, as server/app.py wires them."""

    def __init__(self, zone_url: str, zone: str, global_url: str, interval: float = 1.0) -> None:
        self.zone_store = ZoneRedisStore(zone_url, zone)
        self.global_store = RedisStore(global_url)
        self.store = ZonedStore(self.zone_store, self.global_store)
        self.aggregator = self.aggregator_on(interval)

    def aggregator_on(
        self, interval: float, clock: Callable[[], float] | None = None
    ) -> ZoneAggregator:
        """An aggregator on this replica's stores (``clock``: its own, else the loop's)."""
        return ZoneAggregator(self.zone_store, self.global_store, interval=interval,
                              forget_after=FORGET_AFTER, clock=clock)  # fmt: skip

    async def sync(self, reports: list[BucketReport]) -> SyncResult:
        return await self.store.sync(reports)

    async def close(self) -> None:
        await self.store.close()


async def aggregate(aggregator: ZoneAggregator) -> None:
    """One lease call, then one pass (the pass runs on the lease's holder only)."""
    await aggregator.renew()
    await aggregator.aggregate()


class Fleet:
    """Four replicas in two zones, one Envoy each."""

    def __init__(self, servers: dict[str, RedisServer], interval: float = 1.0) -> None:
        config = load_config([ConfigFile("q.yaml", RULES)])
        self.clock = Clock()
        self.stores: dict[str, Replica] = {}
        self.replicas: dict[str, QuotaCoordinator] = {}
        for name in DEMAND:
            zone = name[0]
            replica = Replica(servers[zone].url, zone, servers["global"].url, interval)
            self.stores[name] = replica
            store = replica.store
            self.replicas[name] = QuotaCoordinator(
                lambda: config, Stats(), store, member=name, clock=self.clock
            )
        self.shares: dict[str, int] = {}

    async def report(self, name: str, hits: int) -> None:
        (action,) = await self.replicas[name].report(f"envoy-{name}", "q", [Usage(BUCKET, hits, 0)])
        assert action.token_bucket is not None
        self.shares[name] = action.token_bucket.tokens_per_fill

    async def round(self) -> None:
        """Every Envoy reports its 5 s, every replica publishes, every zone aggregates,
        every replica publishes again."""
        self.clock.now += 5.0
        for name, rate in DEMAND.items():
            await self.report(name, rate * 5)
        await self.publish_all()

    async def publish_all(self) -> None:
        for replica in self.replicas.values():
            await replica.tick()
        for name in ("a1", "b1"):
            await aggregate(self.stores[name].aggregator)
        for replica in self.replicas.values():
            await replica.tick()

    def view(self, name: str) -> CounterView:
        """The replica's read-out of the counter (what /status.json and /metrics show)."""
        (view,) = [v for v in self.replicas[name].view() if v is not None and v.key == KEY]
        return view

    def part(self, name: str) -> float:
        part = self.view(name).part
        assert part is not None
        return part

    async def close(self) -> None:
        for store in self.stores.values():
            await store.close()


def zone_part(server: RedisServer, zone: str) -> float:
    """The zone's part of the limit, as its aggregator wrote it in the zone store."""
    client = redis.Redis(port=server.port)
    try:
        (key,) = client.zrange(f"rl:zone:{zone}:counters", 0, -1)
        return int(client.hget(key, "Z")) / 1000
    finally:
        client.close()


def global_members(server: RedisServer) -> set[tuple[bytes, ...]]:
    """The members of every entry in the global store (a counter's, a bucket's, and
    the zones' presence): one entry per zone in each."""
    client = redis.Redis(port=server.port)
    try:
        keys = [k for k in client.keys("rl:qt*") if k.endswith(b":m")]
        return {tuple(sorted(client.zrange(key, 0, -1))) for key in keys}
    finally:
        client.close()


@contextlib.asynccontextmanager
async def fleet_of(servers: dict[str, RedisServer], interval: float = 1.0):  # type: ignore[no-untyped-def]
    fleet = Fleet(servers, interval)
    try:
        for name in DEMAND:  # the first reports: nothing measured yet
            await fleet.report(name, 1)
        for _ in range(4):
            await fleet.round()
        yield fleet
    finally:
        await fleet.close()


async def test_two_zones_hold_one_limit_by_demand(servers) -> None:
    async with fleet_of(servers) as fleet:
        # The zones' parts: 120/s and 60/s asked, 100 to divide.
        assert zone_part(servers["a"], "a") == pytest.approx(100 * 120 / 180, abs=0.01)
        assert zone_part(servers["b"], "b") == pytest.approx(100 * 60 / 180, abs=0.01)
        # Each zone's replicas divide the zone's part; the Envoys hold the limit.
        assert fleet.part("a1") + fleet.part("a2") == pytest.approx(66.67, abs=0.02)
        assert fleet.part("b1") + fleet.part("b2") == pytest.approx(33.33, abs=0.02)
        await fleet.round()
        assert 97 <= sum(fleet.shares.values()) <= 100, fleet.shares
        # The global store holds one entry per zone, a zone store one per replica.
        assert global_members(servers["global"]) == {(b"a", b"b")}
        totals = fleet.view("a1").totals
        assert totals is not None and (totals.members, totals.instances) == (2, 2)


async def test_a_zone_keeps_its_part_while_the_global_store_is_away(servers) -> None:
    async with fleet_of(servers) as fleet:
        before = {name: fleet.part(name) for name in DEMAND}
        servers["global"].stop()
        await fleet.round()
        aggregator = fleet.stores["a1"].aggregator
        assert aggregator.global_away and aggregator.global_errors >= 1
        assert {name: fleet.part(name) for name in DEMAND} == pytest.approx(before, abs=0.01)
        assert 97 <= sum(fleet.shares.values()) <= 100
        servers["global"].start()  # back, empty: the zones publish their sums again
        await fleet.round()
        # The first zone heard by the empty store took the whole limit for one pass
        # (a member heard first is not held to room nobody has claimed yet); its
        # replicas hand it out at the next reports, then it shrinks to its part (the
        # replica publishing first after that is held to what the other still holds,
        # for one more pass).
        for _ in range(3):
            await fleet.round()
        assert not aggregator.global_away
        assert (aggregator.global_outages, aggregator.global_recoveries) == (1, 1)
        assert zone_part(servers["a"], "a") == pytest.approx(66.67, abs=0.02)
        assert 97 <= sum(fleet.shares.values()) <= 100


async def test_another_replica_takes_the_lease_when_the_aggregator_stops(servers) -> None:
    interval = 0.2
    async with fleet_of(servers, interval) as fleet:
        first, second = fleet.stores["a1"].aggregator, fleet.stores["a2"].aggregator
        await first.renew()
        await second.renew()
        assert first.leading and not second.leading
        # first stops renewing (its process died): the lease lives one interval.
        taken = await eventually_async(
            lambda: _renewed(second), timeout=4 * interval + 1, what="a2 takes the lease"
        )
        assert taken and second.takeovers == 1
        await first.renew()  # back: it finds the lease held by a2
        assert not first.leading and first.lease_lost == 1


async def _renewed(aggregator: ZoneAggregator) -> bool:
    await aggregator.renew()
    return aggregator.leading


async def test_probabilistic_buckets_refill_at_the_zones_part(servers) -> None:
    """Zone a's replicas offer twice what zone b's do, 180/s against a limit of 100/s:
    after two aggregation passes (the first measures nothing yet) each zone's fleet
    bucket refills at its part, about 67 and 33 a second, and the replicas' syncs say
    so (the local controller's budget follows it)."""
    stores = {name: Replica(servers[name[0]].url, name[0], servers["global"].url)
              for name in DEMAND}  # fmt: skip
    report = {name: BucketReport("q\x1fk\x1ev\x1f1", 100, 1, offered=rate, admitted=rate // 2)
              for name, rate in DEMAND.items()}  # fmt: skip
    try:
        views = {}
        for _ in range(3):
            for name, store in stores.items():
                result = await store.sync([report[name]])
                views[name] = result.views[0]
            for name in ("a1", "b1"):
                await aggregate(stores[name].aggregator)
            await asyncio.sleep(0.3)  # the subject: refills over time on Redis's clock
        for name in DEMAND:
            result = await stores[name].sync([report[name]])
            views[name] = result.views[0]
            assert result.nodes == 2  # the zone's replicas, not the fleet's
        assert views["a1"].limit == pytest.approx(66.7, rel=0.1)
        assert views["b2"].limit == pytest.approx(33.3, rel=0.1)
        assert views["a1"].limit + views["b1"].limit <= 100.01
        assert global_members(servers["global"]) == {(b"a", b"b")}
        # A bucket new to the zone refills at the limit over the two zones until its
        # own part comes back, not at the whole limit.
        fresh = BucketReport("q\x1fk\x1enew\x1f1", 100, 1, offered=1, admitted=1)
        (view,) = (await stores["a1"].sync([fresh])).views
        assert view.limit == 50.0 and view.tokens == pytest.approx(49.0, abs=0.5)
    finally:
        for store in stores.values():
            await store.close()


async def test_a_fresh_deployment_counts_its_zones_before_any_bucket(servers) -> None:
    """No bucket is hot yet, and the aggregators have each made a pass (the first in
    zone a before zone b was there, so it makes a second): each zone knows there are
    two, so the very first bucket starts at half the limit in each, not at the whole
    limit in both."""
    stores = {zone: Replica(servers[zone].url, zone, servers["global"].url) for zone in "ab"}
    try:
        for zone in ("a", "b", "a"):
            await aggregate(stores[zone].aggregator)
        assert global_members(servers["global"]) == {(b"a", b"b")}
        first = BucketReport("q\x1fk\x1efirst\x1f1", 100, 1, offered=1, admitted=1)
        for store in stores.values():
            (view,) = (await store.sync([first])).views
            assert view.limit == 50.0 and view.tokens == pytest.approx(49.0, abs=0.5)
        # Zone a is heard first with the new bucket, and asks for more than the limit:
        # alone in the global store it would get all of it, beside zone b's half. It
        # gets half until b is heard too; then the two parts by demand hold the limit.
        hot = BucketReport(first.key, 100, 1, offered=300, admitted=50)
        await stores["a"].sync([hot])
        await aggregate(stores["a"].aggregator)
        (view,) = (await stores["a"].sync([hot])).views
        assert view.limit == 50.0
        await stores["b"].sync([hot])
        for zone in ("b", "a"):
            await aggregate(stores[zone].aggregator)
        views = {zone: (await store.sync([hot])).views[0] for zone, store in stores.items()}
        assert views["a"].limit > 0 and views["b"].limit > 0
        assert views["a"].limit + views["b"].limit <= 100.01
    finally:
        for store in stores.values():
            await store.close()


async def test_the_others_stay_within_their_parts_while_a_zone_is_cut_off(servers) -> None:
    """Zone b stops publishing (cut off from the global store): zone a keeps its part
    until the global store forgets b (here after 2 s instead of a minute), then takes
    the limit."""
    async with fleet_of(servers) as fleet:
        aggregator = fleet.stores["a1"].aggregator
        aggregator.zone_forget_after = 2.0
        await aggregate(aggregator)
        held = zone_part(servers["a"], "a")
        for name in ("a1", "a2"):  # b is silent from now on
            await fleet.replicas[name].tick()
        await aggregate(aggregator)
        assert zone_part(servers["a"], "a") == pytest.approx(held, abs=0.01)

        async def grown() -> bool:
            await aggregate(aggregator)
            return zone_part(servers["a"], "a") > 99.0

        await eventually_async(grown, timeout=10, what="zone a to take b's part")


async def test_a_deposed_aggregators_late_pass_is_refused(servers) -> None:
    """a1 aggregates, then its clock stands still (its process paused between its
    check and its writes): its lease expires, a2 takes it and publishes with a later
    token. a1's pass then goes out as if nothing had happened: the global store refuses
    it whole, a1 stops aggregating, and a2's part stands. A write-back with a1's token
    is refused by the zone store too."""
    interval = 1.0  # room for a busy machine: the term's margin is an eighth of it
    async with fleet_of(servers, interval) as fleet:
        paused_at = asyncio.get_running_loop().time()
        first = fleet.stores["a1"].aggregator_on(interval, clock=lambda: paused_at)
        second = fleet.stores["a2"].aggregator
        await first.renew()
        token = first.leadership.token
        assert first.leading and token is not None
        await eventually_async(lambda: _renewed(second), timeout=4 * interval + 1,
                               what="a2 takes the lease")  # fmt: skip
        await second.aggregate()
        assert second.passes == 1 and second.leadership.token == token + 1
        held = zone_part(servers["a"], "a")

        await first.aggregate()  # its clock says its term goes on
        assert first.fenced == 1 and first.passes == 0 and first.lease_lost == 1
        assert not first.leading and first.leadership.floor == token + 1
        assert zone_part(servers["a"], "a") == held
        deadline = asyncio.get_running_loop().time() + 1.0
        refused = await fleet.stores["a1"].zone_store.write_back([], 2, token, deadline)
        assert refused == Fenced(token + 1)
        await first.renew()  # a deposed replica's ask changes nothing
        assert not first.leading and second.leadership.token == token + 1
        await aggregate(second)
        assert second.passes == 2 and second.fenced == 0


async def test_a_holder_whose_zone_store_lost_its_tokens_gets_above_them(servers) -> None:
    """Zone a's store restarts empty: its fencing counter starts again below the token
    the global store has seen from zone a. The holder's first publish is refused; its
    next lease call names that token and brings one above it, and the zone publishes
    again."""
    async with fleet_of(servers) as fleet:
        aggregator = fleet.stores["a1"].aggregator
        client = redis.Redis(port=servers["a"].port)
        client.set("rl:zone:a:fence", 6)  # the lease changed hands six times so far
        client.delete("rl:zone:a:lease")  # and expired
        await aggregate(aggregator)
        seen = aggregator.leadership.token
        assert seen == 7 and aggregator.passes > 0
        client.flushall()
        client.close()
        await aggregate(aggregator)
        assert aggregator.fenced == 1 and not aggregator.leading
        await aggregate(aggregator)
        assert aggregator.leading and aggregator.leadership.token == seen + 1
        assert aggregator.fenced == 1 and aggregator.passes > 0
        passes = aggregator.passes
        await fleet.round()
        assert aggregator.passes == passes + 1
        assert zone_part(servers["a"], "a") == pytest.approx(66.67, abs=0.5)


async def test_a_zone_steady_over_the_limit_waits_and_a_new_zone_ends_the_wait(servers) -> None:
    """Zone a alone offers twice the limit: after its first passes its aggregator sends
    the counter to the global store every STRETCH passes (its presence every pass).
    Then zone b's first Envoy reports: b is new to the counter in the global store and
    takes its even share by instances over the limit, and adds to the store's count of
    joins in its next pass; zone a publishes in the pass after that, waiting or not, the
    zones' parts add up within the limit again, and a tells its own store, so that a's
    replicas, whose publishes wait too, divide the smaller part in their next round."""
    fleet = Fleet(servers)
    aggregator = fleet.stores["a1"].aggregator

    async def round_of(names: tuple[str, ...], rate: int) -> int:
        """Each of ``names`` reports ``rate``/s; one publish round; zone a's updates sent."""
        fleet.clock.now += 5.0
        for name in names:
            await fleet.report(name, rate * 5)
        before = aggregator.bucket_updates
        await fleet.publish_all()
        return aggregator.bucket_updates - before

    try:
        for name in ("a1", "a2"):
            await fleet.report(name, 1)
        sent = [await round_of(("a1", "a2"), 100) for _ in range(3 + 3 * STRETCH)]
        assert sent[-2 * STRETCH :].count(2) == 2, sent  # the counter every STRETCH passes
        assert set(sent[-2 * STRETCH :]) == {1, 2}, sent  # the presence every pass
        while sent[-1] != 2:  # to a pass that sent it: the next ones would wait
            sent.append(await round_of(("a1", "a2"), 100))
        assert zone_part(servers["a"], "a") == pytest.approx(100.0, abs=0.01)
        await fleet.report("b1", 30 * 5)  # b's first: the zone has no part of it yet
        sent.append(await round_of(("a1", "a2"), 100))  # a waits; b joins the counter
        assert zone_part(servers["b"], "b") == pytest.approx(100 / 3, abs=0.01)  # 1 of 3
        sent.append(await round_of(("a1", "a2", "b1"), 100))  # b adds to the count
        zone_a = fleet.stores["a1"].zone_store
        woken = await zone_a.joins([])
        sent.append(await round_of(("a1", "a2", "b1"), 100))
        assert sent[-3:] == [1, 1, 2], sent  # a published in the pass after b's count
        assert zone_part(servers["a"], "a") + zone_part(servers["b"], "b") <= 100.01
        moved = [n - w for n, w in zip(await zone_a.joins([]), woken, strict=True)]
        assert moved[join_slot(KEY)] >= 1  # a's replicas told: their waits end
    finally:
        await fleet.close()
