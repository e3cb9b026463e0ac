"""The in-process store: the default when no Redis is configured.

It makes ``serve --config config/`` work on a laptop with no dependencies, and
its fleet is this one process, so probabilistic buckets converge on exact counts.
With several workers each would have its own store, which is why the service
refuses ``--workers > 1`` without Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ratelimit_service.core.drop_ratio import FleetView
from ratelimit_service.core.exact import ExactHit, ExactResult, evaluate
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.lru import LruMap
from ratelimit_service.core.window import DEFAULT_SLICES, SlidingWindow


class _FleetBucket:
    __slots__ = ("admitted", "offered_total", "touched", "window_seconds")

    def __init__(self, window_seconds: int, slices: int, now: float) -> None:
        self.admitted = SlidingWindow(window_seconds, slices)
        self.offered_total = 0
        self.touched = now
        self.window_seconds = window_seconds

    def idle(self, now: float) -> bool:
        """Safe to forget: nothing admitted in the window and no report for a window."""
        return self.admitted.count(now) == 0 and now - self.touched > self.window_seconds


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
        self.swept = 0

    def _window(self, key: str, window_seconds: int) -> SlidingWindow:
        return self._windows.get_or_create(
            f"{key}\x1f{window_seconds}", lambda: SlidingWindow(window_seconds, self._slices)
        )

    def _fleet_bucket(self, key: str, window_seconds: int, now: float) -> _FleetBucket:
        return self._fleet.get_or_create(
            f"{key}\x1f{window_seconds}", lambda: _FleetBucket(window_seconds, self._slices, now)
        )

    async def hit(self, hits: Sequence[ExactHit], commit: bool) -> list[ExactResult]:
        now = self._clock()
        windows = [self._window(hit.key, hit.window_seconds) for hit in hits]
        return evaluate(hits, windows, now, commit)

    async def sync(self, reports: Sequence[BucketReport], interval: float) -> list[FleetView]:
        now = self._clock()
        views: list[FleetView] = []
        for report in reports:
            bucket = self._fleet_bucket(report.key, report.window_seconds, now)
            bucket.touched = now
            bucket.admitted.add(now, report.admitted)
            bucket.offered_total += report.offered
            views.append(
                FleetView(
                    admitted_in_window=bucket.admitted.count(now),
                    expiring=bucket.admitted.expiring_within(now, interval),
                    offered_total=bucket.offered_total,
                    nodes=1,
                    reset_after=bucket.admitted.next_drop(now),
                )
            )
        return views

    def sweep(self) -> int:
        """Forget windows that hold no hits any more; called by the reconciler."""
        now = self._clock()
        removed = self._windows.remove_if(lambda window: window.count(now) == 0)
        removed += self._fleet.remove_if(lambda bucket: bucket.idle(now))
        self.swept += removed
        return removed

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
