"""The status page's data (``/status.json``; the page itself is resources/status.html): one
read-only snapshot of what the engine already tracks, for a person at a browser.

- **Rules**: each stats key's calls per second over a recent interval, the share denied and the hits
  near the limit: engine/stats.py's counters less an earlier copy (:class:`Baselines`), so nothing
  new is counted on the request path.
- **Keys closest to their limit**: probabilistic buckets (the share of the fleet's token bucket in
  use, as last synced less what this process admitted since), RLQS counters (the fleet's allowed
  hits in the window; for a rule per second, the fleet's demand over the limit), and exact keys last
  seen near or over their limit within their window (Stats.near_keys: their counts live in the
  store).
- **State**: the store's figures (its circuit breakers), the reconciler, the zone's aggregator.
- **RLQS**: the Envoys that report here (demand, assigned share) and their counters.

Bounded: each table is its TOP rows by rate or closeness, with the total and how many more, so the
JSON stays under 64 KB at 10,000 stats keys and 1,000 RLQS Envoys. The snapshot is made off the
request path when a page asks, at most once per FRESH_FOR seconds (readers meanwhile share it), in
pieces that return to the event loop (engine/background.in_stretches), as /metrics is.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Generic, TypeVar

from ratelimit_service.core.config_model import RateLimit, RateLimitConfig, period_text
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.core.units import UNIT_SECONDS
from ratelimit_service.engine.background import result_in_stretches
from ratelimit_service.engine.counters import CATALOGUE, KEY_COUNTERS, Label
from ratelimit_service.engine.quota import CounterView, QuotaCoordinator
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.engine.state_metrics import readable_bucket
from ratelimit_service.engine.stats import SLICE, NearKey, Stats
from ratelimit_service.engine.zone_aggregator import ZoneAggregator
from ratelimit_service.storage.base import Store

TOP = 50
"""Rows per table at most (rules, keys, RLQS Envoys, RLQS counters)."""
RATE_WINDOW = 5.0
"""Rates are measured over the last RATE_WINDOW to twice that many seconds while the
page is polled (see Baselines); the first snapshot after a quiet spell has none."""
FRESH_FOR = 1.0
"""Seconds a snapshot is served again before a new one is made."""

_T = TypeVar("_T")
_Item = TypeVar("_Item")

Work = Generator[None, None, _T]
"""Work done in pieces: it yields None where it may return to the event loop."""
Json = dict[str, Any]
Counts = tuple[int, ...]
"""A stats key's counters with a status key (engine/counters.py), in the catalogue's order."""
_SHOWN = [(c.attr, c.status) for c in KEY_COUNTERS if c.status is not None]
_COUNTS = attrgetter(*(attr for attr, _ in _SHOWN))
_ROW_KEYS = [key for _, key in _SHOWN]
_HITS = [attr for attr, _ in _SHOWN].index("total_hits")
_DENIED = [attr for attr, _ in _SHOWN].index("over_limit")
NONE: Counts = (0,) * len(_SHOWN)
_SERVICE = [
    (c.attr, c.status, c.label is Label.DOMAIN)
    for c in CATALOGUE
    if c.status is not None and c.label is not Label.KEY
]
"""The service-wide counters /status.json shows: attribute, key, whether per domain."""


@dataclass(frozen=True, slots=True)
class StatusSources:
    """What the snapshot reads: the engine's state, never changed by it."""

    stats: Stats
    config: Callable[[], RateLimitConfig]
    local: LocalBuckets
    store: Store
    reconciler: Reconciler
    quota: QuotaCoordinator
    zone: ZoneAggregator | None = None


@dataclass(frozen=True, slots=True)
class Sample:
    """The counters at one time."""

    at: float
    counts: dict[str, Counts]
    requests: int


@dataclass(slots=True)
class Baselines:
    """Earlier samples of the counters to measure rates against: a sample is kept when the
    newest is RATE_WINDOW old, two at most, none older than twice that; after a quiet
    spell there is none. Memory: two copies of a few counters per (capped) stats key."""

    samples: list[Sample] = field(default_factory=list)

    def reference(self, now: float) -> Sample | None:
        self.samples = [s for s in self.samples if 0 < now - s.at <= 2 * RATE_WINDOW]
        return self.samples[0] if self.samples else None

    def keep(self, sample: Sample) -> None:
        if not self.samples or sample.at - self.samples[-1].at >= RATE_WINDOW:
            self.samples.append(sample)
            del self.samples[:-2]


