"""Group commit for exact mode: concurrent requests share one script call.

Each script call costs a write and a read system call and a Lua start-up, whatever
it carries. So only a few calls are in flight at a time (MAX_IN_FLIGHT, on one
pipelined connection): a request that finds a free slot goes out at once (no added
latency), and requests that arrive while every slot is busy wait for the first to
come back and then all go together, as one EVALSHA of exact_window.lua. The script
decides them one after the other, so the outcome is the same as separate calls;
under load the batches grow instead of the number of calls. Many slots keep a slow
Redis (milliseconds away) from adding a round trip of queueing to requests: with 4
slots, a Redis 5 ms away at 1,000 requests/s pushed queued requests past a 10 ms
deadline (44 % answered by failure_mode in bench/throughput.py --suite redis-delay).

While the event loop is saturated (``hold`` > 0, set by the store from
loop_load.LoopLoad) the batcher works the other way: a batch opens with the first
request and leaves ``hold`` seconds later, or sooner if it is full. Saturated, grpc.aio
starts about one RPC per loop turn and Redis answers before the next one starts, so
sending at once would mean one request per call however high the load; held for a
millisecond, calls carry several requests and each costs the process and Redis far
less per request. Not saturated, nothing is held: no added latency.

A call's deadline measures Redis, not this process: it runs from when the command is
written to the socket, and a call whose deadline has passed gets one more turn of the
event loop's I/O polling before it is given up (CONFIRM_AFTER), so a reply that
arrived while the loop was busy elsewhere (a burst of requests, a CPU shared with other
processes) is read and used instead of being taken for a Redis failure. Time queued
in the batcher is not bounded by the deadline but by the number of requests waiting
(``max_pending``): past it, :meth:`ExactBatcher.submit` refuses at once with
:class:`StoreOverloaded`, which the limiter answers explicitly.

A request whose caller admits it when Redis fails (``owe``: its rules fail open) is
not lost to the window when that happens: see owed_hits, which the batcher feeds.

The batcher is written with callbacks, not tasks: at one request per batch (a lightly
loaded service) a task and a chain of coroutines per call cost more CPU than the
rest of the exact-mode path.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from ratelimit_service.core.exact import ExactHit, ExactResult, HitRole, request_denied
from ratelimit_service.storage.base import StoreOverloaded, StoreUnavailable
from ratelimit_service.storage.owed_hits import OwedHits

log = logging.getLogger(__name__)

MAX_IN_FLIGHT = 32
"""Script calls outstanding at once; further requests queue into the next batch."""
LONE_BATCHES = 2
"""Held batches in a row that left with one request each, after which holding stops
until the load sensor next finds the loop saturated: nobody came to share the call, so
the hold only delayed it (as when the load has just dropped)."""
MAX_BATCH_DESCRIPTORS = 256
"""Descriptors per script call: bounds how long one Lua call holds Redis. A full
batch goes out at once, even while another call is in flight."""
MAX_PENDING = 2048
"""Requests submitted and not yet answered (queued or in a call) at most, by default;
one more is refused with StoreOverloaded. At the few thousand exact decisions a
second one process makes, that is several hundred milliseconds of queue: far past any
caller's deadline, so nothing useful is refused."""
CONFIRM_AFTER = 0.001
"""Seconds between finding a call past its deadline and giving it up. A timer of a
whole millisecond fires in a later loop iteration than the one that set it, after
an I/O poll, in asyncio's loop and in uvloop (libuv runs due timers before polling;
a timer set for "now" may run in the same pass)."""


class Channel(Protocol):
    """How the batcher reaches Redis (implemented by the Redis store)."""

    def start(self, keys: list[str], args: list[Any], deliver: Callable[[Any], None]) -> float:
        """Send one script call now; ``deliver`` gets its flat reply, or the exception
        it failed with, exactly once (perhaps before ``start`` returns). Returns the
        seconds that may pass before the command is written (0 when it was written;
        the connect timeout when a connection must be opened first): the reply's
        deadline starts after them."""
        ...

    def settle(self, reply: Any) -> Any:
        """A delivered reply's value, after accounting; or raise StoreUnavailable."""
        ...

    def expire(self, timeout: float) -> StoreUnavailable:
        """Account a call that did not answer in time; the error its waiters get."""
        ...


def encode(hits: Sequence[ExactHit], commit: bool, into: list[Any]) -> None:
    """One request's part of the script's ARGV (see the header of exact_window.lua)."""
    into += (1 if commit else 0, len(hits))
    into += hit_args(hits)


def hit_args(hits: Sequence[ExactHit]) -> tuple[Any, ...]:
    """The per-descriptor part of a request's ARGV: the same for the same hits, so
    callers may keep it (RedisStore does, per request plan)."""
    args: list[Any] = []
    for hit in hits:
        args += (hit.limit, hit.window_seconds * 1_000_000, hit.hits, int(hit.role))
    return tuple(args)


