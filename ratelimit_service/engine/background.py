"""A loop that runs beside the gRPC server on the same event loop, and stops cleanly;
and long work on that loop done in stretches that leave it to the calls between."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Generator, Iterable
from typing import Any, TypeVar

log = logging.getLogger(__name__)

_T = TypeVar("_T")

WORK = 0.001
"""Seconds long work (a large /metrics page, a statsd flush) holds the event loop at a time."""
REST = 0.001
"""Seconds the loop is then left to other work: a call needs several turns of the loop
(arrival, message, answer), so a single turn between pieces would add a piece to each."""


async def in_stretches(pieces: Iterable[_T]) -> AsyncIterator[_T]:
    """``pieces`` (each short), taken WORK seconds at a time with REST seconds between."""
    clock = time.perf_counter
    until = clock() + WORK
    for piece in pieces:
        yield piece
        if clock() > until:
            await asyncio.sleep(REST)
            until = clock() + WORK


async def result_in_stretches(work: Generator[None, None, _T]) -> _T:
    """What ``work`` returns, run in stretches; it yields None where it may leave the loop."""
    returned: list[_T] = []

    def pieces() -> Iterable[None]:
        returned.append((yield from work))

    async for _ in in_stretches(pieces()):
        pass
    return returned[0]


async def every(
    interval: float,
    step: Callable[[], Coroutine[Any, Any, Any]],
    what: str,
    failed: Callable[[], None] = lambda: None,
) -> None:
    """Run ``step`` every ``interval`` seconds on the loop's clock, for ever. A step that
    raises is logged (``what`` names it) and counted by ``failed``; a step longer than the
    interval is followed by the next at once, the missed ones skipped."""
    loop = asyncio.get_running_loop()
    next_at = loop.time()
    while True:
        next_at += interval
        try:
            await step()
        except Exception:  # keep the loop alive whatever one round does
            failed()
            log.exception("%s failed", what)
        delay = next_at - loop.time()
        if delay < 0:
            next_at, delay = loop.time(), 0.0
        await asyncio.sleep(delay)


class BackgroundTask:
    def __init__(self, name: str, body: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self.name = name
        self._body = body
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._body(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
