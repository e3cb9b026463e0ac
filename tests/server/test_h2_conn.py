"""server/h2_conn.py, the sans-I/O HTTP/2 server connection of the native front door,
driven byte for byte as a client would drive it.

Requests are built with hpack's encoder (its own dynamic table, as a real peer's) and the
module's frame(); what the server writes is parsed back into frames and its header blocks
decoded with hpack, so every assertion is on values a peer would see: statuses in trailers,
DATA payloads, window increments, GOAWAY and RST_STREAM codes, last stream ids. No socket,
no clock: the connection is a function of the bytes fed to it.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import hpack
import pytest

from ratelimit_service.server.h2_conn import (
    ACK,
    CANCEL,
    COMPRESSION_ERROR,
    CONNECTION_WINDOW,
    CONTINUATION,
    DATA,
    DEFAULT_WINDOW,
    END_HEADERS,
    END_STREAM,
    ENHANCE_YOUR_CALM,
    FLOW_CONTROL_ERROR,
    FRAME_SIZE,
    FRAME_SIZE_ERROR,
    GOAWAY,
    HEADERS,
    INTERNAL,
    MAX_HEADER_LIST,
    MAX_MESSAGE_CHARS,
    MAX_WINDOW,
    NO_ERROR,
    OK_TRAILERS,
    PADDED,
    PING,
    PREFACE,
    PRIORITY,
    PRIORITY_FLAG,
    PROTOCOL_ERROR,
    PUSH_PROMISE,
    REFUSED_STREAM,
    RESOURCE_EXHAUSTED,
    RESPONSE_HEADERS,
    RST_STREAM,
    SETTINGS,
    SETTINGS_ENABLE_PUSH,
    SETTINGS_INITIAL_WINDOW_SIZE,
    SETTINGS_MAX_CONCURRENT_STREAMS,
    SETTINGS_MAX_FRAME_SIZE,
    SETTINGS_MAX_HEADER_LIST_SIZE,
    STREAM_CLOSED,
    UNIMPLEMENTED,
    WINDOW_UPDATE,
    Call,
    Cancelled,
    Event,
    H2Connection,
    HalfClosed,
    Message,
    Opened,
    Refused,
    frame,
    parse_timeout,
    status_block,
)

Headers = list[tuple[str, str]]


class Frame(NamedTuple):
    kind: int
    flags: int
    stream_id: int
    payload: bytes


def parse(data: bytes, max_frame: int = FRAME_SIZE) -> list[Frame]:
    """Whole frames, every one of them: a cut frame or one over ``max_frame`` fails."""
    frames, position = [], 0
    while position < len(data):
        assert len(data) - position >= 9, "a cut frame header"
        length = int.from_bytes(data[position : position + 3])
        assert length <= max_frame, f"a frame of {length} bytes"
        kind, flags = data[position + 3], data[position + 4]
        stream_id = int.from_bytes(data[position + 5 : position + 9])
        assert not stream_id >> 31, "the reserved bit is set"
        payload = data[position + 9 : position + 9 + length]
        assert len(payload) == length, "a cut frame payload"
        frames.append(Frame(kind, flags, stream_id, payload))
        position += 9 + length
    return frames


def settings(*pairs: tuple[int, int]) -> bytes:
    return b"".join(struct.pack(">HI", key, value) for key, value in pairs)


def u32(value: int) -> bytes:
    return struct.pack(">I", value)


def grpc(message: bytes, flag: int = 0) -> bytes:
    """One gRPC length-prefixed message."""
    return bytes((flag,)) + len(message).to_bytes(4) + message


def request(
    path: str = "/svc/M",
    method: str = "POST",
    timeout: str | None = "20m",
    extra: Sequence[tuple[str, str]] = (),
) -> Headers:
    headers = [
        (":method", method),
        (":scheme", "http"),
        (":path", path),
        (":authority", "rls"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    if timeout is not None:
        headers.append(("grpc-timeout", timeout))
    return headers + list(extra)


METADATA = [("content-type", "application/grpc"), ("te", "trailers")]
"""What Call.headers holds of request(): no pseudo-header, no grpc-timeout."""


class Client:
    """The peer: an HPACK encoder for its requests, a decoder for the server's blocks."""

    def __init__(self, conn: H2Connection) -> None:
        self.conn = conn
        self.encoder = hpack.Encoder()
        self.decoder = hpack.Decoder()

    def send(self, *frames: bytes) -> list[Event]:
        return self.conn.receive(b"".join(frames))

    def output(self, max_frame: int = FRAME_SIZE) -> list[Frame]:
        return parse(self.conn.take_output(), max_frame)

    def block(self, headers: Iterable[tuple[str, str] | tuple[bytes, bytes]]) -> bytes:
        return self.encoder.encode(list(headers))

    def decode(self, block: bytes) -> Headers:
        return [(n.decode(), v.decode()) for n, v in self.decoder.decode(block, raw=True)]

    def call(
        self, stream_id: int, message: bytes = b"hi", headers: Headers | None = None
    ) -> list[Event]:
        block = self.block(request() if headers is None else headers)
        return self.send(
            frame(HEADERS, END_HEADERS, stream_id, block),
            frame(DATA, END_STREAM, stream_id, grpc(message)),
        )


def connect(
    max_streams: int = 100,
    max_request_bytes: int = 4096,
    peer_settings: bytes = b"",
    serve: bool = True,
) -> Client:
    """A connection past the prefaces, its output so far (SETTINGS, ACK, WINDOW_UPDATE) taken."""
    client = Client(H2Connection(max_streams, max_request_bytes))
    assert client.send(PREFACE, frame(SETTINGS, 0, 0, peer_settings)) == []
    if serve:
        client.conn.serve()
    client.conn.take_output()
    return client


def call(stream_id: int, message: bytes = b"hi", extra: Headers | None = None) -> Call:
    """The Call of request(extra=extra): grpc-timeout 20m is 20 * 1e-3 == 0.02 exactly."""
    return Call(stream_id, "/svc/M", message, 0.02, METADATA + (extra or []))


def data_of(frames: Iterable[Frame], stream_id: int) -> bytes:
    return b"".join(f.payload for f in frames if f.kind == DATA and f.stream_id == stream_id)


def shape(frames: Iterable[Frame]) -> list[tuple[int, int, int]]:
    """(kind, stream, DATA length or flags): the order of what went out."""
    return [(f.kind, f.stream_id, len(f.payload) if f.kind == DATA else f.flags) for f in frames]


