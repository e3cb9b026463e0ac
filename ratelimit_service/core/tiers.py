"""Tiers: a member's part of a limit from totals, never from a list of every instance
(pure; engine/quota.py publishes, the stores keep the totals).

A *member* of a tier is what publishes to one store: a replica (its own Envoys'
demand summed) to the store its replicas share. Each member publishes, per counter,
its demand (hits per second), how many instances stand behind it and the hits they
allowed since its last publish; the store keeps one entry per member and running
sums, so what it returns is four numbers whatever the size of the fleet:

* the fleet's demand and instance count (sums over live members),
* the number of live members,
* the hits allowed in the current fixed window (windows aligned to the epoch).

A member's part of the limit (:func:`tier_part`): its demand when the fleet asks for
less than the limit, plus the spare spread by instance count (every instance keeps
room to grow until the next publish); the limit in proportion to demand when the
fleet asks for more (every member's instances then see the same drop ratio, as in
the design's global drop ratio). Within a member, the part is divided among its own
instances max-min by demand (core/shares.py).

:class:`TierTable` is the store's side: the arithmetic of
``resources/quota_tier.lua``, kept equal to it by a test on a set clock; the
embedded store holds its counters in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MILLI = 1000
"""Demands travel and are summed as integer thousandths of a hit per second, so the
store's running sums are exact (no float drift however many publishes)."""
EXPIRE_PER_CALL = 16
"""Members silent past the forget time that one publish removes at most (each
member is removed once, so the work per call stays bounded; a burst of departures
is cleared over the next calls)."""


@dataclass(frozen=True, slots=True)
class TierReport:
    """What one member publishes for one counter."""

    key: str
    """The rule's bucket key (its values and window)."""
    member: str
    demand: float
    """Hits per second its instances offer (instances with no measured demand yet
    counted at an even share, see member_demand)."""
    instances: int
    allowed: int
    """Hits its instances allowed since its previous publish."""
    window_seconds: int


@dataclass(frozen=True, slots=True)
class TierTotals:
    """The store's answer for one counter: sums over its live members."""

    demand: float
    """Hits per second, every member's published demand (this one's included)."""
    instances: int
    members: int
    used: int
    """Hits allowed in the current fixed window, fleet-wide."""


def member_demand(measured: list[float], unmeasured: int, even: float) -> float:
    """A member's demand per second: what its instances were measured to offer, and
    ``even`` (the limit over the fleet's instances) for each not measured yet."""
    return sum(measured) + unmeasured * even


def tier_part(limit: float, demand: float, instances: int, totals: TierTotals) -> float:
    """This member's part of ``limit`` (same unit as the demands: hits per second).

    Fleet under the limit: its demand, plus the spare in proportion to its instances.
    Fleet over it: the limit in proportion to its demand. No demand anywhere yet: in
    proportion to its instances."""
    everyone = max(totals.instances, instances, 1)
    if totals.demand <= 0.0:
        return limit * instances / everyone
    if totals.demand <= limit:
        return demand + (limit - totals.demand) * instances / everyone
    return limit * min(demand, totals.demand) / totals.demand


@dataclass(slots=True)
class _Member:
    demand: int
    """Thousandths of a hit per second."""
    instances: int
    seen: int
    """Microseconds."""


@dataclass(slots=True)
class TierTable:
    """One counter as a store keeps it: each member's last publish, running sums, and
    the current window's allowed hits (the twin of ``quota_tier.lua``)."""

    members: dict[str, _Member] = field(default_factory=dict)
    demand: int = 0
    instances: int = 0
    window: int | None = None
    used: int = 0

    def publish(self, report: TierReport, now_us: int, forget_us: int) -> TierTotals:
        """Record ``report`` at ``now_us`` (microseconds); forget members silent longer
        than ``forget_us`` (at most EXPIRE_PER_CALL per call, oldest first)."""
        stale = sorted(
            (m.seen, name) for name, m in self.members.items() if m.seen < now_us - forget_us
        )
        for _, name in stale[:EXPIRE_PER_CALL]:
            gone = self.members.pop(name)
            self.demand -= gone.demand
            self.instances -= gone.instances
        demand = round(report.demand * MILLI)
        old = self.members.get(report.member)
        if old is not None:
            self.demand -= old.demand
            self.instances -= old.instances
        self.members[report.member] = _Member(demand, report.instances, now_us)
        self.demand += demand
        self.instances += report.instances
        index = now_us // (report.window_seconds * 1_000_000)
        if index != self.window:
            self.window, self.used = index, 0
        self.used += report.allowed
        return TierTotals(
            demand=max(0, self.demand) / MILLI,
            instances=max(0, self.instances),
            members=len(self.members),
            used=self.used,
        )

    def idle(self, now_us: int, forget_us: int) -> bool:
        """Every member silent past the forget time (the counter can go)."""
        return all(m.seen < now_us - forget_us for m in self.members.values())
