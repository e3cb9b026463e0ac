"""Tiers: a member's part of a limit from totals, never from a list of every instance
(pure; engine/quota.py publishes, the stores keep the totals).

A *member* of a tier is what publishes to one store: a replica (its own Envoys' demand
summed) to the store its replicas share. Per counter it publishes its demand (hits per
second), its instances, the hits they allowed since its last publish, and the limit; the
store keeps one entry per member and running sums, and hands back the member's part
(:func:`fair_part`, grown only into what the others hold: :func:`capped_part`) and the
window's allowed hits fleet-wide (windows aligned to the epoch), in work that does not
grow with the fleet. Within a member, the part is divided among its instances max-min by
demand (core/shares.py).

**Zones** (``serve --zone``) stack the same arithmetic twice: a zone's replicas are the
members of the zone store; the zones, each published by one aggregator with the zone's
sums, are the members of the global store (core/zones.py). An aggregator writes with a
fencing token, so a deposed one's late write cannot overwrite its successor's
(:class:`Fenced`). See docs/design.md, "RLQS", and docs/scale.md.

Demands, limits and parts travel as integer thousandths of a hit per second, so the
running sums are exact and the arithmetic below gives the same numbers in Python and
in Lua (the same IEEE operations in the same order). :class:`TierTable` is the store's
side, the twin of ``resources/quota_tier.lua``, kept equal to it by a test on a set
clock; the embedded store holds its counters in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

MILLI = 1000
"""Rates travel and are summed as integer thousandths of a hit per second."""
EXPIRE_PER_CALL = 16
"""Members silent past the forget time that one publish removes at most (each member is removed
once, so the work per call stays bounded; a burst of departures is cleared over the next calls)."""


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
    limit: float
    """The rule's limit, hits per second."""


@dataclass(frozen=True, slots=True)
class TierTotals:
    """The store's answer for one counter."""

    part: float
    """This member's part of the limit, hits per second."""
    demand: float
    """Hits per second, every member's published demand (this one's included)."""
    instances: int
    members: int
    used: int
    """Hits allowed in the current fixed window, fleet-wide."""
    limit: float
    """The limit the members' parts divide, hits per second: the rule's, or in a zone's
    store the zone's part of it when lower."""


def member_demand(measured: list[float], unmeasured: int, even: float) -> float:
    """A member's demand per second: what its instances were measured to offer, and
    ``even`` (the limit over the fleet's instances) for each not measured yet."""
    return sum(measured) + unmeasured * even


def fair_part(limit: int, demand: int, instances: int, fleet_demand: int, everyone: int) -> float:
    """A member's fair part of ``limit`` (all rates in thousandths): fleet under the
    limit, its demand plus the spare by instances (room to grow until the next publish);
    over it, the limit by demand (every instance then sees the same drop ratio); no
    demand anywhere yet, by instances. ``everyone``: the fleet's instances, at least 1."""
    if fleet_demand <= 0:
        return limit * instances / everyone
    if fleet_demand <= limit:
        return demand + (limit - fleet_demand) * instances / everyone
    return limit * min(demand, fleet_demand) / fleet_demand


def capped_part(fair: float, room: int, even: float, first: bool) -> int:
    """The part handed out (thousandths): the fair one, grown only into ``room`` (the
    limit less the other members' parts, as last handed out), so members publishing at
    different moments do not hand out the limit twice over after a step in load. A
    member heard from for the first time gets at least ``even`` (its share by
    instances): not starved until the others next publish, for one even share over."""
    most = max(room, even) if first else max(room, 0)
    return math.floor(min(fair, most))


@dataclass(frozen=True, slots=True)
class Fenced:
    """A write refused: it carried a fencing token lower than one the store has seen
    from the same member (a deposed zone aggregator's). Nothing of the call was written."""

    highest: int
    """The highest token the store has seen from that member."""


