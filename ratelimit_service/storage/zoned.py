"""The zone tier (``serve --zone NAME``): a replica's store when replicas are grouped in
zones, each zone with its own Redis and one global Redis above them.

The replicas of a zone publish their RLQS totals to the zone store only
(:class:`ZoneRedisStore`, quota_tier.lua with an index of counters), and their parts
there divide the zone's part of each limit. One replica per zone, elected by a lease
in the zone store, runs the :class:`ZoneAggregator`: every interval it reads the
zone's sums of every live counter, publishes them to the global store as the zone
(the same quota_tier.lua: the zones are the global store's members) and writes back
the zone's part and the fleet's allowed hits. So the global store's work per hot
bucket grows with the zones, the zone store's with its replicas, and neither with
the Envoys.

Failures: the global store away, the zone keeps its last part and its replicas go on
dividing it (fail-static); the aggregator gone, another replica takes the lease
within two intervals (the lease lives one interval and is tried every half); a zone
cut off from the global store keeps its part while the others keep theirs, and its
entry there leaves the sums after ZONE_FORGET_AFTER (a minute), freeing its part for
them.

Probabilistic rules go the same way: the replicas sync with the zone store, whose
fleet bucket refills at the zone's part of the limit; the aggregator publishes each
bucket's offered rate and admitted hits as the zone's demand and allowed hits, and
writes back the zone's part. Exact rules are decided on the global store: exactness
needs one counter per window for the whole fleet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any

from ratelimit_service.core.drop_ratio import SyncResult
from ratelimit_service.core.exact import ExactHit, ExactResult
from ratelimit_service.core.histogram import Histogram
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.tiers import (
    MILLI,
    TierReport,
    TierTotals,
    ZoneShare,
    ZoneTotals,
    reserved_part,
)
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.redis_store import RedisStore, _script

log = logging.getLogger(__name__)

MOST_COUNTERS = 10_000
"""Counters one aggregation pass reads from the zone store at most (the least
recently published first)."""
PUBLISH_BATCH = 256
"""Counters per call to the global store."""
PROBABILISTIC = "p\x1f"
"""Prefixes a probabilistic bucket's key in the global store, apart from an RLQS
counter of the same rule (each is limited on its own, as without zones)."""
PRESENCE = "\x1fzones"
"""A key every zone publishes to the global store at each pass, with or without
counters: its members are the live zones, so a zone knows how many share the fleet
(and a bucket new to it starts at the limit over that many) from its first pass on,
before any bucket is hot."""
RESERVE_PASSES = 2
"""For this many passes after a zone's bucket is created, its part leaves the even
parts of the zones that have not published the bucket yet (core.tiers.reserved_part):
long enough for every zone that has it to be heard, short for a bucket only one zone
has."""
FRESH_US = 10_000_000
"""A zone bucket created within this many microseconds is measured since its creation
at the first pass that sees it (before its first part, a zone's bucket refills at the
whole limit)."""
ZONE_FORGET_AFTER = 60.0
"""Seconds after which the global store no longer counts a zone that stopped
publishing. Longer than a replica's forget time: a zone cut off from the global store
goes on using its last part, and until then the other zones stay within theirs
instead of taking it over; a zone that is really gone frees its part after this."""


@dataclass(frozen=True, slots=True)
class ZoneBucket:
    """One probabilistic bucket as the aggregator reads it from the zone store."""

    store_key: str
    key: str
    offered: int
    """Hits offered to the zone's replicas, a monotonic count."""
    admitted: int
    """Hits they admitted, a monotonic count."""
    limit: int
    window_seconds: int
    forwarded: int
    """Of ``admitted``, what the aggregator already published to the global store."""
    created_us: int
    """When the zone's bucket was created (the store's clock, microseconds)."""