def goaway(frames: list[Frame]) -> tuple[int, int, bytes]:
    """The one GOAWAY's last stream id, error code and debug data."""
    found = [f for f in frames if f.kind == GOAWAY]
    assert len(found) == 1, frames
    assert found[0].stream_id == 0
    last, code = struct.unpack(">II", found[0].payload[:8])
    return last, code, found[0].payload[8:]


def resets(frames: Iterable[Frame]) -> list[tuple[int, int]]:
    return [(f.stream_id, int.from_bytes(f.payload)) for f in frames if f.kind == RST_STREAM]


def windows(frames: Iterable[Frame]) -> list[tuple[int, int]]:
    return [(f.stream_id, int.from_bytes(f.payload)) for f in frames if f.kind == WINDOW_UPDATE]


# -- a call, whole ---------------------------------------------------------------------------


def test_a_unary_call_is_received_and_answered() -> None:
    client = Client(H2Connection(max_streams=7, max_request_bytes=4096))
    block = client.block(request(extra=[("x-custom", "v1")]))
    events = client.send(
        PREFACE,
        frame(SETTINGS, 0, 0),
        frame(HEADERS, END_HEADERS, 1, block),
        frame(DATA, END_STREAM, 1, grpc(b"hello")),
    )
    assert events == [call(1, b"hello", [("x-custom", "v1")])]
    (got,) = events
    assert isinstance(got, Call)
    assert got.timeout == pytest.approx(0.02)
    assert not [name for name, _ in got.headers if name.startswith(":")]
    assert client.conn.first_path == "/svc/M"
    assert client.conn.streams == 1

    ours, ack = client.output()
    assert (ours.kind, ours.flags, ours.stream_id) == (SETTINGS, 0, 0)
    entries = [struct.unpack(">HI", ours.payload[i : i + 6]) for i in range(0, 18, 6)]
    assert len(ours.payload) == 18
    assert entries == [
        (SETTINGS_MAX_CONCURRENT_STREAMS, 7),
        (SETTINGS_MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST),
        (SETTINGS_ENABLE_PUSH, 0),
    ]
    assert ack == Frame(SETTINGS, ACK, 0, b"")

    client.conn.serve()
    assert client.output() == [Frame(WINDOW_UPDATE, 0, 0, u32(CONNECTION_WINDOW - DEFAULT_WINDOW))]
    client.conn.serve()
    assert client.conn.take_output() == b""

    client.conn.answer(1, b"world")
    headers, data, trailers = client.output()
    assert (headers.kind, headers.flags, headers.stream_id) == (HEADERS, END_HEADERS, 1)
    assert client.decode(headers.payload) == [
        (":status", "200"),
        ("content-type", "application/grpc"),
    ]
    assert data == Frame(DATA, 0, 1, b"\x00\x00\x00\x00\x05world")
    assert (trailers.kind, trailers.flags, trailers.stream_id) == (
        HEADERS,
        END_HEADERS | END_STREAM,
        1,
    )
    assert client.decode(trailers.payload) == [("grpc-status", "0")]
    assert client.conn.streams == 0
    assert not client.conn.closed


def test_an_answer_within_the_windows_is_its_three_frames_and_spends_the_windows() -> None:
    client = connect(peer_settings=settings((SETTINGS_INITIAL_WINDOW_SIZE, 100_000)))
    for stream_id in (1, 3, 5, 7, 9):
        client.call(stream_id)
    client.conn.take_output()
    client.conn.answer(1, b"x" * 16_000)  # 16,005 bytes of DATA: one frame, within the windows
    assert client.conn.take_output() == (
        frame(HEADERS, END_HEADERS, 1, RESPONSE_HEADERS)
        + frame(DATA, 0, 1, grpc(b"x" * 16_000))
        + frame(HEADERS, END_HEADERS | END_STREAM, 1, OK_TRAILERS)
    )
    for stream_id in (3, 5, 7):
        client.conn.answer(stream_id, b"x" * 16_000)
    # What is left of the connection's window (65,535) goes to the next answer, no more.
    client.conn.answer(9, b"y" * 2_000)
    assert len(data_of(client.output(), 9)) == DEFAULT_WINDOW - 4 * 16_005


def test_a_call_fed_one_byte_at_a_time_is_the_same_call() -> None:
    encoder = hpack.Encoder()
    wire = (
        PREFACE
        + frame(SETTINGS, 0, 0, settings((SETTINGS_INITIAL_WINDOW_SIZE, 1 << 16)))
        + frame(HEADERS, END_HEADERS, 1, encoder.encode(request(extra=[("x-custom", "v")])))
        + frame(DATA, END_STREAM, 1, grpc(b"message"))
    )
    whole = H2Connection(10, 4096)
    expected = whole.receive(wire)
    assert expected == [call(1, b"message", [("x-custom", "v")])]

    fed = H2Connection(10, 4096)
    events: list[Event] = []
    for i in range(len(wire)):
        events += fed.receive(wire[i : i + 1])
        if i < len(wire) - 1:
            assert events == [], f"a call before its last byte (byte {i})"
    assert events == expected
    assert fed.take_output() == whole.take_output()


def test_continuation_padding_and_priority() -> None:
    client = connect()
    block = client.block(request(extra=[("x-long", "y" * 300)]))
    first, second, third = block[:10], block[10:100], block[100:]
    padded_headers = bytes((3,)) + u32(0x80000003) + b"\x10" + first + b"\0" * 3
    padded_data = bytes((4,)) + grpc(b"padded") + b"\0" * 4
    events = client.send(
        frame(HEADERS, PADDED | PRIORITY_FLAG, 1, padded_headers),
        frame(CONTINUATION, 0, 1, second),
    )
    assert events == []
    assert client.conn.streams == 1
    assert client.send(frame(CONTINUATION, END_HEADERS, 1, third)) == []
    assert client.send(frame(DATA, PADDED | END_STREAM, 1, padded_data)) == [
        call(1, b"padded", [("x-long", "y" * 300)])
    ]
    assert client.output() == []


def test_padding_of_zero_and_a_padded_frame_all_padding() -> None:
    client = connect()
    block = client.block(request())
    assert (
        client.send(
            frame(HEADERS, END_HEADERS | PADDED, 1, b"\x00" + block),
            frame(DATA, PADDED, 1, bytes((2,)) + grpc(b"ab") + b"\0\0"),
            frame(DATA, PADDED, 1, bytes((9,)) + b"\0" * 9),  # all padding: no body
        )
        == []
    )
    assert client.send(frame(DATA, END_STREAM, 1)) == [call(1, b"ab")]


