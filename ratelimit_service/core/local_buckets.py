"""Per-process state of probabilistic buckets: the request path's only data structure.

A decision is a dict lookup, one comparison against the cached drop ratio and one
against the bucket's credit: no I/O, no lock (the event loop is single-threaded),
no allocation for a known bucket. Counts accumulate here until the reconciler
takes them (:meth:`LocalBuckets.take_reports`) and hands back the fleet's view
(:meth:`LocalBuckets.apply`).

A sync costs the buckets used since the previous one, not those held: a bucket joins its
table's list for the sync period the first time it counts a hit in it, and idle buckets are
looked for from the least recently used end, a bounded number per sync.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass

from ratelimit_service.core.drop_ratio import (
    FleetView,
    SyncResult,
    capacity,
    carried_credit,
    control,
    fleet_estimate,
    initial_credit,
    node_share,
    smoothed_rate,
)
from ratelimit_service.core.settings_table import default
from ratelimit_service.core.stretch import (
    OVER,
    PREPAID_NODES,
    SETTLED,
    far_below,
    moved,
    prepaid_unspent,
    prepaid_wait,
    stepped_up,
)

IDLE_SECONDS = 30.0
"""How long a bucket no request used is kept (at least its window), so a process that
sees a key now and then keeps its fleet view and carried credit in between; dropped
sooner, a key spread over a large fleet would meet a fresh bucket (and its initial
credit) on each visit: about one hit per process per visit whatever its limit."""

MAX_IDLE_EXAMINED = 2000
"""Buckets looked at per sync for idleness, at most (a bounded pause); past that many
keys going idle per sync, the table's size bound evicts the least recently used."""

GOLDEN_RATIO = 0.6180339887498949
"""The fractional part of the golden ratio: the step of the buckets' draw sequences."""


def _ramp(bucket: ProbabilisticBucket) -> int:
    """The longest wait over its limit ``bucket``'s next report may pay for: 2 at its
    first, one interval more at each after (core/stretch.py prepaid_wait)."""
    return bucket.overs - SETTLED + 2


class SyncPeriod:
    """A table's current sync period: its number, and the buckets that counted hits in it."""

    __slots__ = ("number", "used")

    def __init__(self) -> None:
        self.number = 1
        self.used: list[ProbabilisticBucket] = []


def _mark_used(bucket: ProbabilisticBucket) -> None:
    """Put the bucket on its period's list, once per period (counts outside take())."""
    period = bucket.period
    if bucket.epoch != period.number:
        bucket.epoch = period.number
        period.used.append(bucket)


