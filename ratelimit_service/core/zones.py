"""Zones (``serve --zone``): the zone aggregator's arithmetic and every zone type, pure
(no Redis, no asyncio; clocks are arguments). engine/zone_aggregator.py runs it,
storage/zoned.py talks to the stores.

The replicas of a zone publish their totals to the zone's store; one replica per zone,
elected by a lease there (:class:`Leadership`), is the zone's aggregator. Every interval
it reads the zone's sums (:class:`ZoneTotals` per RLQS counter, :class:`ZoneBucket` per
probabilistic bucket), publishes them to the global store as the zone (:meth:`ZonePass.plan`:
the zones are the global store's members, core/tiers.py), and writes back what came back
(:meth:`ZonePass.shares`: a :class:`ZoneShare` per counter and bucket, the zone's part of
the limit that its replicas then divide). The lease is renewed by its own work on the zone
store, apart from the pass (RENEW_SHARE), so a global store that hangs, answers late or is
cut off cannot make it lapse.

**Fencing.** A write can still arrive after its sender stopped (a process paused past
its lease, a request held in the network). Each time the lease changes hands the zone
store hands out a higher fencing token (lease.lua); the aggregator sends its token with
every write, to the global store (quota_tier.lua, per counter and zone) and to the zone
store (zone_write.lua), and both refuse a token lower than the highest they have seen for
the zone (:class:`~ratelimit_service.core.tiers.Fenced`). A refused aggregator stops
acting as one; its next renewal names the token it was refused against, so that a holder
whose zone store lost its counter (a restart) gets a token above it, and a deposed one
learns who holds the lease.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, IntEnum

from ratelimit_service.core.drop_ratio import FleetView, control
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.stretch import join_slot, steady_over
from ratelimit_service.core.tiers import MILLI, TierReport, TierTotals

ZONE_FORGET_AFTER = 60.0
"""Seconds after which the global store no longer counts a zone that stopped publishing:
longer than a replica's forget time, so the others stay within their parts while a zone
cut off goes on using its last one; a zone really gone frees its part after this."""
RESERVE_PASSES = 2
"""Passes after a zone's bucket is created during which :func:`reserved_part` applies:
long enough for every zone that has it to be heard, short for a bucket only one has."""
FRESH_US = 10_000_000
"""A zone bucket created within this many microseconds is measured since its creation at
the first pass that sees it (before its first part, it refills at the whole limit)."""
PROBABILISTIC = "p\x1f"
"""Prefixes a probabilistic bucket's key in the global store, apart from an RLQS
counter of the same rule (each is limited on its own, as without zones)."""
PRESENCE = "\x1fzones"
"""A key every zone publishes to the global store at each pass: its members are the live
zones, so a zone knows how many share the fleet (a bucket new to it starts at the limit
over that many) from its first pass on, before any bucket is hot."""

LEASE_TTL_SHARE = 1.0
"""The lease lives this many intervals: a dead aggregator's zone gets another within
about that long plus one renewal period."""
RENEW_SHARE = 0.25
"""Every replica asks for the lease every this many intervals (the holder renews it,
the others try to take it), each call bounded by as long: a holder keeps its term
through two failed renewals in a row (the third must answer within the margin)."""
MARGIN_SHARE = 0.125
"""Of an interval: how long before its lease could expire a holder stops acting as the
aggregator (covers a write sent at the last moment; a later one is fenced)."""
PASS_SHARE = 0.75
"""Of an interval: how long one pass may take at most (its store calls share it), so a
pass stuck on the global store ends before the next is due."""


@dataclass(frozen=True, slots=True)
class ZoneKeys:
    """A zone's keys in its store: the aggregator's indexes (kept by a RedisStore,
    storage/redis_store.py) and the lease."""

    counters: str
    """The index of live RLQS counters (a sorted set; quota_tier.lua keeps it)."""
    buckets: str
    """The index of live probabilistic buckets (a sorted set; fleet_sync.lua)."""
    zones: str
    """How many zones share the fleet (written by the aggregator, read by fleet_sync.lua)."""
    lease: str
    """The aggregator's lease (lease.lua)."""
    fence: str
    """The zone's fencing counter: tokens handed out by lease.lua, and the highest
    token a write has brought (zone_write.lua). It never expires."""

    @classmethod
    def of(cls, prefix: str, zone: str) -> ZoneKeys:
        base = f"{prefix}zone:{zone}:"
        return cls(*(base + name for name in ("counters", "buckets", "zones", "lease", "fence")))


def reserved_part(part: float, limit: float, members: int, zones: int) -> float:
    """A new bucket's part in one zone while only ``members`` of the ``zones`` have
    published it: at most the even parts of those heard. The zones not heard from yet
    refill their own new bucket at the limit over the zones meanwhile (zone_limit); the
    first zone heard would otherwise get the whole limit beside them."""
    if members >= zones or zones <= 0:
        return part
    return min(part, limit * members / zones)


