"""Exact hits admitted without Redis, kept until Redis can count them.

When Redis fails (no answer in time, connection lost, circuit open) an exact rule with
``failure_mode: open`` admits the request unchecked. Its hits must still land in the
window, or the window would hold fewer hits than were admitted and the next decisions
would admit beyond the limit again once Redis answers. So the batcher keeps each such
request here (its keys and its hits' ARGV part) and sends it with the next script call
as a forced hit (``commit`` 2 in exact_window.lua: counted whether it fits or not).
A call that timed out but whose reply comes later tells exactly which requests Redis
itself counted; only the others are kept.

Bounded: at most ``max_requests`` are kept (the oldest dropped first, counted), and
one is dropped unsent once its shortest window has passed: by then its hits would
count against a window they were never part of.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

MAX_OWED = 10_000
"""Requests kept at most (about 200 bytes each with one descriptor)."""


class OwedHits:
    def __init__(self, max_requests: int = MAX_OWED) -> None:
        self._owed: deque[tuple[tuple[str, ...], tuple[Any, ...], float]] = deque(
            maxlen=max_requests
        )
        self.added = 0
        self.sent = 0
        self.dropped = 0
        """Dropped unsent: past the bound, or older than their window."""

    def __len__(self) -> int:
        return len(self._owed)

    def add(self, keys: Sequence[str], args: Sequence[Any], since: float) -> None:
        """Keep one request's hits: ``args`` is its per-descriptor ARGV part (limit,
        window_us, hits, role per descriptor); ``since``: when it was admitted."""
        if len(self._owed) == self._owed.maxlen:
            self.dropped += 1
        self._owed.append((tuple(keys), tuple(args), since))
        self.added += 1

    def drain(self, now: float) -> list[tuple[tuple[str, ...], tuple[Any, ...], float]]:
        """Every request still worth sending (with when it was admitted), oldest
        first; none is kept."""
        ready = []
        for keys, args, since in self._owed:
            shortest = min(args[1::4]) / 1_000_000  # window_us of each descriptor
            if now - since < shortest:
                ready.append((keys, args, since))
            else:
                self.dropped += 1
        self._owed.clear()
        self.sent += len(ready)
        return ready
