"""Redis Cluster and Sentinel, real servers on loopback, both modes."""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ratelimit_harness.redis import RedisCluster, RedisSentinelSetup
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.exact import CHECK, DECIDE, DENIED, ExactHit
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.redis_url import (
    Target,
    Topology,
    normalize_url,
    parse_target,
)
from ratelimit_service.storage.redis_store import RedisStore
from ratelimit_service.storage.script_calls import fleet_state

pytestmark = pytest.mark.slow  # starts processes

needs_redis = pytest.mark.skipif(
    shutil.which("redis-server") is None or shutil.which("redis-cli") is None,
    reason="redis-server and redis-cli are needed",
)


def test_parse_targets() -> None:
    assert parse_target("redis://h:1/0").kind is Topology.SINGLE
    assert parse_target("redis+cluster://a:7000,b:7001") == Target(
        Topology.CLUSTER, (("a", 7000), ("b", 7001))
    )
    assert parse_target("redis+sentinel://u:p@s1:26379,s2:26380/main/2") == Target(
        Topology.SENTINEL, (("s1", 26379), ("s2", 26380)), "main", 2, "u", "p"
    )
    with pytest.raises(ValueError, match="master name"):
        parse_target("redis+sentinel://s1:26379")
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_target("redis+cluster://justahost")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    setup = RedisCluster(tmp_path)
    try:
        setup.start()
        yield setup
    finally:
        setup.stop()


@pytest.fixture
def sentinel(tmp_path: Path) -> Iterator[RedisSentinelSetup]:
    setup = RedisSentinelSetup(tmp_path)
    try:
        setup.start()
        yield setup
    finally:
        setup.stop()


@needs_redis
async def test_cluster_exact_across_slots(cluster: RedisCluster) -> None:
    store = RedisStore(cluster.url, request_timeout=1)
    try:
        assert store.cluster
        keys = [f"tenant\x1e{i}" for i in range(6)]  # spread over several slots
        hits = [ExactHit(key, 2, 60, 1) for key in keys]
        first = await store.hit(hits, True)
        assert [r.remaining for r in first] == [1] * 6
        await store.hit([ExactHit(keys[0], 2, 60, 1)], True)  # keys[0] is now full
        denied = await store.hit(hits, True)
        assert [r.admitted for r in denied] == [False] + [True] * 5
        # the denied request consumed nothing in any slot
        after = await store.hit([ExactHit(key, 2, 60, 0) for key in keys[1:]], True)
        assert [r.before for r in after] == [1] * 5
    finally:
        await store.close()


@needs_redis
async def test_cluster_counts_a_denied_requests_costs_across_slots(cluster: RedisCluster) -> None:
    """A request over several slots denied by one of them: its plain admissions consume
    nothing, its costs count in their slots (core/exact.py counts); denied already by a
    descriptor decided elsewhere (DENIED), only its costs count."""
    store = RedisStore(cluster.url, request_timeout=1)
    try:
        keys = [f"budget\x1e{i}" for i in range(6)]  # spread over several slots
        await store.hit([ExactHit(keys[0], 1, 60, 1)], True)  # keys[0] is now full
        hits = [ExactHit(keys[0], 1, 60, 1)]
        hits += [ExactHit(key, 100, 60, 7, cost=i % 2 == 0) for i, key in enumerate(keys[1:])]
        denied = await store.hit(hits, DECIDE)
        assert [r.admitted for r in denied] == [False] + [True] * 5
        look = [ExactHit(key, 100, 60, 0) for key in keys[1:]]
        assert [r.before for r in await store.hit(look, CHECK)] == [7, 0, 7, 0, 7]
        await store.hit(hits[1:], DENIED)
        assert [r.before for r in await store.hit(look, CHECK)] == [14, 0, 14, 0, 14]
    finally:
        await store.close()


@needs_redis
async def test_cluster_probabilistic_sync(cluster: RedisCluster) -> None:
    stores = [RedisStore(cluster.url, request_timeout=1) for _ in range(2)]
    try:
        reports = [BucketReport(f"b{i}", 100, 1, offered=30, admitted=20) for i in range(8)]
        started = time.monotonic()
        await stores[0].sync(reports)
        result = await stores[1].sync(reports)
        elapsed = time.monotonic() - started
        assert result.nodes == 2
        assert [v.offered_total for v in result.views] == [60] * 8
        # 100 stored - 40 admitted, plus what 100/s refilled between the two syncs
        # (bounded by the time both took: a first call to a cluster is slow).
        assert all(55 <= v.tokens <= 60 + 100 * elapsed + 1 for v in result.views)
    finally:
        for store in stores:
            await store.close()


