"""The server side of one HTTP/2 connection carrying unary gRPC calls, sans I/O.

The native front door (server/native_grpc.py) answers ShouldRateLimit without grpcio:
grpcio's per-call work (a task, several completion-queue round trips between its core's
thread and the event loop) is most of a Python RLS service's CPU, and a whole call here
is a few frames parsed in one pass over the bytes a read brought. This module is that
pass: bytes in (:meth:`H2Connection.receive`), calls out (:class:`Call`), answers in
(:meth:`H2Connection.answer`, :meth:`H2Connection.fail`), bytes out
(:meth:`H2Connection.take_output`). No sockets, no event loop, no clock: like h11.

What it implements of RFC 9113, for a server of unary calls: the prefaces, SETTINGS
(ours sent first; the peer's applied and acknowledged), PING, GOAWAY both ways,
RST_STREAM, HEADERS with CONTINUATION, padding and priority, flow control both ways
(DATA sent only within the peer's windows, the rest queued; our receive windows
replenished as requests arrive, up to the request size bound), and the errors that
end a connection (GOAWAY with the code) or a stream (RST_STREAM). Header blocks are
decoded by hpack (RFC 7541); the answers' headers are literals that never touch the
peer's table. Server push and stream priorities are not used.
"""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import quote

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0, 1, 2, 3, 4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 5, 6, 7, 8, 9
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20

NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM = 0x5, 0x6, 0x7
CANCEL, COMPRESSION_ERROR, ENHANCE_YOUR_CALM = 0x8, 0x9, 0xB

SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH = 0x1, 0x2
SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 0x3, 0x4
SETTINGS_MAX_FRAME_SIZE, SETTINGS_MAX_HEADER_LIST_SIZE = 0x5, 0x6

DEFAULT_WINDOW = 65_535
MAX_WINDOW = (1 << 31) - 1
FRAME_SIZE = 16_384
"""Our SETTINGS_MAX_FRAME_SIZE (the protocol's default): larger frames are an error."""
CONNECTION_WINDOW = 1 << 20
"""Our connection-level receive window: replenished whenever half of it has arrived."""
MAX_HEADER_BLOCK = 64 * 1024
"""Largest header block (HEADERS and its CONTINUATIONs) accepted, encoded."""
MAX_HEADER_LIST = 16 * 1024
"""SETTINGS_MAX_HEADER_LIST_SIZE: decoded headers' size (RFC 9113's count), at most."""
MAX_MESSAGE_CHARS = 1024
"""grpc-message is cut to this many characters."""

# gRPC status codes the front door answers with itself.
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED = 0, 1, 2, 3, 4
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14

_TIMEOUT_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


class ConnectionError_(Exception):
    """The peer broke the protocol: the connection ends with GOAWAY(code)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


@dataclass(slots=True)
class Call:
    """A unary call received whole: its request message, ready to be answered."""

    stream_id: int
    path: str
    message: bytes
    """The request message (the gRPC length prefix removed)."""
    timeout: float | None
    """grpc-timeout in seconds (None: the caller set no deadline)."""
    headers: list[tuple[str, str]]
    """The call's metadata: every header but the pseudo-headers."""


@dataclass(slots=True)
class Refused:
    """A call answered by the connection itself (malformed, too large): for the counts."""

    stream_id: int
    status: int


@dataclass(slots=True)
class Cancelled:
    """The peer reset a stream whose call may still be running (RST_STREAM)."""

    stream_id: int


@dataclass(slots=True)
class Opened:
    """A call to a method not served here (``relayed``): its messages follow as
    :class:`Message` events, its end as :class:`HalfClosed`; answer it with
    :meth:`H2Connection.send_headers`, :meth:`~H2Connection.send_message` and
    :meth:`~H2Connection.send_trailers`."""

    stream_id: int
    path: str
    timeout: float | None
    headers: list[tuple[str, str]]


@dataclass(slots=True)
class Message:
    """One request message of a relayed call."""

    stream_id: int
    message: bytes


@dataclass(slots=True)
class HalfClosed:
    """The peer has sent all of a relayed call's messages."""

    stream_id: int


