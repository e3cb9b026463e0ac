"""A probabilistic bucket steady well over its limit waits between reports, paid in
advance (core/stretch.py prepaid_wait): a fleet of processes, each a LocalBuckets with
its reconciler, on one embedded store and an injected clock, their syncs staggered over
the interval as a real fleet's are. The fleet still holds the limit, its store is sent a
fraction of the reports, every hit admitted is charged, and a step is reported at once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ratelimit_service.core.drop_ratio import SyncResult
from ratelimit_service.core.local_buckets import BucketReport, LocalBuckets, ProbabilisticBucket
from ratelimit_service.core.stretch import STRETCH
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.embedded import EmbeddedStore

INTERVAL = 0.25
NODES = 16
LIMIT = 1600
"""Hits per second the fleet may admit."""
SLOTS = NODES
"""Each interval in as many slots: node i syncs at the start of slot i."""


class Clock:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


class FleetStore(EmbeddedStore):
    """The embedded store answering for a fleet of NODES processes (Redis counts them
    in its registry), keeping the reports it was sent and the hits they charged."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock=clock)
        self.reports = 0
        self.charged = 0
        self.down = False

    async def sync(self, reports: Sequence[BucketReport]) -> SyncResult:
        self.reports += len(reports)
        if self.down:
            raise StoreUnavailable("down")
        self.charged += sum(r.admitted for r in reports)
        result = await super().sync(reports)
        return SyncResult(nodes=NODES, views=result.views)


@dataclass
class Fleet:
    stretch: int
    late_every: int = 0
    """Every this many intervals one takes half an interval more on the clock: a busy
    machine's sync that came late (0: none)."""
    clock: Clock = field(default_factory=Clock)
    admitted: list[int] = field(default_factory=list)
    """Hits the fleet admitted, per interval."""

    def __post_init__(self) -> None:
        self.store = FleetStore(self.clock)
        self.nodes = [LocalBuckets(turn=i * 7919) for i in range(NODES)]
        self.reconcilers = [
            Reconciler(n, self.store, INTERVAL, clock=self.clock, stretch=self.stretch)
            for n in self.nodes
        ]
        self._owed = [0.0] * NODES

    async def run(self, seconds: float, rate: float) -> None:
        """``rate`` hits a second offered to the fleet, spread evenly over its nodes."""
        per_slot = rate / NODES * INTERVAL / SLOTS
        for number in range(round(seconds / INTERVAL)):
            late = self.late_every and number % self.late_every == 0
            step = INTERVAL / SLOTS * (1.5 if late else 1.0)
            admitted = 0
            for slot in range(SLOTS):
                await self.reconcilers[slot].sync_once()
                for i, node in enumerate(self.nodes):
                    self._owed[i] += per_slot
                    while self._owed[i] >= 1:
                        self._owed[i] -= 1
                        bucket = node.get("k", LIMIT, 1, self.clock.now)
                        admitted += node.decide(bucket, 1, bucket.next_draw())
                self.clock.now += step
            self.admitted.append(admitted)

    def buckets(self) -> list[ProbabilisticBucket]:
        """Each process's bucket of the key."""
        held = [node.peek("k") for node in self.nodes]
        assert all(b is not None for b in held)
        return [b for b in held if b is not None]

    def per_second(self, seconds: float) -> list[float]:
        """Admitted hits in each of the last ``seconds`` seconds."""
        per = round(1 / INTERVAL)
        tail = self.admitted[-round(seconds / INTERVAL) :]
        return [sum(tail[i : i + per]) for i in range(0, len(tail), per)]


async def test_a_fleet_over_its_limit_waits_paid_in_advance_and_holds_the_limit() -> None:
    """At twice the limit, the waits cut the reports to under two a second per node (of
    four), and the fleet admits the limit as a sync every interval does."""
    waiting, every = Fleet(STRETCH), Fleet(1)
    rates = []
    for fleet in (waiting, every):
        await fleet.run(8.0, 2 * LIMIT)  # settles, and the waits begin
        before = fleet.store.reports
        await fleet.run(20.0, 2 * LIMIT)
        rates.append((fleet.store.reports - before) / NODES / 20.0)
    assert rates[0] < 1.6 and rates[1] == 4.0, rates
    # Each process reads the fleet's tokens with what the waits paid and did not spend
    # added back: no debt (ratelimit_rule_overshoot_hits) where none was admitted.
    assert all(b.tokens >= 0 for b in waiting.buckets()), [b.tokens for b in waiting.buckets()]
    for fleet in (waiting, every):
        seconds = fleet.per_second(20.0)
        assert abs(sum(seconds) / (20 * LIMIT) - 1.0) <= 0.05, seconds
        assert max(seconds) <= 1.15 * LIMIT, seconds


