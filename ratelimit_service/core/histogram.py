"""A histogram of durations as plain counts: observed on the request path at the cost
of a bisect and three additions, turned into a Prometheus family at scrape time."""

from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

LATENCY_BOUNDS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the buckets; one more bucket holds everything above. They
reach 10 s, so that a call held by a pause of the event loop shows where its caller saw
it; one sits at 20 ms, Envoy's ratelimit filter timeout (above it the caller gave up)."""


class Histogram:
    __slots__ = ("bounds", "buckets", "count", "sum")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BOUNDS) -> None:
        self.bounds = bounds
        self.buckets = [0] * (len(bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        """Count one duration in the first bucket whose bound is at least it."""
        self.buckets[bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, count at or below it) per bucket, the last bound infinite."""
        return list(zip((*self.bounds, float("inf")), accumulate(self.buckets), strict=True))