class ZoneRedisStore(RedisStore):
    """The zone store: a RedisStore whose RLQS publishes also keep an index of live
    counters, and which answers the aggregator's reads, writes and lease."""

    def __init__(self, url: str, zone: str, **options: Any) -> None:
        super().__init__(url, **options)
        if self.cluster:
            raise ValueError("a zone store must be one Redis (or Sentinel), not Cluster")
        self.zone = zone
        self.tier_index = f"{self.prefix}zone:{zone}:counters"
        self.fleet_index = f"{self.prefix}zone:{zone}:buckets"
        self.zones_key = f"{self.prefix}zone:{zone}:zones"
        self.lease_key = f"{self.prefix}zone:{zone}:aggregator"
        self._read = self._client.register_script(_script("zone_read.lua"))
        self._read_fleet = self._client.register_script(_script("zone_read_fleet.lua"))
        self._write = self._client.register_script(_script("zone_write.lua"))
        self._lease = self._client.register_script(_script("lease.lua"))

    async def zone_totals(self, forget_after: float) -> list[ZoneTotals]:
        """Every counter a replica of the zone published within ``forget_after``."""
        assert self.tier_index is not None
        args = [int(forget_after * 1_000_000), MOST_COUNTERS]
        raw = await self._call(self._read, [self.tier_index], args, self.sync_timeout)
        return [
            ZoneTotals(
                store_key=_text(raw[i]),
                key=_text(raw[i + 1]),
                demand=int(raw[i + 2]) / MILLI,
                instances=int(raw[i + 3]),
                limit=int(raw[i + 4]) / MILLI,
                window_seconds=int(raw[i + 5]) // 1_000_000,
                used=int(raw[i + 6]),
                forwarded=int(raw[i + 7]),
                window=int(raw[i + 8]),
            )
            for i in range(0, len(raw), 9)
        ]

    async def zone_buckets(self, forget_after: float) -> tuple[int, int, list[ZoneBucket]]:
        """The store's time (microseconds), the zone's live replicas, and every
        probabilistic bucket a replica of the zone synced within ``forget_after``."""
        assert self.fleet_index is not None
        keys = [self.fleet_index, self.prefix + "nodes"]
        args = [int(forget_after * 1_000_000), MOST_COUNTERS]
        raw = await self._call(self._read_fleet, keys, args, self.sync_timeout)
        buckets = [
            ZoneBucket(
                store_key=_text(raw[i]),
                key=_text(raw[i + 1]),
                offered=int(raw[i + 2]),
                admitted=int(raw[i + 3]),
                limit=int(raw[i + 4]),
                window_seconds=int(raw[i + 5]) // 1_000_000,
                forwarded=int(raw[i + 6]),
                created_us=int(raw[i + 7]),
            )
            for i in range(2, len(raw), 8)
        ]
        return int(raw[0]), int(raw[1]), buckets

    async def write_back(self, shares: Sequence[tuple[str, ZoneShare]], zones: int) -> None:
        """Write back each counter's zone part and the fleet's allowed hits, and the
        number of zones (with the first chunk)."""
        keep_ms = round(2 * ZONE_FORGET_AFTER * 1000)
        for start in range(0, max(1, len(shares)), PUBLISH_BATCH):
            chunk = shares[start : start + PUBLISH_BATCH]
            args: list[Any] = ["" if start else zones, keep_ms]
            for _, share in chunk:
                args += (share.part, share.global_used, share.window, share.forwarded)
            keys = [self.zones_key, *(key for key, _ in chunk)]
            await self._call(self._write, keys, args, self.sync_timeout)

    async def lease(self, holder: str, ttl: float) -> tuple[int, str]:
        """(2 taken now, 1 renewed, 0 held by another; the holder)."""
        args = [holder, max(1, round(ttl * 1000))]
        state, name = await self._call(self._lease, [self.lease_key], args, self.sync_timeout)
        return int(state), _text(name)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ZoneAggregator:
    """Runs on every replica of a zone; the one that holds the zone's lease publishes the
    zone's totals to the global store every ``interval`` and writes back its parts."""

    def __init__(
        self,
        zone_store: ZoneRedisStore,
        global_store: RedisStore,
        *,
        interval: float,
        forget_after: float,
        zone_forget_after: float = ZONE_FORGET_AFTER,
    ) -> None:
        self.zone_store = zone_store
        self.global_store = global_store
        self.zone = zone_store.zone
        self.interval = interval
        self.forget_after = forget_after
        """Seconds after which the zone's own replicas, counters and buckets are
        forgotten (as a replica forgets its Envoys)."""
        self.zone_forget_after = zone_forget_after
        self.holder = zone_store.node_id
        self.leading = False
        self.takeovers = 0
        """Times this replica took the zone's lease."""
        self.lease_lost = 0
        """Times it lost the lease (the zone store away, or another replica holds it)."""
        self.global_outages = 0
        self.global_recoveries = 0
        self.passes = 0
        self.counters = 0
        """Counters in the last pass."""
        self.global_errors = 0
        self.zone_errors = 0
        self.global_away = False
        self._steps = 0
        self._task: asyncio.Task[None] | None = None
        self._offered: dict[str, tuple[int, int]] = {}
        """Each probabilistic bucket's offered total and the store's time at the last
        pass (its demand is the rate between two passes)."""

    async def step(self) -> None:
        """Take or renew the lease; every other step, aggregate if this replica holds it."""
        try:
            state, holder = await self.zone_store.lease(self.holder, self.interval)
        except StoreUnavailable:
            self.zone_errors += 1
            self._lead(False, "the zone store is away")
            return
        if state == 2:
            self.takeovers += 1
        self._lead(state > 0, f"the lease is held by {holder}")
        self._steps += 1
        if self.leading and self._steps % 2 == 1:
            await self.aggregate()

    def _lead(self, leading: bool, why: str) -> None:
        if leading and not self.leading:
            log.info("zone %s: this replica aggregates the zone now", self.zone)
        elif self.leading and not leading:
            self.lease_lost += 1
            log.warning("zone %s: this replica no longer aggregates (%s)", self.zone, why)
        self.leading = leading

    async def aggregate(self) -> None:
        """One pass: the zone's sums to the global store, the zone's parts back (RLQS
        counters and probabilistic buckets alike: the zones are the global store's
        members for both)."""
        try:
            counters = await self.zone_store.zone_totals(self.forget_after)
            now_us, buckets = await self._bucket_reports()
        except StoreUnavailable:
            self.zone_errors += 1
            return
        reports = [self._report(t) for t in counters] + [report for report, _ in buckets]
        published = await self._publish([self._presence(), *reports])
        if published is None:
            return
        present, *answers = published
        zones = present.members  # every live zone, hot buckets or not
        shares = [
            (t.store_key, ZoneShare(round(a.part * MILLI), a.used, t.window, t.used))
            for t, a in zip(counters, answers[: len(counters)], strict=True)
        ]
        for (report, bucket), a in zip(buckets, answers[len(counters) :], strict=True):
            part = a.part
            if now_us - bucket.created_us <= RESERVE_PASSES * self.interval * 1e6:
                part = reserved_part(part, report.limit, a.members, zones)
            shares.append((bucket.store_key, ZoneShare(round(part * MILLI), 0, 0, bucket.admitted)))
        try:
            await self.zone_store.write_back(shares, zones)
        except StoreUnavailable:
            self.zone_errors += 1
            return
        self.passes += 1
        self.counters = len(counters) + len(buckets)

    async def _bucket_reports(self) -> tuple[int, list[tuple[TierReport, ZoneBucket]]]:
        """The zone store's time (microseconds) and the zone's probabilistic buckets as
        reports to the global store: demand is
        the rate of offered hits since the previous pass, or since its creation for a
        bucket created lately (else, seen first by an aggregator that just took over,
        it is only measured this pass and keeps its part meanwhile)."""
        now_us, replicas, buckets = await self.zone_store.zone_buckets(self.forget_after)
        reports = []
        seen: dict[str, tuple[int, int]] = {}
        for bucket in buckets:
            before = self._offered.get(bucket.store_key)
            seen[bucket.store_key] = (bucket.offered, now_us)
            if before is None and now_us - bucket.created_us <= FRESH_US:
                before = (0, bucket.created_us)  # a new bucket: its rate since creation
            if before is None or now_us <= before[1]:
                continue
            rate = max(0, bucket.offered - before[0]) * 1_000_000 / (now_us - before[1])
            report = TierReport(
                key=PROBABILISTIC + bucket.key,
                member=self.zone,
                demand=rate,
                instances=max(1, replicas),
                allowed=max(0, bucket.admitted - bucket.forwarded),
                window_seconds=bucket.window_seconds,
                limit=bucket.limit / bucket.window_seconds,
            )
            reports.append((report, bucket))
        self._offered = seen  # only the buckets still live: bounded by the index
        return now_us, reports

    async def _publish(self, reports: list[TierReport]) -> list[TierTotals] | None:
        """The zone's reports to the global store; None while it is away."""
        answers: list[TierTotals] = []
        try:
            for start in range(0, len(reports), PUBLISH_BATCH):
                answers += await self.global_store.publish(
                    reports[start : start + PUBLISH_BATCH], self.zone_forget_after
                )
        except StoreUnavailable as exc:
            self.global_errors += 1
            if not self.global_away:
                self.global_outages += 1
                log.warning(
                    "zone %s: the global store is away (%s); the zone keeps its last parts",
                    self.zone,
                    exc,
                )
            self.global_away = True
            return None
        if self.global_away:
            self.global_recoveries += 1
            log.info("zone %s: the global store answers again", self.zone)
            self.global_away = False
        return answers

    def _presence(self) -> TierReport:
        """This zone's entry in the global store's count of zones (no demand)."""
        return TierReport(PRESENCE, self.zone, 0.0, 1, 0, 1, 1.0)

    def _report(self, totals: ZoneTotals) -> TierReport:
        return TierReport(
            key=totals.key,
            member=self.zone,
            demand=totals.demand,
            instances=totals.instances,
            allowed=max(0, totals.used - totals.forwarded),
            window_seconds=totals.window_seconds,
            limit=totals.limit,
        )

    async def run(self) -> None:
        while True:
            try:
                await self.step()
            except Exception:  # keep the loop alive whatever one step does
                log.exception("zone %s: aggregation step failed", self.zone)
            await asyncio.sleep(self.interval / 2)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self.run(), name=f"zone-{self.zone}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def stats(self) -> dict[str, float]:
        return {
            "zone_aggregating": float(self.leading),
            "zone_takeovers": self.takeovers,
            "zone_lease_lost": self.lease_lost,
            "zone_global_outages": self.global_outages,
            "zone_global_recoveries": self.global_recoveries,
            "zone_passes": self.passes,
            "zone_counters": self.counters,
            "zone_global_errors": self.global_errors,
            "zone_store_errors": self.zone_errors,
            "zone_global_away": float(self.global_away),
        }


