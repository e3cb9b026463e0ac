"""Group commit for exact mode: concurrent requests share one script call.

Each script call costs system calls, wake-ups of this process and of Redis, and a Lua
start-up, whatever it carries. So calls are paced, one at most every ``gap`` seconds
(``--exact-batch-hold``): a request that comes sooner after the last call opens a batch
that leaves when the gap is over, joined by the requests that come meanwhile, as one
EVALSHA of exact_window.lua (which decides them one by one: the outcome of separate
calls). Batches grow with the load by themselves (about rate x gap requests a call);
sending at once would mean one request per call however high the load, as grpc.aio
starts about one RPC per loop turn and Redis answers within a turn. Calls are pipelined,
up to MAX_IN_FLIGHT at a time; a full batch (MAX_BATCH_DESCRIPTORS) leaves at once.

Each request waits until its own deadline (the caller's, at most ``timeout``); one timer
serves them all, and reads the socket first (Channel.poll) so that a reply that came
while the loop was busy is used. A request that could only be given up is answered so
at once (``late``, ``hopeless``): an answer at the last moment comes too late, and the
call costs Redis for nothing. Giving up is no breaker event: the channel decides from
evidence when Redis is down. Past ``max_pending`` waiting requests, :meth:`submit
<ExactBatcher.submit>` raises :class:`StoreOverloaded`. Hits of requests whose rules
fail open are kept for Redis when it fails (see owed_hits).

Callbacks, not tasks: at one request per batch, a task and a chain of coroutines per
call would cost more CPU than the rest of the exact-mode path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ratelimit_service.core.exact import ExactResult, request_denied
from ratelimit_service.core.settings_table import default
from ratelimit_service.storage.base import StoreOverloaded, StoreUnavailable
from ratelimit_service.storage.owed_hits import OwedHits
from ratelimit_service.storage.script_calls import (
    add_exact_request,
    exact_batch_args,
    exact_reply,
    hit_roles,
    without_costs,
)

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 32
"""Script calls outstanding at once; further requests queue into the next batch."""
MAX_BATCH_DESCRIPTORS = 256
"""Descriptors per script call: bounds how long one Lua call holds Redis."""
LONE_BATCHES = 2
"""Held batches in a row that left alone, after which a request goes at once if no call is out."""
PROMPT_WINDOW = 1.0
"""Seconds of replies over which ExactBatcher.prompt takes the quickest (and the window before)."""


class Channel(Protocol):
    """How the batcher reaches Redis (exact_channel.ExactChannel)."""

    def send(self, keys: list[str], args: list[Any], deliver: Callable[[Any], None]) -> None:
        """Send one script call now; ``deliver`` gets its reply or exception once, maybe at once."""

    def settle(self, reply: Any) -> Any:
        """A delivered reply's value, after accounting; or raise StoreUnavailable."""

    def poll(self) -> None:
        """Deliver the replies already on the socket; fail the calls of a dead connection."""

    def silent_longer_than(self, seconds: float) -> bool:
        """Whether Redis has sent no byte for longer than ``seconds`` while calls wait for it."""

    def ready(self) -> bool:
        """Whether a call sent now would go to Redis: owed hits ride only on those."""

    def timed_out(self, requests: int) -> None:
        """Account requests given up at their deadline."""


FORCE = 2
"""``commit`` of a request counted whatever the window holds (owed hits)."""


class _Waiter:
    """A request in a batch."""

    __slots__ = ("count", "deadline", "future", "open", "since", "submitted")

    def __init__(
        self,
        future: asyncio.Future[list[ExactResult]] | None,
        count: int,
        since: float | None,
        deadline: float,
        submitted: float,
    ) -> None:
        self.future = future
        """Who waits for its results (None: owed hits, nobody)."""
        self.count = count
        """Its descriptors."""
        self.since = since
        """If its hits are owed to Redis should the call fail, since when (kept when it is
        sent again, so it expires with its window however long Redis stays away)."""
        self.deadline = deadline
        self.submitted = submitted
        self.open = future is not None
        """Counted in ``pending``: not answered, given up or cancelled yet."""