class Top(Generic[_Item]):
    """The ``size`` items of highest rank offered, in a heap: bounded work and memory."""

    def __init__(self, size: int = TOP) -> None:
        self.size = size
        self.offered = 0
        self._heap: list[tuple[tuple[float, ...], int, _Item]] = []

    def wants(self, rank: tuple[float, ...]) -> bool:
        """Whether an item of ``rank`` would be kept (counted as offered): make it only then."""
        self.offered += 1
        return len(self._heap) < self.size or (rank, -self.offered) > self._heap[0][:2]

    def keep(self, rank: tuple[float, ...], item: _Item) -> None:
        """Keep an item :meth:`wants` just wanted."""
        entry = (rank, -self.offered, item)  # the first offered wins a tie; items never compared
        if len(self._heap) < self.size:
            heapq.heappush(self._heap, entry)
        else:
            heapq.heapreplace(self._heap, entry)

    def offer(self, rank: tuple[float, ...], item: _Item) -> None:
        if self.wants(rank):
            self.keep(rank, item)

    def best(self) -> list[_Item]:
        return [item for _, _, item in sorted(self._heap, key=lambda e: e[:2], reverse=True)]

    def table(self, rows: list[Json]) -> Json:
        """A table of ``rows`` (the best, made into rows) out of all those offered."""
        total = self.offered
        return {"total": total, "shown": len(rows), "more": max(0, total - len(rows)), "rows": rows}


