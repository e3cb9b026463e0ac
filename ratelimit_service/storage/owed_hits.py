"""Exact hits admitted without Redis, kept until Redis can count them.

When Redis fails, an exact rule with ``failure_mode: open`` admits the request
unchecked. Its hits must still land in the window, or the next decisions would admit
beyond the limit once Redis answers: the batcher keeps them here and, once Redis
answers, sends them as forced hits (``commit`` 2 in exact_window.lua), a batch at a time.
Requests with the same keys and limits are kept as one entry whose hits add up: an
outage costs work and memory by the keys it touched, not by its length. Bounded: at
most ``max_entries`` entries, and an entry's hits are dropped unsent (counted) once its
shortest window has passed since the first of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_OWED = 10_000
"""Distinct requests (keys and limits) kept at most."""

Owed = tuple[tuple[str, ...], tuple[Any, ...], float]
"""One entry to send: its keys, its ARGV part with the hits added up, and since when."""


@dataclass(slots=True, eq=False)
class _Entry:
    hits: list[int]
    shortest: float
    since: float


class OwedHits:
    def __init__(self, max_entries: int = MAX_OWED) -> None:
        self.max_entries = max_entries
        self._owed: dict[tuple[tuple[str, ...], tuple[Any, ...]], _Entry] = {}
        self.added = 0
        """Requests kept."""
        self.sent = 0
        """Entries handed out to be sent."""
        self.dropped = 0
        """Requests dropped unsent: past the bound, or older than their window."""

    def __len__(self) -> int:
        return len(self._owed)

    def add(self, keys: Sequence[str], args: Sequence[Any], since: float) -> None:
        """Keep one request's hits: ``args`` is its per-descriptor ARGV part (limit,
        window_us, hits, role per descriptor); ``since``: when it was admitted."""
        without_hits = list(args)
        without_hits[2::4] = [0] * (len(args) // 4)
        shape = (tuple(keys), tuple(without_hits))
        entry = self._owed.get(shape)
        if entry is None:
            if len(self._owed) >= self.max_entries:
                self.dropped += 1
                return
            shortest = min(args[1::4]) / 1_000_000  # window_us of each descriptor
            self._owed[shape] = _Entry(list(args[2::4]), shortest, since)
        else:
            if since - entry.since >= entry.shortest:  # the kept hits' window is over
                self.dropped += 1
                entry.hits = [0] * len(entry.hits)
                entry.since = since
            entry.hits = [kept + hits for kept, hits in zip(entry.hits, args[2::4], strict=True)]
            entry.since = min(entry.since, since)
        self.added += 1

    def take(self, descriptors: int, now: float) -> list[Owed]:
        """Entries worth sending (no longer kept), oldest first: ``descriptors`` at most, or one."""
        out: list[Owed] = []
        count = 0
        for shape in list(self._owed):
            keys, shaped = shape
            if out and count + len(keys) > descriptors:
                break
            entry = self._owed.pop(shape)
            if now - entry.since >= entry.shortest:
                self.dropped += 1
                continue
            args = list(shaped)
            args[2::4] = entry.hits
            out.append((keys, tuple(args), entry.since))
            count += len(keys)
        self.sent += len(out)
        return out