class _Batch:
    __slots__ = ("args", "done", "due", "forced", "keys", "release", "sent_at", "waiters")

    def __init__(self, slices: int) -> None:
        self.release: asyncio.TimerHandle | None = None
        """The end of its hold, while held."""
        self.due = False
        """Not held (any more): it goes as soon as a call slot is free."""
        self.keys: list[str] = []
        self.args: list[Any] = exact_batch_args(slices)
        self.waiters: list[_Waiter] = []
        self.done = False
        """Its call slot is free: answered, or every caller gave up."""
        self.forced = 0
        """Owed requests in it (nobody waits for them)."""
        self.sent_at = 0.0

    def add(self, waiter: _Waiter, keys: Sequence[str], commit: int, args: Sequence[Any]) -> None:
        self.waiters.append(waiter)
        if waiter.future is None:
            self.forced += 1
        self.keys += keys
        add_exact_request(self.args, commit, args)

    def requests(self) -> list[tuple[_Waiter, list[str], list[Any]]]:
        """Each request with its keys and its per-descriptor ARGV part."""
        out, key, arg = [], 0, 2
        for waiter in self.waiters:
            count = waiter.count
            hits = self.args[arg + 2 : arg + 2 + 4 * count]
            out.append((waiter, self.keys[key : key + count], hits))
            key += count
            arg += 2 + 4 * count
        return out

    def waited_for(self) -> bool:
        """Whether a caller still waits, or owed hits ride in it."""
        return any(w.open or w.since is not None for w in self.waiters)


