"""Coalesces the exact-mode calls of concurrent requests into one script call.

Each call costs a full redis-py command (tens of microseconds of Python) plus a Lua
call start-up, and under load that, not Redis, is what limits throughput. So calls
go out one at a time (group commit): requests that arrive while a call is in flight
are queued and all sent, as one EVALSHA of exact_window.lua, as soon as it returns.
The script decides them one after the other, so the outcome is the same as separate
calls. Nothing waits for a batch to fill: with nothing in flight a request goes out
on the next event-loop turn, so a lightly loaded service keeps its latency, and a
busy one sends bigger batches instead of more calls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from ratelimit_service.core.exact import ExactHit, ExactResult
from ratelimit_service.storage.base import StoreUnavailable

log = logging.getLogger(__name__)

MAX_BATCH_DESCRIPTORS = 256
"""Descriptors per script call: bounds how long one Lua call holds Redis."""
MAX_IN_FLIGHT = 1
"""Script calls in flight at once; the rest of the requests queue for the next."""

Send = Callable[[list[str], list[Any], float], Awaitable[Sequence[Any]]]
"""Runs the script on (keys, argv) within a timeout; returns its flat reply, or raises
StoreUnavailable."""


def encode(hits: Sequence[ExactHit], commit: bool, into: list[Any]) -> None:
    """One request's part of the script's ARGV (see the header of exact_window.lua)."""
    into += (1 if commit else 0, len(hits))
    for hit in hits:
        into += (hit.limit, hit.window_seconds * 1_000_000, hit.hits, int(hit.role))


def decode(raw: Sequence[Any], start: int, count: int) -> list[ExactResult]:
    """``count`` results from the script's flat reply, beginning at descriptor ``start``."""
    return [
        ExactResult(
            admitted=bool(raw[i]),
            before=int(raw[i + 1]),
            remaining=int(raw[i + 2]),
            reset_after=int(raw[i + 3]) / 1e6,
        )
        for i in range(4 * start, 4 * (start + count), 4)
    ]


class _Batch:
    __slots__ = ("args", "keys", "opened", "waiters")

    def __init__(self, slices: int, opened: float) -> None:
        self.opened = opened
        self.keys: list[str] = []
        self.args: list[Any] = [slices, 0]
        self.waiters: list[tuple[asyncio.Future[list[ExactResult]], int]] = []


class ExactBatcher:
    def __init__(self, send: Send, slices: int, timeout: float) -> None:
        self._send = send
        self._slices = slices
        self._timeout = timeout
        self._open: _Batch | None = None
        self._scheduled = False
        self._inflight: set[asyncio.Task[None]] = set()
        self.batches = 0
        self.requests = 0

    def submit(
        self, keys: list[str], hits: Sequence[ExactHit], commit: bool
    ) -> asyncio.Future[list[ExactResult]]:
        loop = asyncio.get_running_loop()
        batch = self._open
        if batch is None:
            batch = self._open = _Batch(self._slices, loop.time())
        future: asyncio.Future[list[ExactResult]] = loop.create_future()
        batch.waiters.append((future, len(hits)))
        batch.keys += keys
        batch.args[1] += 1
        encode(hits, commit, batch.args)
        if len(batch.keys) >= MAX_BATCH_DESCRIPTORS:
            self._send_open()  # full: it goes now, even past MAX_IN_FLIGHT
        elif not self._scheduled and len(self._inflight) < MAX_IN_FLIGHT:
            self._scheduled = True
            loop.call_soon(self._flush_scheduled)
        return future

    def _flush_scheduled(self) -> None:
        self._scheduled = False
        if len(self._inflight) < MAX_IN_FLIGHT:
            self._send_open()

    def _send_open(self) -> None:
        batch = self._open
        if batch is None:
            return
        self._open = None
        self.batches += 1
        self.requests += len(batch.waiters)
        task = asyncio.ensure_future(self._run(batch))
        self._inflight.add(task)  # keep a reference until it ends
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        if len(self._inflight) < MAX_IN_FLIGHT:
            self._send_open()  # what queued meanwhile goes out at once

    async def _run(self, batch: _Batch) -> None:
        # The deadline runs from when the batch opened: time spent queued behind a
        # call in flight counts, so no request waits longer than the timeout.
        left = self._timeout - (asyncio.get_running_loop().time() - batch.opened)
        if left <= 0:
            self._fail(batch, f"redis: no answer within {self._timeout * 1000:.0f} ms")
            return
        try:
            raw = await self._send(batch.keys, batch.args, left)
            results = [decode(raw, start, count) for start, count in _spans(batch)]
        except StoreUnavailable as exc:
            self._fail(batch, str(exc))
            return
        except Exception as exc:  # a bug or a malformed reply: fail the batch, loudly
            log.exception("exact batch failed")
            self._fail(batch, f"redis: unexpected {type(exc).__name__}")
            return
        for (future, _), result in zip(batch.waiters, results, strict=True):
            if not future.done():  # a caller that gave up (cancelled) is skipped
                future.set_result(result)

    @staticmethod
    def _fail(batch: _Batch, reason: str) -> None:
        # One exception object per waiter: a shared one would collect every
        # waiter's traceback.
        for future, _ in batch.waiters:
            if not future.done():
                future.set_exception(StoreUnavailable(reason))


def _spans(batch: _Batch) -> list[tuple[int, int]]:
    spans, start = [], 0
    for _, count in batch.waiters:
        spans.append((start, count))
        start += count
    return spans