async def test_as_the_waits_begin_the_fleet_stays_at_its_limit() -> None:
    """The payments in advance begin all at once over the fleet: the fleet's bucket is
    charged them early, and a process reading it adds back what the fleet's waits hold
    unspent (core/stretch.py prepaid_unspent), or the fleet would hold back as much.
    Every second from the third (the first two spend the full bucket) is within 10 % of
    the limit."""
    fleet = Fleet(STRETCH)
    await fleet.run(10.0, 2 * LIMIT)
    seconds = fleet.per_second(8.0)
    assert all(abs(s / LIMIT - 1) <= 0.10 for s in seconds), seconds


async def test_every_hit_admitted_is_charged_and_the_payments_in_advance_are_held() -> None:
    """What the store was charged is what the fleet admitted plus the payments it holds
    in advance, to the hit; once the waits end (a step down, reported at once) they
    are given back."""
    fleet = Fleet(STRETCH)
    await fleet.run(12.0, 2 * LIMIT)
    buckets = fleet.buckets()
    held = sum(b.prepaid for b in buckets)
    assert held > 0  # the fleet waits
    unreported = sum(b.admitted for b in buckets)
    assert fleet.store.charged == sum(fleet.admitted) - unreported + held
    await fleet.run(2.0, LIMIT / 4)  # a step down to a quarter: the waits end
    assert all(b.prepaid == 0 for b in buckets)
    unreported = sum(b.admitted for b in buckets)
    assert fleet.store.charged == sum(fleet.admitted) - unreported
    # Far below the limit now, every hit offered is admitted within a second.
    assert fleet.per_second(1.0) == [LIMIT // 4]


async def test_a_small_fleet_reports_every_interval() -> None:
    """Under PREPAID_NODES processes a bucket over its limit is reported every sync."""

    class Few(FleetStore):
        async def sync(self, reports: Sequence[BucketReport]) -> SyncResult:
            result = await super().sync(reports)
            return SyncResult(nodes=4, views=result.views)

    fleet = Fleet(STRETCH)
    fleet.store = Few(fleet.clock)
    for reconciler in fleet.reconcilers:
        reconciler.store = fleet.store
    await fleet.run(8.0, 2 * LIMIT)
    before = fleet.store.reports
    await fleet.run(4.0, 2 * LIMIT)
    assert fleet.store.reports - before == NODES * 16


async def test_with_the_store_away_every_node_reports_and_the_waits_start_again_after() -> None:
    """A report paying for a wait that the store never got pays for nothing: the node
    reports every sync while the store is away (as every bucket then does), and once
    it is back the fleet holds the limit and waits again."""
    fleet = Fleet(STRETCH)
    await fleet.run(10.0, 2 * LIMIT)
    fleet.store.down = True
    await fleet.run(INTERVAL, 2 * LIMIT)  # each node's sync finds the store away
    before = fleet.store.reports
    await fleet.run(1.0, 2 * LIMIT)
    assert fleet.store.reports - before == NODES * 4  # then every node, every sync
    buckets = fleet.buckets()
    assert all(b.due == 0 and b.paying == 0 for b in buckets)
    fleet.store.down = False
    await fleet.run(8.0, 2 * LIMIT)
    before = fleet.store.reports
    await fleet.run(10.0, 2 * LIMIT)
    assert (fleet.store.reports - before) / NODES / 10.0 < 1.6
    seconds = fleet.per_second(10.0)
    assert abs(sum(seconds) / (10 * LIMIT) - 1.0) <= 0.05, seconds


async def test_on_a_busy_machine_a_wait_still_lasts_its_syncs() -> None:
    """One interval in three half an interval late: a wait is counted in syncs, so it
    still spans STRETCH of them (counted in seconds, it would end a sync early)."""
    fleet = Fleet(STRETCH, late_every=3)
    await fleet.run(12.0, 2 * LIMIT)
    before = fleet.store.reports
    await fleet.run(10.0, 2 * LIMIT)
    per_sync = (fleet.store.reports - before) / NODES / (10.0 / INTERVAL)
    assert per_sync <= 1.1 / STRETCH, per_sync