class ExactBatcher:
    def __init__(
        self,
        channel: Channel,
        slices: int,
        timeout: float,
        max_pending: int = default("--exact-max-pending"),
        gap: float = 0.0,
    ) -> None:
        """``timeout``: the longest any request waits, and a request without a deadline."""
        self._channel = channel
        self._slices = slices
        self._timeout = timeout
        self.max_pending = max_pending
        self.pending = 0
        """Requests submitted and not yet answered, given up or cancelled."""
        self.overloaded = 0
        """Requests refused because ``max_pending`` were waiting."""
        self.given_up = 0
        """Requests answered with StoreUnavailable at their deadline."""
        self.hopeless = 0
        """Requests answered with StoreUnavailable at once: Redis silent too long."""
        self.late = 0
        """Requests answered with StoreUnavailable at once: less time left than prompt."""
        self.prompt = 0.0
        """Seconds from sending a call to reading its reply (this process's delays included), the
        quickest in the last PROMPT_WINDOW or two; 0 before the first reply."""
        self._quickest = -1.0
        self._previous_quickest = 0.0
        self._window_end = 0.0
        self.owed = OwedHits()
        self._open: _Batch | None = None
        self._in_flight = 0
        # Batches sent and not yet answered, oldest first, and one timer for the earliest
        # deadline: a timer per request would cost more than the rest of the batcher.
        self._flying: deque[_Batch] = deque()
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        """When the timer fires (uvloop's handles for a time already past do not say)."""
        self.gap = gap
        """Seconds from one script call to the next at least (0: no batch waits)."""
        self._last_sent = -gap
        """When the last script call left (the loop's clock)."""
        self._lone = 0
        """Held batches in a row that left with one request (see LONE_BATCHES)."""
        self.batches = 0
        self.requests = 0
        self.held = 0
        """Batches that opened within the gap and waited for its end (or to be full)."""

    def submit(
        self,
        keys: Sequence[str],
        args: tuple[Any, ...],
        commit: int,
        owe: bool = False,
        deadline: float | None = None,
    ) -> asyncio.Future[list[ExactResult]]:
        """One request: its keys and its hits' ARGV part (:func:`hit_args`). ``owe``: the caller
        admits it if the call fails. ``deadline`` (the loop's clock): at most ``timeout`` away.
        Raises StoreOverloaded, sending nothing, past ``max_pending``."""
        if self.pending >= self.max_pending:
            self.overloaded += 1
            raise StoreOverloaded(f"redis: {self.pending} exact requests already waiting")
        loop = asyncio.get_running_loop()
        now = loop.time()
        latest = now + self._timeout
        deadline = latest if deadline is None else min(deadline, latest)
        left = deadline - now
        if left <= 0 or (self._in_flight and left < self.prompt):
            # Not even a call sent now would be answered in time. With nothing in flight
            # a call goes, so `prompt` stays current.
            self.late += 1
            if owe and commit:
                self.owed.add(keys, args, now)
            raise StoreUnavailable(
                f"redis: answers take {self.prompt * 1000:.1f} ms lately,"
                f" {max(left, 0.0) * 1000:.1f} ms left"
            )
        if self._channel.silent_longer_than(left):
            self.hopeless += 1
            if owe and commit:
                self.owed.add(keys, args, now)
            raise StoreUnavailable("redis: silent for longer than the caller can wait")
        batch = self._open
        if batch is None:
            batch = self._open = _Batch(self._slices)
            due_at = self._last_sent + self.gap
            if due_at > now and (self._lone < LONE_BATCHES or self._in_flight):
                # A call left less than `gap` ago: gather company until the gap is over
                # (unless the last held batches found none, and no call is out).
                batch.release = loop.call_at(due_at, self._release, batch)
                self.held += 1
            else:
                batch.due = True
            if self.owed and self._channel.ready():  # owed hits first: the requests see them
                self._add_owed(batch, now, latest)
        future: asyncio.Future[list[ExactResult]] = loop.create_future()
        self.pending += 1
        owed_since = now if owe and commit else None
        batch.add(_Waiter(future, len(keys), owed_since, deadline, now), keys, int(commit), args)
        self._arm(loop, deadline)
        full = len(batch.keys) >= MAX_BATCH_DESCRIPTORS
        if full or (batch.due and self._in_flight < MAX_IN_FLIGHT):
            self._send(loop)
        return future

    def _add_owed(self, batch: _Batch, now: float, deadline: float) -> None:
        """Owed hits into ``batch``: at most a batch's descriptors, however long the outage."""
        for keys, args, since in self.owed.take(MAX_BATCH_DESCRIPTORS, now):
            batch.add(_Waiter(None, len(keys), since, deadline, now), keys, FORCE, args)

    def _repay(self, loop: asyncio.AbstractEventLoop) -> None:
        """Redis has just answered: owed hits left go out in a batch of their own, if a
        call slot is free and no batch is open to carry them."""
        if not self.owed or self._open is not None or self._in_flight >= MAX_IN_FLIGHT:
            return
        now = loop.time()
        batch = self._open = _Batch(self._slices)
        self._add_owed(batch, now, now + self._timeout)
        self._send(loop)

    def close(self) -> None:
        """Fail the batch not sent yet and stop holding (a held batch would reconnect)."""
        self.gap = 0.0
        batch, self._open = self._open, None
        if batch is not None:
            if batch.release is not None:
                batch.release.cancel()
            self._settle(batch, None, "redis: store closed")

    def _release(self, batch: _Batch) -> None:
        """A held batch's time is up: it goes now, or when a call slot frees."""
        batch.release = None
        if self._open is not batch:  # it left full, or the store closed
            return
        batch.due = True
        self._lone = self._lone + 1 if _callers(batch) <= 1 else 0
        if self._in_flight < MAX_IN_FLIGHT:
            self._send(asyncio.get_running_loop())

    def _send_queued(self, loop: asyncio.AbstractEventLoop) -> None:
        """A call slot has freed: the open batch goes, unless its hold is not over."""
        batch = self._open
        if batch is not None and batch.due:
            self._send(loop)

    def _send(self, loop: asyncio.AbstractEventLoop) -> None:
        batch = self._open
        if batch is None:
            return
        self._open = None
        if batch.release is not None:
            batch.release.cancel()
            batch.release = None
        if not batch.waited_for():  # every caller gave up before it left: not sent
            return
        self._in_flight += 1
        self._last_sent = batch.sent_at = loop.time()
        self.batches += 1
        self.requests += _callers(batch)
        self._flying.append(batch)
        self._channel.send(batch.keys, batch.args, functools.partial(self._delivered, batch))

    def _delivered(self, batch: _Batch, reply: Any) -> None:
        if not batch.done:
            self._close(batch)
        try:
            raw = self._channel.settle(reply)
        except StoreUnavailable as exc:
            self._settle(batch, None, str(exc))
        except Exception as exc:  # a bug or a malformed reply: fail the batch, loudly
            log.exception("exact batch failed")
            self._settle(batch, None, f"redis: unexpected {type(exc).__name__}")
        else:
            self._settle(batch, raw, "")
            loop = asyncio.get_running_loop()
            self._timed(loop.time(), loop.time() - batch.sent_at)
            self._repay(loop)
        self._send_queued(asyncio.get_running_loop())  # what queued meanwhile goes out now

    def _timed(self, now: float, took: float) -> None:
        """A reply read ``took`` seconds after its call was sent: keep :attr:`prompt` current."""
        if now >= self._window_end:
            self._window_end = now + PROMPT_WINDOW
            self._previous_quickest = self._quickest if self._quickest >= 0 else took
            self._quickest = took
        elif took < self._quickest:
            self._quickest = took
        self.prompt = min(self._previous_quickest, self._quickest)

    def _settle(self, batch: _Batch, raw: Any, error: str) -> None:
        """Hand each request its results (or ``error``); owe admitted hits Redis did not count."""
        start = 0
        for waiter, keys, args in batch.requests():
            future = waiter.future
            if raw is None:
                if future is not None and not future.done():
                    # One exception object per waiter: a shared one would collect every
                    # waiter's traceback.
                    future.set_exception(StoreUnavailable(error))
                if waiter.since is not None and not (future is not None and future.cancelled()):
                    self.owed.add(keys, args, waiter.since)
            elif future is not None:
                if not future.done():
                    future.set_result(exact_reply(raw, start, waiter.count))
                elif waiter.since is not None and not future.cancelled():
                    self._owe_if_denied(waiter, keys, args, raw, start)
            self._finish(waiter)
            start += waiter.count

    def _owe_if_denied(
        self, waiter: _Waiter, keys: list[str], args: list[Any], raw: Any, start: int
    ) -> None:
        """A given-up request admitted on failure: owe its hits (not costs) if Redis denied it."""
        assert waiter.since is not None
        admitted = [r.admitted for r in exact_reply(raw, start, waiter.count)]
        if request_denied(hit_roles(args), admitted):
            self.owed.add(keys, without_costs(args), waiter.since)

    def _finish(self, waiter: _Waiter) -> None:
        if waiter.open:
            waiter.open = False
            self.pending -= 1

    def _check_deadlines(self) -> None:
        """Read what Redis has answered, then answer every request past its deadline with
        StoreUnavailable (a batch nobody waits for frees its slot); then wait for the next."""
        self._timer = None
        loop = asyncio.get_running_loop()
        self._channel.poll()
        now = loop.time()
        upcoming, expired = None, 0
        batches = list(self._flying)
        if self._open is not None:
            batches.append(self._open)
        for batch in batches:
            if batch.done:
                continue
            for waiter in batch.waiters:
                future = waiter.future
                if not waiter.open or future is None:
                    continue
                if future.done():  # cancelled by its caller
                    self._finish(waiter)
                elif waiter.deadline <= now:
                    waited = (now - waiter.submitted) * 1000
                    future.set_exception(StoreUnavailable(f"redis: no answer in {waited:.0f} ms"))
                    self._finish(waiter)
                    expired += 1
                elif upcoming is None or waiter.deadline < upcoming:
                    upcoming = waiter.deadline
            if batch is not self._open and not any(w.open for w in batch.waiters):
                self._close(batch)
        if expired:
            self.given_up += expired
            self._channel.timed_out(expired)
        if self._in_flight < MAX_IN_FLIGHT:
            self._send_queued(loop)  # what queued behind the given-up calls goes out now
        if upcoming is not None:
            self._arm(loop, upcoming)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        """Have _check_deadlines run at ``when`` at the latest."""
        timer = self._timer
        if timer is not None:
            if self._timer_at <= when:
                return
            timer.cancel()
        self._timer = loop.call_at(when, self._check_deadlines)
        self._timer_at = when

    def _close(self, batch: _Batch) -> None:
        """Free the batch's call slot."""
        batch.done = True
        self._in_flight -= 1
        flying = self._flying
        while flying and flying[0].done:  # keep the line short; the timer skips the rest
            flying.popleft()


def _callers(batch: _Batch) -> int:
    """Requests in a batch that someone waits for (owed hits are not pending)."""
    return len(batch.waiters) - batch.forced
