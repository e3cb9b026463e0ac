"""The native gRPC front door (``--grpc-engine native``): ShouldRateLimit and health
Check answered on our own HTTP/2 connections (server/h2_conn.py), everything else by
the grpcio server behind it.

grpcio's per-call work is most of what a Python RLS service spends (docs/design.md,
"The native front door"): a task per call and several hops between its core's thread
and the event loop. Here a read's bytes are parsed in one pass and a call decided
without a store (probabilistic rules) is answered within that read, without a task; a
call that waits for Redis (exact rules) is answered from a callback on the store's
future, also without a task, and the answers that one loop turn makes go out in one
write.

The grpcio server listens on a private Unix socket. A connection whose first call is
another method (Envoy's RLQS cluster, reflection, health Watch) is spliced to it byte
for byte; on a connection served here, a call to another method is relayed to it as
its client would have made it (gRPC clients share one connection between channels to
the same target).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import socket
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import grpc

from ratelimit_service.core.address import listen_host, split_host_port
from ratelimit_service.rls.servicer import Answering, CallFailed
from ratelimit_service.server.h2_conn import (
    ACK,
    INTERNAL,
    PREFACE,
    RESOURCE_EXHAUSTED,
    SETTINGS,
    Call,
    Cancelled,
    H2Connection,
    HalfClosed,
    Message,
    Opened,
    Refused,
    frame,
)
from ratelimit_service.server.receive_queue import ReceiveQueue, queued_bytes

log = logging.getLogger(__name__)

SNIFF_LIMIT = 64 * 1024
"""Bytes a connection may send before its first call; past them it is served here."""
MAX_STREAMS = 1024
"""Calls open at once on one connection (SETTINGS_MAX_CONCURRENT_STREAMS)."""
TURN_SECONDS = 0.004
"""Time a turn of the event loop may spend starting calls, over every connection. Past
it the calls read wait for the next turn, and their connections read no more until
then: the turn ends, so Redis's replies are read and answers written within a few
turns however much waits to be read, and what waits ages where its age is known (in
the kernel, server/receive_queue.py, or held back here): a call whose deadline passed
meanwhile is answered DEADLINE_EXCEEDED for the price of a parse, one with too little
time left for Redis by its failure_mode (exact_late), neither costing Redis a decision."""
DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
RELAY_QUEUE = 64
"""Request messages of a relayed call that may wait for grpcio; one more ends the call."""


@dataclass(frozen=True, slots=True)
class BackendSocket:
    """The grpcio server's private Unix socket, as grpc and as asyncio name it."""

    grpc_target: str
    """``unix:/path`` or ``unix-abstract:name``."""
    path: str
    """The file's path, or the abstract name after a NUL byte."""


@dataclass(frozen=True, slots=True)
class Route:
    """How one method is answered: ``now`` decides at once if it can (None: it cannot);
    ``later`` decides by waiting (for the store), in a task; ``start``, when given, instead
    of both: the answer at once, or an Answering to finish when its future is done. Each
    raises CallFailed for a status."""

    now: Callable[[bytes], bytes | None]
    later: Callable[[bytes, Context], Awaitable[bytes]] | None = None
    start: Callable[[bytes, float | None, float], bytes | Answering] | None = None


class Context:
    """What a servicer asks of its grpc.aio context, for a call served here: the time
    left, the metadata, and abort (raised as CallFailed)."""

    __slots__ = ("_deadline", "_headers", "_loop")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        deadline: float | None,
        headers: list[tuple[str, str]],
    ) -> None:
        """``deadline``: the loop's time, counted from the call's arrival (a call read after
        the loop was held arrived earlier), as gRPC's core would count it."""
        self._loop, self._deadline, self._headers = loop, deadline, headers

    def time_remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - self._loop.time())

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return tuple(self._headers)

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise CallFailed(code, details)


@dataclass(slots=True)
class _Deferred:
    """A read's events, handled up to ``next``."""

    events: list[Any]
    next: int
    read_at: float
    kernel_wait: float


@dataclass(slots=True)
class CallCounts:
    """Calls as this front door counts them (grpcio's channelz counts the rest):
    ``failed`` includes every status but OK, refusals by the connection itself too."""

    started: int = 0
    succeeded: int = 0
    failed: int = 0