def test_request_trailers_end_the_call() -> None:
    client = connect()
    assert (
        client.send(
            frame(HEADERS, END_HEADERS, 1, client.block(request())),
            frame(DATA, 0, 1, grpc(b"body")),
        )
        == []
    )
    trailers = client.block([("x-trailer", "t")])
    assert client.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers)) == [call(1, b"body")]


def test_priority_and_unknown_frames_are_ignored() -> None:
    client = connect()
    assert (
        client.send(
            frame(PRIORITY, 0, 1, u32(0) + b"\x10"),
            frame(0x42, 0xFF, 0, b"extension"),
            frame(SETTINGS, ACK, 0),
        )
        == []
    )
    assert client.output() == []
    assert client.call(1) == [call(1)]


def test_answers_to_streams_that_are_gone_send_nothing() -> None:
    client = connect()
    client.conn.answer(1, b"x")
    client.conn.fail(1, INTERNAL, "x")
    assert client.conn.take_output() == b""
    assert client.call(1) == [call(1)]
    client.conn.answer(1, b"x")
    client.output()
    client.conn.answer(1, b"again")
    client.conn.fail(1, INTERNAL, "again")
    assert client.conn.take_output() == b""


# -- flow control, sending -------------------------------------------------------------------


def answered_within_10_bytes() -> tuple[Client, bytes, list[Frame]]:
    """A call answered with 30 bytes to a peer whose streams open with a 10-byte window:
    the client, the message and what went out (the headers and the first 10 bytes)."""
    client = connect(peer_settings=settings((SETTINGS_INITIAL_WINDOW_SIZE, 10)))
    assert client.call(1) == [call(1)]
    message = bytes(range(30))
    client.conn.answer(1, message)
    out = client.output()
    assert shape(out) == [(HEADERS, 1, END_HEADERS), (DATA, 1, 10)]
    return client, message, out


def test_the_peer_stream_window_holds_data_and_trailers_back() -> None:
    client, message, out = answered_within_10_bytes()
    assert client.conn.streams == 1

    client.send(frame(WINDOW_UPDATE, 0, 1, u32(10)))
    out += (more := client.output())
    assert shape(more) == [(DATA, 1, 10)]

    # A larger initial window applies to the open stream (RFC 9113 6.9.2): 15 bytes left.
    client.send(frame(SETTINGS, 0, 0, settings((SETTINGS_INITIAL_WINDOW_SIZE, 30))))
    more = client.output()
    assert shape(more) == [
        (SETTINGS, 0, ACK),
        (DATA, 1, 15),
        (HEADERS, 1, END_HEADERS | END_STREAM),
    ]
    out += more
    assert data_of(out, 1) == grpc(message)
    assert client.decode(out[0].payload) == [
        (":status", "200"),
        ("content-type", "application/grpc"),
    ]
    assert client.decode(out[-1].payload) == [("grpc-status", "0")]
    assert client.conn.streams == 0


def test_a_smaller_initial_window_makes_the_stream_window_negative() -> None:
    client, message, out = answered_within_10_bytes()
    # 10 - 6: the window is -6 (RFC 9113 6.9.2); 6 bytes of update bring it to 0 only.
    client.send(frame(SETTINGS, 0, 0, settings((SETTINGS_INITIAL_WINDOW_SIZE, 4))))
    client.send(frame(WINDOW_UPDATE, 0, 1, u32(6)))
    assert shape(client.output()) == [(SETTINGS, 0, ACK)]
    client.send(frame(WINDOW_UPDATE, 0, 1, u32(1)))
    out += (more := client.output())
    assert shape(more) == [(DATA, 1, 1)]
    client.send(frame(WINDOW_UPDATE, 0, 1, u32(100)))
    out += (more := client.output())
    assert shape(more) == [(DATA, 1, 24), (HEADERS, 1, END_HEADERS | END_STREAM)]
    assert data_of(out, 1) == grpc(message)


def test_the_connection_window_is_shared_and_released_in_order() -> None:
    client = connect(peer_settings=settings((SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20)))
    messages = {sid: bytes([sid]) * 20_000 for sid in (1, 3, 5, 7, 9)}
    for sid in messages:
        assert client.call(sid) == [call(sid)]
    for sid, message in messages.items():
        client.conn.answer(sid, message)
    out = client.output()
    # 20,005 bytes of DATA each: three answers whole (60,015 bytes), 5,520 of the fourth.
    assert sum(len(f.payload) for f in out if f.kind == DATA) == DEFAULT_WINDOW
    assert shape(out)[-5:] == [
        (DATA, 5, 3621),
        (HEADERS, 5, END_HEADERS | END_STREAM),
        (HEADERS, 7, END_HEADERS),
        (DATA, 7, 5520),
        (HEADERS, 9, END_HEADERS),
    ]
    assert client.conn.streams == 2

    client.send(frame(WINDOW_UPDATE, 0, 9, u32(1000)))  # the stream's window: not the limit
    assert client.output() == []

    client.send(frame(WINDOW_UPDATE, 0, 0, u32(14_485 + 10_000)))
    more = client.output()
    assert shape(more) == [
        (DATA, 7, 10_864),
        (DATA, 7, 3621),
        (HEADERS, 7, END_HEADERS | END_STREAM),
        (DATA, 9, 10_000),
    ]
    out += more
    client.send(frame(WINDOW_UPDATE, 0, 0, u32(100_000)))
    more = client.output()
    assert shape(more) == [
        (DATA, 9, 6384),
        (DATA, 9, 3621),
        (HEADERS, 9, END_HEADERS | END_STREAM),
    ]
    out += more
    for sid, message in messages.items():
        assert data_of(out, sid) == grpc(message)
        last_data = max(i for i, f in enumerate(out) if f.kind == DATA and f.stream_id == sid)
        (trailers,) = [
            i
            for i, f in enumerate(out)
            if f.kind == HEADERS and f.flags & END_STREAM and f.stream_id == sid
        ]
        assert trailers > last_data
    assert client.conn.streams == 0


