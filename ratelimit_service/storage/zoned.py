"""The zone tier's storage (``serve --zone NAME``): each zone of replicas with its own
Redis, one global Redis above them. :class:`ZoneRedisStore` is the zone's Redis: a
RedisStore that keeps the indexes its aggregator (engine/zone_aggregator.py) reads, and
answers its lease, reads and write-backs. :class:`ZonedStore` is a replica's store seam:
exact rules on the global store (one counter per window for the whole fleet), RLQS and
probabilistic rules on the zone's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import replace
from typing import Any

from ratelimit_service.core.drop_ratio import SyncResult
from ratelimit_service.core.exact import ExactHit, ExactResult
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.settings_table import default
from ratelimit_service.core.tiers import Fenced, TierReport, TierTotals
from ratelimit_service.core.zones import (
    ZONE_FORGET_AFTER,
    Lease,
    ZoneBuckets,
    ZoneKeys,
    ZoneShare,
    ZoneTotals,
)
from ratelimit_service.storage.base import StoreMetrics
from ratelimit_service.storage.redis_store import CALL_CHUNK, RedisStore
from ratelimit_service.storage.script_calls import (
    lease_args,
    lease_reply,
    write_args,
    zone_read_args,
    zone_read_fleet_reply,
    zone_read_reply,
    zone_write_reply,
)

MOST_COUNTERS = 10_000
"""Counters (and buckets) an aggregation pass reads at most (least recently published first)."""


class ZoneRedisStore(RedisStore):
    """Every aggregator call is bounded by the deadline (the loop's time) or timeout given."""

    def __init__(self, url: str, zone: str, **options: Any) -> None:
        keys = ZoneKeys.of(options.get("prefix", default("--redis-key-prefix")), zone)
        super().__init__(url, zone_keys=keys, **options)
        if self.cluster:
            raise ValueError("a zone store must be one Redis (or Sentinel), not Cluster")
        self.zone = zone
        self.keys = keys
        self._read = self.redis.register("zone_read.lua")
        self._read_fleet = self.redis.register("zone_read_fleet.lua")
        self._write = self.redis.register("zone_write.lua")
        self._lease = self.redis.register("lease.lua")

    async def zone_totals(self, forget_after: float, deadline: float) -> list[ZoneTotals]:
        """Every counter a replica of the zone published within ``forget_after``."""
        args = zone_read_args(int(forget_after * 1_000_000), MOST_COUNTERS)
        keys = [self.keys.counters]
        raw = await self.redis.call(self._read, keys, args, self.redis.time_left(deadline))
        return zone_read_reply(raw)

    async def zone_buckets(self, forget_after: float, deadline: float) -> ZoneBuckets:
        """The store's time, the zone's live replicas and buckets synced within ``forget_after``."""
        keys = [self.keys.buckets, self.prefix + "nodes"]
        args = zone_read_args(int(forget_after * 1_000_000), MOST_COUNTERS)
        raw = await self.redis.call(self._read_fleet, keys, args, self.redis.time_left(deadline))
        return zone_read_fleet_reply(raw)

    async def write_back(
        self, shares: Sequence[tuple[str, ZoneShare]], zones: int, token: int, deadline: float
    ) -> int | Fenced:
        """Write back each counter's zone part, the fleet's allowed hits and the number of zones, as
        the holder of ``token`` (refused past a higher one). Returns the counters written."""
        keep_ms = round(2 * ZONE_FORGET_AFTER * 1000)
        written = 0
        for start in range(0, max(1, len(shares)), CALL_CHUNK):
            chunk = shares[start : start + CALL_CHUNK]
            args = write_args(
                [share for _, share in chunk], None if start else zones, keep_ms, token
            )
            keys = [self.keys.zones, self.keys.fence, *(key for key, _ in chunk)]
            raw = await self.redis.call(self._write, keys, args, self.redis.time_left(deadline))
            answer = zone_write_reply(raw)
            if isinstance(answer, Fenced):
                return answer
            written += answer
        return written

    async def lease(self, holder: str, ttl: float, floor: int | None, timeout: float) -> Lease:
        """Take or renew the zone's lease for ``ttl`` seconds (lease.lua), within
        ``timeout``; ``floor``: a token a write of ``holder`` was refused against."""
        keys = [self.keys.lease, self.keys.fence]
        args = lease_args(holder, max(1, round(ttl * 1_000_000)), floor)
        return lease_reply(await self.redis.call(self._lease, keys, args, timeout))


class ZonedStore:
    """The Store seam for a replica in a zone (its aggregator wired by server/app.py)."""

    def __init__(self, zone_store: ZoneRedisStore, global_store: RedisStore) -> None:
        self.zone_store = zone_store
        self.global_store = global_store

    def hit(
        self,
        hits: Sequence[ExactHit],
        commit: int,
        owe: bool = False,
        deadline: float | None = None,
    ) -> Awaitable[list[ExactResult]]:
        return self.global_store.hit(hits, commit, owe, deadline)

    async def sync(self, reports: Sequence[BucketReport]) -> SyncResult:
        return await self.zone_store.sync(reports)

    async def publish(self, reports: Sequence[TierReport], forget_after: float) -> list[TierTotals]:
        return await self.zone_store.publish(reports, forget_after)

    async def joins(self, add: Sequence[int]) -> list[int]:
        """The zone store's: a replica's fellow members are its zone's replicas."""
        return await self.zone_store.joins(add)

    async def start(self) -> None:
        await asyncio.gather(self.zone_store.start(), self.global_store.start())

    def healthy(self) -> bool:
        """The zone store answers: RLQS goes on (fail-static without the global one)."""
        return self.zone_store.healthy()

    def metrics(self) -> StoreMetrics:
        """Both stores' metrics (the zone's named ``zone_store_``, ``zone_``) and breakers."""
        above, zone = self.global_store.metrics(), self.zone_store.metrics()
        figures = {**above.figures, **{f"zone_store_{k}": v for k, v in zone.figures.items()}}
        histograms = {**above.histograms, **{f"zone_{k}": v for k, v in zone.histograms.items()}}
        breakers = above.breakers + tuple(replace(b, name="zone store") for b in zone.breakers)
        return StoreMetrics("zoned", figures, histograms, breakers)

    async def close(self) -> None:
        await asyncio.gather(self.zone_store.close(), self.global_store.close())