@needs_redis
async def test_cluster_calendar_budgets_do_not_refill(cluster: RedisCluster) -> None:
    """Calendar budgets' buckets over several slots: each holds its limit less what two
    nodes admitted, whatever time passed (a rolling bucket beside them refills), and
    lives until a minute after its period's end."""
    stores = [RedisStore(cluster.url, request_timeout=1) for _ in range(2)]
    try:
        budgets = [BucketReport(f"m{i}", 100, 60, 30, 20, ends_in=3_600.0) for i in range(8)]
        rolling = BucketReport("r", 100, 1, offered=30, admitted=20)
        await stores[0].sync([*budgets, rolling])
        result = await stores[1].sync([*budgets, rolling])
        assert [v.tokens for v in result.views[:-1]] == [60.0] * 8
        assert result.views[-1].tokens > 60.0  # 100 a second since the first sync
        client = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        keys = [stores[0]._fleet_key(budget.key, 60) for budget in budgets]
        ttls = [client.pttl(key) for key in keys]
        assert len({client.keyslot(key) for key in keys}) > 1
        client.close()
        assert all(3_655_000 < ttl <= 3_660_000 for ttl in ttls), ttls
    finally:
        for store in stores:
            await store.close()


@needs_redis
async def test_sentinel_both_modes_and_failover(sentinel: RedisSentinelSetup) -> None:
    store = RedisStore(sentinel.url, request_timeout=1, sync_timeout=2)
    try:
        assert not store.cluster
        assert (await store.hit([ExactHit("k", 3, 60, 1)], True))[0].remaining == 2
        result = await store.sync([BucketReport("p", 100, 1, 10, 10)])
        assert result.nodes == 1 and result.views[0].offered_total == 10
        old_master = sentinel.master()
        sentinel.failover()
        await eventually_async(
            lambda: sentinel.master() != old_master, timeout=30, what="a failover"
        )

        # The client asks the Sentinel again and reaches the new master.
        async def synced_on_the_new_master() -> bool:
            result = await store.sync([BucketReport("p", 100, 1, 5, 5)])
            return result.views[0].offered_total >= 15

        await eventually_async(
            synced_on_the_new_master,
            timeout=30,
            what="the store reaching the new master",
            ignore=(Exception,),
        )
        assert (await store.hit([ExactHit("k", 3, 60, 0)], True))[0].before >= 1
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("given", "socket_type", "url"),
    [
        ("localhost:6379", "tcp", "redis://localhost:6379"),
        ("localhost:6379", "unix", "redis://localhost:6379"),  # a port: TCP whatever it says
        ("/run/redis.sock", "tcp", "unix:///run/redis.sock"),
        ("redis.sock", "unix", "unix://redis.sock"),
        ("redis://h:1/2", "tcp", "redis://h:1/2"),
        ("rediss://u:p@h:6380", "tcp", "rediss://u:p@h:6380"),
        ("redis+cluster://a:1,b:2", "tcp", "redis+cluster://a:1,b:2"),
    ],
)
def test_store_urls_as_the_go_service_and_we_write_them(
    given: str, socket_type: str, url: str
) -> None:
    assert normalize_url(given, socket_type) == url


@pytest.mark.parametrize(
    ("given", "cause"),
    [
        ("redis://127.0.0.1:notaport", "bad port"),
        ("ftp://h:1", "unknown scheme 'ftp://'"),
        ("localhost", "expected HOST:PORT"),
        ("h:99999", "port out of range"),
        ("redis://:1", "no host"),
        ("redis+sentinel://s1:26379", "master name"),
        ("unix://", "socket path"),
    ],
)
def test_bad_store_urls_say_why(given: str, cause: str) -> None:
    with pytest.raises(ValueError, match=re.escape(cause)):
        normalize_url(given)


def test_store_errors_are_one_short_line() -> None:
    from redis.sentinel import MasterNotFoundError

    from ratelimit_service.storage.redis_calls import MAX_REASON, describe

    dump = "No master found for 'main' : <redis.asyncio.client.Redis(<" + "x" * 1000 + ">)>"
    assert describe(MasterNotFoundError(dump)) == "No master found for 'main'"
    assert len(describe(OSError("y" * 1000))) == MAX_REASON
    assert describe(TimeoutError()) == "TimeoutError"


@pytest.mark.parametrize(
    ("text", "options", "expected"),
    [
        ("h:1", {}, ("h", 1)),
        ("[::1]:6379", {}, ("::1", 6379)),
        (":9090", {}, ("", 9090)),
        ("127.0.0.1:0", {"any_port": True}, ("127.0.0.1", 0)),
    ],
)
def test_one_address_parser(text: str, options: dict[str, bool], expected: tuple[str, int]) -> None:
    from ratelimit_service.core.address import split_host_port

    assert split_host_port(text, **options) == expected