def decode(raw: Sequence[Any], start: int, count: int) -> list[ExactResult]:
    """``count`` results from the script's flat reply, beginning at descriptor ``start``."""
    results = []  # a loop, not a comprehension: one call fewer per reply (3.11)
    for i in range(4 * start, 4 * (start + count), 4):
        results.append(
            ExactResult(bool(raw[i]), int(raw[i + 1]), int(raw[i + 2]), int(raw[i + 3]) / 1e6)
        )
    return results


FORCE = 2
"""``commit`` of a request counted whatever the window holds (owed hits)."""

_Waiter = tuple["asyncio.Future[list[ExactResult]] | None", int, float | None]
"""A request in a batch: who waits for its results (None: owed hits, nobody), its
descriptor count, and, if its hits are owed to Redis should the call fail, since when
(an owed request sent again keeps its first time, so it still expires with its
window however long Redis stays away)."""


class _Batch:
    __slots__ = (
        "args",
        "deadline",
        "done",
        "due",
        "forced",
        "keys",
        "late",
        "overdue",
        "release",
        "waiters",
    )

    def __init__(self, slices: int) -> None:
        self.deadline = 0.0
        """When its reply is due: set when it is sent."""
        self.overdue = False
        """Found past its deadline; given up at the next check unless answered."""
        self.release: asyncio.TimerHandle | None = None
        """The end of its hold, while held."""
        self.due = False
        """Not held (any more): it goes as soon as a call slot is free."""
        self.keys: list[str] = []
        self.args: list[Any] = [slices, 0]
        self.waiters: list[_Waiter] = []
        self.done = False
        self.late = False
        """Given up at its deadline; a reply may still come and tell what Redis did."""
        self.forced = 0
        """Owed requests in it (nobody waits for them)."""

    def add(self, waiter: _Waiter, keys: Sequence[str], commit: int, args: Sequence[Any]) -> None:
        self.waiters.append(waiter)
        if waiter[0] is None:
            self.forced += 1
        self.keys += keys
        self.args[1] += 1
        self.args += (commit, len(keys))
        self.args += args

    def requests(self) -> list[tuple[_Waiter, list[str], list[Any]]]:
        """Each request with its keys and its per-descriptor ARGV part."""
        out, key, arg = [], 0, 2
        for waiter in self.waiters:
            count = waiter[1]
            hits = self.args[arg + 2 : arg + 2 + 4 * count]
            out.append((waiter, self.keys[key : key + count], hits))
            key += count
            arg += 2 + 4 * count
        return out


