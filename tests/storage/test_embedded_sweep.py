"""The embedded store forgets empty windows and idle fleet buckets a piece at a time,
so the reconciler's sweep never holds the event loop for a pass over every key."""

from __future__ import annotations

import asyncio

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
    pieces = list(store.sweep())
    assert len(pieces) >= 2 and sum(pieces) == SWEEP_PIECE + 10
    assert store.stats()["exact_keys"] == 1 and store.stats()["swept"] == SWEEP_PIECE + 10
    result = await store.hit([ExactHit("long", 10, 3_600, 0)], True)
    assert result[0].before == 1  # its hit is still counted


async def test_the_reconciler_leaves_the_loop_to_calls_while_it_sweeps() -> None:
    now = [1_000.0]
    store = EmbeddedStore(clock=lambda: now[0])
    for i in range(30_000):
        await store.hit([ExactHit(f"k{i}", 10, 1, 1)], True)
    now[0] += 2
    reconciler = Reconciler(LocalBuckets(), store, interval=1.0, clock=lambda: now[0])
    seen: set[float] = set()

    async def beside() -> None:
        while True:
            seen.add(store.stats()["exact_keys"])
            await asyncio.sleep(0)

    task = asyncio.ensure_future(beside())
    try:
        await reconciler.sync_once()  # the first sync sweeps
    finally:
        task.cancel()
    assert store.stats()["exact_keys"] == 0
    # Other work ran between the pieces: it saw the sweep half done.
    assert any(0 < keys < 30_000 for keys in seen), sorted(seen)