@pytest.mark.parametrize(
    ("text", "options", "cause"),
    [
        ("h", {}, "expected HOST:PORT"),
        ("h:x", {}, "expected HOST:PORT"),
        ("[::1:80", {}, "unbalanced brackets"),
        ("h:0", {}, "port out of range"),
        ("h:70000", {}, "port out of range"),
        (":80", {"need_host": True}, "no host"),
    ],
)
def test_the_address_parser_says_what_is_wrong(
    text: str, options: dict[str, bool], cause: str
) -> None:
    from ratelimit_service.core.address import split_host_port

    with pytest.raises(ValueError, match=re.escape(cause)):
        split_host_port(text, **options)


async def test_cluster_as_the_global_store_of_a_zone(cluster: RedisCluster, redis_server) -> None:
    """A zone's aggregator publishes many counters to a Redis Cluster: each counter's
    keys stay in one slot, the counters spread over the masters, and every counter's
    zone part comes back; its next pass adds one to the count of joins of each one's slot."""
    from ratelimit_service.core.stretch import join_slot
    from ratelimit_service.core.tiers import TierReport
    from ratelimit_service.core.zones import PRESENCE
    from ratelimit_service.engine.zone_aggregator import ZoneAggregator
    from ratelimit_service.storage.zoned import ZonedStore, ZoneRedisStore

    zone_store, global_store = ZoneRedisStore(redis_server.url, "z"), RedisStore(cluster.url)
    store = ZonedStore(zone_store, global_store)
    aggregator = ZoneAggregator(zone_store, global_store, interval=1.0, forget_after=15.0)
    keys = [f"q\x1ftenant\x1et{n}\x1f1" for n in range(30)]
    try:
        await store.publish([TierReport(k, "r1", 10.0, 1, 5, 1, 100.0) for k in keys], 15.0)
        await aggregator.renew()
        await aggregator.aggregate()
        assert aggregator.counters == 30 and aggregator.global_errors == 0
        await aggregator.aggregate()  # adds the slots of the counters it was new to
        slots = {join_slot(k) for k in keys} | {join_slot(PRESENCE)}
        counts = await global_store.joins([])
        assert {n for n, count in enumerate(counts) if count} == slots
        assert set(counts) <= {0, 1}  # each counted once
        zone = redis.Redis(port=redis_server.port)
        parts = [int(zone.hget(h, "Z")) for h in zone.zrange("rl:zone:z:counters", 0, -1)]
        zone.close()
        assert parts == [100_000] * 30  # the zone alone: the whole limit
        masters_used = 0
        for port in cluster.ports:
            node = redis.Redis(port=port)
            masters_used += any(k.startswith(b"rl:qt{") for k in node.keys("*"))
            node.close()
        assert masters_used >= 2
    finally:
        await store.close()


async def test_cluster_as_the_global_store_of_a_zones_calendar_budgets(
    cluster: RedisCluster, redis_server
) -> None:
    """A zone's calendar budgets, over several slots of a Redis Cluster as the global
    store: the aggregator folds what the zone admitted into each budget's global bucket
    and allots the zone (alone: all that is left), which its replicas' next sync sees."""
    from ratelimit_service.engine.zone_aggregator import ZoneAggregator
    from ratelimit_service.storage.zoned import ZonedStore, ZoneRedisStore

    zone_store, global_store = ZoneRedisStore(redis_server.url, "z"), RedisStore(cluster.url)
    store = ZonedStore(zone_store, global_store)
    aggregator = ZoneAggregator(zone_store, global_store, interval=1.0, forget_after=15.0)
    budgets = [BucketReport(f"m{i}", 100, 60, 30, 20 + i, ends_in=3_600.0) for i in range(8)]
    try:
        await store.sync(budgets)
        await aggregator.renew()
        await aggregator.aggregate()
        assert aggregator.passes == 1 and aggregator.global_errors == 0
        fleet = redis.RedisCluster(host="127.0.0.1", port=cluster.ports[0])
        keys = [global_store._fleet_key(budget.key, 60) for budget in budgets]
        assert len({fleet.keyslot(key) for key in keys}) > 1
        states = [fleet_state(fleet.hget(key, "v")) for key in keys]
        assert [state and state.tokens for state in states] == [80.0 - i for i in range(8)]
        fleet.close()
        zone = redis.Redis(port=redis_server.port)
        allotments = [zone.hget(zone_store._fleet_key(b.key, 60), "T") for b in budgets]
        zone.close()
        # (the zone's share of the demand is 1 to the thousandth a rate travels in)
        assert [float(allot) for allot in allotments] == pytest.approx([100.0] * 8)
        idle = [BucketReport(b.key, 100, 60, 0, 0, ends_in=3_599.0) for b in budgets]
        result = await store.sync(idle)
        tokens = [view.tokens for view in result.views]
        # The reply carries tokens in whole thousandths, truncated: one may be lost.
        assert tokens == pytest.approx([80.0 - i for i in range(8)], abs=0.0015)
    finally:
        await store.close()
