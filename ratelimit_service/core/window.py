"""Sliding-window counting on a fixed number of slices.

A window of length ``T`` is cut into ``S`` slices of width ``w = T / S``. A hit at
time ``t`` is counted in slice ``floor(t / w)``; at time ``now`` the window holds the
slices ``cur - S .. cur`` where ``cur = floor(now / w)``. Those slices cover every
instant of ``(now - T, now]`` and at most ``w`` more, so if a hit is admitted only
while ``count + hits <= limit``, **no interval of length T ever holds more than the
limit** (there is no 2x burst at window edges as with fixed windows). The price is
being conservative by at most one slice: the effective window is between ``T`` and
``T + w`` (1.7 % longer with the default 60 slices).

Memory is bounded by ``S`` (slice index, count) pairs whatever the limit, unlike a
log of timestamps, which grows with the limit. The same arithmetic runs in the
Redis Lua script, so both stores agree.
"""

from __future__ import annotations

import math
from collections import deque

DEFAULT_SLICES = 60


class SlidingWindow:
    """Hit counts per slice, oldest first; only non-empty slices are stored."""

    __slots__ = ("_slices", "slice_count", "total", "width")

    def __init__(self, window_seconds: float, slice_count: int = DEFAULT_SLICES) -> None:
        if window_seconds <= 0 or slice_count <= 0:
            raise ValueError("window and slice count must be positive")
        self.width = window_seconds / slice_count
        self.slice_count = slice_count
        self._slices: deque[list[int]] = deque()
        self.total = 0

    def _index(self, now: float) -> int:
        return math.floor(now / self.width)

    def _expire(self, now: float) -> None:
        oldest_kept = self._index(now) - self.slice_count
        slices = self._slices
        while slices and slices[0][0] < oldest_kept:
            self.total -= slices.popleft()[1]

    def count(self, now: float) -> int:
        """Hits in the window ending at ``now``."""
        self._expire(now)
        return self.total

    def add(self, now: float, hits: int) -> None:
        if hits <= 0:
            return
        self._expire(now)
        index = self._index(now)
        slices = self._slices
        if slices and slices[-1][0] >= index:
            slices[-1][1] += hits  # clock went backwards or same slice: never reorder
        else:
            slices.append([index, hits])
        self.total += hits

    def next_drop(self, now: float) -> float:
        """Seconds until the count next goes down (the oldest slice leaves); 0 if empty."""
        self._expire(now)
        if not self._slices:
            return 0.0
        return self._leave_time(now, self._slices[0][0])

    def wait_for_room(self, now: float, hits: int, limit: int) -> float:
        """Seconds until ``hits`` more would fit under ``limit``; 0 if they fit now. When
        they never can (``hits > limit``): until the window is empty, the best there is."""
        self._expire(now)
        excess = self.total + hits - limit
        if excess <= 0:
            return 0.0
        freed = 0
        for index, count in self._slices:
            freed += count
            if freed >= excess:
                return self._leave_time(now, index)
        return self._leave_time(now, self._slices[-1][0]) if self._slices else 0.0

    def _leave_time(self, now: float, index: int) -> float:
        """Seconds until slice ``index`` is no longer part of the window."""
        return max(0.0, (index + self.slice_count + 1) * self.width - now)

    def __len__(self) -> int:
        return len(self._slices)