class StatusBoard:
    """Makes the snapshot when asked, shares it for FRESH_FOR seconds, keeps the samples."""

    def __init__(
        self,
        sources: StatusSources,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.sources = sources
        self._clock = clock
        self._wall = wall
        self._baselines = Baselines()
        self._limits: tuple[RateLimitConfig, dict[str, RateLimit]] | None = None
        """The rules' limits by stats key, for the config they were read from."""
        self._last: tuple[float, bytes] | None = None
        self._making: asyncio.Future[bytes] | None = None

    async def json(self) -> bytes:
        """The snapshot as JSON: the last while fresh, else a new one (shared while made)."""
        last = self._last
        if last is not None and self._clock() - last[0] < FRESH_FOR:
            return last[1]
        making = self._making
        if making is None:
            making = self._making = asyncio.ensure_future(self._make())
        # Shielded: a reader that goes away does not cancel the others' snapshot.
        return await asyncio.shield(making)

    async def snapshot(self) -> Json:
        return dict(json.loads(await self.json()))

    async def _make(self) -> bytes:
        try:
            now, timing = self._clock(), _Timing()
            snapshot = await result_in_stretches(timing.timed(self._compose(now)))
            snapshot["took"] = {
                "seconds": _num(self._clock() - now, 4),
                "work_seconds": _num(timing.work, 4),
                "longest_piece_seconds": _num(timing.longest, 4),
                "pieces": timing.pieces,
            }
            body = json.dumps(snapshot, separators=(",", ":"), allow_nan=False).encode()
            self._last = (now, body)
            return body
        finally:
            self._making = None

    def _compose(self, now: float) -> Work[Json]:
        """The whole snapshot, in pieces."""
        src = self.sources
        reference = self._baselines.reference(now)
        interval = None if reference is None else now - reference.at
        limits = yield from self._limits_by_key(src.config())
        sample, rules = yield from _rules(src.stats, limits, reference, now, interval)
        self._baselines.keep(sample)
        views: list[CounterView] = []
        for view in src.quota.view():
            if view is None:
                yield None
            else:
                views.append(view)
        keys = yield from _closest_keys(src.local, src.stats.near_keys.items(), views, now)
        envoys = yield from _envoys(views)
        counters = yield from _counters(views)
        return {
            "generated_at": round(self._wall(), 3),
            "rate_interval_seconds": _num(interval, 3),
            "bounds": {"rows": TOP, "rate_window_seconds": RATE_WINDOW, "fresh_for": FRESH_FOR},
            "service": _service(src.stats, reference, sample, interval),
            "rules": rules,
            "keys": keys,
            "store": _store(src.store),
            "reconciler": _reconciler(src.reconciler, src.local, self._wall()),
            "zone": _zone(src.zone),
            "rlqs": {**_rlqs_totals(src.quota), "envoys": envoys, "counters": counters},
        }

    def _limits_by_key(self, config: RateLimitConfig) -> Work[dict[str, RateLimit]]:
        """Every rule's limit by its stats key (read again only when the rules change)."""
        if self._limits is not None and self._limits[0] is config:
            return self._limits[1]
        limits: dict[str, RateLimit] = {}
        for count, limit in enumerate(config.limits(), 1):
            limits.setdefault(limit.stats_key, limit)
            if count % SLICE == 0:
                yield None
        self._limits = (config, limits)
        return limits


@dataclass(slots=True)
class _Timing:
    """How long the pieces of some work held the loop, in the thread's CPU time: the work
    itself, not moments the core ran another process (the snapshot's wall time shows those)."""

    work: float = 0.0
    longest: float = 0.0
    pieces: int = 0

    def timed(self, work: Work[_T]) -> Work[_T]:
        clock = time.thread_time
        while True:
            started = clock()
            try:
                next(work)
            except StopIteration as done:
                result: _T = done.value
                return result
            finally:
                seconds = clock() - started
                self.work += seconds
                self.longest = max(self.longest, seconds)
                self.pieces += 1
            yield None


def _rules(
    stats: Stats,
    limits: dict[str, RateLimit],
    reference: Sample | None,
    now: float,
    interval: float | None,
) -> Work[tuple[Sample, Json]]:
    """Every stats key's counters sampled; the busiest TOP over the interval (else by hits)."""
    earlier = reference.counts if reference is not None else None
    counts: dict[str, Counts] = {}
    top: Top[tuple[str, Counts, Counts | None]] = Top()
    hits = over = 0
    for count, (key, rule) in enumerate(list(stats.rules.items()), 1):
        now_counts: Counts = _COUNTS(rule)
        counts[key] = now_counts
        if earlier is None:
            rank: tuple[float, ...] = (now_counts[_HITS],)
            delta = None
        else:
            delta = tuple([a - b for a, b in zip(now_counts, earlier.get(key, NONE), strict=True)])
            hits, over = hits + delta[_HITS], over + delta[_DENIED]
            rank = (delta[_HITS], now_counts[_HITS])
        top.offer(rank, (key, now_counts, delta))
        if count % SLICE == 0:
            yield None
    table = top.table([_rule_row(key, c, d, limits.get(key), interval) for key, c, d in top.best()])
    table["loaded"] = len(limits)
    table["rate"] = None if interval is None else _num(hits / interval)
    table["denied_share"] = None if interval is None else _share(over, hits)
    return Sample(now, counts, stats.total_requests), table


def _rule_row(
    key: str, counts: Counts, delta: Counts | None, limit: RateLimit | None, interval: float | None
) -> Json:
    row: Json = {
        "key": key,
        "limit": None if limit is None else limit_text(limit),
        "mode": None if limit is None else limit.mode.value,
        "shadow": limit is not None and limit.shadow_mode,
        "total_hits": counts[_HITS],
        "total_denied": counts[_DENIED],
        "rate": None,
        "denied_share": None,
        **dict.fromkeys(_ROW_KEYS),
    }
    if delta is not None and interval is not None:
        row.update(zip(_ROW_KEYS, delta, strict=True))
        row["rate"] = _num(delta[_HITS] / interval)
        row["denied_share"] = _share(delta[_DENIED], delta[_HITS])
    return row


def _closest_keys(
    local: LocalBuckets, near_keys: list[tuple[str, NearKey]], views: list[CounterView], now: float
) -> Work[Json]:
    """The TOP keys using the largest share of their limit: probabilistic buckets, exact keys
    last seen near or over it (Stats.near_keys: ``used`` as of that call), RLQS counters."""
    top: Top[Json] = Top()
    for count, bucket in enumerate(local.buckets(), 1):
        if bucket.capacity > 0:
            used = 1.0 - bucket.remaining() / bucket.capacity
            rank = (used, bucket.fleet_rate or 0.0)
            if top.wants(rank):
                text = f"{bucket.limit}/{_period(bucket.window_seconds)}"
                row = _key_row(bucket.key, bucket.rule, "probabilistic", rank, text)
                row["drop_ratio"] = _num(local.drop_ratio(bucket))
                top.keep(rank, row)
        if count % SLICE == 0:
            yield None
    for key, near in near_keys:
        if now - near.seen < near.window_seconds:  # its count has not drained away yet
            rank = (near.used / near.limit, 0.0)
            if top.wants(rank):
                text = f"{near.limit}/{_period(near.window_seconds)}"
                row = _key_row(key, near.rule, "exact", rank, text)
                row["rate"] = None  # counted in the store: no rate in the process
                top.keep(rank, row)
    for count, view in enumerate(views, 1):
        if count % SLICE == 0:
            yield None
        limit = view.limit
        if limit.requests_per_unit <= 0:
            continue
        demand = _fleet_demand(view)
        used = view.used if limit.window_seconds > 1 else demand  # a rule per second: its demand
        rank = (used / limit.requests_per_unit, demand)
        if top.wants(rank):
            top.keep(rank, _key_row(view.key, view.stats_key, "rlqs", rank, limit_text(limit)))
    return top.table(top.best())


def _key_row(key: str, rule: str, kind: str, rank: tuple[float, float], limit: str) -> Json:
    return {
        "key": readable_bucket(key),
        "rule": rule,
        "kind": kind,
        "used": _num(rank[0]),
        "rate": _num(rank[1]),
        "limit": limit,
        "drop_ratio": None,
    }


def _fleet_demand(view: CounterView) -> float:
    """Hits per second the fleet offers the counter: the store's sum, else this replica's."""
    if view.totals is not None:
        return view.totals.demand
    return sum(demand for _, demand, _, _ in view.instances if demand is not None)


def _envoys(views: list[CounterView]) -> Work[Json]:
    """The TOP RLQS Envoys reporting here by demand, with their counters, shares and buckets."""
    envoys: defaultdict[str, _Envoy] = defaultdict(_Envoy)
    for count, view in enumerate(views, 1):
        for name, demand, share, bucket in view.instances:
            envoys[name].add(view, demand, share, bucket)
        if count % SLICE == 0:
            yield None
    top: Top[tuple[str, _Envoy]] = Top()
    for count, (name, envoy) in enumerate(envoys.items(), 1):
        top.offer((-1.0 if envoy.demand is None else envoy.demand, envoy.counters), (name, envoy))
        if count % SLICE == 0:
            yield None
    return top.table([{"name": name, **envoy.row()} for name, envoy in top.best()])


@dataclass(slots=True)
class _Envoy:
    """An RLQS Envoy's counters, summed over those it reports here."""

    counters: int = 0
    demand: float | None = None
    """Hits per second it offers its counters (None: not measured yet)."""
    share: float = 0.0
    """Its shares of its counters' limits, per second: the division by demand."""
    assigned: float | None = None
    """Its token buckets per second: shares in whole tokens and seconds (None: blanket rules)."""
    busiest: tuple[float, CounterView, float | None] | None = None
    """Its busiest counter: (that demand, the counter, its share of it); set by the first add."""

    def add(
        self, view: CounterView, demand: float | None, share: float | None, bucket: float | None
    ) -> None:
        self.counters += 1
        if demand is not None:
            self.demand = (self.demand or 0.0) + demand
        if share is not None:
            self.share += share / view.limit.window_seconds
        if bucket is not None:
            self.assigned = (self.assigned or 0.0) + bucket
        if self.busiest is None or (demand or 0.0) > self.busiest[0]:
            self.busiest = (demand or 0.0, view, share)

    def row(self) -> Json:
        assert self.busiest is not None
        _, view, share = self.busiest
        return {
            "counters": self.counters,
            "demand": _num(self.demand),
            "share": _num(self.share),
            "assigned": _num(self.assigned),
            "busiest": readable_bucket(view.key),
            "busiest_share": _num(share),
            "busiest_limit": limit_text(view.limit),
        }


def _counters(views: list[CounterView]) -> Work[Json]:
    """The RLQS counters reported here, the TOP by the fleet's demand."""
    top: Top[CounterView] = Top()
    for count, view in enumerate(views, 1):
        if count % SLICE == 0:
            yield None
        top.offer((_fleet_demand(view), len(view.instances)), view)
    return top.table([_counter_row(view) for view in top.best()])


def _counter_row(view: CounterView) -> Json:
    totals = view.totals
    return {
        "key": readable_bucket(view.key),
        "rule": view.stats_key,
        "limit": limit_text(view.limit),
        "instances": len(view.instances),
        "fleet_instances": None if totals is None else totals.instances,
        "replicas": None if totals is None else totals.members,
        "part": _num(view.part),
        "demand": _num(_fleet_demand(view)),
        "used": view.used,
    }


_RLQS = ("streams", "reports", "assignments", "pushed", "abandons", "publishes")


def _rlqs_totals(quota: QuotaCoordinator) -> Json:
    return {
        **{name: getattr(quota, name) for name in _RLQS},
        "bucket_updates": quota.bucket_updates,
        "bucket_updates_per_second": _num(quota.last_updates / quota.interval),
        "store_errors": quota.store_errors,
    }


def _service(
    stats: Stats, reference: Sample | None, sample: Sample, interval: float | None
) -> Json:
    """The service-wide counters the catalogue shows (a per-domain one as its sum),
    the call rate over the interval, and the stats keys against their cap."""
    requests = sample.requests - (reference.requests if reference is not None else 0)
    service: Json = {"rate": None if interval is None else _num(requests / interval)}
    for attr, key, per_domain in _SERVICE:
        value = getattr(stats, attr)
        service[key] = sum(value.values()) if per_domain else value
    service["stats_keys"] = len(stats.rules)
    service["stats_keys_cap"] = stats.max_keys
    return service


_BREAKER = ("name", "open", "healthy", "errors", "outages", "recoveries")


def _store(store: Store) -> Json:
    metrics = store.metrics()
    return {
        "name": metrics.name,
        "healthy": store.healthy(),
        "breakers": [{name: getattr(b, name) for name in _BREAKER} for b in metrics.breakers],
        "figures": {name: _num(value) for name, value in sorted(metrics.figures.items())},
    }


def _reconciler(reconciler: Reconciler, local: LocalBuckets, wall: float) -> Json:
    last = local.last_sync_ok
    return {
        "rounds": reconciler.syncs,
        "errors": reconciler.errors,
        "failing": reconciler.failing,
        "last_round_seconds": _num(reconciler.last_duration, 4),
        "since_last_sync_seconds": None if last is None else _num(wall - last),
        "interval_seconds": reconciler.interval,
        "bucket_updates": reconciler.bucket_updates,
        "bucket_updates_per_second": _num(reconciler.last_updates / reconciler.interval),
        "buckets": len(local),
        "max_buckets": local.max_buckets,
        "evicted": local.evicted_overflow + local.evicted_idle,
        "nodes": local.nodes,
    }


def _zone(zone: ZoneAggregator | None) -> Json | None:
    if zone is None:
        return None
    figures = zone.stats()
    return {
        "zone": zone.zone,
        "aggregating": bool(figures.get("zone_aggregating")),
        "global_away": bool(figures.get("zone_global_away")),
        "figures": {name: _num(value) for name, value in sorted(figures.items())},
    }


def limit_text(limit: RateLimit) -> str:
    """``10/minute``, ``600/10 minutes``, ``unlimited``."""
    return "unlimited" if limit.unlimited else f"{limit.requests_per_unit}/{limit.period}"


LONGEST_FIRST = sorted(UNIT_SECONDS.items(), key=lambda item: -item[1])


def _period(seconds: int) -> str:
    """A window of ``seconds`` in words, as RateLimit.period says a rule's period: in
    the longest unit it is a whole number of (``minute``, ``10 minutes``)."""
    unit, length = next((u, n) for u, n in LONGEST_FIRST if seconds % n == 0)  # seconds at worst
    return period_text(unit, seconds // length)


def _share(part: int, whole: int) -> float | None:
    return None if whole <= 0 else _num(part / whole, 4)


def _num(value: float | None, digits: int = 3) -> float | None:
    """A figure for JSON: rounded, None when unknown or not finite."""
    return None if value is None or not math.isfinite(value) else round(value, digits)
