"""Reports that wait (core/stretch.py): a probabilistic bucket far below its limit is
sent to the store every few syncs instead of every one; near its limit, on a step up,
or with the store away, every sync. The reconciler on the embedded store and an
injected clock."""

from __future__ import annotations

from collections.abc import Sequence

from ratelimit_service.core.drop_ratio import SyncResult
from ratelimit_service.core.local_buckets import BucketReport, LocalBuckets
from ratelimit_service.core.stretch import STRETCH
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.embedded import EmbeddedStore

INTERVAL = 0.25
LIMIT = 1000
"""Hits per second of the probabilistic bucket."""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingStore(EmbeddedStore):
    """The embedded store, keeping the keys each sync reported and the hits reported
    admitted; failing while ``down``."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock=clock)
        self.rounds: list[list[str]] = []
        self.admitted = 0
        self.down = False

    async def sync(self, reports: Sequence[BucketReport]) -> SyncResult:
        self.rounds.append([r.key for r in reports])
        if self.down:
            raise StoreUnavailable("down")
        self.admitted += sum(r.admitted for r in reports)
        return await super().sync(reports)


async def _sync_rounds(
    rates: Sequence[float], stretch: int = STRETCH, down: Sequence[int] = ()
) -> tuple[list[int], int, int]:
    """One bucket offered ``rates[i]`` hits a second in round i, a sync after each round.
    Returns the rounds that reported it, the hits admitted and the hits reported admitted."""
    clock = Clock()
    store, local = CountingStore(clock), LocalBuckets()
    reconciler = Reconciler(local, store, INTERVAL, clock=clock, stretch=stretch)
    admitted = 0
    for number, rate in enumerate(rates):
        bucket = local.get("k", LIMIT, 1, clock.now)
        for _ in range(round(rate * INTERVAL)):
            admitted += local.decide(bucket, 1, 0.99)
        clock.now += INTERVAL
        store.down = number in down
        await reconciler.sync_once()
    store.down = False
    for _ in range(stretch):  # what waited is sent within as many syncs
        clock.now += INTERVAL
        await reconciler.sync_once()
    reported = [n for n, keys in enumerate(store.rounds) if "k" in keys]
    return reported, admitted, store.admitted


async def test_a_bucket_far_below_its_limit_is_reported_every_stretch_intervals() -> None:
    """At a tenth of its limit the bucket is reported once every STRETCH syncs (the
    node's sync still runs each interval); every hit it admitted is reported still."""
    reported, admitted, counted = await _sync_rounds([100.0] * 16)
    assert reported == list(range(0, 17, STRETCH))  # the first sync, then every STRETCH
    assert counted == admitted == 16 * 25
    every, _, _ = await _sync_rounds([100.0] * 16, stretch=1)
    assert every == list(range(16))


async def test_near_its_limit_a_step_up_or_the_store_away_it_is_reported_every_interval() -> None:
    near, _, _ = await _sync_rounds([300.0] * 12)  # the fleet could not offer 4x within it
    assert near == list(range(12))
    step, admitted, counted = await _sync_rounds([100.0] * 6 + [400.0] * 2)
    assert 6 in step  # the round its rate doubled
    assert counted == admitted
    away, _, _ = await _sync_rounds([100.0] * 12, down=range(5, 8))
    assert {6, 7, 8} <= set(away)  # after a sync failed, until one succeeded


async def test_the_stretch_is_the_services_setting(start_service, write_config) -> None:  # type: ignore[no-untyped-def]
    """``--sync-stretch`` reaches the reconciler (its default: core/stretch.py's)."""
    rules = """\
domain: d
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1}
"""
    config = write_config(rules)
    default = await start_service(config)
    assert default.service.reconciler.stretch == STRETCH
    every = await start_service(config, sync_stretch=1)
    assert every.service.reconciler.stretch == 1
