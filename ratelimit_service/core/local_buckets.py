"""Per-process state of probabilistic buckets: the request path's only data structure.

A decision is a dict lookup, one comparison against the cached drop ratio and one
against the bucket's credit: no I/O, no lock (the event loop is single-threaded),
no allocation for a known bucket. Counts accumulate here until the reconciler
takes them with :meth:`LocalBuckets.take_reports` and hands back the fleet's view
with :meth:`LocalBuckets.apply`.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ratelimit_service.core.drop_ratio import FleetView, control, initial_credit, smoothed_rate


class ProbabilisticBucket:
    """One counter identity (descriptor values + window) in probabilistic mode."""

    __slots__ = (
        "admitted",
        "credit",
        "fleet_rate",
        "key",
        "last_report",
        "last_used",
        "limit",
        "local_rate",
        "offered",
        "offered_total_seen",
        "ratio",
        "reset_after",
        "synced_at",
        "window_count",
        "window_seconds",
    )

    def __init__(self, key: str, limit: int, window_seconds: int, now: float, nodes: int) -> None:
        self.key = key
        self.limit = limit
        self.window_seconds = window_seconds
        self.ratio = 0.0
        self.credit = initial_credit(limit, nodes)
        self.offered = 0
        self.admitted = 0
        self.offered_total_seen: int | None = None
        self.fleet_rate: float | None = None
        self.local_rate: float | None = None
        self.window_count = 0
        self.reset_after = 0.0
        self.synced_at = now
        self.last_report = now
        self.last_used = now

    def remaining(self) -> int:
        """Best estimate of what the window still allows: last fleet count plus local hits."""
        return max(0, self.limit - self.window_count - self.admitted)

    def reset_estimate(self, now: float) -> float:
        return max(0.0, self.reset_after - (now - self.synced_at))


@dataclass(frozen=True, slots=True)
class BucketReport:
    """This process's counts for one bucket since the previous sync."""

    key: str
    limit: int
    window_seconds: int
    offered: int
    admitted: int


class LocalBuckets:
    """All probabilistic buckets of this process, bounded in number (least recently used
    buckets are evicted first) and in time (idle buckets are dropped at sync)."""

    def __init__(self, max_buckets: int = 100_000, decay: float = 0.5) -> None:
        self._buckets: OrderedDict[str, ProbabilisticBucket] = OrderedDict()
        self.max_buckets = max_buckets
        self.decay = decay
        self.nodes = 1
        self.evicted_overflow = 0
        self.evicted_idle = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def get(self, key: str, limit: int, window_seconds: int, now: float) -> ProbabilisticBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = ProbabilisticBucket(key, limit, window_seconds, now, self.nodes)
            self._buckets[key] = bucket
            if len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
                self.evicted_overflow += 1
        else:
            self._buckets.move_to_end(key)
            if bucket.limit != limit:
                bucket.limit = limit  # a reload changed the limit; keep the counts
        bucket.last_used = now
        return bucket

    @staticmethod
    def decide(bucket: ProbabilisticBucket, hits: int, draw: float) -> bool:
        """Admit ``hits`` or not; ``draw`` is uniform in [0, 1). Hits of 0 only ask
        whether one more hit would be admitted."""
        bucket.offered += hits
        if bucket.credit < max(hits, 1) or draw < bucket.ratio:
            return False
        bucket.credit -= hits
        bucket.admitted += hits
        return True

    def take_reports(self, now: float, interval: float) -> list[BucketReport]:
        """Counts of every active bucket since the last sync; idle buckets are dropped."""
        reports: list[BucketReport] = []
        idle: list[str] = []
        for key, bucket in self._buckets.items():
            if bucket.offered == 0 and bucket.admitted == 0:
                if now - bucket.last_used > max(bucket.window_seconds, 10 * interval):
                    idle.append(key)
                continue
            elapsed = max(now - bucket.last_report, 1e-3)
            measured = bucket.offered / elapsed
            bucket.local_rate = smoothed_rate(bucket.local_rate, measured, self.decay)
            reports.append(
                BucketReport(
                    key, bucket.limit, bucket.window_seconds, bucket.offered, bucket.admitted
                )
            )
            bucket.offered = 0
            bucket.admitted = 0
            bucket.last_report = now
        for key in idle:
            del self._buckets[key]
        self.evicted_idle += len(idle)
        return reports

    def apply(self, key: str, view: FleetView, now: float, interval: float) -> None:
        """Set a bucket's ratio and credit from the fleet's totals."""
        bucket = self._buckets.get(key)
        if bucket is None:
            return
        self.nodes = max(1, view.nodes)
        if bucket.offered_total_seen is None:
            measured = bucket.local_rate or 0.0
        else:
            elapsed = max(now - bucket.synced_at, 1e-3)
            measured = max(0, view.offered_total - bucket.offered_total_seen) / elapsed
        bucket.offered_total_seen = view.offered_total
        bucket.fleet_rate = smoothed_rate(bucket.fleet_rate, measured, self.decay)
        local_rate = bucket.local_rate or 0.0
        result = control(
            limit=bucket.limit,
            view=view,
            fleet_rate=max(bucket.fleet_rate, local_rate),
            local_rate=local_rate,
            interval=interval,
        )
        bucket.ratio = result.ratio
        # Hits admitted while the sync was in flight are not in the view yet.
        bucket.credit = max(0.0, result.credit - bucket.admitted)
        bucket.window_count = view.admitted_in_window
        bucket.reset_after = view.reset_after
        bucket.synced_at = now

    def buckets(self) -> list[ProbabilisticBucket]:
        return list(self._buckets.values())