@pytest.mark.parametrize(
    ("peer_frame_size", "sizes"),
    [(None, [16_384, 16_384, 7237]), (32_768, [32_768, 7237]), ((1 << 24) - 1, [40_005])],
)
def test_data_is_cut_at_the_peer_max_frame_size(
    peer_frame_size: int | None, sizes: list[int]
) -> None:
    pairs = [(SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20)]
    if peer_frame_size is not None:
        pairs.append((SETTINGS_MAX_FRAME_SIZE, peer_frame_size))
    client = connect(peer_settings=settings(*pairs))
    client.send(frame(WINDOW_UPDATE, 0, 0, u32(1 << 20)))
    assert client.call(1) == [call(1)]
    message = bytes(i % 251 for i in range(40_000))
    client.conn.answer(1, message)
    out = client.output(max_frame=peer_frame_size or FRAME_SIZE)
    assert [len(f.payload) for f in out if f.kind == DATA] == sizes
    assert data_of(out, 1) == grpc(message)
    assert shape(out)[-1] == (HEADERS, 1, END_HEADERS | END_STREAM)


@pytest.mark.parametrize("size", [FRAME_SIZE - 1, 1 << 24])
def test_a_max_frame_size_out_of_range_ends_the_connection(size: int) -> None:
    client = connect()
    client.send(frame(SETTINGS, 0, 0, settings((SETTINGS_MAX_FRAME_SIZE, size))))
    assert goaway(client.output())[:2] == (0, PROTOCOL_ERROR)
    assert client.conn.closed


def test_a_stream_window_update_of_zero_or_past_the_maximum_resets_the_stream() -> None:
    client = connect()
    assert client.call(1) == [call(1)]
    assert client.call(3) == [call(3)]
    client.send(frame(WINDOW_UPDATE, 0, 1, u32(0)))
    client.send(frame(WINDOW_UPDATE, 0, 3, u32(MAX_WINDOW)))
    assert resets(client.output()) == [(1, PROTOCOL_ERROR), (3, FLOW_CONTROL_ERROR)]
    client.conn.answer(1, b"x")
    client.conn.answer(3, b"x")
    assert client.conn.take_output() == b""
    assert not client.conn.closed


# -- flow control, receiving -----------------------------------------------------------------