class _Connection(asyncio.Protocol):
    """One client connection: routed by its first call, then served or spliced."""

    def __init__(self, server: NativeGrpcServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._h2 = H2Connection(MAX_STREAMS, server.max_request_bytes, server.routes.__contains__)
        self._transport: asyncio.Transport | None = None
        self._sniffed: bytearray | None = bytearray()
        """What the client sent before its first call was seen (None: routed)."""
        self._backend: asyncio.Transport | None = None
        self._to_backend = _WithoutFirstAck()
        self._tasks: dict[int, asyncio.Future[Any]] = {}
        """What each call in flight waits for (a task, or the store's future): cancelled
        when the client resets the call or the connection ends."""
        self._relays: dict[int, asyncio.Queue[bytes | None]] = {}
        """Each relayed call's request messages on their way to grpcio (None: the end)."""
        self._flush_scheduled = False
        self._age_timer: asyncio.TimerHandle | None = None
        self._receive: ReceiveQueue | None = None
        """How long reads waited in the kernel (plaintext connections only)."""
        self._read_at = 0.0
        """When the read whose calls are being started was made (perf_counter)."""
        self._kernel_wait = 0.0
        """How long that read's calls at least waited in the kernel before it."""
        self._deferred: deque[_Deferred] = deque()
        """Reads' events not handled yet: the loop's turn was spent (see TURN_SECONDS)."""
        self._write_paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's are not subclasses
        self._server.connections.add(self)
        # Our SETTINGS at once (gRPC clients send no call before a server's); the rest of
        # what the connection says waits until it is known to be served here.
        self._transport.write(self._h2.take_output())
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if sock is not None and transport.get_extra_info("ssl_object") is None:
            self._receive = ReceiveQueue(functools.partial(queued_bytes, sock.fileno()))

    def connection_lost(self, exc: Exception | None) -> None:
        self._server.connections.discard(self)
        self._deferred.clear()
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
        if self._backend is not None:
            self._backend.close()
        if self._age_timer is not None:
            self._age_timer.cancel()

    def data_received(self, data: bytes) -> None:
        if self._backend is not None:
            self._backend.write(self._to_backend.feed(data))
            return
        read_at = time.perf_counter()
        receive = self._receive
        kernel_wait = 0.0 if receive is None else receive.waited(read_at, len(data))
        sniffed = self._sniffed
        if sniffed is not None:
            sniffed += data
        events = self._h2.receive(data)
        if sniffed is not None:
            path = self._h2.first_path
            if path is None and len(sniffed) <= SNIFF_LIMIT and not self._h2.closed:
                return  # no call yet: nothing sent, so that grpcio may still take it
            self._sniffed = None
            if path is not None and path not in self._server.routes:
                self._splice(bytes(sniffed))
                return
            if not self._h2.closed:  # (a protocol error before the first call: GOAWAY only)
                self._h2.serve()
                self._started()
        if self._deferred:  # behind calls not started yet: in their order
            self._deferred.append(_Deferred(events, 0, read_at, kernel_wait))
        else:
            stopped = self._handle(events, 0, read_at, kernel_wait)
            if stopped < len(events):
                self._deferred.append(_Deferred(events, stopped, read_at, kernel_wait))
                self._hold()
        self._flush()

    def _handle(self, events: list[Any], start: int, read_at: float, kernel_wait: float) -> int:
        """Handle a read's events from ``start`` on, until the loop's turn is spent; the
        index of the first left for a later turn (``len(events)``: none)."""
        server = self._server
        self._read_at, self._kernel_wait = read_at, kernel_wait
        for index in range(start, len(events)):
            event = events[index]
            if isinstance(event, Call):
                if server.turn_spent():
                    return index
                self._dispatch(event)
            elif isinstance(event, Refused):
                counts = self._server.counts
                counts.started += 1
                counts.failed += 1
            elif isinstance(event, Opened):
                self._open_relay(event)
            elif isinstance(event, (Message, HalfClosed)):
                self._to_relay(event)
            elif isinstance(event, Cancelled):
                task = self._tasks.pop(event.stream_id, None)
                if task is not None:
                    task.cancel()
        return len(events)

    def _hold(self) -> None:
        """Read no more until the calls read are started (:meth:`go_on`, next turn)."""
        if self._transport is not None:
            self._transport.pause_reading()
        self._server.hold(self)

    def go_on(self) -> bool:
        """A new turn: start the calls held back, oldest first; read again once they are
        all started (True), or wait for the next turn, this one spent too (False)."""
        deferred = self._deferred
        transport = self._transport
        if transport is None or transport.is_closing():
            deferred.clear()
            return True
        while deferred:
            read = deferred[0]
            read.next = self._handle(read.events, read.next, read.read_at, read.kernel_wait)
            if read.next < len(read.events):
                self._flush()
                return False
            deferred.popleft()
        if not self._write_paused:
            transport.resume_reading()
        self._flush()
        return True

    def _started(self) -> None:
        """Served here from now on: the connection's age is counted, when it is bounded."""
        age = self._server.max_connection_age
        if age is not None:
            self._age_timer = self._loop.call_later(age, self._too_old)

    def _too_old(self) -> None:
        self._age_timer = None
        self.go_away()
        grace = self._server.max_connection_age_grace
        if grace is not None and self._transport is not None:
            self._loop.call_later(grace, self._transport.abort)

    def _dispatch(self, call: Call) -> None:
        counts = self._server.counts
        counts.started += 1
        if not self._h2.is_open(call.stream_id):
            # Reset in the same read (a client that gave up while this process was held
            # up): not decided, no hit counted; failed, as grpcio counts a cancelled call.
            counts.failed += 1
            return
        route = self._server.routes[call.path]  # the others are relayed (Opened)
        if route.start is not None:
            self._start(route.start, call)
            return
        try:
            answer = route.now(call.message)
        except CallFailed as failed:
            counts.failed += 1
            self._h2.fail(call.stream_id, failed.code.value[0], failed.details)
            return
        if answer is not None:
            counts.succeeded += 1
            self._h2.answer(call.stream_id, answer)
        elif route.later is None:
            counts.failed += 1
            self._h2.fail(call.stream_id, INTERNAL, "no answer")
        else:
            deadline, waited = self._deadline(call)
            if self._expired(call, waited):
                return
            context = Context(self._loop, deadline, call.headers)
            task = self._loop.create_task(self._later(route.later, call, context))
            self._tasks[call.stream_id] = task

    def _expired(self, call: Call, waited: float) -> bool:
        """Whether the call's deadline passed before it could be started (it waited that
        long): then its caller has given up, and it is answered DEADLINE_EXCEEDED at once,
        as grpcio answers a call it could not start in time, without a decision (no hit
        counted, the price of a parse)."""
        if call.timeout is None or waited < call.timeout:
            return False
        self._server.counts.failed += 1
        self._h2.fail(call.stream_id, DEADLINE_EXCEEDED, "deadline exceeded before it started")
        return True

    def _deadline(self, call: Call) -> tuple[float | None, float]:
        """The call's deadline (the loop's time; None: it has none) and what it waited for
        the loop or in the kernel before it was started: a call read after the loop was
        held, or behind bytes still queued at an earlier read (server/receive_queue.py),
        or held back a turn (TURN_SECONDS) arrived earlier than now, and its deadline
        counts from then, so that too little time left is said at once (exact_late)."""
        now = time.perf_counter()
        # and in the kernel before the read, and since the read behind its earlier calls
        waited = max(self._server.waited(now), self._kernel_wait + now - self._read_at)
        if call.timeout is None:
            return None, waited
        return self._loop.time() + call.timeout - waited, waited

    def _start(
        self, start: Callable[[bytes, float | None, float], bytes | Answering], call: Call
    ) -> None:
        """A call answered at once, or when what it waits for is done (no task)."""
        counts = self._server.counts
        deadline, waited = self._deadline(call)
        if self._expired(call, waited):
            return
        try:
            outcome = start(call.message, deadline, waited)
        except CallFailed as failed:
            counts.failed += 1
            self._h2.fail(call.stream_id, failed.code.value[0], failed.details)
            return
        if isinstance(outcome, bytes):
            counts.succeeded += 1
            self._h2.answer(call.stream_id, outcome)
            return
        waiting = outcome.waiting
        self._tasks[call.stream_id] = waiting
        waiting.add_done_callback(functools.partial(self._answered, call.stream_id, outcome))

    def _answered(self, stream_id: int, outcome: Answering, waiting: asyncio.Future[Any]) -> None:
        self._tasks.pop(stream_id, None)
        counts = self._server.counts
        if waiting.cancelled():  # the client reset the call, or the connection ended
            counts.failed += 1
            return
        try:
            answer = outcome.finish()
        except CallFailed as failed:
            counts.failed += 1
            self._h2.fail(stream_id, failed.code.value[0], failed.details)
        except Exception:
            log.exception("a call on the native front door failed")
            counts.failed += 1
            self._h2.fail(stream_id, INTERNAL, "internal error")
        else:
            counts.succeeded += 1
            self._h2.answer(stream_id, answer)
        self._flush_soon()

    async def _later(
        self, later: Callable[[bytes, Context], Awaitable[bytes]], call: Call, context: Context
    ) -> None:
        counts = self._server.counts
        try:
            answer = await later(call.message, context)
        except CallFailed as failed:
            counts.failed += 1
            self._h2.fail(call.stream_id, failed.code.value[0], failed.details)
        except asyncio.CancelledError:  # the client reset the stream, or the connection ended
            counts.failed += 1
            return
        except Exception:
            log.exception("a call on the native front door failed")
            counts.failed += 1
            self._h2.fail(call.stream_id, INTERNAL, "internal error")
        else:
            counts.succeeded += 1
            self._h2.answer(call.stream_id, answer)
        finally:
            self._tasks.pop(call.stream_id, None)
        self._flush_soon()

    def _flush_soon(self) -> None:
        """Write what the calls answered in this turn of the loop, together, in the next."""
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._flush)

    # -- calls relayed to grpcio, on a connection served here -----------------------------

    def _open_relay(self, opened: Opened) -> None:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._relays[opened.stream_id] = queue
        self._tasks[opened.stream_id] = self._loop.create_task(self._relay(opened, queue))

    def _to_relay(self, event: Message | HalfClosed) -> None:
        queue = self._relays.get(event.stream_id)
        if queue is None:
            return
        if isinstance(event, HalfClosed):
            queue.put_nowait(None)
        elif queue.qsize() < RELAY_QUEUE:
            queue.put_nowait(event.message)
        else:  # grpcio takes them slower than the client sends: the call ends, said so
            task = self._tasks.pop(event.stream_id, None)
            if task is not None:
                task.cancel()
            self._relays.pop(event.stream_id, None)
            message = f"more than {RELAY_QUEUE} request messages waiting"
            self._h2.send_trailers(event.stream_id, RESOURCE_EXHAUSTED, message, [])

    async def _relay(self, opened: Opened, queue: asyncio.Queue[bytes | None]) -> None:
        """One call to another method on a connection served here, made to grpcio as its
        client would have: metadata, deadline, messages both ways, status."""
        stream_id, h2 = opened.stream_id, self._h2

        async def requests() -> AsyncIterator[bytes]:
            while (message := await queue.get()) is not None:
                yield message

        call = self._server.backend_channel().stream_stream(opened.path)(
            requests(), metadata=relayed_metadata(opened.headers), timeout=opened.timeout
        )
        try:
            h2.send_headers(stream_id, wire_metadata(await call.initial_metadata()))
            self._flush_soon()
            async for response in call:
                h2.send_message(stream_id, response)
                self._flush_soon()
            code, details = await call.code(), await call.details()
            trailing = wire_metadata(await call.trailing_metadata())
            h2.send_trailers(stream_id, code.value[0], details or "", trailing)
        except grpc.aio.AioRpcError as error:
            trailing = wire_metadata(error.trailing_metadata())
            h2.send_trailers(stream_id, error.code().value[0], error.details() or "", trailing)
        except asyncio.CancelledError:  # the client reset the call, or the connection ended
            call.cancel()
            raise
        finally:
            self._tasks.pop(stream_id, None)
            self._relays.pop(stream_id, None)
            self._flush_soon()

    def _flush(self) -> None:
        self._flush_scheduled = False
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        out = self._h2.take_output()
        if out:
            transport.write(out)
        if self._h2.closed:
            transport.close()

    def go_away(self) -> None:
        """Take no new call here; close once the calls taken are answered. A spliced
        connection is left to grpcio, which says the same to it when it stops."""
        if self._backend is None and self._sniffed is None:
            self._h2.go_away()
            self._flush()
        elif self._sniffed is not None and self._transport is not None:
            self._transport.close()  # no call yet: nothing to finish

    def end(self) -> None:
        """Close a connection served here: its GOAWAY out first if its calls are done,
        else at once (their grace is over). A spliced one ends with grpcio's side."""
        transport = self._transport
        if transport is None or self._backend is not None:
            return
        if self._tasks:
            transport.abort()
        else:
            transport.close()

    @property
    def idle(self) -> bool:
        """No call of ours in flight or arriving, no answer held back by the client's window.
        A spliced connection's calls are grpcio's: its stop,
        after ours, gives them their grace (an idle one, such as Envoy's RLQS connection
        once its streams are ended, must not hold the shutdown for the whole grace)."""
        return not self._tasks and (self._backend is not None or not self._h2.streams)

    # -- splicing to grpcio -------------------------------------------------------------

    def _splice(self, first: bytes) -> None:
        """Hand the connection to the grpcio server: what came so far, then both ways."""
        transport = self._transport
        assert transport is not None
        transport.pause_reading()
        task = self._loop.create_task(self._connect_backend(first))
        self._server.splicing.add(task)
        task.add_done_callback(self._server.splicing.discard)

    async def _connect_backend(self, first: bytes) -> None:
        transport = self._transport
        assert transport is not None
        try:
            backend, _ = await self._loop.create_unix_connection(
                lambda: _Backend(transport), self._server.backend.path
            )
        except OSError as exc:
            log.warning("the grpcio server behind the native front door refused: %s", exc)
            transport.close()
            return
        if transport.is_closing():
            backend.close()
            return
        self._backend = backend
        backend.write(self._to_backend.feed(first))
        transport.resume_reading()

    def pause_writing(self) -> None:
        if self._backend is not None:
            self._backend.pause_reading()
        elif self._transport is not None:
            self._write_paused = True
            self._transport.pause_reading()  # answers pile up: take no more calls meanwhile

    def resume_writing(self) -> None:
        if self._backend is not None:
            self._backend.resume_reading()
        elif self._transport is not None:
            self._write_paused = False
            if not self._deferred:
                self._transport.resume_reading()