@dataclass(frozen=True, slots=True)
class ZoneTotals:
    """One counter as a zone's aggregator reads it from the zone store (zone_read.lua)."""

    store_key: str
    """Its hash in the zone store."""
    key: str
    """The counter's key (the rule's bucket key)."""
    demand: float
    instances: int
    limit: float
    window_seconds: int
    used: int
    """The zone's allowed hits in the current window."""
    forwarded: int
    """Of those, what the aggregator already published to the global store."""
    window: int
    """The current window's index."""


@dataclass(frozen=True, slots=True)
class ZoneBucket:
    """One probabilistic bucket as the aggregator reads it from the zone store
    (zone_read_fleet.lua)."""

    store_key: str
    key: str
    offered: int
    """Hits offered to the zone's replicas, a monotonic count."""
    admitted: int
    """Hits they admitted, a monotonic count."""
    limit: int
    window_seconds: int
    forwarded: int
    """Of ``admitted``, what the aggregator already published to the global store."""
    created_us: int
    """When the zone's bucket was created (the store's clock, microseconds)."""
    ends_us: int | None = None
    """A calendar budget's: when its period ends (the store's clock, microseconds);
    None: a rolling bucket."""


@dataclass(frozen=True, slots=True)
class ZoneBuckets:
    """The aggregator's read of the zone's probabilistic buckets."""

    now_us: int
    """The zone store's time."""
    replicas: int
    """The zone's live replicas."""
    buckets: list[ZoneBucket]


@dataclass(frozen=True, slots=True)
class ZoneShare:
    """What a zone's aggregator writes back to one counter of the zone store."""

    part: int
    """The zone's part of the limit, thousandths of a hit per second."""
    global_used: int
    window: int
    forwarded: int
    allot: float | None = None
    """A calendar budget's bucket: the admitted total the zone may reach (see
    :meth:`ZonePass.allot`); None: left as it is."""


# -- the lease -------------------------------------------------------------------------


class LeaseState(IntEnum):
    """What lease.lua answered (its reply's first number)."""

    HELD_BY_ANOTHER = 0
    RENEWED = 1
    """The asker held it already: its time to live starts again."""
    TAKEN = 2
    """It was free (never held, or expired): the asker holds it now, with a new token."""


@dataclass(frozen=True, slots=True)
class Lease:
    """lease.lua's answer: the state, who holds the lease, and the holder's token."""

    state: LeaseState
    holder: str
    token: int


class Change(Enum):
    """How a replica's part in its zone changed."""

    NONE = "none"
    TOOK = "took"
    """It took the lease: it aggregates now."""
    RESUMED = "resumed"
    """It aggregates again under the lease it still held (after a lapse or a refusal)."""
    LOST = "lost"
    """Another replica holds the lease."""
    LAPSED = "lapsed"
    """It could not renew the lease in time."""
    FENCED = "fenced"
    """A store refused its write: a later token was seen for the zone."""


@dataclass(slots=True)
class Leadership:
    """Whether this replica acts as its zone's aggregator, on its own clock (seconds, monotonic). It
    does from a successful renewal (or take) until the time that call was sent plus ``ttl`` less
    ``margin``: the store started the lease's time to live no earlier than the call was sent, so the
    replica stops before the lease can expire there and another take it."""

    ttl: float
    margin: float
    token: int | None = None
    """The fencing token of the current term; None: not aggregating."""
    until: float = -math.inf
    """When the current term ends."""
    floor: int | None = None
    """A token this replica's write was refused against, sent with its next ask."""
    holder: str = ""
    """Who held the lease at the last answer."""
    acting: bool = False
    """Whether it counted itself as the aggregator at the last look (each transition is
    reported once)."""

    def leading(self, now: float) -> bool:
        return self.token is not None and now < self.until

    def term(self, now: float) -> int | None:
        """The token to write with now, or None when not aggregating."""
        return self.token if self.leading(now) else None

    def answered(self, lease: Lease, sent_at: float, now: float) -> Change:
        """The lease call sent at ``sent_at`` was answered at ``now`` with ``lease``."""
        self.holder = lease.holder
        if lease.state == LeaseState.HELD_BY_ANOTHER:
            self.token = None
            return self._look(now, Change.LOST)
        self.token, self.until = lease.token, sent_at + self.ttl - self.margin
        if self.floor is not None and lease.token > self.floor:
            self.floor = None
        change = self._look(now, Change.LAPSED)  # LAPSED: a reply later than its term
        if lease.state == LeaseState.TAKEN and self.acting:
            return Change.TOOK  # a new term (after its own lease had expired, too)
        return change

    def failed(self, now: float) -> Change:
        """A lease call failed or timed out: the term runs on until it ends."""
        return self._look(now, Change.LAPSED)

    def refused(self, token: int, highest: int, now: float) -> Change:
        """A write with ``token`` was refused: a store has seen ``highest`` for the zone.
        The term that wrote it ends (a late pass of an earlier term changes nothing)."""
        self.floor = max(self.floor or 0, highest)
        if token != self.token:
            return Change.NONE
        self.token = None
        return self._look(now, Change.FENCED)

    def _look(self, now: float, stopped: Change) -> Change:
        """``stopped`` if it was acting and is no longer; RESUMED if it was not and is
        (the caller tells a take apart); NONE otherwise."""
        leading = self.leading(now)
        was, self.acting = self.acting, leading
        if was and not leading:
            return stopped
        if leading and not was:
            return Change.RESUMED
        return Change.NONE