class ProbabilisticBucket:
    """One counter identity (descriptor values + window) in probabilistic mode."""

    __slots__ = (
        "admitted",
        "burst",
        "capacity",
        "credit",
        "due",
        "ends_at",
        "epoch",
        "fleet_rate",
        "grant",
        "key",
        "last_report",
        "last_used",
        "limit",
        "local_before",
        "local_rate",
        "offered",
        "offered_total_seen",
        "overs",
        "pace",
        "paying",
        "period",
        "phase",
        "pool",
        "prepaid",
        "ratio",
        "renewed",
        "rule",
        "synced_at",
        "tokens",
        "unspent",
        "window_seconds",
    )

    def __init__(
        self,
        key: str,
        limit: int,
        window_seconds: int,
        now: float,
        nodes: int,
        burst: int | None = None,
        period: SyncPeriod | None = None,
        ends_at: float | None = None,
    ) -> None:
        self.key = key
        self.rule = ""
        """Stats key of the rule that owns the bucket (for per-rule metrics)."""
        self.limit = limit
        self.window_seconds = window_seconds
        self.burst = burst
        """The rule's burst (None: the limit)."""
        self.capacity = capacity(limit, burst)
        """What the fleet bucket holds when full (kept: the request path reads it)."""
        self.ratio = 0.0
        self.credit = initial_credit(self.capacity, nodes)
        self.grant = self.credit
        """The credit of the last sync, renewed each interval while the store is away."""
        self.renewed = 0
        """The renewals (LocalBuckets.renewals) already granted to this bucket."""
        self.offered = 0
        self.admitted = 0
        self.offered_total_seen: int | None = None
        self.pace = 0.0
        """Its share of the limit's refill over an interval, at the last sync: what a wait
        over the limit pays in advance per interval (its stored tokens not included:
        the interval of the report spends those, as any sync does)."""
        self.unspent = 0.0
        """What the last sync added back to the fleet's tokens it read (LocalBuckets._unspent):
        ``tokens`` less this is the store's own figure."""
        self.overs = 0
        """Its reports in a row that found it well over its limit (LocalBuckets._prepay)."""
        self.due = 0
        """While it waits over its limit, its credit paid for in advance: the number of
        the sync period whose end reports it (core/stretch.py prepaid_wait; counted in
        syncs, not seconds, so a late sync does not end a wait early); 0: none."""
        self.prepaid = 0
        """Hits the fleet's bucket was charged in advance and not yet given back: the
        next report charges what was admitted less this (kept until its answer)."""
        self.paying = 0
        """Hits the report in flight pays in advance: credit once the store has them."""
        self.pool = 0.0
        """Of the credit paid in advance, what is still to be granted: a pace an interval
        (LocalBuckets._top_up), so that its admissions keep their pace over the wait as
        a sync every interval would have them."""
        self.fleet_rate: float | None = None
        self.local_rate: float | None = None
        self.local_before: float | None = None
        """The local rate one sync earlier (see :func:`fleet_estimate`)."""
        self.tokens = self.capacity
        self.synced_at = now
        self.last_report = now
        self.last_used = now
        self.phase = now % 1.0
        """Position in the bucket's draw sequence (see :meth:`next_draw`)."""
        self.period = period if period is not None else SyncPeriod()
        """Its table's sync period (a bucket made alone has one of its own)."""
        self.epoch = 0
        """The number of the last period it counted hits in."""
        self.ends_at = ends_at
        """A calendar budget's bucket (one per period): when its period ends, in epoch
        seconds. Its fleet bucket does not refill before then, nor is its credit renewed
        while the store is away (a renewal is a refill). None: a rolling bucket."""

    def next_draw(self) -> float:
        """The next number of this bucket's golden-ratio (Weyl) sequence, in [0, 1).

        Drawn against the drop ratio instead of independent random numbers: among any n
        consecutive decisions the share dropped is the ratio to within about 1/n (where
        independent draws scatter by sqrt(n)), over any regular subsequence too (every
        k-th request), so a client's share does not depend on when it sends."""
        phase = self.phase + GOLDEN_RATIO
        if phase >= 1.0:
            phase -= 1.0
        self.phase = phase
        return phase

    def take(self, hits: int, draw: float | None) -> bool:
        """Offer ``hits``; admit them or not. ``draw`` is uniform in [0, 1); None: the
        bucket's own sequence (:meth:`next_draw`). Hits of 0 are a check (a usage budget's,
        before its cost is reported): admitted while the fleet's bucket as last seen holds
        one more hit (:meth:`remaining`), not this process's credit (a check takes nothing,
        and a process that only checks is granted no share). Still reported at the next
        sync, so that its view stays fresh."""
        if draw is None:
            draw = self.next_draw()
        self.offered += hits
        period = self.period
        if self.epoch != period.number:  # first count this period: to be reported
            self.epoch = period.number
            period.used.append(self)
        if not hits:
            return self.remaining() >= 1
        if self.credit < hits or draw < self.ratio:
            return False
        self.credit -= hits
        self.admitted += hits
        return True

    def charge(self, hits: int) -> None:
        """Count ``hits`` that :meth:`take` did not admit: a cost, already spent, is
        counted whatever the answer (core/exact.py counts). The credit may go below 0:
        calls are denied until a sync grants more."""
        self.credit -= hits
        self.admitted += hits

    def remaining(self) -> int:
        """Best estimate of what the fleet may still admit now: the token bucket at the
        last sync, less what this process admitted since."""
        return max(0, int(self.tokens) - self.admitted)

    def used(self) -> int:
        """Hits the fleet has taken from the bucket as this process sees it."""
        return max(0, int(self.capacity) - self.remaining())

    def reset_estimate(self, now: float) -> float:
        """Seconds until the bucket would be full again with no more traffic: for a calendar budget,
        until its period ends (a budget of the next period starts full then)."""
        if self.ends_at is not None:
            return max(0.0, self.ends_at - now)
        missing = self.capacity - self.tokens + self.admitted
        if missing <= 0 or self.limit == 0:
            return 0.0
        left = missing * self.window_seconds / self.limit - (now - self.synced_at)
        return left if left > 0.0 else 0.0