_NOT_RELAYED = frozenset(
    ("te", "content-type", "user-agent", "grpc-timeout", "grpc-encoding",
     "grpc-accept-encoding", "content-length", "host", "connection")
)  # fmt: skip
"""Headers of a call that are HTTP/2's or gRPC's own, not the caller's metadata."""


def relayed_metadata(headers: list[tuple[str, str]]) -> tuple[tuple[str, str | bytes], ...]:
    """A call's metadata as grpc.aio takes it: binary values (``-bin``) decoded."""
    out: list[tuple[str, str | bytes]] = []
    for name, value in headers:
        if name in _NOT_RELAYED:
            continue
        if name.endswith("-bin"):
            try:
                out.append((name, base64.b64decode(value + "=" * (-len(value) % 4))))
            except ValueError:
                continue  # not base64: dropped, as grpcio drops it
        else:
            out.append((name, value))
    return tuple(out)


def wire_metadata(metadata: Any) -> list[tuple[str, bytes]]:
    """grpc.aio metadata as header values: binary ones (``-bin``) in base64."""
    out = []
    for name, value in metadata or ():
        if isinstance(value, bytes):
            out.append((name, base64.b64encode(value).rstrip(b"=")))
        else:
            out.append((name, str(value).encode()))
    return out


class _WithoutFirstAck:
    """The client's bytes on their way to grpcio, less the client's acknowledgement of our
    SETTINGS (sent before the connection was handed on: grpcio never sent them). The
    client's own SETTINGS were not acknowledged by us: grpcio does."""

    __slots__ = ("_head", "_preface", "_rest", "done")

    def __init__(self) -> None:
        self._preface = len(PREFACE)
        self._rest = 0
        """Bytes of the current frame's payload still to pass."""
        self._head = b""
        self.done = False

    def feed(self, data: bytes) -> bytes:
        if self.done:
            return data
        out = bytearray()
        position = min(self._preface, len(data))
        out += data[:position]
        self._preface -= position
        while position < len(data):
            if self._rest:
                take = min(self._rest, len(data) - position)
                out += data[position : position + take]
                position += take
                self._rest -= take
                continue
            take = 9 - len(self._head)
            self._head += data[position : position + take]
            position += take
            if len(self._head) < 9:
                break
            head, self._head = self._head, b""
            if head == _SETTINGS_ACK:
                self.done = True
                out += data[position:]
                break
            out += head
            self._rest = int.from_bytes(head[:3])
        return bytes(out)