class ExactBatcher:
    def __init__(
        self, channel: Channel, slices: int, timeout: float, max_pending: int = MAX_PENDING
    ) -> None:
        self._channel = channel
        self._slices = slices
        self._timeout = timeout
        self.max_pending = max_pending
        self.pending = 0
        """Requests submitted and not yet answered or failed."""
        self.overloaded = 0
        """Requests refused because ``max_pending`` were waiting."""
        self.owed = OwedHits()
        self._open: _Batch | None = None
        self._in_flight = 0
        # Batches sent and not yet answered or expired, oldest first, and one timer
        # for the earliest deadline: a timer per call would cost more than the rest
        # of the batcher.
        self._flying: deque[_Batch] = deque()
        self._timer: asyncio.Handle | None = None
        self._timer_at = 0.0
        """When the timer fires (uvloop's handles for a time already past do not say)."""
        self.hold = 0.0
        """Seconds a batch waits for company before it leaves; 0: send at once (see
        set_hold)."""
        self._lone = 0
        self.batches = 0
        self.requests = 0
        self.held = 0
        """Batches that opened with a hold (sent when it ended, or when full)."""

    def submit(
        self, keys: Sequence[str], args: tuple[Any, ...], commit: bool, owe: bool = False
    ) -> asyncio.Future[list[ExactResult]]:
        """One request: its keys and its hits' ARGV part (:func:`hit_args`). ``owe``:
        the caller admits the request if the call fails, so its hits are owed to Redis
        then (see owed_hits). Raises StoreOverloaded, sending nothing, when
        ``max_pending`` requests are waiting."""
        if self.pending >= self.max_pending:
            self.overloaded += 1
            raise StoreOverloaded(f"redis: {self.pending} exact requests already waiting")
        loop = asyncio.get_running_loop()
        batch = self._open
        if batch is None:
            batch = self._open = _Batch(self._slices)
            if self.hold:
                batch.release = loop.call_later(self.hold, self._release, batch)
                self.held += 1
            else:
                batch.due = True
            if self.owed:  # owed hits land first: the requests below see them
                for owed_keys, owed_args, since in self.owed.drain(loop.time()):
                    batch.add((None, len(owed_keys), since), owed_keys, FORCE, owed_args)
        future: asyncio.Future[list[ExactResult]] = loop.create_future()
        self.pending += 1
        owed_since = loop.time() if owe and commit else None
        batch.add((future, len(keys), owed_since), keys, 1 if commit else 0, args)
        full = len(batch.keys) >= MAX_BATCH_DESCRIPTORS
        if full or (batch.due and self._in_flight < MAX_IN_FLIGHT):
            self._send(loop)
        return future

    def set_hold(self, seconds: float) -> None:
        """Hold new batches this long from now on (0: not at all); the count of lone
        held batches starts again."""
        self.hold = seconds
        self._lone = 0

    def close(self) -> None:
        """Fail the batch not sent yet and stop holding: nothing goes out after the
        store has closed its connection (a held batch would reopen it)."""
        self.hold = 0.0
        batch, self._open = self._open, None
        if batch is not None:
            if batch.release is not None:
                batch.release.cancel()
            self.pending -= _callers(batch)
            self._fail(batch, "redis: store closed")

    def _release(self, batch: _Batch) -> None:
        """A held batch's time is up: it goes now, or when a call slot frees."""
        batch.release = None
        if self._open is not batch:  # it left full, or the store closed
            return
        batch.due = True
        self._lone = 0 if _callers(batch) > 1 else self._lone + 1
        if self._lone >= LONE_BATCHES:
            self.hold = 0.0
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
        self._in_flight += 1
        self.batches += 1
        self.requests += _callers(batch)
        self._flying.append(batch)
        deliver = functools.partial(self._delivered, batch)
        # The deadline measures Redis: it starts once the command is written.
        allowance = self._channel.start(batch.keys, batch.args, deliver)
        if not batch.done:  # not answered at once (as when the circuit is open)
            batch.deadline = loop.time() + allowance + self._timeout
            self._arm(loop, batch.deadline)

    def _delivered(self, batch: _Batch, reply: Any) -> None:
        if batch.done:  # it expired: only what Redis did with owed hits matters now
            if batch.late:
                self._settle_late(batch, reply)
            return
        self._close(batch)
        try:
            raw = self._channel.settle(reply)
            results, start = [], 0
            for _, count, _ in batch.waiters:
                results.append(decode(raw, start, count))
                start += count
        except StoreUnavailable as exc:
            self._fail(batch, str(exc))
        except Exception as exc:  # a bug or a malformed reply: fail the batch, loudly
            log.exception("exact batch failed")
            self._fail(batch, f"redis: unexpected {type(exc).__name__}")
        else:
            for (future, _, _), result in zip(batch.waiters, results, strict=True):
                if future is not None and not future.done():  # None: owed; done: gave up
                    future.set_result(result)
        self._send_queued(asyncio.get_running_loop())  # what queued meanwhile goes out now

    def _fail(self, batch: _Batch, reason: str, late: bool = False) -> None:
        """Every waiter hears ``reason``; the hits of requests admitted on failure
        are owed to Redis, or, for a call that may still be answered (``late``),
        once its reply shows what Redis did not count."""
        batch.late = late
        for (future, _, since), keys, args in batch.requests():
            # One exception object per waiter: a shared one would collect every
            # waiter's traceback.
            if future is not None and not future.done():
                future.set_exception(StoreUnavailable(reason))
            if since is not None and not late:
                self.owed.add(keys, args, since)

    def _settle_late(self, batch: _Batch, reply: Any) -> None:
        """The reply of a call given up at its deadline: owe the hits of requests
        admitted on failure that Redis did not count (all of them if the reply is an
        error: whether the script ran is unknown, and counting twice only denies
        sooner)."""
        batch.late = False
        start = 0
        for (future, count, since), keys, args in batch.requests():
            if since is not None:
                counted = future is None  # forced hits always count
                if not counted and not isinstance(reply, BaseException):
                    admitted = [r.admitted for r in decode(reply, start, count)]
                    roles = [HitRole(role) for role in args[3::4]]
                    counted = not request_denied(roles, admitted)
                if not counted:
                    self.owed.add(keys, args, since)
            start += count

    def _check_deadlines(self) -> None:
        """Fail every call that was already past its deadline at the previous check
        and is still unanswered; mark those newly past it, and look again after the
        next I/O poll (CONFIRM_AFTER): a reply that came while the loop was busy is
        read in that poll. Then wait for the next deadline."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        expired = [b for b in self._flying if b.overdue and not b.done]
        # All are closed before any is accounted: accounting may drop a stuck
        # connection, which would otherwise fail the others as "connection lost".
        for batch in expired:
            self._close(batch)
        confirm, upcoming = False, None
        for batch in self._flying:  # a few dozen at most (MAX_IN_FLIGHT, full batches)
            if batch.done:
                continue
            if batch.deadline <= now:
                batch.overdue = confirm = True
            elif upcoming is None or batch.deadline < upcoming:
                upcoming = batch.deadline
        for batch in expired:
            self._fail(batch, str(self._channel.expire(self._timeout)), late=True)
        if self._in_flight < MAX_IN_FLIGHT:  # the timer of an answered call frees nothing
            self._send_queued(loop)  # what queued behind the expired calls goes out now
        if confirm:
            self._arm(loop, now + CONFIRM_AFTER)
        elif upcoming is not None:
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
        batch.done = True
        self._in_flight -= 1
        self.pending -= _callers(batch)
        flying = self._flying
        while flying and flying[0].done:  # keep the line short; the timer skips the rest
            flying.popleft()


def _callers(batch: _Batch) -> int:
    """Requests in a batch that someone waits for (owed hits are not pending)."""
    return len(batch.waiters) - batch.forced
