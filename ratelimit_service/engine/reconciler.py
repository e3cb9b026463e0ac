"""The background loop of probabilistic mode: report local counts, read fleet totals,
set drop ratios. It is the only place where probabilistic rules touch the store."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import replace

from ratelimit_service.core.drop_ratio import SyncResult
from ratelimit_service.core.histogram import Histogram
from ratelimit_service.core.local_buckets import BucketReport, LocalBuckets
from ratelimit_service.core.stretch import STRETCH
from ratelimit_service.engine.background import BackgroundTask, every
from ratelimit_service.storage.base import Store, StoreUnavailable

log = logging.getLogger(__name__)

LATE_AFTER = 0.2
"""A sync is late once it has taken this share of the interval (a sync on a healthy
Redis takes milliseconds): the buckets' credit, granted for one interval, is renewed
then, not a whole interval later, so a frozen Redis leaves no gap in admissions."""


class Reconciler:
    def __init__(
        self,
        local: LocalBuckets,
        store: Store,
        interval: float,
        clock: Callable[[], float] = time.time,
        stretch: int = STRETCH,
    ) -> None:
        """``stretch``: sync intervals a bucket far below its limit, or steady well over it
        (paid in advance), may wait between two reports (1: none; core/stretch.py)."""
        if interval <= 0:
            raise ValueError("sync interval must be positive")
        self.local = local
        self.store = store
        self.interval = interval
        self.stretch = stretch
        self._clock = clock
        self.syncs = 0
        self.bucket_updates = 0
        """Bucket reports sent to the store, ever (its work grows with them: docs/scale.md)."""
        self.last_updates = 0
        """Bucket reports the last round sent."""
        self.errors = 0
        self.failing = False
        self.last_duration = 0.0
        self.durations = Histogram()
        self._background = BackgroundTask("reconciler", self.run)

    async def sync_once(self) -> int:
        """One reconciliation; returns the number of buckets synced."""
        started = time.perf_counter()
        sent_while_failing = self.failing
        # While the store is away every bucket reports: restore() and forgive() act on
        # what a sync took, and waiting buckets would keep renewed counts apart.
        stretch = 1 if sent_while_failing else self.stretch
        reports = self.local.take_reports(self._clock(), self.interval, stretch)
        if sent_while_failing:
            # Sent while the store is away, this call may run late: it must not charge
            # hits admitted on renewed credit (a calendar budget's are granted, and count).
            reports = [replace(r, admitted=0) if r.refills else r for r in reports]
        self.bucket_updates += len(reports)
        self.last_updates = len(reports)
        try:
            # With nothing to report, a sync still proves the store answers (freshness).
            result = await self._sync_keeping_rates(reports)
        except StoreUnavailable as exc:
            self.errors += 1
            self.failing = True
            self.local.restore(reports)
            self.local.renew()
            log.debug("sync failed, keeping last drop ratios: %s", exc)
            return 0
        now = self._clock()
        if sent_while_failing:
            # A late answer (a frozen Redis that resumed): see LocalBuckets.forgive.
            self.local.forgive(reports)
        self.local.apply_all(reports, result, now, self.interval)
        self.syncs += 1
        self.failing = False
        self.local.last_sync_ok = now
        self.last_duration = time.perf_counter() - started
        self.durations.observe(self.last_duration)
        return len(reports)

    async def _sync_keeping_rates(self, reports: list[BucketReport]) -> SyncResult:
        """The store's answer; while it is late (a slow or frozen Redis can take the whole
        sync timeout), buckets get their last credit again every interval, so they keep
        their last rate instead of running dry."""
        pending = asyncio.ensure_future(self.store.sync(reports))
        wait = self.interval * LATE_AFTER
        while True:
            done, _ = await asyncio.wait({pending}, timeout=wait)
            if done:
                return pending.result()
            self.local.renew()
            wait = self.interval

    async def run(self) -> None:
        await every(self.interval, self.sync_once, "sync round", self._failed)

    def _failed(self) -> None:
        self.errors += 1

    def start(self) -> None:
        self.local.last_sync_ok = self._clock()
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()
