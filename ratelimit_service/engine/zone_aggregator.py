"""The zone's aggregator (``serve --zone``): two loops on every replica of a zone, beside the server
on the same event loop.

- **The lease**, every RENEW_SHARE of the interval, each call bounded by as long: the holder renews
  the zone's lease in the zone store, the others try to take it. Nothing else runs in this loop, so
  a global store that hangs or is cut off cannot cost the zone its aggregator. A replica aggregates
  only while its :class:`~ratelimit_service.core.zones.Leadership` says so (its last renewal's send
  time plus the lease's TTL, less a margin, on this process's clock), so one that cannot renew stops
  before another can take the lease.
- **The pass**, every interval, on the holder only, bounded by PASS_SHARE of the interval: read the
  zone's sums, publish them to the global store as the zone, fold the zone's calendar budgets into
  the global store's, write back the zone's parts and allotments (core/zones.py ZonePass). Every
  write carries the term's fencing token; a store that has seen a later one refuses it, and this
  replica stops aggregating.

The global store away, the zone keeps its last parts (fail-static). Every transition is counted in
:meth:`ZoneAggregator.stats` (``ratelimit_store{store="zoned",name=...}``) and logged once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial

from ratelimit_service.core.drop_ratio import FleetView
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.stretch import STRETCH, join_slot, joins_moved
from ratelimit_service.core.tiers import Fenced, TierReport, TierTotals
from ratelimit_service.core.zones import (
    LEASE_TTL_SHARE,
    MARGIN_SHARE,
    PASS_SHARE,
    RENEW_SHARE,
    ZONE_FORGET_AFTER,
    Change,
    Leadership,
    PassPlan,
    ZonePass,
)
from ratelimit_service.engine.background import BackgroundTask, every
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.redis_store import RedisStore
from ratelimit_service.storage.zoned import ZoneRedisStore

log = logging.getLogger(__name__)


class ZoneAggregator:
    """Runs on every replica of a zone; the lease holder aggregates (the module docstring)."""

    def __init__(
        self,
        zone_store: ZoneRedisStore,
        global_store: RedisStore,
        *,
        interval: float,
        forget_after: float,
        zone_forget_after: float = ZONE_FORGET_AFTER,
        stretch: int = STRETCH,
        clock: Callable[[], float] | None = None,
    ) -> None:
        """``stretch``: passes a counter or bucket steady well over its limit may wait
        between two publishes to the global store (core/stretch.py; 1: none)."""
        self.zone_store = zone_store
        self.global_store = global_store
        self.zone = zone_store.zone
        self.interval = interval
        self.forget_after = forget_after
        """Seconds after which the zone's silent replicas, counters and buckets are forgotten."""
        self.zone_forget_after = zone_forget_after
        self.stretch = stretch
        self._joins: list[int] | None = None
        """The global store's counts of zones new to a counter, per slot, as last read
        (Store.joins, core/stretch.py join_slot)."""
        self._joined: set[int] = set()
        """Slots of the reports this zone sent for the first time, to add next pass."""
        self._term: int | None = None
        """The fencing token of the term whose passes filled ``arithmetic.answered``."""
        self.holder = zone_store.node_id
        self.ttl = LEASE_TTL_SHARE * interval
        self.renew_every = RENEW_SHARE * interval
        """Seconds between two lease calls, and the most one may take."""
        self.pass_timeout = PASS_SHARE * interval
        self.leadership = Leadership(self.ttl, MARGIN_SHARE * interval)
        self.arithmetic = ZonePass(self.zone, interval)
        self._clock = clock
        self.takeovers = 0
        """Times this replica took the zone's lease."""
        self.resumed = 0
        """Times it aggregated again under the lease it still held (after a lapse)."""
        self.lease_lost = 0
        """Times it stopped aggregating: the lease taken, lapsed, or a write refused."""
        self.lease_lapsed = 0
        """Of those, times it could not renew the lease in time."""
        self.fenced = 0
        """Writes refused: a store had seen a later fencing token for the zone."""
        self.abandoned = 0
        """Passes left before their write-back: the term ended meanwhile."""
        self.global_outages = 0
        self.global_recoveries = 0
        self.passes = 0
        self.counters = 0
        """Counters and buckets in the last pass."""
        self.bucket_updates = 0
        """Counters, buckets and presences sent to the global store (a monotonic count): a
        counter or bucket steady well over its limit goes every ``stretch`` passes."""
        self.global_errors = 0
        self.zone_errors = 0
        self.global_away = False
        zone = f"zone {self.zone}"
        lease = partial(every, self.renew_every, self.renew, f"{zone}: lease call")
        passes = partial(every, self.interval, self.aggregate, f"{zone}: aggregation pass")
        self._tasks = [
            BackgroundTask(f"zone-{self.zone}-lease", lease),
            BackgroundTask(f"zone-{self.zone}-pass", passes),
        ]

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()

    @property
    def leading(self) -> bool:
        """Whether this replica acts as the zone's aggregator now."""
        return self.leadership.leading(self._now())

    # -- the lease -------------------------------------------------------------------

    async def renew(self) -> None:
        """One lease call: renew (the holder) or try to take it (the others)."""
        sent_at = self._now()
        try:
            lease = await self.zone_store.lease(
                self.holder, self.ttl, self.leadership.floor, self.renew_every
            )
        except StoreUnavailable as exc:
            self.zone_errors += 1
            self._moved(self.leadership.failed(self._now()), f"could not renew its lease: {exc}")
            return
        change = self.leadership.answered(lease, sent_at, self._now())
        self._moved(change, f"the lease is held by {lease.holder}")

    def _moved(self, change: Change, why: str) -> None:
        """Count and log a transition once."""
        token = self.leadership.token
        if change == Change.TOOK:
            self.takeovers += 1
            log.info("zone %s: this replica aggregates the zone now (token %s)", self.zone, token)
        elif change == Change.RESUMED:
            self.resumed += 1
            log.info("zone %s: this replica aggregates the zone again (token %s)", self.zone, token)
        elif change in (Change.LOST, Change.LAPSED, Change.FENCED):
            self.lease_lost += 1
            self.lease_lapsed += change == Change.LAPSED
            self.global_away = False  # no longer this replica's to tell
            log.warning("zone %s: this replica no longer aggregates (%s)", self.zone, why)

    # -- the pass --------------------------------------------------------------------

    async def aggregate(self) -> None:
        """One pass, if this replica holds the lease: the zone's sums (RLQS counters and
        probabilistic buckets) to the global store, its parts back, within pass_timeout."""
        token = self.leadership.term(self._now())
        if token is None:
            return
        if token != self._term:  # a term of its own: nothing kept from an earlier one
            self._term, self._joins = token, None
            self.arithmetic.answered.clear()
        deadline = asyncio.get_running_loop().time() + self.pass_timeout
        try:
            counters = await self.zone_store.zone_totals(self.forget_after, deadline)
            buckets = await self.zone_store.zone_buckets(self.forget_after, deadline)
        except StoreUnavailable:
            self.zone_errors += 1
            return
        plan = self.arithmetic.plan(counters, buckets)
        if not self._still(token):
            return
        going, woken = await self._going(plan, deadline)
        joining = self.arithmetic.joining(plan)
        sent = [report for report, went in zip(plan.reports, going, strict=True) if went]
        self.bucket_updates += len(sent)
        answers = await self._publish(sent, token, deadline)
        if answers is None:
            return
        if isinstance(answers, Fenced):
            self._refused("global", token, answers.highest)
            return
        self._joined |= joining
        merged = self.arithmetic.merge(plan, going, answers)
        budgets = await self._fold(self.arithmetic.calendar_reports(plan), deadline)
        shares, zones = self.arithmetic.shares(plan, merged, budgets, going)
        if not self._still(token):
            return
        try:
            written = await self.zone_store.write_back(shares, zones, token, deadline)
        except StoreUnavailable:
            self.zone_errors += 1
            return
        if isinstance(written, Fenced):
            self._refused("zone", token, written.highest)
            return
        if woken:
            await self._wake(woken, deadline)
        self.passes += 1
        self.counters = len(plan.counters) + len(plan.buckets)

    async def _going(self, plan: PassPlan, deadline: float) -> tuple[list[bool], set[int]]:
        """Which reports go to the global store this pass (ZonePass.going), and the slots
        of the counters a join moved (their parts may shrink). When any would wait, or
        this zone was new to counters there last pass, one call adds those and reads the
        global store's counts of joins (Store.joins): the reports in slots another zone
        joined go."""
        going = self.arithmetic.going(plan, 1 if self.global_away else self.stretch)
        if all(going) and not self._joined:
            return going, set()
        added = sorted(self._joined)
        try:
            counts = await self.global_store.joins(added, deadline)
        except StoreUnavailable:  # added next pass; nothing waits meanwhile
            return [True] * len(going), set()
        self._joined.clear()
        seen, self._joins = self._joins, counts
        moved = joins_moved(seen, counts, added)
        slots = [join_slot(report.key) for report in plan.reports]
        wakes = [
            not went and (moved is None or slot in moved)
            for went, slot in zip(going, slots, strict=True)
        ]
        counters = slots[1 : 1 + len(plan.counters)]  # after the presence, before the buckets
        woken = {slot for slot in counters if moved is None or slot in moved}
        return [went or wake for went, wake in zip(going, wakes, strict=True)], woken

    async def _wake(self, slots: set[int], deadline: float) -> None:
        """Tell the zone store of joins in ``slots``: the zone's part of a counter in a
        slot a join moved may have shrunk, and the zone's replicas whose publishes of it
        wait publish in their next round."""
        try:
            await self.zone_store.joins(sorted(slots), deadline)
        except StoreUnavailable as exc:  # their waits end within their stretch
            self.zone_errors += 1
            log.debug("zone %s: could not tell the zone store of joins: %s", self.zone, exc)

    def _still(self, token: int) -> bool:
        """Whether the term that started this pass goes on (else the pass is left)."""
        if self.leadership.term(self._now()) == token:
            return True
        self.abandoned += 1
        return False

    def _refused(self, store: str, token: int, highest: int) -> None:
        self.fenced += 1
        change = self.leadership.refused(token, highest, self._now())
        why = f"the {store} store refused its write with token {token}: it has seen {highest}"
        if change == Change.NONE:  # a late write of a term already over
            log.info("zone %s: %s", self.zone, why)
        self._moved(change, why)

    async def _publish(
        self, reports: list[TierReport], token: int, deadline: float
    ) -> list[TierTotals] | Fenced | None:
        """The zone's reports to the global store; None while it is away."""
        try:
            answers = await self.global_store.publish_fenced(
                reports, self.zone_forget_after, token, deadline
            )
        except StoreUnavailable as exc:
            self.global_errors += 1
            if not self.global_away:
                self.global_outages += 1
                log.warning(
                    "zone %s: the global store is away (%s); the zone keeps its last parts",
                    self.zone,
                    exc,
                )
            self.global_away = True
            return None
        if self.global_away:
            self.global_recoveries += 1
            log.info("zone %s: the global store answers again", self.zone)
            self.global_away = False
        return answers

    async def _fold(self, reports: list[BucketReport], deadline: float) -> list[FleetView] | None:
        """The zone's calendar budgets folded into the global store's; None while it is away."""
        if not reports:
            return []
        try:
            return await self.global_store.fold(reports, deadline)
        except StoreUnavailable:
            self.global_errors += 1
            return None

    def start(self) -> None:
        for task in self._tasks:
            task.start()

    async def stop(self) -> None:
        for task in self._tasks:
            await task.stop()

    def stats(self) -> dict[str, float]:
        now = self._now()
        return {
            "zone_aggregating": float(self.leadership.leading(now)),
            "zone_token": float(self.leadership.term(now) or 0),
            "zone_takeovers": self.takeovers,
            "zone_resumed": self.resumed,
            "zone_lease_lost": self.lease_lost,
            "zone_lease_lapsed": self.lease_lapsed,
            "zone_fenced": self.fenced,
            "zone_passes_abandoned": self.abandoned,
            "zone_global_outages": self.global_outages,
            "zone_global_recoveries": self.global_recoveries,
            "zone_passes": self.passes,
            "zone_counters": self.counters,
            "zone_global_updates": self.bucket_updates,
            "zone_global_errors": self.global_errors,
            "zone_store_errors": self.zone_errors,
            "zone_global_away": float(self.global_away),
        }