class ZonedStore:
    """The Store seam for a replica in a zone: RLQS and probabilistic rules on the zone
    store (with the zone's aggregator beside it), exact rules on the global store."""

    name = "zoned"

    def __init__(self, zone_store: ZoneRedisStore, global_store: RedisStore, interval: float,
                 forget_after: float) -> None:  # fmt: skip
        self.zone_store = zone_store
        self.global_store = global_store
        self.aggregator = ZoneAggregator(
            zone_store, global_store, interval=interval, forget_after=forget_after
        )

    def hit(
        self,
        hits: Sequence[ExactHit],
        commit: bool,
        owe: bool = False,
        deadline: float | None = None,
    ) -> Awaitable[list[ExactResult]]:
        return self.global_store.hit(hits, commit, owe, deadline)

    async def sync(self, reports: Sequence[BucketReport], interval: float) -> SyncResult:
        return await self.zone_store.sync(reports, interval)

    async def publish(self, reports: Sequence[TierReport], forget_after: float) -> list[TierTotals]:
        return await self.zone_store.publish(reports, forget_after)

    async def start(self) -> None:
        await asyncio.gather(self.zone_store.start(), self.global_store.start())
        self.aggregator.start()

    def sweep(self) -> int:
        return 0

    @property
    def wants_saturation(self) -> bool:
        return self.global_store.wants_saturation

    def loop_saturated(self, saturated: bool) -> None:
        self.global_store.loop_saturated(saturated)

    def healthy(self) -> bool:
        """The zone store answers: RLQS goes on (fail-static without the global one)."""
        return self.zone_store.healthy()

    def stats(self) -> dict[str, float]:
        zone = {f"zone_store_{k}": v for k, v in self.zone_store.stats().items()}
        return {**self.global_store.stats(), **zone, **self.aggregator.stats()}

    def histograms(self) -> dict[str, Histogram]:
        zone = {f"zone_{k}": v for k, v in self.zone_store.histograms().items()}
        return {**self.global_store.histograms(), **zone}

    async def close(self) -> None:
        await self.aggregator.stop()
        await asyncio.gather(self.zone_store.close(), self.global_store.close())
