"""server/gc_policy.py's tenuring: it tenures at a quiet moment, and while calls keep
coming its search for one costs the loop little, however many tasks are in flight."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator

import pytest

from ratelimit_service.server import gc_policy
from ratelimit_service.server.gc_policy import Tenuring


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    yield
    gc.unfreeze()  # what a tenure froze belongs to this test alone


def test_the_task_count_bounds_the_tasks_alive() -> None:
    async def main() -> None:
        release = asyncio.Event()
        tasks = [asyncio.create_task(release.wait()) for _ in range(50)]
        await asyncio.sleep(0)
        assert gc_policy._task_count() >= len(asyncio.all_tasks()) >= 51
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(main())


async def test_a_quiet_moment_is_tenured() -> None:
    tenuring = Tenuring(interval=0.01)
    background = asyncio.create_task(asyncio.Event().wait())  # long-lived: settles
    tenuring._background.start()
    try:
        for _ in range(200):
            if tenuring.tenures:
                break
            await asyncio.sleep(0.01)
        assert tenuring.tenures >= 1
    finally:
        await tenuring._background.stop()
        background.cancel()


async def test_while_calls_keep_coming_the_search_does_not_list_every_task(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    listed = 0
    all_tasks = asyncio.all_tasks

    def counting(loop: asyncio.AbstractEventLoop | None = None) -> set[asyncio.Task[object]]:
        nonlocal listed
        listed += 1
        return all_tasks(loop)

    stop = asyncio.Event()

    in_flight: set[asyncio.Task[None]] = set()

    async def calls() -> None:  # ~200 short calls in flight, new ones all the time
        while not stop.is_set():
            for _ in range(20):
                task = asyncio.create_task(asyncio.sleep(0.005))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
            await asyncio.sleep(0.0005)

    tenuring = Tenuring(interval=0.01)
    source = asyncio.create_task(calls())
    await asyncio.sleep(0.05)
    monkeypatch.setattr(asyncio, "all_tasks", counting)
    tenuring._background.start()
    try:
        for _ in range(300):
            if tenuring.skipped >= 2:
                break
            await asyncio.sleep(0.01)
        assert tenuring.skipped >= 2 and tenuring.tenures == 0
        # A listing every LIST_EVERY tries and one a round (to remember the tasks), not
        # one a try (QUIET_TRIES a round).
        rounds = tenuring.skipped + 1
        most = rounds * (gc_policy.QUIET_TRIES // gc_policy.LIST_EVERY + 1)
        assert listed <= most, (listed, rounds)
    finally:
        await tenuring._background.stop()
        stop.set()
        await source