_SETTINGS_ACK = frame(SETTINGS, ACK, 0)


class _Backend(asyncio.Protocol):
    """The grpcio side of a spliced connection: its bytes go to the client as they come."""

    def __init__(self, client: asyncio.Transport) -> None:
        self._client = client
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._client.write(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._client.close()

    def pause_writing(self) -> None:
        self._client.pause_reading()

    def resume_writing(self) -> None:
        self._client.resume_reading()


class NativeGrpcServer:
    """The listener of the native front door (see the module docstring)."""

    def __init__(
        self,
        routes: dict[str, Route],
        backend: BackendSocket,
        max_request_bytes: int,
        max_connection_age: float | None = None,
        max_connection_age_grace: float | None = None,
        waited: Callable[[float], float] = lambda started: 0.0,
        turn_seconds: float = TURN_SECONDS,
    ) -> None:
        self.routes = routes
        """Methods served here, by path (``/package.Service/Method``)."""
        self.backend = backend
        """The grpcio server's Unix socket, where other connections are spliced."""
        self.max_request_bytes = max_request_bytes
        self.max_connection_age = max_connection_age
        self.max_connection_age_grace = max_connection_age_grace
        self.waited = waited
        """How long a call read at a perf_counter time waited for the loop (LoopLag)."""
        self.counts = CallCounts()
        self._backend: grpc.aio.Channel | None = None
        self.connections: set[_Connection] = set()
        self.splicing: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None
        self.turn_seconds = turn_seconds
        self._turn_from: float | None = None
        """When this turn of the loop started its first call (None: none yet)."""
        self._held: deque[_Connection] = deque()
        """Connections with calls held back, in the order they were held."""

    def turn_spent(self) -> bool:
        """Whether this turn of the loop has started calls for TURN_SECONDS already."""
        now = time.perf_counter()
        if self._turn_from is None:
            self._turn_from = now
            asyncio.get_running_loop().call_soon(self._next_turn)
            return False
        return now - self._turn_from > self.turn_seconds

    def hold(self, connection: _Connection) -> None:
        """``connection`` holds calls back until :meth:`_next_turn` (once until then)."""
        self._held.append(connection)

    def _next_turn(self) -> None:
        """The loop turned: the calls held back first, oldest connection first."""
        self._turn_from = None
        held = self._held
        while held:
            if not held[0].go_on():
                return  # spent again: the rest in a later turn (already asked for)
            held.popleft()

    async def start(
        self, addr: str, reuse_port: bool = False, tls: ssl.SSLContext | None = None
    ) -> int:
        """Listen on ``addr`` (host:port, or unix:path), over TLS with ``tls``; the port
        bound (0 for a Unix socket). Spliced connections reach grpcio decrypted."""
        loop = asyncio.get_running_loop()
        if addr.startswith("unix:"):
            path = addr.removeprefix("unix:").removeprefix("//")
            self._server = await loop.create_unix_server(lambda: _Connection(self), path, ssl=tls)
            return 0
        host, port = split_host_port(addr, any_port=True)
        self._server = await loop.create_server(
            lambda: _Connection(self),
            listen_host(host),
            port,
            reuse_port=reuse_port or None,
            ssl=tls,
        )
        sockets = self._server.sockets
        return int(sockets[0].getsockname()[1]) if sockets else 0

    def backend_channel(self) -> grpc.aio.Channel:
        """The channel to grpcio, for calls relayed from connections served here."""
        if self._backend is None:
            self._backend = grpc.aio.insecure_channel(
                self.backend.grpc_target,
                options=[("grpc.max_receive_message_length", -1),
                         ("grpc.max_send_message_length", -1)],
            )  # fmt: skip
        return self._backend

    async def stop(self, grace: float) -> None:
        """Take no new connection; tell each served connection to take no new call, and
        give the calls in flight ``grace`` seconds."""
        if self._server is not None:
            self._server.close()
        for connection in list(self.connections):
            connection.go_away()
        loop = asyncio.get_running_loop()
        until = loop.time() + grace
        while any(not c.idle for c in self.connections) and loop.time() < until:
            await asyncio.sleep(0.01)  # pacing: calls finish on their own schedule
        for connection in list(self.connections):
            connection.end()
        for task in list(self.splicing):
            task.cancel()
        if self._backend is not None:
            await self._backend.close()
