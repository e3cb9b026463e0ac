"""The zone's gauges on /metrics, from two replicas' aggregators on a real redis-server
(the zone store on one database, the global store on another): the zone label, one
aggregator per zone, and one ``ratelimit_store`` sample per name."""

from __future__ import annotations

from collections import Counter

from prometheus_client.core import Metric

from ratelimit_harness.redis import RedisServer
from ratelimit_service.engine.quota import FORGET_AFTER
from ratelimit_service.engine.state_metrics import store_metrics, zone_metrics
from ratelimit_service.engine.zone_aggregator import ZoneAggregator
from ratelimit_service.storage.redis_store import RedisStore
from ratelimit_service.storage.zoned import ZonedStore, ZoneRedisStore


def samples(families: list[Metric]) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    return [(s.name, tuple(sorted(s.labels.items())), s.value) for f in families for s in f.samples]


def replica(server: RedisServer, zone: str) -> tuple[ZonedStore, ZoneAggregator]:
    zone_store = ZoneRedisStore(server.url.removesuffix("/0") + "/1", zone)
    global_store = RedisStore(server.url)
    aggregator = ZoneAggregator(zone_store, global_store, interval=1.0, forget_after=FORGET_AFTER)
    return ZonedStore(zone_store, global_store), aggregator


async def test_one_replica_of_the_zone_says_it_aggregates(redis_server: RedisServer) -> None:
    (store_1, first), (store_2, second) = replica(redis_server, "a"), replica(redis_server, "a")
    try:
        before = samples(list(zone_metrics(first)))
        assert before == [("ratelimit_zone_aggregating", (("zone", "a"),), 0.0)]
        await first.renew()
        await second.renew()  # finds the lease held by the first
        assert samples([*zone_metrics(first), *zone_metrics(second)]) == [
            ("ratelimit_zone_aggregating", (("zone", "a"),), 1.0),
            ("ratelimit_zone_aggregating", (("zone", "a"),), 0.0),
        ]
    finally:
        await store_1.close()
        await store_2.close()


async def test_the_zoned_store_has_one_sample_per_name(redis_server: RedisServer) -> None:
    store, aggregator = replica(redis_server, "a")
    try:
        await aggregator.renew()
        rows = [
            (dict(labels)["name"], value)
            for name, labels, value in samples(list(store_metrics(store, aggregator.stats())))
            if name == "ratelimit_store"
        ]
        names = Counter(name for name, _ in rows)
        assert [name for name, count in names.items() if count > 1] == []
        values = dict(rows)
        assert values["healthy"] == values["zone_store_healthy"] == 1.0
        assert values["zone_aggregating"] == 1.0
    finally:
        await store.close()