@dataclass(slots=True)
class _Member:
    demand: int
    instances: int
    part: int
    seen: int
    """Microseconds."""


@dataclass(slots=True)
class TierTable:
    """One counter as a store keeps it: each member's last publish and part, running
    sums, and the current window's allowed hits."""

    members: dict[str, _Member] = field(default_factory=dict)
    demand: int = 0
    instances: int = 0
    parts: int = 0
    window: int | None = None
    used: int = 0
    zone_part: int | None = None
    """In a zone's store: the zone's part of the limit (thousandths), which the members' parts
    divide; written by the zone's aggregator (zone_write.lua, a ZoneShare), never in process."""
    global_used: int = 0
    global_window: int | None = None
    forwarded: int = 0
    """Of ``global_used`` (the fleet's allowed hits in ``global_window``), what came
    from this zone."""
    fences: dict[str, int] = field(default_factory=dict)
    """Per member that writes with a fencing token (a zone's aggregator, in the global
    store): the highest token seen. Kept when the member leaves the sums."""

    def refuses(self, member: str, token: int) -> int | None:
        """The highest token seen from ``member`` when ``token`` is lower, else None."""
        highest = self.fences.get(member)
        return highest if highest is not None and token < highest else None

    def publish(
        self, report: TierReport, now_us: int, forget_us: int, token: int | None = None
    ) -> TierTotals:
        """Record ``report`` at ``now_us`` (microseconds) and hand out the member's part;
        forget members silent longer than ``forget_us`` (at most EXPIRE_PER_CALL per
        call, oldest first). ``token``: the member's fencing token, recorded (the
        caller checked it first, see :func:`publish_fenced`)."""
        stale = sorted(
            (m.seen, name) for name, m in self.members.items() if m.seen < now_us - forget_us
        )
        for _, name in stale[:EXPIRE_PER_CALL]:
            self._leave(self.members.pop(name))
        if (old := self.members.pop(report.member, None)) is not None:
            self._leave(old)
        demand, limit = round(report.demand * MILLI), round(report.limit * MILLI)
        if self.zone_part is not None and self.zone_part < limit:
            limit = self.zone_part
        self.demand += demand
        self.instances += report.instances
        everyone = max(self.instances, report.instances, 1)
        fair = fair_part(limit, demand, report.instances, max(0, self.demand), everyone)
        even = limit * report.instances / everyone
        part = capped_part(fair, limit - self.parts, even, old is None)
        self.members[report.member] = _Member(demand, report.instances, part, now_us)
        if token is not None:
            self.fences[report.member] = token
        self.parts += part
        index = now_us // (report.window_seconds * 1_000_000)
        if index != self.window:
            self.window, self.used = index, 0
        self.used += report.allowed
        used = self.used
        if self.global_window == index:
            used = max(used, self.global_used + used - self.forwarded)
        return TierTotals(
            part=part / MILLI,
            demand=max(0, self.demand) / MILLI,
            instances=max(0, self.instances),
            members=len(self.members),
            used=used,
            limit=limit / MILLI,
        )

    def _leave(self, member: _Member) -> None:
        self.demand -= member.demand
        self.instances -= member.instances
        self.parts -= member.part


def publish_fenced(
    tables: Sequence[TierTable],
    reports: Sequence[TierReport],
    now_us: int,
    forget_us: int,
    token: int | None,
) -> list[TierTotals] | Fenced:
    """One call of quota_tier.lua: each report into its table (index-aligned). With a ``token``, the
    call is refused as a whole, before anything is written, when any of the tables has seen a higher
    token from the member (the highest of those is named)."""
    if token is not None:
        refusals = [
            highest
            for table, report in zip(tables, reports, strict=True)
            if (highest := table.refuses(report.member, token)) is not None
        ]
        if refusals:
            return Fenced(max(refusals))
    return [
        table.publish(report, now_us, forget_us, token)
        for table, report in zip(tables, reports, strict=True)
    ]