def test_the_receive_windows_are_replenished() -> None:
    client = connect(max_request_bytes=1 << 20)
    assert client.send(frame(HEADERS, END_HEADERS, 1, client.block(request()))) == []
    message = bytes(i % 253 for i in range(600_000))
    body = grpc(message)
    chunks = [body[i : i + FRAME_SIZE] for i in range(0, len(body), FRAME_SIZE)]
    assert len(chunks) == 37
    updates = []
    for n, chunk in enumerate(chunks, 1):
        events = client.send(frame(DATA, END_STREAM if n == len(chunks) else 0, 1, chunk))
        got = windows(client.output())
        updates.append(got)
        if n < len(chunks):
            assert events == []
    assert events == [call(1, message)]
    # Our stream window: replenished by what arrived once half of 65,535 did (two frames).
    for n, got in enumerate(updates, 1):
        stream = [increment for sid, increment in got if sid == 1]
        assert stream == ([2 * FRAME_SIZE] if n % 2 == 0 and n < len(chunks) else []), n
        connection = [increment for sid, increment in got if sid == 0]
        assert connection == ([CONNECTION_WINDOW // 2] if n == 32 else []), n


def test_an_unserved_connection_keeps_the_default_connection_window() -> None:
    client = connect(max_request_bytes=1 << 20, serve=False)
    client.send(frame(HEADERS, END_HEADERS, 1, client.block(request())))
    for _ in range(CONNECTION_WINDOW // 2 // FRAME_SIZE):
        client.send(frame(DATA, 0, 1, b"\0" * FRAME_SIZE))
    assert [sid for sid, _ in windows(client.output())] == [1] * 16


# -- errors that end the connection ----------------------------------------------------------


def _block(headers: Headers) -> bytes:
    return hpack.Encoder().encode(headers)


_OPEN_1 = frame(HEADERS, END_HEADERS, 1, _block(request()))
_CALL_1 = _OPEN_1 + frame(DATA, END_STREAM, 1, grpc(b"x"))
_HALF_BLOCK = frame(HEADERS, 0, 1, _block(request())[:5])

_BIG = _block([*request(), ("x-big", "b" * MAX_HEADER_LIST)])

CONNECTION_ERRORS: dict[str, tuple[bytes, int, int]] = {
    # what the client sends after its preface: the GOAWAY's code and last stream id
    "a frame longer than 16384": (bytes.fromhex("004001") + b"\0\0" + u32(1), FRAME_SIZE_ERROR, 0),
    "DATA on stream 0": (frame(DATA, 0, 0, b"x"), PROTOCOL_ERROR, 0),
    "DATA on an idle stream": (_OPEN_1 + frame(DATA, 0, 3, b"x"), PROTOCOL_ERROR, 1),
    "HEADERS on an even stream": (
        frame(HEADERS, END_HEADERS, 2, _block(request())),
        PROTOCOL_ERROR,
        0,
    ),
    "HEADERS on stream 0": (frame(HEADERS, END_HEADERS, 0, _block(request())), PROTOCOL_ERROR, 0),
    "HEADERS on a closed stream": (
        frame(HEADERS, END_HEADERS, 3, _block(request())) + frame(HEADERS, END_HEADERS, 1, b"\x83"),
        STREAM_CLOSED,
        3,
    ),
    "HEADERS after the stream's end": (
        _CALL_1 + frame(HEADERS, END_HEADERS | END_STREAM, 1, b""),
        STREAM_CLOSED,
        1,
    ),
    "trailers without END_STREAM": (
        _OPEN_1 + frame(HEADERS, END_HEADERS, 1, b""),
        PROTOCOL_ERROR,
        1,
    ),
    "CONTINUATION without HEADERS": (
        frame(CONTINUATION, END_HEADERS, 1, b"\x83"),
        PROTOCOL_ERROR,
        0,
    ),
    "CONTINUATION on another stream": (
        _HALF_BLOCK + frame(CONTINUATION, END_HEADERS, 3, b""),
        PROTOCOL_ERROR,
        1,
    ),
    "a header block cut by a PING": (
        _HALF_BLOCK + frame(PING, 0, 0, b"\0" * 8),
        PROTOCOL_ERROR,
        1,
    ),
    "a header block larger than 64 KiB": (
        _HALF_BLOCK + frame(CONTINUATION, 0, 1, b"\0" * FRAME_SIZE) * 4,
        ENHANCE_YOUR_CALM,
        1,
    ),
    "a PUSH_PROMISE": (frame(PUSH_PROMISE, END_HEADERS, 1, u32(2) + b"\x82"), PROTOCOL_ERROR, 0),
    "SETTINGS of 5 bytes": (frame(SETTINGS, 0, 0, b"\0\x04\0\0\0"), FRAME_SIZE_ERROR, 0),
    "SETTINGS on a stream": (frame(SETTINGS, 0, 1), PROTOCOL_ERROR, 0),
    "a SETTINGS ACK with a payload": (
        frame(SETTINGS, ACK, 0, settings((SETTINGS_ENABLE_PUSH, 0))),
        FRAME_SIZE_ERROR,
        0,
    ),
    "SETTINGS_INITIAL_WINDOW_SIZE 2**31": (
        frame(SETTINGS, 0, 0, settings((SETTINGS_INITIAL_WINDOW_SIZE, 1 << 31))),
        FLOW_CONTROL_ERROR,
        0,
    ),
    "SETTINGS_ENABLE_PUSH 2": (
        frame(SETTINGS, 0, 0, settings((SETTINGS_ENABLE_PUSH, 2))),
        PROTOCOL_ERROR,
        0,
    ),
    "a PING of 7 bytes": (frame(PING, 0, 0, b"\0" * 7), FRAME_SIZE_ERROR, 0),
    "a PING on a stream": (frame(PING, 0, 1, b"\0" * 8), PROTOCOL_ERROR, 0),
    "a PRIORITY on stream 0": (frame(PRIORITY, 0, 0, b"\0" * 5), PROTOCOL_ERROR, 0),
    "a PRIORITY of 4 bytes": (frame(PRIORITY, 0, 1, b"\0" * 4), FRAME_SIZE_ERROR, 0),
    "a garbage HPACK block": (
        frame(HEADERS, END_HEADERS, 1, b"\xfe\xff\xff"),
        COMPRESSION_ERROR,
        1,
    ),
    "a header list over the limit": (frame(HEADERS, END_HEADERS, 1, _BIG), COMPRESSION_ERROR, 1),
    "padding longer than the frame": (
        frame(HEADERS, END_HEADERS | PADDED, 1, b"\x05abcd"),
        PROTOCOL_ERROR,
        0,
    ),
    "a WINDOW_UPDATE of 0 on the connection": (
        frame(WINDOW_UPDATE, 0, 0, u32(0)),
        PROTOCOL_ERROR,
        0,
    ),
    "a WINDOW_UPDATE of 3 bytes": (frame(WINDOW_UPDATE, 0, 0, b"\0\0\1"), FRAME_SIZE_ERROR, 0),
    "the connection window past 2**31-1": (
        frame(WINDOW_UPDATE, 0, 0, u32(MAX_WINDOW - DEFAULT_WINDOW + 1)),
        FLOW_CONTROL_ERROR,
        0,
    ),
    "RST_STREAM on an idle stream": (frame(RST_STREAM, 0, 1, u32(CANCEL)), PROTOCOL_ERROR, 0),
    "RST_STREAM of 3 bytes": (
        _OPEN_1 + frame(RST_STREAM, 0, 1, b"\0\0\x08"),
        FRAME_SIZE_ERROR,
        1,
    ),
}


@pytest.mark.parametrize(
    ("wire", "code", "last"), CONNECTION_ERRORS.values(), ids=CONNECTION_ERRORS.keys()
)
def test_protocol_errors_end_the_connection_with_goaway(wire: bytes, code: int, last: int) -> None:
    client = connect()
    client.send(wire)
    assert client.conn.closed and client.conn.going_away
    got_last, got_code, why = goaway(client.output())
    assert (got_last, got_code) == (last, code)
    assert why, "a GOAWAY says why"
    assert client.conn.streams == 0
    assert client.call(5) == []
    assert client.conn.take_output() == b""


@pytest.mark.parametrize(
    "wire",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/1.1", PREFACE[:-1] + b"X" + b"\0" * 9],
    ids=["HTTP/1.1", "a short wrong prefix", "a wrong last byte"],
)
def test_a_bad_preface_ends_the_connection(wire: bytes) -> None:
    conn = H2Connection(10, 4096)
    assert conn.receive(wire) == []
    frames = parse(conn.take_output())
    assert frames[0].kind == SETTINGS
    assert goaway(frames)[:2] == (0, PROTOCOL_ERROR)
    assert conn.closed
    assert conn.first_path is None


def test_a_preface_in_pieces_is_awaited() -> None:
    conn = H2Connection(10, 4096)
    assert conn.receive(PREFACE[:5]) == []
    assert conn.receive(PREFACE[5:20]) == []
    assert not conn.closed
    conn.receive(PREFACE[20:] + frame(SETTINGS, 0, 0))
    assert [f.kind for f in parse(conn.take_output())] == [SETTINGS, SETTINGS]
    assert not conn.closed


def test_goaway_after_an_error_names_the_last_stream() -> None:
    client = connect()
    assert client.call(1) == [call(1)]
    assert client.call(3) == [call(3)]
    client.send(frame(PING, 0, 0, b"short"))
    assert goaway(client.output())[:2] == (3, FRAME_SIZE_ERROR)
    client.conn.answer(1, b"late")
    assert client.conn.take_output() == b""


# -- errors that end a call ------------------------------------------------------------------


def _refusal(client: Client, frames: list[Frame], stream_id: int) -> Headers:
    """The trailers-only answer's headers (the first frame: HEADERS with END_STREAM)."""
    answer = frames[0]
    assert (answer.kind, answer.flags, answer.stream_id) == (
        HEADERS,
        END_HEADERS | END_STREAM,
        stream_id,
    )
    headers = client.decode(answer.payload)
    assert headers[:2] == [(":status", "200"), ("content-type", "application/grpc")]
    return headers[2:]


def test_a_request_larger_than_the_bound_is_refused_and_reset() -> None:
    client = connect(max_request_bytes=10)
    events = client.send(
        frame(HEADERS, END_HEADERS, 1, client.block(request())),
        frame(DATA, 0, 1, grpc(b"0123456789A")[:12]),  # more than 10 + 5 bytes: not yet
    )
    assert events == []
    events = client.send(frame(DATA, 0, 1, grpc(b"0123456789A")[12:]))
    assert events == [Refused(1, RESOURCE_EXHAUSTED)]
    out = client.output()
    assert _refusal(client, out, 1) == [
        ("grpc-status", "8"),
        ("grpc-message", "request larger than --max-request-bytes"),
    ]
    assert resets(out) == [(1, NO_ERROR)]
    assert len(out) == 2
    # What the peer still had in flight on the stream is dropped.
    assert client.send(frame(DATA, END_STREAM, 1, b"more")) == []
    assert client.output() == []
    assert client.conn.streams == 0


def test_a_request_larger_than_the_bound_in_the_last_frame_is_refused_without_reset() -> None:
    client = connect(max_request_bytes=10)
    assert client.call(1, b"0123456789") == [call(1, b"0123456789")]  # exactly the bound
    client.output()
    assert client.call(3, b"0123456789A") == [Refused(3, RESOURCE_EXHAUSTED)]
    out = client.output()
    assert _refusal(client, out, 3)[0] == ("grpc-status", "8")
    assert resets(out) == []  # the peer ended the stream: it is closed, nothing to reset


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        (grpc(b"zipped", flag=1), UNIMPLEMENTED, "compressed requests are not accepted"),
        (grpc(b"abc")[:-1], INTERNAL, "the request is not one gRPC message"),
        (grpc(b"abc") + grpc(b"d"), INTERNAL, "the request is not one gRPC message"),
        (grpc(b"abc", flag=2), INTERNAL, "the request is not one gRPC message"),
        (b"\0\0\0", INTERNAL, "the request is not one gRPC message"),
        (b"", INTERNAL, "the request is not one gRPC message"),
    ],
    ids=["compressed", "short", "two messages", "flag 2", "no prefix", "empty"],
)
def test_a_body_that_is_not_one_plain_message_is_refused(
    body: bytes, status: int, message: str
) -> None:
    client = connect()
    events = client.send(
        frame(HEADERS, END_HEADERS, 1, client.block(request())),
        frame(DATA, END_STREAM, 1, body),
    )
    assert events == [Refused(1, status)]
    out = client.output()
    assert _refusal(client, out, 1) == [("grpc-status", str(status)), ("grpc-message", message)]
    assert resets(out) == []
    assert client.conn.streams == 0


@pytest.mark.parametrize("ends_stream", [True, False])
def test_a_get_or_a_call_without_path_is_refused(ends_stream: bool) -> None:
    client = connect()
    flags = END_HEADERS | (END_STREAM if ends_stream else 0)
    get = [(n, "GET" if n == ":method" else v) for n, v in request()]
    no_path = [(n, v) for n, v in request() if n != ":path"]
    events = client.send(frame(HEADERS, flags, 1, client.block(get)))
    events += client.send(frame(HEADERS, flags, 3, client.block(no_path)))
    assert events == [Refused(1, INTERNAL), Refused(3, INTERNAL)]
    out = client.output()
    assert _refusal(client, out, 1) == [
        ("grpc-status", "13"),
        ("grpc-message", "a gRPC call is a POST with a path, not 'GET'"),
    ]
    # RST_STREAM(NO_ERROR) only when the peer may still be sending (it did not end the stream).
    expected_resets = [] if ends_stream else [(1, NO_ERROR), (3, NO_ERROR)]
    assert resets(out) == expected_resets
    third = next(f for f in out if f.kind == HEADERS and f.stream_id == 3)
    assert client.decode(third.payload)[2:] == [
        ("grpc-status", "13"),
        ("grpc-message", "a gRPC call is a POST with a path, not 'POST'"),
    ]
    assert client.conn.first_path == "/svc/M"  # the first call's, refused or not
    assert client.call(5) == [call(5)]


def test_fail_percent_encodes_grpc_message() -> None:
    client = connect()
    assert client.call(1) == [call(1)]
    client.conn.fail(1, 3, "bad ü: 100% {ok}\n")
    out = client.output()
    assert _refusal(client, out, 1) == [
        ("grpc-status", "3"),
        ("grpc-message", "bad %C3%BC: 100%25 {ok}%0A"),
    ]
    assert resets(out) == []  # the call was whole: the peer ended its stream
    assert client.conn.streams == 0


def test_status_block() -> None:
    """Literals that never enter the peer's table; grpc-message cut, then percent-encoded."""
    decoder = hpack.Decoder()

    def decode(block: bytes) -> Headers:
        return [(n.decode(), v.decode()) for n, v in decoder.decode(block, raw=True)]

    assert decode(status_block(14, "")) == [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", "14"),
    ]
    long = decode(status_block(2, "é" * (MAX_MESSAGE_CHARS + 10)))
    assert long[-1] == ("grpc-message", "%C3%A9" * MAX_MESSAGE_CHARS)
    printable = "".join(chr(c) for c in range(0x20, 0x7F))
    assert decode(status_block(2, printable))[-1] == (
        "grpc-message",
        printable.replace("%", "%25"),
    )
    assert len(decoder.header_table.dynamic_entries) == 0


# -- streams over the bound, resets, pings ---------------------------------------------------


@pytest.mark.parametrize("split", [False, True], ids=["HEADERS", "HEADERS+CONTINUATION"])
def test_streams_over_the_bound_are_refused_and_the_table_kept(split: bool) -> None:
    client = connect(max_streams=1)
    block1 = client.block(request())
    assert client.send(frame(HEADERS, END_HEADERS, 1, block1)) == []

    block3 = client.block(request(extra=[("x-new", "v")]))  # inserts x-new into the table
    if split:
        refused = frame(HEADERS, 0, 3, block3[:4]) + frame(CONTINUATION, END_HEADERS, 3, block3[4:])
    else:
        refused = frame(HEADERS, END_HEADERS, 3, block3)
    assert client.send(refused) == []
    assert client.output() == [Frame(RST_STREAM, 0, 3, u32(REFUSED_STREAM))]
    assert client.send(frame(DATA, END_STREAM, 3, grpc(b"in flight"))) == []
    assert client.output() == []

    assert client.send(frame(DATA, END_STREAM, 1, grpc(b"one"))) == [call(1, b"one")]
    client.conn.answer(1, b"")
    client.output()

    block5 = client.block(request(extra=[("x-new", "v")]))
    assert client.send(
        frame(HEADERS, END_HEADERS, 5, block5), frame(DATA, END_STREAM, 5, grpc(b"five"))
    ) == [call(5, b"five", [("x-new", "v")])]
    # Without block 3 in the table, block 5 decodes to something else.
    skipped = hpack.Decoder()
    skipped.decode(block1)
    with pytest.raises(hpack.HPACKDecodingError):
        skipped.decode(block5)


def test_a_reset_after_the_call_cancels_it() -> None:
    client = connect()
    assert client.call(1) == [call(1)]
    assert client.send(frame(RST_STREAM, 0, 1, u32(CANCEL))) == [Cancelled(1)]
    assert client.conn.streams == 0
    client.conn.answer(1, b"too late")
    client.conn.fail(1, INTERNAL, "too late")
    assert client.conn.take_output() == b""
    # A second reset, or one on a stream never whole, is no Cancelled.
    assert client.send(frame(RST_STREAM, 0, 1, u32(CANCEL))) == []
    assert client.send(frame(HEADERS, END_HEADERS, 3, client.block(request()))) == []
    assert client.send(frame(RST_STREAM, 0, 3, u32(CANCEL))) == []
    assert client.send(frame(DATA, END_STREAM, 3, grpc(b"x"))) == []
    assert client.output() == []


def test_a_reset_of_an_answer_waiting_for_window_drops_it() -> None:
    client = connect(peer_settings=settings((SETTINGS_INITIAL_WINDOW_SIZE, 0)))
    assert client.call(1) == [call(1)]
    client.conn.answer(1, b"held")
    assert shape(client.output()) == [(HEADERS, 1, END_HEADERS)]
    assert client.send(frame(RST_STREAM, 0, 1, u32(CANCEL))) == []  # answered: no Cancelled
    client.send(frame(WINDOW_UPDATE, 0, 1, u32(100)))
    client.send(frame(SETTINGS, 0, 0, settings((SETTINGS_INITIAL_WINDOW_SIZE, 100))))
    assert shape(client.output()) == [(SETTINGS, 0, ACK)]
    assert client.conn.streams == 0


def test_ping_is_acknowledged_with_its_payload() -> None:
    client = connect()
    client.send(frame(PING, 0, 0, b"8 bytes!"))
    assert client.output() == [Frame(PING, ACK, 0, b"8 bytes!")]
    client.send(frame(PING, ACK, 0, b"8 bytes!"))
    assert client.output() == []


def test_data_after_the_end_of_the_stream_resets_it() -> None:
    client = connect()
    assert client.call(1) == [call(1)]
    assert client.send(frame(DATA, 0, 1, b"more")) == []
    assert client.output() == [Frame(RST_STREAM, 0, 1, u32(STREAM_CLOSED))]
    assert client.conn.streams == 0
    client.conn.answer(1, b"x")
    assert client.conn.take_output() == b""
    assert not client.conn.closed
    assert client.call(3) == [call(3)]


# -- going away ------------------------------------------------------------------------------


def test_go_away_takes_no_new_call_and_closes_once_the_calls_are_answered() -> None:
    client = connect()
    assert client.call(1) == [call(1)]
    assert client.call(3) == [call(3)]
    client.conn.go_away()
    assert client.output() == [Frame(GOAWAY, 0, 0, struct.pack(">II", 3, NO_ERROR))]
    assert client.conn.going_away and not client.conn.closed

    assert client.call(5) == []
    assert client.output() == [Frame(RST_STREAM, 0, 5, u32(REFUSED_STREAM))]
    client.conn.go_away()
    assert client.conn.take_output() == b""

    client.conn.answer(1, b"one")
    assert not client.conn.closed
    client.conn.fail(3, UNIMPLEMENTED, "no")
    assert client.conn.closed
    kinds = shape(client.output())
    assert kinds[-1] == (HEADERS, 3, END_HEADERS | END_STREAM)
    assert GOAWAY not in [kind for kind, _, _ in kinds]


def test_go_away_with_nothing_open_closes_at_once() -> None:
    client = connect()
    client.conn.go_away()
    assert client.conn.closed
    assert client.output() == [Frame(GOAWAY, 0, 0, struct.pack(">II", 0, NO_ERROR))]


def test_the_peer_goaway_stops_new_calls() -> None:
    client = connect()
    assert client.call(1) == [call(1)]
    client.send(frame(GOAWAY, 0, 0, struct.pack(">II", 0, NO_ERROR)))
    assert client.conn.going_away and not client.conn.closed
    assert client.output() == []
    assert client.call(3) == []
    assert client.output() == [Frame(RST_STREAM, 0, 3, u32(REFUSED_STREAM))]
    client.conn.answer(1, b"last")
    assert client.conn.closed

    idle = connect()
    idle.send(frame(GOAWAY, 0, 0, struct.pack(">II", 0, NO_ERROR)))
    assert idle.conn.closed


# -- HPACK: the decoded-block cache ----------------------------------------------------------


def _raw(text: bytes) -> bytes:
    assert len(text) < 127
    return bytes((len(text),)) + text


_POST_PATH = b"\x83" + b"\x04" + _raw(b"/svc/M")  # :method POST; :path literal, name entry 4


def _insert(name: bytes, value: bytes) -> bytes:
    """A literal with incremental indexing, new name (RFC 7541 6.2.1)."""
    return b"\x40" + _raw(name) + _raw(value)


def _calls_for(blocks: list[bytes]) -> list[Headers]:
    """The metadata of one call per block, on one connection, in order; checked against a
    reference decoder fed the same blocks."""
    client = connect(max_streams=1)
    reference = hpack.Decoder()
    got = []
    for n, block in enumerate(blocks):
        sid = 2 * n + 1
        (event,) = client.send(
            frame(HEADERS, END_HEADERS, sid, block), frame(DATA, END_STREAM, sid, grpc(b""))
        )
        assert isinstance(event, Call), event
        assert event.path == "/svc/M"
        expected = [(n.decode(), v.decode()) for n, v in reference.decode(block, raw=True)]
        assert event.headers == expected[2:]
        got.append(event.headers)
        client.conn.answer(sid, b"")
    return got


def test_a_cached_block_decodes_anew_once_the_table_changed() -> None:
    a = _POST_PATH + _insert(b"x-a", b"1")
    b = _POST_PATH + b"\xbe"  # dynamic entry 62: the newest
    c = _POST_PATH + _insert(b"x-b", b"2")
    d = _POST_PATH + b"\xbf"  # entry 63
    assert _calls_for([a, b, b, c, b, d, b]) == [
        [("x-a", "1")],
        [("x-a", "1")],
        [("x-a", "1")],
        [("x-b", "2")],
        [("x-b", "2")],
        [("x-a", "1")],
        [("x-b", "2")],
    ]


def test_a_block_inserting_a_duplicate_of_the_newest_entry_is_not_cached() -> None:
    """A full table, and an insertion equal to the newest entry (RFC 7541 allows
    duplicates): the table's length and newest entry look the same, yet it moved."""
    size_108 = b"\x3f" + bytes((108 - 31,))  # dynamic table size update: three 36-byte entries
    fill = size_108 + _POST_PATH + _insert(b"x-c", b"3") + _insert(b"x-a", b"1")
    fill += _insert(b"x-b", b"2")  # table: x-b, x-a, x-c
    again = _POST_PATH + _insert(b"x-b", b"2")  # x-b, x-b, x-a; then x-b, x-b, x-b
    third = _POST_PATH + b"\xc0"  # entry 64: the oldest
    assert _calls_for([fill, again, again, third]) == [
        [("x-c", "3"), ("x-a", "1"), ("x-b", "2")],
        [("x-b", "2")],
        [("x-b", "2")],
        [("x-b", "2")],
    ]


# -- grpc-timeout ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("20m", 0.02),
        ("1S", 1.0),
        ("3H", 10_800.0),
        ("2M", 120.0),
        ("100u", 1e-4),
        ("5n", 5e-9),
        ("0S", 0.0),
        ("12345678m", 12_345.678),
        ("123456789m", None),
        ("", None),
        ("m", None),
        ("10x", None),
        ("10s", None),
        ("1.5S", None),
        ("-1S", None),
        (" 1S", None),
        ("\u00b2m", None),  # a superscript two: str.isdigit() says yes, int() says no
        ("\u0661m", None),  # an Arabic-Indic one: not an ASCII digit
    ],
)
def test_parse_timeout(value: str, seconds: float | None) -> None:
    got = parse_timeout(value)
    if seconds is None:
        assert got is None
    else:
        assert got == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("value", [b"10x", b"", b"\xb2m", b"999999999S"])
