"""The embedded store forgets empty windows and idle fleet buckets a piece at a time,
so the reconciler's sweep never holds the event loop for a pass over every key."""

from __future__ import annotations

from ratelimit_service.core.exact import ExactHit
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.core.lru import SWEEP_PIECE, LruMap
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.storage.embedded import EmbeddedStore


def test_remove_if_works_in_pieces_and_judges_each_entry_when_its_piece_comes() -> None:
    lru: LruMap[list[int]] = LruMap(10_000)
    for i in range(2_500):
        lru.get_or_create(f"k{i}", lambda: [0])
    pieces = lru.remove_if(lambda value: value[0] == 0, piece=1_000)
    assert next(pieces) == 1_000
    lru.get_or_create("k1500", lambda: [0])[0] = 1  # holds something now: kept
    lru.get_or_create("late", lambda: [0])  # added after the listing: next pass
    assert list(pieces) == [999, 500]
    assert sorted(lru) == ["k1500", "late"]


async def test_the_embedded_sweep_forgets_only_what_holds_nothing() -> None:
    now = [1_000.0]
    store = EmbeddedStore(clock=lambda: now[0])
    for i in range(SWEEP_PIECE + 10):
        await store.hit([ExactHit(f"short{i}", 10, 1, 1)], True)
    await store.hit([ExactHit("long", 10, 3_600, 1)], True)
    now[0] += 2  # the one-second windows are empty; the hour's is not
    await store.sync([])  # each sync, the store's heartbeat, judges one piece
    figures = store.metrics().figures
    assert figures["swept"] == SWEEP_PIECE and figures["exact_keys"] == 11
    await store.sync([])
    figures = store.metrics().figures
    assert figures["exact_keys"] == 1 and figures["swept"] == SWEEP_PIECE + 10
    result = await store.hit([ExactHit("long", 10, 3_600, 0)], True)
    assert result[0].before == 1  # its hit is still counted


async def test_a_sync_judges_one_piece_so_calls_run_between_pieces() -> None:
    now = [1_000.0]
    store = EmbeddedStore(clock=lambda: now[0])
    for i in range(30_000):
        await store.hit([ExactHit(f"k{i}", 10, 1, 1)], True)
    now[0] += 2
    reconciler = Reconciler(LocalBuckets(), store, interval=1.0, clock=lambda: now[0])
    kept = []
    for _ in range(30):
        await reconciler.sync_once()
        kept.append(store.metrics().figures["exact_keys"])
    # One piece per sync: the pass is spread over the syncs, the loop free between them.
    assert kept == [30_000 - SWEEP_PIECE * n for n in range(1, 31)]