# -- the pass --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PassPlan:
    """One pass's reports to the global store, and what they were made from."""

    counters: list[ZoneTotals]
    buckets: list[tuple[TierReport, ZoneBucket]]
    """The probabilistic buckets measured this pass, each with its report."""
    now_us: int
    reports: list[TierReport]
    """The zone's presence, then one report per counter, then per bucket."""


@dataclass(slots=True)
class ZonePass:
    """The aggregator's arithmetic, pass after pass (:meth:`plan`, :meth:`shares`)."""

    zone: str
    interval: float
    offered: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Per bucket (its hash in the zone store): the offered total and the zone store's
    time (microseconds) at the last pass that read it."""
    answered: dict[str, tuple[TierReport, TierTotals, int]] = field(default_factory=dict)
    """Per report's key: its last publish the global store answered, the answer, and the
    passes it waited since (:meth:`going`)."""

    def plan(self, counters: Sequence[ZoneTotals], buckets: ZoneBuckets) -> PassPlan:
        measured = self._bucket_reports(buckets)
        reports = [self.presence(), *(self._report(t) for t in counters), *(r for r, _ in measured)]
        return PassPlan(list(counters), measured, buckets.now_us, reports)

    def going(self, plan: PassPlan, stretch: int) -> list[bool]:
        """Per report of ``plan``, whether it goes to the global store this pass: all but
        a counter or bucket steady well over its limit (core/stretch.py, steady_over),
        which goes every ``stretch`` passes, as a replica's publish to its zone does."""
        go = []
        for report in plan.reports:
            last = self.answered.get(report.key)
            go.append(
                stretch <= 1
                or last is None
                or last[2] + 1 >= stretch
                or not steady_over(report, last[0], last[1])
            )
        return go

    def joining(self, plan: PassPlan) -> set[int]:
        """The slots (core/stretch.py join_slot) of the reports of ``plan`` that go to the
        global store for the first time in this term (a counter or bucket new to the zone,
        or a new term): the global store may take this zone for a newcomer to them, with at
        least its even share."""
        return {join_slot(report.key) for report in plan.reports if report.key not in self.answered}

    def merge(
        self, plan: PassPlan, going: Sequence[bool], answers: Sequence[TierTotals]
    ) -> list[TierTotals]:
        """The global store's ``answers`` to the reports that went, with the last answer
        to each that waited, in the order of ``plan.reports``; kept for the next pass."""
        sent = iter(answers)
        merged = []
        kept: dict[str, tuple[TierReport, TierTotals, int]] = {}
        for report, went in zip(plan.reports, going, strict=True):
            if went:
                answer = next(sent)
                kept[report.key] = (report, answer, 0)
            else:
                last, answer, waited = self.answered[report.key]
                kept[report.key] = (last, answer, waited + 1)
            merged.append(answer)
        self.answered = kept  # only what this pass read: bounded by the zone's index
        return merged

    def shares(
        self,
        plan: PassPlan,
        answers: Sequence[TierTotals],
        budgets: Sequence[FleetView] | None = None,
        going: Sequence[bool] | None = None,
    ) -> tuple[list[tuple[str, ZoneShare]], int]:
        """Each counter's and bucket's share to write back (by its hash in the zone store),
        and the number of live zones. ``answers``: the global store's, in the order of
        ``plan.reports``; ``budgets``: its calendar budgets' fleet buckets, in the order
        of :meth:`calendar_reports` (None: not read this pass; allotments are kept);
        ``going``: which reports went (:meth:`going`; None: all). One that waited keeps
        its last part, and its allowed hits stay to forward."""
        zones = answers[0].members  # the presence key: every live zone, hot buckets or not
        rest, count = answers[1:], len(plan.counters)
        went = list(going[1:]) if going is not None else [True] * (len(answers) - 1)
        shares = [
            (t.store_key, ZoneShare(round(a.part * MILLI), a.used, t.window, t.used))
            if sent
            else (t.store_key, ZoneShare(round(a.part * MILLI), 0, t.window, t.forwarded))
            for t, a, sent in zip(plan.counters, rest[:count], went[:count], strict=True)
        ]
        fresh_us = RESERVE_PASSES * self.interval * 1e6
        views = iter(budgets) if budgets is not None else None
        buckets = zip(plan.buckets, rest[count:], went[count:], strict=True)
        for (report, bucket), a, sent in buckets:
            part = a.part
            if plan.now_us - bucket.created_us <= fresh_us:
                part = reserved_part(part, report.limit, a.members, zones)
            # A zone's admitted count falls when a replica gives back credit it paid in
            # advance and did not spend: what was forwarded stays forwarded (the count
            # rising to it again is not forwarded twice).
            forwarded = max(bucket.admitted, bucket.forwarded) if sent else bucket.forwarded
            allot = None
            if bucket.ends_us is not None:
                if views is not None:
                    allot = self.allot(report, bucket, a, next(views), zones)
                else:  # not folded into the global budget: forwarded at the next pass
                    forwarded = bucket.forwarded
            share = ZoneShare(round(part * MILLI), 0, 0, forwarded, allot)
            shares.append((bucket.store_key, share))
        return shares, zones

    def calendar_reports(self, plan: PassPlan) -> list[BucketReport]:
        """The zone's calendar budgets measured this pass, as a node's reports to the global
        store's fleet buckets (the zones are their nodes): the hits admitted since the last
        pass and the time to the period's end. No offered count: a zone's share of a budget
        goes by its demand, published with the pass (:meth:`allot`)."""
        return [
            BucketReport(
                bucket.key,
                bucket.limit,
                bucket.window_seconds,
                offered=0,
                admitted=report.allowed,
                ends_in=max(0, bucket.ends_us - plan.now_us) / 1e6,
            )
            for report, bucket in plan.buckets
            if bucket.ends_us is not None
        ]

    def allot(
        self, report: TierReport, bucket: ZoneBucket, fleet: TierTotals, budget: FleetView,
        zones: int,
    ) -> float:  # fmt: skip
        """A calendar budget's allotment to the zone until the next pass: the admitted total it may
        reach, what it admitted so far and its credit in the global fleet bucket (drop_ratio.control
        without refill, the zones as the nodes, by the zone's demand against the fleet's), so the
        allotments together stay within what the budget has left; the zone's replicas divide its own
        (fleet_sync.lua). A zone not heard yet may hold what a new bucket holds (the budget over the
        zones), unseen in the global bucket: that much is not allotted until it is heard."""
        unheard = max(0, zones - fleet.members)
        credit = control(
            limit=bucket.limit,
            window_seconds=bucket.window_seconds,
            tokens=budget.tokens - unheard * bucket.limit / zones,
            fleet_rate=fleet.demand,
            local_rate=report.demand,
            interval=self.interval,
            nodes=zones,
            refills=False,
        ).credit
        return bucket.admitted + credit

    def presence(self) -> TierReport:
        """This zone's entry in the global store's count of zones (no demand)."""
        return TierReport(PRESENCE, self.zone, 0.0, 1, 0, 1, 1.0)

    def _report(self, totals: ZoneTotals) -> TierReport:
        return TierReport(
            key=totals.key,
            member=self.zone,
            demand=totals.demand,
            instances=totals.instances,
            allowed=max(0, totals.used - totals.forwarded),
            window_seconds=totals.window_seconds,
            limit=totals.limit,
        )

    def _bucket_reports(self, read: ZoneBuckets) -> list[tuple[TierReport, ZoneBucket]]:
        """The zone's probabilistic buckets as reports to the global store: demand is the
        rate of offered hits since the previous pass, or since its creation for a bucket
        created lately (FRESH_US); others seen first are measured from this pass on."""
        now_us = read.now_us
        reports = []
        seen: dict[str, tuple[int, int]] = {}
        for bucket in read.buckets:
            before = self.offered.get(bucket.store_key)
            seen[bucket.store_key] = (bucket.offered, now_us)
            if before is None and now_us - bucket.created_us <= FRESH_US:
                before = (0, bucket.created_us)  # a new bucket: its rate since creation
            if before is None or now_us <= before[1]:
                continue
            rate = max(0, bucket.offered - before[0]) * 1_000_000 / (now_us - before[1])
            report = TierReport(
                key=PROBABILISTIC + bucket.key,
                member=self.zone,
                demand=rate,
                instances=max(1, read.replicas),
                allowed=max(0, bucket.admitted - bucket.forwarded),
                window_seconds=bucket.window_seconds,
                limit=bucket.limit / bucket.window_seconds,
            )
            reports.append((report, bucket))
        self.offered = seen  # only the buckets still live: bounded by the index
        return reports