def test_a_call_with_a_malformed_timeout_has_none(value: bytes) -> None:
    client = connect()
    headers = [(n.encode(), v.encode()) for n, v in request(timeout=None)]
    block = client.block([*headers, (b"grpc-timeout", value)])
    (event,) = client.send(
        frame(HEADERS, END_HEADERS, 1, block), frame(DATA, END_STREAM, 1, grpc(b"t"))
    )
    assert isinstance(event, Call)
    assert event.timeout is None
    assert event.headers == METADATA
    assert not client.conn.closed


# -- calls relayed (methods not served here) ------------------------------------------------


def relaying(max_request_bytes: int = 4096) -> Client:
    """A connection serving /svc/M only: other methods' calls are relayed."""
    client = Client(H2Connection(100, max_request_bytes, lambda path: path == "/svc/M"))
    assert client.send(PREFACE, frame(SETTINGS, 0, 0)) == []
    client.conn.serve()
    client.conn.take_output()
    return client


def test_a_relayed_call_arrives_message_by_message() -> None:
    client = relaying()
    block = client.block(request("/other/S", extra=[("x-m", "1")]))
    opened = client.send(frame(HEADERS, END_HEADERS, 1, block))
    assert opened == [Opened(1, "/other/S", 0.02, [*METADATA, ("x-m", "1")])]
    two = grpc(b"one") + grpc(b"two")
    third = grpc(b"three")
    assert client.send(frame(DATA, 0, 1, two + third[:4])) == [
        Message(1, b"one"),
        Message(1, b"two"),
    ]
    assert client.send(frame(DATA, END_STREAM, 1, third[4:])) == [
        Message(1, b"three"),
        HalfClosed(1),
    ]
    # A served method on the same connection is still a Call.
    assert client.call(3) == [call(3)]