@dataclass(slots=True)
class _Stream:
    stream_id: int
    send_window: int
    path: str = ""
    timeout: float | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    unacknowledged: int = 0
    """Bytes of DATA received since its window was last replenished."""
    remote_closed: bool = False
    answered: bool = False
    """Its last frame (trailers) is queued or sent."""
    relayed: bool = False
    """A call to a method not served here: its messages are events as they come."""
    headers_sent: bool = False
    pending: deque[tuple[bool, bytes]] = field(default_factory=deque)
    """Frames waiting for flow control: (is DATA, the frame's payload or encoded frame)."""


Event = Call | Refused | Cancelled | Opened | Message | HalfClosed


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame: its 9-byte header and payload."""
    return (
        struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + stream_id.to_bytes(4) + payload
    )


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """An HPACK integer with an N-bit prefix, ``first`` holding the bits above it."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _literal(name: bytes, value: bytes) -> bytes:
    """A header as a literal never indexed by the peer's table, names and values raw."""
    return b"\x00" + _integer(len(name), 7, 0) + name + _integer(len(value), 7, 0) + value


_STATUS_200 = b"\x88"  # :status 200, the static table's entry 8
_GRPC_CONTENT_TYPE = b"\x0f\x10" + _integer(16, 7, 0) + b"application/grpc"  # name: entry 31
RESPONSE_HEADERS = _STATUS_200 + _GRPC_CONTENT_TYPE
OK_TRAILERS = _literal(b"grpc-status", b"0")
_HEADERS_HEAD = len(RESPONSE_HEADERS).to_bytes(3) + bytes((HEADERS, END_HEADERS))
_TRAILERS_HEAD = len(OK_TRAILERS).to_bytes(3) + bytes((HEADERS, END_HEADERS | END_STREAM))
_DATA_KIND = bytes((DATA, 0))


def status_block(status: int, message: str) -> bytes:
    """A trailers-only answer's header block: :status, content-type, grpc-status and
    grpc-message (percent-encoded, as gRPC's HTTP/2 mapping says)."""
    block = RESPONSE_HEADERS + _literal(b"grpc-status", str(status).encode())
    if message:
        text = quote(message[:MAX_MESSAGE_CHARS], safe=" !\"#$&'()*+,-./:;<=>?@[\\]^_`{|}~")
        block += _literal(b"grpc-message", text.encode())
    return block


def parse_timeout(value: str) -> float | None:
    """grpc-timeout's value in seconds (up to 8 digits and a unit), or None if malformed."""
    digits, unit = value[:-1], value[-1:].encode()
    if not (digits.isascii() and digits.isdigit()) or len(digits) > 8:
        return None
    if unit not in _TIMEOUT_UNITS:
        return None
    return int(digits) * _TIMEOUT_UNITS[unit]


_Head = tuple[str, str, float | None, tuple[tuple[str, str], ...]]


def _head(decoded: list[tuple[bytes, bytes]]) -> _Head:
    """A request's path, method, timeout (grpc-timeout) and other headers, decoded."""
    path = method = ""
    timeout = None
    headers = []
    for name, value in decoded:
        if name.startswith(b":"):
            if name == b":path":
                path = value.decode("latin-1")
            elif name == b":method":
                method = value.decode("latin-1")
        elif name == b"grpc-timeout":
            timeout = parse_timeout(value.decode("latin-1"))
        else:
            headers.append((name.decode("latin-1"), value.decode("latin-1")))
    return path, method, timeout, tuple(headers)


