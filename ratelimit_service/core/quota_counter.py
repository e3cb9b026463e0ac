"""RLQS: one counter's share bookkeeping on one replica (pure: engine/quota.py keeps a
:class:`QuotaCounter` per counter reported to it and feeds it reports and publishes).

The replica holds a part of the counter's limit (core/tiers.py) and divides it among
the Envoy instances that report the counter (core/shares.py). Each instance holds the
share last assigned to it until its next report, so a new share may only take what the
others do not hold now (:meth:`QuotaCounter.room`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from ratelimit_service.core.matching import Match
from ratelimit_service.core.shares import Split, TokenBucket, counted_share, water_level
from ratelimit_service.core.stretch import steady_over
from ratelimit_service.core.tiers import TierReport, TierTotals


@dataclass(slots=True)
class Seen:
    """One instance's own view of one counter (its reports to this replica)."""

    last_report: float
    demand: float | None = None
    """Hits per second it offered over its last measured report; None: not yet."""
    idle: int = 0
    bucket: Mapping[str, str] | None = None
    """The bucket id the instance last reported for the counter (what a pushed assignment names)."""
    sent: TokenBucket | None = None
    """The token bucket the instance holds (None: none yet, or a blanket rule)."""
    saved: float | None = None
    """What its bucket holds, as core.shares.stored counts it (None: no bucket yet)."""
    lost: float = 0.0
    """What it lost to its full bucket over its last report (core.shares.stored)."""
    saved_at: float = 0.0
    """When ``saved`` was counted (the coordinator's clock)."""


@dataclass(slots=True)
class QuotaCounter:
    """One counter (a rule's bucket key) on this replica: the instances that report it
    here, their shares, and the replica's part of the limit."""

    key: str
    match: Match
    seen: dict[str, Seen] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)
    """The share last assigned to each instance, in hits per window."""
    counts: dict[str, float] = field(default_factory=dict)
    """What each instance's share counts for in the others' room (counted_share)."""
    held: float = 0.0
    """The sum of ``counts``: what the instances hold of the part."""
    part: float | None = None
    """This replica's part of the limit, hits per window; None until first published."""
    split: Split = field(default_factory=lambda: Split(math.inf, 0.0))
    """The part divided among ``seen`` by demand (recomputed at each publish)."""
    totals: TierTotals | None = None
    used: int = 0
    """The fleet's allowed hits in the current window: the store's count at the last
    publish and this replica's since."""
    window: int = -1
    unpublished: int = 0
    """Allowed hits reported here since the last publish."""
    published: TierReport | None = None
    """The last publish the store answered."""
    waited: int = 0
    """Publish rounds it waited since (see :meth:`can_wait`)."""

    @property
    def window_seconds(self) -> int:
        return self.match.limit.window_seconds

    def can_wait(self, report: TierReport, stretch: int) -> bool:
        """Whether this round's publish of ``report`` may wait (core/stretch.py,
        steady_over), up to ``stretch`` rounds between two publishes."""
        totals, last = self.totals, self.published
        if stretch <= 1 or self.waited + 1 >= stretch or totals is None or last is None:
            return False
        return steady_over(report, last, totals)

    def asked(self, seen: Seen, even: float) -> float:
        """What an instance asks for, in hits per window (``even`` while unmeasured)."""
        return even if seen.demand is None else seen.demand * self.window_seconds

    def even(self) -> float:
        return (self.part or 0.0) / max(1, len(self.seen))

    def assign(self, name: str, share: float, even: float) -> None:
        """Record ``name``'s new share and what it counts for in the others' room."""
        seen = self.seen.get(name)
        counted = counted_share(share, None if seen is None else seen.demand, even)
        self.held += counted - self.counts.get(name, 0.0)
        self.shares[name], self.counts[name] = share, counted

    def room(self, name: str) -> float:
        """What ``name`` may hold: the part less what the others hold now."""
        return (self.part or 0.0) - (self.held - self.counts.get(name, 0.0))

    def resplit(self) -> None:
        """Divide the part among the instances again (their demands changed)."""
        part, even = self.part or 0.0, self.even()
        self.split = water_level(part, {n: self.asked(s, even) for n, s in self.seen.items()})
        self.held = 0.0
        for name, share in list(self.shares.items()):
            self.counts.pop(name, None)
            self.assign(name, share, even)

    def remove(self, name: str) -> None:
        self.seen.pop(name, None)
        self.shares.pop(name, None)
        self.held -= self.counts.pop(name, 0.0)
