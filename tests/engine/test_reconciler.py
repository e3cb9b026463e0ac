"""The reconciler against a store whose syncs can be held back or failed: credit is
renewed soon after a sync runs late, and a late answer to a sync sent while the store
was away does not charge what was admitted on renewed credit."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.drop_ratio import SyncResult
from ratelimit_service.core.local_buckets import BucketReport, LocalBuckets
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.engine.state_metrics import reconciler_metrics
from ratelimit_service.engine.status import _reconciler
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore


class GatedStore(EmbeddedStore):
    """The embedded store, whose syncs wait for ``gate`` or fail while ``down``;
    ``asked`` is set once a sync has reached it."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()
        self.down = False
        self.asked = asyncio.Event()

    async def sync(self, reports: Sequence[BucketReport]) -> SyncResult:
        self.asked.set()
        await self.gate.wait()
        if self.down:
            raise StoreUnavailable("down")
        return await super().sync(reports)


async def _overloaded_bucket(local: LocalBuckets, reconciler: Reconciler) -> None:
    bucket = local.get("k", 100, 1, now=time.time())  # the reconciler's clock
    for _ in range(200):
        local.decide(bucket, 1, 0.99)
    await reconciler.sync_once()


async def test_credit_is_renewed_soon_after_a_sync_runs_late() -> None:
    local, store = LocalBuckets(), GatedStore()
    reconciler = Reconciler(local, store, interval=0.2)
    await _overloaded_bucket(local, reconciler)
    bucket = local.buckets()[0]
    grant = bucket.grant
    assert grant > 0
    bucket.credit = 0.0  # spent
    store.gate.clear()  # the next sync hangs
    loop = asyncio.get_running_loop()
    started = loop.time()
    pending = asyncio.ensure_future(reconciler.sync_once())
    await eventually_async(  # granted when the bucket is next touched
        lambda: local.credit(bucket) == grant, timeout=5, what="credit renewed"
    )
    assert loop.time() - started < 0.2  # after 0.2 * LATE_AFTER: well before a whole interval
    store.gate.set()
    await pending


async def test_a_late_answer_to_a_failing_sync_does_not_charge_renewed_admissions() -> None:
    local, store = LocalBuckets(), GatedStore()
    reconciler = Reconciler(local, store, interval=0.2)
    await _overloaded_bucket(local, reconciler)
    bucket = local.buckets()[0]
    for _ in range(10):  # traffic, so the next syncs carry a report for the bucket
        local.decide(bucket, 1, 0.99)
    store.down = True
    assert await reconciler.sync_once() == 0
    assert reconciler.failing
    store.down, store.gate = False, asyncio.Event()  # back, but answering late
    store.asked.clear()
    pending = asyncio.ensure_future(reconciler.sync_once())
    await asyncio.wait_for(store.asked.wait(), 5)  # the sync is out, its answer held back
    for _ in range(30):  # admitted on renewed credit while the answer is outstanding
        local.decide(bucket, 1, 0.99)
    assert bucket.admitted > 0
    store.gate.set()
    assert await pending == 1
    assert not reconciler.failing
    assert bucket.admitted == 0
    assert bucket.credit == bucket.grant  # not reduced by the forgiven admissions


async def test_a_calendar_budgets_admissions_while_the_store_is_away_count_when_it_returns() -> (
    None
):
    """A calendar budget's bucket is never renewed, so what it admitted while syncs
    failed was granted from the budget: it reaches the fleet bucket once the store
    answers (a rolling bucket's is forgiven)."""
    local, store = LocalBuckets(), GatedStore()
    reconciler = Reconciler(local, store, interval=0.2)
    now = time.time()  # the reconciler's clock
    budget = local.get("k@0", 100, 86_400, now=now, ends_at=now + 3_600)
    rolling = local.get("r", 100, 86_400, now=now)
    for bucket in (budget, rolling):
        assert bucket.take(10, 0.99)
    store.down = True
    assert await reconciler.sync_once() == 0
    for bucket in (budget, rolling):
        assert bucket.take(5, 0.99)
    assert await reconciler.sync_once() == 0  # sent while failing, failed again
    store.down = False
    assert await reconciler.sync_once() == 2
    assert budget.tokens == 85.0  # all 15 counted
    assert rolling.tokens == 100.0  # forgiven (and refilled)


async def test_the_bucket_updates_sent_are_counted_and_shown(redis_server) -> None:  # type: ignore[no-untyped-def]
    """Only buckets hit since the last sync are sent: the count, /metrics' counter and
    /status.json's figures move with them, and an idle round sends none (its
    heartbeat still runs: the store hears this node). Every bucket hit is sent (stretch
    1: a bucket far below its limit waits otherwise, tests/engine/test_stretch.py)."""
    local, store = LocalBuckets(), RedisStore(redis_server.url)
    reconciler = Reconciler(local, store, interval=0.25, stretch=1)
    try:
        for key in ("a", "b", "c"):
            local.decide(local.get(key, 100, 1, now=time.time()), 1, 0.5)
        assert await reconciler.sync_once() == 3
        assert await reconciler.sync_once() == 0  # nothing hit since
        assert local.nodes == 1  # the idle round's heartbeat was heard
        local.decide(local.get("a", 100, 1, now=time.time()), 1, 0.5)
        assert await reconciler.sync_once() == 1
        families = {f.name: f for f in reconciler_metrics(reconciler)}
        assert families["ratelimit_sync_bucket_updates"].samples[0].value == 4
        status = _reconciler(reconciler, local, time.time())
        assert (status["bucket_updates"], status["bucket_updates_per_second"]) == (4, 4.0)
    finally:
        await store.close()