class H2Connection:
    """One connection's HTTP/2 state, server side. Feed it bytes, answer its calls, send what
    :meth:`take_output` returns."""

    def __init__(
        self,
        max_streams: int,
        max_request_bytes: int,
        served: Callable[[str], bool] = lambda path: True,
    ) -> None:
        self.max_streams = max_streams
        self.max_request_bytes = max_request_bytes
        self.served = served
        """Whether a path is answered here whole (a Call); the others are relayed."""
        self._decoder = hpack.Decoder(max_header_list_size=MAX_HEADER_LIST)
        self._decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self._heads: dict[bytes, _Head] = {}
        """A request header block's path, method, timeout and other headers, by its bytes
        (a client repeats the same block while its HPACK table stands still)."""
        """Header blocks already decoded that left the peer's table as it was: Envoy and
        gRPC clients send the same few blocks over and over (valid until the table changes)."""
        self._buffer = b""
        self._preface_seen = False
        self._streams: dict[int, _Stream] = {}
        self._blocked: deque[int] = deque()
        """Streams with output waiting for the peer's windows, oldest first."""
        self._last_stream = 0
        self._headers_for: _Stream | None = None
        """The stream whose header block continues in CONTINUATION frames."""
        self._block = bytearray()
        self._block_ends_stream = False
        self._send_window = DEFAULT_WINDOW
        self._peer_initial_window = DEFAULT_WINDOW
        self._peer_frame_size = FRAME_SIZE
        self._received = 0
        """DATA bytes since our connection window was last replenished."""
        self._out: list[bytes] = [
            frame(
                SETTINGS,
                0,
                0,
                struct.pack(">HI", SETTINGS_MAX_CONCURRENT_STREAMS, max_streams)
                + struct.pack(">HI", SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)
                + struct.pack(">HI", SETTINGS_ENABLE_PUSH, 0),
            ),
        ]
        self._serving = False
        self.first_path: str | None = None
        """The path of the first call the peer opened (to route a connection by it)."""
        self.going_away = False
        """GOAWAY sent or received: no new call is taken."""
        self.closed = False
        """The connection is over (a protocol error, or GOAWAY and no stream left): close it."""

    def serve(self) -> None:
        """This connection is ours to serve (not handed on after its first call): our
        connection window opens wide."""
        if not self._serving:
            self._serving = True
            increment = CONNECTION_WINDOW - DEFAULT_WINDOW
            self._out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", increment)))

    # -- bytes in -------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """The calls (and resets) that ``data`` completes. A protocol error queues GOAWAY
        and marks the connection closed."""
        events: list[Event] = []
        if self.closed:
            return events
        buffer = self._buffer + data if self._buffer else data
        try:
            if not self._preface_seen:
                if len(buffer) < len(PREFACE):
                    if not PREFACE.startswith(buffer):
                        raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    self._buffer = buffer
                    return events
                if not buffer.startswith(PREFACE):
                    raise ConnectionError_(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                buffer = buffer[len(PREFACE) :]
                self._preface_seen = True
            end = self._frames(buffer, events)
            self._buffer = buffer[end:]
        except ConnectionError_ as error:
            self._end(error.code, str(error))
        if self._serving and self._received >= CONNECTION_WINDOW // 2:
            self._out.append(frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", self._received)))
            self._received = 0
        return events

    def _frames(self, buffer: bytes, events: list[Event]) -> int:
        """Every whole frame in ``buffer``; returns where the unfinished one begins."""
        position, size = 0, len(buffer)
        while size - position >= 9:
            length = int.from_bytes(buffer[position : position + 3])
            if length > FRAME_SIZE:
                raise ConnectionError_(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
            end = position + 9 + length
            if end > size:
                break
            kind, flags = buffer[position + 3], buffer[position + 4]
            stream_id = int.from_bytes(buffer[position + 5 : position + 9]) & 0x7FFFFFFF
            payload = buffer[position + 9 : end]
            position = end
            if self._headers_for is not None and kind != CONTINUATION:
                raise ConnectionError_(PROTOCOL_ERROR, "a header block cut by another frame")
            if kind == DATA:
                self._data(stream_id, flags, payload, events)
            elif kind == HEADERS:
                self._headers(stream_id, flags, payload, events)
            elif kind == CONTINUATION:
                self._continuation(stream_id, flags, payload, events)
            elif kind == SETTINGS:
                self._settings(stream_id, flags, payload)
            elif kind == WINDOW_UPDATE:
                self._window_update(stream_id, payload)
            elif kind == PING:
                if stream_id:
                    raise ConnectionError_(PROTOCOL_ERROR, "a PING on a stream")
                if length != 8:
                    raise ConnectionError_(FRAME_SIZE_ERROR, "a PING not of 8 bytes")
                if not flags & ACK:
                    self._out.append(frame(PING, ACK, 0, payload))
            elif kind == RST_STREAM:
                self._reset(stream_id, payload, events)
            elif kind == GOAWAY:
                self.going_away = True
                self._close_if_done()
            elif kind == PUSH_PROMISE:
                raise ConnectionError_(PROTOCOL_ERROR, "PUSH_PROMISE from a client")
            elif kind == PRIORITY and not stream_id:
                raise ConnectionError_(PROTOCOL_ERROR, "a PRIORITY on stream 0")
            elif kind == PRIORITY and length != 5:
                raise ConnectionError_(FRAME_SIZE_ERROR, "a PRIORITY not of 5 bytes")
            # other kinds (PRIORITY, unknown extensions) are ignored, as RFC 9113 says
        return position

    @staticmethod
    def _unpad(flags: int, payload: bytes) -> bytes:
        if not flags & PADDED:
            return payload
        if not payload or payload[0] >= len(payload):
            raise ConnectionError_(PROTOCOL_ERROR, "padding longer than the frame")
        return payload[1 : len(payload) - payload[0]]

    def _data(self, stream_id: int, flags: int, payload: bytes, events: list[Event]) -> None:
        self._received += len(payload)  # padding counts against the window too
        if stream_id == 0 or stream_id > self._last_stream:
            raise ConnectionError_(PROTOCOL_ERROR, f"DATA on idle stream {stream_id}")
        stream = self._streams.get(stream_id)
        if stream is None:  # over (answered, refused or reset): what was in flight is dropped
            return
        if stream.remote_closed:
            self._out.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", STREAM_CLOSED)))
            self._drop(stream)
            return
        body = self._unpad(flags, payload)
        stream.unacknowledged += len(payload)
        stream.remote_closed = bool(flags & END_STREAM)  # before a refusal: no RST_STREAM then
        if stream.relayed:
            self._relay_data(stream, body, events)
            return
        if len(stream.body) + len(body) > self.max_request_bytes + 5:
            self._refuse(
                stream, RESOURCE_EXHAUSTED, "request larger than --max-request-bytes", events
            )
            return
        stream.body += body
        if stream.remote_closed:
            self._complete(stream, events)
        elif stream.unacknowledged >= DEFAULT_WINDOW // 2:
            increment = stream.unacknowledged
            stream.unacknowledged = 0
            self._out.append(frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment)))

    def _relay_data(self, stream: _Stream, body: bytes, events: list[Event]) -> None:
        """A relayed call's DATA: each whole message an event, the window replenished as
        they go (the relay bounds what it holds)."""
        buffer = stream.body
        buffer += body
        while len(buffer) >= 5:
            size = int.from_bytes(buffer[1:5])
            if size > self.max_request_bytes:
                message = "request larger than --max-request-bytes"
                self._refuse(stream, RESOURCE_EXHAUSTED, message, events)
                return
            if len(buffer) < 5 + size:
                break
            events.append(Message(stream.stream_id, bytes(buffer[5 : 5 + size])))
            del buffer[: 5 + size]
        if stream.remote_closed:
            if buffer:
                self._refuse(stream, INTERNAL, "a request message cut short", events)
                return
            events.append(HalfClosed(stream.stream_id))
        elif stream.unacknowledged >= DEFAULT_WINDOW // 2:
            increment, stream.unacknowledged = stream.unacknowledged, 0
            self._out.append(
                frame(WINDOW_UPDATE, 0, stream.stream_id, struct.pack(">I", increment))
            )

    def _headers(self, stream_id: int, flags: int, payload: bytes, events: list[Event]) -> None:
        if stream_id == 0 or not stream_id & 1:
            raise ConnectionError_(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        payload = self._unpad(flags, payload)
        if flags & PRIORITY_FLAG:
            payload = payload[5:]
        stream = self._streams.get(stream_id)
        if stream is None:
            if stream_id <= self._last_stream:
                raise ConnectionError_(STREAM_CLOSED, f"HEADERS on closed stream {stream_id}")
            self._last_stream = stream_id
            stream = _Stream(stream_id, self._peer_initial_window)
            if self.going_away or len(self._streams) >= self.max_streams:
                # Refused; its header block is still decoded: the peer's table depends on it.
                self._out.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", REFUSED_STREAM)))
                if flags & END_HEADERS:
                    self._decode(payload)
                else:
                    self._headers_for, self._block = _Stream(stream_id, 0), bytearray(payload)
                return
            self._streams[stream_id] = stream
        elif stream.remote_closed:
            raise ConnectionError_(STREAM_CLOSED, f"HEADERS after the end of stream {stream_id}")
        self._block_ends_stream = bool(flags & END_STREAM)
        if flags & END_HEADERS:
            self._header_block(stream, payload, events)
        else:
            self._headers_for, self._block = stream, bytearray(payload)

    def _continuation(
        self, stream_id: int, flags: int, payload: bytes, events: list[Event]
    ) -> None:
        stream = self._headers_for
        if stream is None or stream.stream_id != stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "CONTINUATION out of place")
        self._block += payload
        if len(self._block) > MAX_HEADER_BLOCK:
            raise ConnectionError_(ENHANCE_YOUR_CALM, "a header block larger than 64 KiB")
        if flags & END_HEADERS:
            self._headers_for = None
            block = bytes(self._block)
            self._block = bytearray()
            if stream.stream_id in self._streams:
                self._header_block(stream, block, events)
            else:  # a refused stream's block: decoded for the table's sake only
                self._decode(block)

    def _decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        decoded = self._decoded.get(block)
        if decoded is not None:
            return decoded
        table = self._decoder.header_table
        before = (
            len(table.dynamic_entries),
            table.dynamic_entries[0] if table.dynamic_entries else None,
        )
        try:
            decoded = list(self._decoder.decode(block, raw=True))
        except hpack.HPACKError as error:
            raise ConnectionError_(COMPRESSION_ERROR, f"header block: {error}") from error
        entries = table.dynamic_entries
        # An insertion leaves a new tuple at entries[0] even when it equals the one it
        # follows (duplicates are allowed, RFC 7541 2.3.2): compared by identity.
        if len(entries) == before[0] and (entries[0] if entries else None) is before[1]:
            if len(self._decoded) < 64:
                self._decoded[block] = decoded
        else:
            self._decoded.clear()  # the table moved: indices decode differently now
            self._heads.clear()
        return decoded

    def _header_block(self, stream: _Stream, block: bytes, events: list[Event]) -> None:
        ends = self._block_ends_stream
        if stream.path:  # trailers from the client: only their end matters
            if not ends:
                raise ConnectionError_(PROTOCOL_ERROR, "trailers without END_STREAM")
            self._decode(block)
            stream.remote_closed = True
            self._complete(stream, events)
            return
        head = self._heads.get(block)
        if head is None:
            head = _head(self._decode(block))
            if block in self._decoded:  # kept while the table stands still
                self._heads[block] = head
        stream.path, method, stream.timeout, headers = head
        stream.headers = list(headers)
        if self.first_path is None:
            self.first_path = stream.path
        stream.remote_closed = ends  # before a refusal: no RST_STREAM on a stream the peer ended
        if method != "POST" or not stream.path:
            self._refuse(
                stream, INTERNAL, f"a gRPC call is a POST with a path, not {method!r}", events
            )
            return
        if not self.served(stream.path):
            stream.relayed = True
            events.append(Opened(stream.stream_id, stream.path, stream.timeout, stream.headers))
            if ends:
                events.append(HalfClosed(stream.stream_id))
            return
        if ends:
            self._complete(stream, events)

    def _complete(self, stream: _Stream, events: list[Event]) -> None:
        """The request is whole: one length-prefixed message, uncompressed."""
        body = stream.body
        if len(body) < 5 or body[0] not in (0, 1) or int.from_bytes(body[1:5]) != len(body) - 5:
            self._refuse(stream, INTERNAL, "the request is not one gRPC message", events)
        elif body[0] == 1:
            self._refuse(stream, UNIMPLEMENTED, "compressed requests are not accepted", events)
        elif len(body) - 5 > self.max_request_bytes:
            self._refuse(
                stream, RESOURCE_EXHAUSTED, "request larger than --max-request-bytes", events
            )
        else:
            events.append(
                Call(stream.stream_id, stream.path, bytes(body[5:]), stream.timeout, stream.headers)
            )
            stream.body = bytearray()

    def _refuse(self, stream: _Stream, status: int, message: str, events: list[Event]) -> None:
        events.append(Refused(stream.stream_id, status))
        self.fail(stream.stream_id, status, message)

    def _settings(self, stream_id: int, flags: int, payload: bytes) -> None:
        if stream_id:
            raise ConnectionError_(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise ConnectionError_(FRAME_SIZE_ERROR, "a SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise ConnectionError_(FRAME_SIZE_ERROR, "a SETTINGS payload not in 6-byte entries")
        for offset in range(0, len(payload), 6):
            key, value = struct.unpack_from(">HI", payload, offset)
            if key == SETTINGS_INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise ConnectionError_(FLOW_CONTROL_ERROR, "an initial window past 2^31-1")
                delta, self._peer_initial_window = value - self._peer_initial_window, value
                for stream in self._streams.values():
                    stream.send_window += delta
            elif key == SETTINGS_MAX_FRAME_SIZE:
                if not FRAME_SIZE <= value < 1 << 24:
                    raise ConnectionError_(PROTOCOL_ERROR, f"SETTINGS_MAX_FRAME_SIZE {value}")
                self._peer_frame_size = value
            elif key == SETTINGS_ENABLE_PUSH and value > 1:
                raise ConnectionError_(PROTOCOL_ERROR, f"SETTINGS_ENABLE_PUSH {value}")
        self._out.append(frame(SETTINGS, ACK, 0))
        self._flush_blocked()

    def _window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "a WINDOW_UPDATE not of 4 bytes")
        increment = int.from_bytes(payload) & 0x7FFFFFFF
        if stream_id == 0:
            if not increment:
                raise ConnectionError_(PROTOCOL_ERROR, "a WINDOW_UPDATE of 0")
            self._send_window += increment
            if self._send_window > MAX_WINDOW:
                raise ConnectionError_(FLOW_CONTROL_ERROR, "the connection window past 2^31-1")
        else:
            stream = self._streams.get(stream_id)
            if stream is None:
                return  # a stream already over: nothing to send on it
            stream.send_window += increment
            if not increment or stream.send_window > MAX_WINDOW:
                self._drop(stream)
                code = FLOW_CONTROL_ERROR if increment else PROTOCOL_ERROR
                self._out.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", code)))
                return
        self._flush_blocked()

    def _reset(self, stream_id: int, payload: bytes, events: list[Event]) -> None:
        if len(payload) != 4:
            raise ConnectionError_(FRAME_SIZE_ERROR, "an RST_STREAM not of 4 bytes")
        if stream_id == 0 or stream_id > self._last_stream:
            raise ConnectionError_(PROTOCOL_ERROR, f"RST_STREAM on idle stream {stream_id}")
        stream = self._streams.get(stream_id)
        if stream is not None:
            if (stream.remote_closed or stream.relayed) and not stream.answered:
                events.append(Cancelled(stream_id))
            self._drop(stream)

    # -- answers out ------------------------------------------------------------------------

    def answer(self, stream_id: int, message: bytes) -> None:
        """Send ``message`` as the call's response, then status OK. Nothing if the stream
        is gone (reset by the peer)."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.answered:
            return
        stream.answered = True
        size = len(message) + 5
        if (
            not stream.pending
            and size <= self._peer_frame_size
            and size <= self._send_window
            and size <= stream.send_window
            and stream.remote_closed
        ):
            # The usual answer: all of it within the windows, in one piece, as _send would
            # write it frame by frame.
            self._send_window -= size
            stream.send_window -= size
            sid = stream_id.to_bytes(4)
            head = _HEADERS_HEAD + sid + RESPONSE_HEADERS
            body = size.to_bytes(3) + _DATA_KIND + sid + len(message).to_bytes(5)
            self._out.append(b"".join((head, body, message, _TRAILERS_HEAD, sid, OK_TRAILERS)))
            self._drop(stream)
            return
        self._out.append(frame(HEADERS, END_HEADERS, stream_id, RESPONSE_HEADERS))
        data = len(message).to_bytes(5) + message  # flag 0, then the 4-byte length
        limit = self._peer_frame_size
        for start in range(0, len(data), limit):
            stream.pending.append((True, data[start : start + limit]))
        stream.pending.append(
            (False, frame(HEADERS, END_HEADERS | END_STREAM, stream_id, OK_TRAILERS))
        )
        self._send(stream)

    def fail(self, stream_id: int, status: int, message: str) -> None:
        """End the call with a gRPC status (a trailers-only answer)."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.answered:
            return
        stream.answered = True
        block = status_block(status, message)
        self._out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block))
        if not stream.remote_closed:  # the peer may still be sending: tell it to stop
            self._out.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", NO_ERROR)))
        self._drop(stream)

    def send_headers(self, stream_id: int, metadata: list[tuple[str, bytes]]) -> None:
        """A relayed call's response headers, with its initial metadata (values as sent)."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.answered or stream.headers_sent:
            return
        stream.headers_sent = True
        block = RESPONSE_HEADERS + b"".join(_literal(k.encode(), v) for k, v in metadata)
        self._out.append(frame(HEADERS, END_HEADERS, stream_id, block))

    def send_message(self, stream_id: int, message: bytes) -> None:
        """One response message of a relayed call (after its headers), within the windows."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.answered:
            return
        if not stream.headers_sent:
            self.send_headers(stream_id, [])
        data = len(message).to_bytes(5) + message
        limit = self._peer_frame_size
        for start in range(0, len(data), limit):
            stream.pending.append((True, data[start : start + limit]))
        self._send(stream)

    def send_trailers(
        self, stream_id: int, status: int, details: str, metadata: list[tuple[str, bytes]]
    ) -> None:
        """End a relayed call: its status and trailing metadata, after its messages."""
        stream = self._streams.get(stream_id)
        if stream is None or stream.answered:
            return
        extra = b"".join(_literal(k.encode(), v) for k, v in metadata)
        if not stream.headers_sent:  # trailers only
            stream.answered = True
            block = status_block(status, details) + extra
            self._out.append(frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block))
            if not stream.remote_closed:
                self._out.append(frame(RST_STREAM, 0, stream_id, struct.pack(">I", NO_ERROR)))
            self._drop(stream)
            return
        stream.answered = True
        block = status_block(status, details)[len(RESPONSE_HEADERS) :] + extra
        stream.pending.append((False, frame(HEADERS, END_HEADERS | END_STREAM, stream_id, block)))
        self._send(stream)

    def _send(self, stream: _Stream) -> None:
        """The stream's queued frames, as far as the windows allow; the stream is closed
        once its trailers are out."""
        pending = stream.pending
        while pending:
            is_data, chunk = pending[0]
            if is_data:
                room = min(self._send_window, stream.send_window)
                if len(chunk) > room:
                    if room > 0:  # what fits now (a peer may grant no more until it has it)
                        self._send_window -= room
                        stream.send_window -= room
                        self._out.append(frame(DATA, 0, stream.stream_id, chunk[:room]))
                        pending[0] = (True, chunk[room:])
                    if stream.stream_id not in self._blocked:
                        self._blocked.append(stream.stream_id)
                    return
                self._send_window -= len(chunk)
                stream.send_window -= len(chunk)
                self._out.append(frame(DATA, 0, stream.stream_id, chunk))
            else:
                self._out.append(chunk)
            pending.popleft()
        if stream.answered:
            if not stream.remote_closed:  # a relayed call the peer still sends on: stop it
                self._out.append(
                    frame(RST_STREAM, 0, stream.stream_id, struct.pack(">I", NO_ERROR))
                )
            self._drop(stream)

    def _flush_blocked(self) -> None:
        for _ in range(len(self._blocked)):
            stream = self._streams.get(self._blocked.popleft())
            if stream is not None:
                self._send(stream)

    def _drop(self, stream: _Stream) -> None:
        self._streams.pop(stream.stream_id, None)
        self._close_if_done()

    def _close_if_done(self) -> None:
        if self.going_away and not self._streams:
            self.closed = True

    def go_away(self) -> None:
        """Take no new call; the connection ends once the calls taken are answered."""
        if not self.going_away:
            self.going_away = True
            self._out.append(frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, NO_ERROR)))
        self._close_if_done()

    def _end(self, code: int, why: str) -> None:
        self._out.append(
            frame(GOAWAY, 0, 0, struct.pack(">II", self._last_stream, code) + why.encode()[:256])
        )
        self.going_away = self.closed = True
        self._streams.clear()
        self._blocked.clear()

    # -- bytes out ------------------------------------------------------------------------

    def take_output(self) -> bytes:
        """What to send now (and forget)."""
        if not self._out:
            return b""
        out = b"".join(self._out)
        self._out.clear()
        return out

    def is_open(self, stream_id: int) -> bool:
        """Whether a call is still there to answer (not reset by the peer, nor refused)."""
        return stream_id in self._streams

    @property
    def streams(self) -> int:
        """Calls open: received or being received, not answered (or answers queued)."""
        return len(self._streams)