def test_a_relayed_call_is_answered_headers_messages_trailers() -> None:
    client = relaying()
    client.send(frame(HEADERS, END_HEADERS | END_STREAM, 1, client.block(request("/o/S"))))
    client.conn.send_headers(1, [("x-a", b"1")])
    client.conn.send_message(1, b"r1")
    client.conn.send_message(1, b"r2")
    assert client.conn.streams == 1
    client.conn.send_trailers(1, 0, "", [("x-t", b"2")])
    out = client.output()
    assert shape(out) == [
        (HEADERS, 1, END_HEADERS),
        (DATA, 1, len(grpc(b"r1"))),
        (DATA, 1, len(grpc(b"r2"))),
        (HEADERS, 1, END_HEADERS | END_STREAM),
    ]
    assert client.decode(out[0].payload) == [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("x-a", "1"),
    ]
    assert client.decode(out[-1].payload) == [("grpc-status", "0"), ("x-t", "2")]
    assert client.conn.streams == 0
    assert resets(out) == []


def test_a_relayed_call_failed_before_any_answer_is_trailers_only() -> None:
    client = relaying()
    client.send(frame(HEADERS, END_HEADERS, 1, client.block(request("/o/S"))))
    client.conn.send_trailers(1, 12, "no such method", [])
    out = client.output()
    assert shape(out) == [(HEADERS, 1, END_HEADERS | END_STREAM), (RST_STREAM, 1, 0)]
    assert client.decode(out[0].payload) == [
        (":status", "200"),
        ("content-type", "application/grpc"),
        ("grpc-status", "12"),
        ("grpc-message", "no such method"),
    ]
    assert resets(out) == [(1, 0)]  # the peer had not ended its side: told to stop


