"""The in-process store: the default when no Redis is configured.

It makes ``serve --config config/`` work on a laptop with no dependencies, and
its fleet is this one process. With several worker processes each would have its
own store, so the service must not run more than one process on it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from itertools import chain

from ratelimit_service.core.drop_ratio import (
    FleetView,
    SyncResult,
    capacity,
    refill,
    take,
    zone_limit,
)
from ratelimit_service.core.exact import ExactHit, ExactResult, evaluate
from ratelimit_service.core.histogram import Histogram
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.lru import LruMap
from ratelimit_service.core.tiers import (
    Fenced,
    TierReport,
    TierTable,
    TierTotals,
    publish_fenced,
)
from ratelimit_service.core.window import DEFAULT_SLICES, SlidingWindow


class _FleetBucket:
    """Fleet totals of one probabilistic bucket: its token bucket and offered count (the
    twin of fleet_sync.lua, held equal to it by tests/storage/test_fleet_sync_script.py)."""

    __slots__ = ("offered_total", "tokens", "touched", "window_seconds", "zone_part")

    def __init__(self, window_seconds: int, now: float) -> None:
        self.window_seconds = window_seconds
        self.tokens: float | None = None
        """None until the first report fills the bucket."""
        self.offered_total = 0
        self.touched = now
        self.zone_part: int | None = None
        """In a zone's store, the zone's part of the limit (thousandths of a hit per
        second) written by its aggregator; never set here (no zones in process)."""

    def update(self, report: BucketReport, now: float, zones: int | None = None) -> FleetView:
        """Refill since the last report at the limit the bucket refills at (the rule's;
        in a zone's store, see drop_ratio.zone_limit, with ``zones`` sharing the fleet),
        take the admitted hits, count the offered ones."""
        window = report.window_seconds
        full = capacity(report.limit, report.burst)
        limit, full = zone_limit(report.limit, full, self.zone_part, window * 1_000_000, zones)
        if self.tokens is None:
            refilled = full
        else:
            refilled = refill(self.tokens, now - self.touched, limit, window, burst=full)
        self.tokens = take(refilled, report.admitted, limit)
        self.offered_total += report.offered
        self.touched = now
        return FleetView(self.tokens, self.offered_total, limit)

    def idle(self, now: float) -> bool:
        """Safe to forget: no report for a whole window, so the bucket is full again."""
        return now - self.touched > self.window_seconds


class EmbeddedStore:
    name = "embedded"

    def __init__(
        self,
        *,
        max_keys: int = 100_000,
        slices: int = DEFAULT_SLICES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._slices = slices
        self._windows: LruMap[SlidingWindow] = LruMap(max_keys)
        self._fleet: LruMap[_FleetBucket] = LruMap(max_keys)
        self._tiers: LruMap[TierTable] = LruMap(max_keys)
        self.swept = 0

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

    def histograms(self) -> dict[str, Histogram]:
        return {}  # nothing is remote

    async def sync(self, reports: Sequence[BucketReport], interval: float) -> SyncResult:
        now = self._clock()
        views: list[FleetView] = []
        for report in reports:
            views.append(self._fleet_bucket(report, now).update(report, now))
        return SyncResult(nodes=1, views=views)

    async def publish(self, reports: Sequence[TierReport], forget_after: float) -> list[TierTotals]:
        now_us, forget_us = round(self._clock() * 1_000_000), round(forget_after * 1_000_000)
        tables = [self._tiers.get_or_create(report.key, TierTable) for report in reports]
        answers = publish_fenced(tables, reports, now_us, forget_us, None)
        assert not isinstance(answers, Fenced)  # no token, no fence
        return answers

    def sweep(self) -> Iterator[int]:
        """Forget state that no longer holds anything, a piece at a time (the clock is
        read per entry: calls run between pieces)."""
        clock = self._clock
        pieces = chain(
            self._windows.remove_if(lambda window: window.count(clock()) == 0),
            self._fleet.remove_if(lambda bucket: bucket.idle(clock())),
        )
        for removed in pieces:
            self.swept += removed
            yield removed

    async def start(self) -> None:
        """Nothing to connect to."""

    def healthy(self) -> bool:
        return True

    def stats(self) -> dict[str, float]:
        return {
            "exact_keys": len(self._windows),
            "fleet_keys": len(self._fleet),
            "evictions": self._windows.evictions + self._fleet.evictions,
            "swept": self.swept,
        }

    async def close(self) -> None:
        return None
