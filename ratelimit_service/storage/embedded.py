"""The in-process store, the default when no Redis is configured: its fleet is this one
process, so the service must not run more than one process on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from itertools import chain

from ratelimit_service.core.calendar import KEPT_AFTER_END
from ratelimit_service.core.drop_ratio import (
    FleetView,
    SyncResult,
    capacity,
    refill,
    take,
    zone_limit,
)
from ratelimit_service.core.exact import ExactHit, ExactResult, evaluate
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.lru import LruMap
from ratelimit_service.core.settings_table import default
from ratelimit_service.core.stretch import JOIN_SLOTS
from ratelimit_service.core.tiers import Fenced, TierReport, TierTable, TierTotals, publish_fenced
from ratelimit_service.core.window import DEFAULT_SLICES, SlidingWindow
from ratelimit_service.storage.base import StoreMetrics


class _FleetBucket:
    """Fleet totals of one probabilistic bucket: its token bucket and offered count (the
    twin of fleet_sync.lua, held equal to it by tests/storage/test_fleet_sync_script.py)."""

    __slots__ = (
        "admitted_total",
        "allot",
        "ends_at",
        "offered_total",
        "tokens",
        "touched",
        "window_seconds",
        "zone_part",
    )

    def __init__(self, window_seconds: int, now: float) -> None:
        self.window_seconds = window_seconds
        self.tokens: float | None = None
        """None until the first report fills the bucket."""
        self.offered_total = 0
        self.touched = now
        self.zone_part: int | None = None
        """In a zone's store, the zone's part of the limit (thousandths of a hit per
        second); never set here (no zones in process)."""
        self.ends_at: float | None = None
        """A calendar budget's: when its period ends (it is forgotten then)."""
        self.allot: float | None = None
        """A calendar budget's in a zone's store: the admitted total the zone may reach
        (fleet_sync.lua's 'T'); never set here."""
        self.admitted_total = 0
        """Hits admitted, a monotonic count (fleet_sync.lua's 'a', kept in a zone)."""

    def update(
        self, report: BucketReport, now: float, zones: int | None = None, zoned: bool = False
    ) -> FleetView:
        """Refill since the last report (at the rule's limit, or drop_ratio.zone_limit's
        with ``zones`` sharing the fleet; not for a calendar budget), take the admitted
        hits, count the offered ones. ``zoned``: as a zone's store keeps it (a calendar
        budget's tokens are then the zone's allotment less what it admitted)."""
        window = report.window_seconds
        full = capacity(report.limit, report.burst)
        limit, full = zone_limit(report.limit, full, self.zone_part, window * 1_000_000, zones)
        if self.tokens is None:
            refilled = full
            if report.ends_in is not None:
                self.ends_at = now + report.ends_in
        elif report.refills:
            refilled = refill(self.tokens, now - self.touched, limit, window, burst=full)
        else:
            refilled = self.tokens
        if zoned and not report.refills:
            if self.allot is None:
                self.allot = full
            refilled = self.allot - self.admitted_total
        self.tokens = take(refilled, report.admitted, limit)
        self.offered_total += report.offered
        self.admitted_total += report.admitted
        self.touched = now
        return FleetView(self.tokens, self.offered_total, limit)

    def idle(self, now: float) -> bool:
        """Safe to forget: no report for a whole window, so the bucket is full again; a
        calendar budget's once its period is over (KEPT_AFTER_END)."""
        if self.ends_at is not None:
            return now >= self.ends_at + KEPT_AFTER_END
        return now - self.touched > self.window_seconds


class EmbeddedStore:
    """Exact windows, fleet buckets and RLQS tables in this process's memory, each map
    bounded (least recently used out first). What holds nothing any more is forgotten
    one piece per sync, short enough to leave the loop to calls (core/lru.py)."""

    def __init__(
        self,
        *,
        max_keys: int = default("--max-buckets"),
        slices: int = DEFAULT_SLICES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._slices = slices
        self._windows: LruMap[SlidingWindow] = LruMap(max_keys)
        self._fleet: LruMap[_FleetBucket] = LruMap(max_keys)
        self._tiers: LruMap[TierTable] = LruMap(max_keys)
        self._joins = [0] * JOIN_SLOTS
        self.swept = 0
        self._sweep: Iterator[int] = iter(())

    def _window(self, key: str, window_seconds: int) -> SlidingWindow:
        return self._windows.get_or_create(
            f"{key}\x1f{window_seconds}", lambda: SlidingWindow(window_seconds, self._slices)
        )

    def _fleet_bucket(self, report: BucketReport, now: float) -> _FleetBucket:
        return self._fleet.get_or_create(
            f"{report.key}\x1f{report.window_seconds}",
            lambda: _FleetBucket(report.window_seconds, now),
        )

    async def hit(
        self,
        hits: Sequence[ExactHit],
        commit: int,
        owe: bool = False,
        deadline: float | None = None,
    ) -> list[ExactResult]:
        """``owe`` and ``deadline`` mean nothing here: this store never fails or waits."""
        now = self._clock()
        windows = [self._window(hit.key, hit.window_seconds) for hit in hits]
        return evaluate(hits, windows, now, commit)

    async def sync(self, reports: Sequence[BucketReport]) -> SyncResult:
        now = self._clock()
        views = [self._fleet_bucket(report, now).update(report, now) for report in reports]
        self._sweep_a_piece()
        return SyncResult(nodes=1, views=views)

    async def publish(self, reports: Sequence[TierReport], forget_after: float) -> list[TierTotals]:
        now_us, forget_us = round(self._clock() * 1_000_000), round(forget_after * 1_000_000)
        tables = [self._tiers.get_or_create(report.key, TierTable) for report in reports]
        answers = publish_fenced(tables, reports, now_us, forget_us, None)
        assert not isinstance(answers, Fenced)  # no token, no fence
        return answers

    async def joins(self, add: Sequence[int]) -> list[int]:
        """joins.lua's twin: the counts of members new to a counter per slot, one more in
        each slot of ``add`` (this process is the only member: nobody else reads them)."""
        for slot in add:
            if 0 <= slot < JOIN_SLOTS:  # another is kept by Redis and never read
                self._joins[slot] += 1
        return list(self._joins)

    def _sweep_a_piece(self) -> None:
        """Judge the next piece of the current pass over the maps (a new pass when the
        last one is done); the clock is read per entry."""
        removed = next(self._sweep, None)
        if removed is None:
            self._sweep = self._sweep_pass()
            removed = next(self._sweep, 0)
        self.swept += removed

    def _sweep_pass(self) -> Iterator[int]:
        """One pass: empty windows, then idle fleet buckets, a piece at a time."""
        clock = self._clock
        return chain(
            self._windows.remove_if(lambda window: window.count(clock()) == 0),
            self._fleet.remove_if(lambda bucket: bucket.idle(clock())),
        )

    async def start(self) -> None:
        """Nothing to connect to."""

    def healthy(self) -> bool:
        return True

    def metrics(self) -> StoreMetrics:
        figures = {
            "exact_keys": float(len(self._windows)),
            "fleet_keys": float(len(self._fleet)),
            "evictions": float(self._windows.evictions + self._fleet.evictions),
            "swept": float(self.swept),
        }
        return StoreMetrics("embedded", figures)  # nothing remote, no breaker

    async def close(self) -> None:
        """Nothing to close."""