def test_a_relayed_call_reset_by_the_peer_is_cancelled() -> None:
    client = relaying()
    client.send(frame(HEADERS, END_HEADERS, 1, client.block(request("/o/S"))))
    assert client.send(frame(RST_STREAM, 0, 1, u32(8))) == [Cancelled(1)]
    client.conn.send_message(1, b"late")
    assert client.output() == []


def test_relayed_messages_are_bounded_and_whole() -> None:
    client = relaying(max_request_bytes=10)
    client.send(frame(HEADERS, END_HEADERS, 1, client.block(request("/o/S"))))
    assert client.send(frame(DATA, 0, 1, grpc(b"x" * 11))) == [Refused(1, 8)]
    client.send(frame(HEADERS, END_HEADERS, 3, client.block(request("/o/S"))))
    assert client.send(frame(DATA, END_STREAM, 3, grpc(b"abc")[:6])) == [Refused(3, 13)]


def test_a_long_relayed_stream_gets_its_window_back() -> None:
    client = relaying(max_request_bytes=20_000)
    client.send(frame(HEADERS, END_HEADERS, 1, client.block(request("/o/S"))))
    events: list[Event] = []
    for _ in range(4):
        events += client.send(frame(DATA, 0, 1, grpc(b"z" * 10_000)))
    assert events == [Message(1, b"z" * 10_000)] * 4
    assert windows(client.output()) == [(1, 4 * 10_005)]