@dataclass(frozen=True, slots=True)
class BucketReport:
    """This process's counts for one bucket since the previous sync."""

    key: str
    limit: int
    window_seconds: int
    offered: int
    admitted: int
    since: float = 0.0
    """Start of the period the counts cover."""
    burst: int | None = None
    """The rule's burst: what the fleet bucket holds when full (None: the limit)."""
    ends_in: float | None = None
    """A calendar budget's bucket: seconds from the report to its period's end (its fleet
    bucket starts full, never refills, and is gone after the end); None: a rolling one."""

    @property
    def refills(self) -> bool:
        """Whether the fleet bucket refills (a rolling bucket) or not (a calendar one)."""
        return self.ends_in is None


class LocalBuckets:
    """All probabilistic buckets of this process, bounded in number (least recently used
    buckets are evicted first) and in time (idle buckets are dropped at sync)."""

    def __init__(
        self,
        max_buckets: int = default("--max-buckets"),
        decay: float = 0.5,
        stale_after: float = default("--stale-after"),
        turn: int = 0,
    ) -> None:
        """``turn``: this process's offset among the turns of the reports that wait over
        their limits (core/stretch.py prepaid_wait); processes of a fleet draw theirs
        at random, so that their reports of a bucket spread over the intervals."""
        self.turn = turn
        self._stretch = 1
        """The reconciler's stretch when a wait over a limit was last paid for: the
        longest wait, which :meth:`_unspent` reckons the fleet's by."""
        self._buckets: OrderedDict[str, ProbabilisticBucket] = OrderedDict()
        self.stale_after = stale_after
        self.last_sync_ok: float | None = None
        """When the store last answered a sync (set when the reconciler starts); past
        ``stale_after`` rules fall back to their failure_mode instead of trusting ratios
        that no longer track the fleet. None: no reconciler, never stale."""
        self.max_buckets = max_buckets
        self.decay = decay
        self.nodes = 1
        self.evicted_overflow = 0
        self.evicted_idle = 0
        self._period = SyncPeriod()
        """The buckets that counted hits since the last sync; take_reports starts anew."""
        self.renewals = 0
        """How many times :meth:`renew` was called; a bucket catches up when next used."""

    def __len__(self) -> int:
        return len(self._buckets)

    def get(
        self,
        key: str,
        limit: int,
        window_seconds: int,
        now: float,
        rule: str = "",
        burst: int | None = None,
        ends_at: float | None = None,
    ) -> ProbabilisticBucket:
        """The bucket of ``key``, made if there is none; ``ends_at``: a calendar budget's
        period end (its key is the period's)."""
        bucket = self._buckets.get(key)
        if bucket is None or bucket.window_seconds != window_seconds:
            # New, or a reload changed the unit: counts of another window mean nothing.
            bucket = ProbabilisticBucket(
                key, limit, window_seconds, now, self.nodes, burst, self._period, ends_at
            )
            bucket.rule = rule
            bucket.renewed = self.renewals
            self._buckets[key] = bucket
            self._buckets.move_to_end(key)
            if len(self._buckets) > self.max_buckets:
                self._buckets.popitem(last=False)
                self.evicted_overflow += 1
        else:
            self._buckets.move_to_end(key)
            if bucket.renewed != self.renewals:
                self._catch_up(bucket)
            if (
                now - bucket.last_used > bucket.window_seconds
                and (bucket.ratio == 0.0 or self.nodes <= 1)
                and bucket.ends_at is None  # a calendar budget never refills
            ):
                # Unused here for a whole window, the fleet not dropping (or this process
                # alone): its bucket has refilled. A key the fleet was dropping keeps its
                # view until the next sync, or a key spread thin would get a fresh credit
                # on each visit to each process.
                bucket.credit = max(bucket.credit, initial_credit(bucket.capacity, self.nodes))
                bucket.ratio = 0.0
            if bucket.limit != limit or bucket.burst != burst:
                bucket.limit = limit  # a reload changed the limit; keep the counts
                bucket.burst = burst
                bucket.capacity = capacity(limit, burst)
        bucket.last_used = now
        return bucket

    def peek(self, key: str) -> ProbabilisticBucket | None:
        """The bucket of ``key`` if there is one, as it is: not created, not marked used."""
        return self._buckets.get(key)

    @staticmethod
    def decide(bucket: ProbabilisticBucket, hits: int, draw: float) -> bool:
        """Admit ``hits`` or not, against a given draw (see ProbabilisticBucket.take)."""
        return bucket.take(hits, draw)

    @staticmethod
    def fail(bucket: ProbabilisticBucket, hits: int, admit: bool) -> bool:
        """Decide by failure policy (store out of reach too long). Offered hits still count
        (the rate estimate needs them); admitted ones are not charged, or a long outage
        would come back as a debt that blocks the bucket after the store recovers."""
        bucket.offered += hits
        _mark_used(bucket)
        return admit

    def take_reports(self, now: float, interval: float, stretch: int = 1) -> list[BucketReport]:
        """Counts of every bucket used since the last sync (in order of use), but those
        that may wait (:meth:`can_wait`, up to ``stretch`` intervals between two reports;
        1: none waits); idle buckets are dropped."""
        period = self._period
        used, closed = period.used, period.number
        period.used = []
        period.number = closed + 1
        reports: list[BucketReport] = []
        buckets = self._buckets
        for bucket in used:
            if buckets.get(bucket.key) is not bucket:
                continue  # evicted since (its key may have a new bucket)
            if stretch > 1 and (
                self.can_wait(bucket, now, interval, stretch)
                or self.waits_over(bucket, closed, now, interval)
            ):
                self._top_up(bucket)
                bucket.epoch = period.number  # still to report: on the next period's list
                period.used.append(bucket)
                continue
            # At least one interval: a bucket born just before a sync would otherwise
            # show an absurd rate, and the fast-attack estimate would believe it.
            elapsed = max(now - bucket.last_report, interval)
            measured = bucket.offered / elapsed
            waits, paying = self._prepay(bucket, elapsed, stretch)
            bucket.due = closed + waits if waits > 1 else 0
            bucket.local_before = bucket.local_rate
            bucket.local_rate = smoothed_rate(bucket.local_rate, measured, self.decay)
            reports.append(
                BucketReport(
                    bucket.key,
                    bucket.limit,
                    bucket.window_seconds,
                    bucket.offered,
                    # What was admitted since the last report was paid for up to what
                    # that report paid in advance; this one pays for its own wait.
                    bucket.admitted - bucket.prepaid + paying,
                    bucket.last_report,
                    bucket.burst,
                    None if bucket.ends_at is None else max(0.0, bucket.ends_at - now),
                )
            )
            bucket.offered = 0
            bucket.admitted = 0
            bucket.paying = paying
            bucket.last_report = now
        self._drop_idle(now, closed)
        return reports

    def _prepay(self, bucket: ProbabilisticBucket, elapsed: float, stretch: int) -> tuple[int, int]:
        """How ``bucket`` waits after the report now taken (core/stretch.py
        prepaid_wait): only while the fleet, of :data:`PREPAID_NODES` processes or
        more, offers it well over its limit (:data:`OVER` times) and its bucket is
        at most half full by the store's figure, :data:`SETTLED` reports in a row; not a
        calendar budget (its admissions are counted as they are reported)."""
        if (
            stretch <= 1
            or bucket.ends_at is not None
            or bucket.fleet_rate is None
            or self.nodes < PREPAID_NODES
            or bucket.fleet_rate < OVER * bucket.limit / bucket.window_seconds
            or (bucket.tokens - bucket.unspent) * 2 > bucket.capacity
        ):
            bucket.overs = 0
            return 1, 0
        bucket.overs += 1
        if bucket.overs < SETTLED:
            return 1, 0
        rate = bucket.local_rate or 0.0
        # The bucket's offset among the turns, from its key: buckets' reports spread too.
        place = self._period.number + self.turn + zlib.crc32(bucket.key.encode())
        self._stretch = stretch
        return prepaid_wait(
            place, _ramp(bucket), bucket.pace, bucket.offered, rate, elapsed, stretch
        )

    @staticmethod
    def _top_up(bucket: ProbabilisticBucket) -> None:
        """An interval of a wait over the limit begins: a pace more of its credit paid in
        advance is granted (what a sync would have granted it, once steady)."""
        grant = min(bucket.pool, bucket.pace)
        bucket.credit += grant
        bucket.pool -= grant

    @staticmethod
    def waits_over(bucket: ProbabilisticBucket, closed: int, now: float, interval: float) -> bool:
        """Whether a bucket waiting over its limit (its credit paid in advance) goes on
        waiting as sync period ``closed`` ends: within its wait, and its offered rate
        where it was (a step either way is reported at once)."""
        if closed >= bucket.due:
            return False
        since = max(now - bucket.last_report, interval)
        return not moved(bucket.offered, bucket.local_rate or 0.0, since)

    def can_wait(
        self, bucket: ProbabilisticBucket, now: float, interval: float, stretch: int
    ) -> bool:
        """Whether a used bucket's report may wait for the next sync (core/stretch.py):
        the fleet far below its limit (not dropping, its bucket at least half full at the
        last sync), this node's credit not running low (half its grant left) nor its rate
        stepping up, and the next sync within ``stretch`` intervals of its last report.
        Not a calendar budget (each admission counts against the period's budget), nor a
        bucket never synced. Admissions stay within the credit granted; the others see
        this node's counts up to ``stretch`` intervals late, in a bucket whose tokens
        cover that."""
        if bucket.ends_at is not None or bucket.fleet_rate is None or bucket.ratio > 0.0:
            return False
        since = now - bucket.last_report
        if since + interval > stretch * interval * (1 + 1e-9):
            return False
        if not far_below(bucket.fleet_rate, bucket.limit / bucket.window_seconds):
            return False
        if bucket.tokens * 2 < bucket.capacity or self.credit(bucket) * 2 < bucket.grant:
            return False
        return not stepped_up(bucket.offered, bucket.local_rate or 0.0, max(since, interval))

    def _drop_idle(self, now: float, closed: int) -> None:
        """Drop idle buckets from the least recently used end, MAX_IDLE_EXAMINED at
        most. A bucket is idle when unused for its window (or past its calendar period)
        and IDLE_SECONDS, with nothing left to report; the walk ends at the first bucket
        used within IDLE_SECONDS (the rest were used later still)."""
        idle: list[str] = []
        for examined, (key, bucket) in enumerate(self._buckets.items()):
            if examined >= MAX_IDLE_EXAMINED or now - bucket.last_used <= IDLE_SECONDS:
                break
            if (
                bucket.epoch != closed  # just reported: kept until the next sync at least
                and bucket.offered == 0
                and bucket.admitted == 0
                and (
                    now - bucket.last_used > bucket.window_seconds
                    or (bucket.ends_at is not None and now >= bucket.ends_at)
                )
            ):
                idle.append(key)
        for key in idle:
            del self._buckets[key]
        self.evicted_idle += len(idle)

    def apply_all(
        self, reports: list[BucketReport], result: SyncResult, now: float, interval: float
    ) -> None:
        """Apply a whole sync: the node count, then each bucket's view."""
        self.nodes = max(1, result.nodes)
        for report, view in zip(reports, result.views, strict=True):
            self.apply(report.key, view, now, interval)

    def renew(self) -> None:
        """A sync failed: grant every bucket its last interval's credit again, so it keeps admitting
        at its last rate instead of running dry until the staleness bound switches to failure_mode.
        Granted when each bucket is next touched (:meth:`_catch_up`), at a cost that does not grow
        with the buckets held (renewals in between change nothing: ``max`` with an unchanged grant).
        Not to a calendar budget's bucket: its budget does not come back within the period, and
        every admission is charged once the store answers (:meth:`restore`)."""
        self.renewals += 1

    def credit(self, bucket: ProbabilisticBucket) -> float:
        """``bucket``'s credit, the renewals it has not been touched since included."""
        if bucket.renewed != self.renewals and bucket.ends_at is None:
            return max(bucket.credit, bucket.grant)
        return bucket.credit

    def drop_ratio(self, bucket: ProbabilisticBucket) -> float:
        """The share of calls ``bucket`` drops now: every call while it has no credit
        left, else its ratio (what metrics and the status page report)."""
        return 1.0 if self.credit(bucket) < 1 else bucket.ratio

    def _catch_up(self, bucket: ProbabilisticBucket) -> None:
        """Grant ``bucket`` the renewal(s) it missed since it was last touched."""
        bucket.credit = self.credit(bucket)
        bucket.renewed = self.renewals

    def forgive(self, reports: list[BucketReport]) -> None:
        """Drop the admitted counts gathered since ``reports`` were taken: they were made
        on renewed credit while the store was away, which is never charged. A calendar
        budget's bucket keeps them: it is never renewed, so they were granted."""
        for report in reports:
            bucket = self._buckets.get(report.key)
            if bucket is not None and bucket.ends_at is None:
                bucket.admitted = 0

    def restore(self, reports: list[BucketReport]) -> None:
        """Put back the offered counts of a sync that failed, so the next rate estimate
        sees them. Admitted counts are not: the buckets run on renewed credit meanwhile,
        and charging it all when the store returns would leave a debt that starves the
        bucket after the recovery. A calendar budget's are (it runs on no renewed credit:
        what it admitted was granted), and are charged at the next sync."""
        for report in reports:
            bucket = self._buckets.get(report.key)
            if bucket is not None:
                bucket.offered += report.offered
                bucket.paying = bucket.prepaid = 0  # the store took none of the report
                bucket.due = 0
                if bucket.ends_at is not None:
                    bucket.admitted += report.admitted
                # The next rate covers the whole period since the last good report: the
                # restored hits spread over an outage are not one interval's worth.
                bucket.last_report = min(bucket.last_report, report.since)
                _mark_used(bucket)

    def give_back(self, taken: list[tuple[ProbabilisticBucket, int]]) -> None:
        """Return the hits a request took (it was denied, or not decided); a bucket
        reported meanwhile reports the return at the next sync."""
        for bucket, hits in taken:
            if bucket.renewed != self.renewals:
                self._catch_up(bucket)
            bucket.credit += hits
            bucket.admitted -= hits
            _mark_used(bucket)

    def apply(self, key: str, view: FleetView, now: float, interval: float) -> None:
        """Set a bucket's ratio and credit from the fleet's totals."""
        if (bucket := self._buckets.get(key)) is None:
            return
        if bucket.renewed != self.renewals:
            self._catch_up(bucket)  # renewed before this sync's answer came
        if bucket.offered_total_seen is None:
            measured = bucket.local_rate or 0.0
        else:
            elapsed = max(now - bucket.synced_at, interval)
            measured = max(0, view.offered_total - bucket.offered_total_seen) / elapsed
        bucket.offered_total_seen = view.offered_total
        bucket.fleet_rate = smoothed_rate(bucket.fleet_rate, measured, self.decay)
        local_rate = bucket.local_rate or 0.0
        limit = bucket.limit if view.limit is None else view.limit
        fleet_rate = fleet_estimate(bucket.fleet_rate, local_rate, bucket.local_before)
        share = node_share(local_rate, fleet_rate, self.nodes)
        bucket.pace = limit * interval / bucket.window_seconds * share
        # As a sync every interval would read them (what waits paid is not yet admitted).
        bucket.unspent = self._unspent(bucket, limit, interval)
        tokens = view.tokens + bucket.unspent
        result = control(
            refills=bucket.ends_at is None,
            limit=limit,
            window_seconds=bucket.window_seconds,
            tokens=tokens,
            fleet_rate=fleet_rate,
            local_rate=local_rate,
            interval=interval,
            nodes=self.nodes,
            # A key this node sees now and then: its share of the refill since its last
            # sync of it (take_reports measures its rate over that span too). One that
            # waited over its limit was paid its wait's share in advance.
            span=interval if bucket.prepaid else now - bucket.synced_at,
        )
        bucket.ratio = result.ratio
        # Hits admitted while the sync was in flight are not in the view yet.
        granted = max(0.0, result.credit - bucket.admitted)
        bucket.credit = carried_credit(granted, bucket.credit, bucket.grant, self.nodes)
        # The intervals of its wait after this one, paid in advance: granted as they come.
        bucket.pool = bucket.prepaid = bucket.paying
        bucket.paying = 0
        bucket.grant = result.credit
        bucket.tokens = tokens
        bucket.synced_at = now

    def _unspent(self, bucket: ProbabilisticBucket, limit: float, interval: float) -> float:
        """What the fleet's waits over ``bucket``'s limit hold paid in advance and not yet
        spent, as this process reckons it when it pays for a wait of its own
        (core/stretch.py prepaid_unspent): the fleet's bucket was charged it early, so
        its tokens read that much lower than a sync every interval would leave them."""
        if not bucket.paying:
            return 0.0
        refill = limit * interval / bucket.window_seconds
        return prepaid_unspent(_ramp(bucket), self._stretch) * refill

    def stale(self, now: float) -> bool:
        return self.last_sync_ok is not None and now - self.last_sync_ok > self.stale_after

    def buckets(self) -> list[ProbabilisticBucket]:
        return list(self._buckets.values())
