"""envoyproxy/ratelimit's HTTP endpoints: ``/healthcheck`` and ``/json`` (its ``PORT``).

``POST /json`` takes a RateLimitRequest in the protobuf JSON mapping (field names in
lowerCamelCase or as in the .proto, as the Go service's protojson accepts them) and
answers the RateLimitResponse in JSON: 200 for OK, 429 for OVER_LIMIT, 500 for
UNKNOWN; a body that is not such a request, or a request the service refuses, is a
400 with the reason. The decision is the gRPC one: the JSON becomes the request's wire
bytes and goes through the same :class:`RateLimitServicer` (same parsing, limiter,
counters and response headers), whose wire bytes become JSON again.

``GET /healthcheck`` is 200 ``OK`` while the service serves and 500 once it is not
(draining after SIGTERM, or stopping), as the Go service answers.

The server is HTTP/1.1 on asyncio streams, on the service's event loop, with
keep-alive and request bodies (Content-Length or chunked).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import cast

import grpc
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import json_format

from ratelimit_service.rls.servicer import RateLimitServicer

log = logging.getLogger(__name__)

PageResult = tuple[int, str, bytes]
Handler = Callable[[str, bytes], Awaitable[PageResult]]
MAX_LINE = 8192
MAX_HEADERS = 100
IDLE_TIMEOUT = 60.0
"""Seconds a kept-alive connection may wait for its next request."""
REQUEST_TIMEOUT = 10.0
"""Seconds one request may take to arrive, once its first line has."""

_OVERALL_STATUS = {
    rls_pb2.RateLimitResponse.OK: 200,
    rls_pb2.RateLimitResponse.OVER_LIMIT: 429,
    rls_pb2.RateLimitResponse.UNKNOWN: 500,
}
_ABORT_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
}


class BadRequest(Exception):
    """A request the HTTP layer refuses before any handler runs."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpServer:
    """Routes by exact path (the query string ignored); every method goes to the
    route's handler, which gets the method and the body."""

    def __init__(self, routes: dict[str, Handler], max_body: int = 1 << 20) -> None:
        self.routes = routes
        self.max_body = max_body
        self.port = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        self._server = await asyncio.start_server(
            self._handle, host, port, limit=MAX_LINE, reuse_port=reuse_port or None
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for writer in list(self._connections):  # idle keep-alive connections
            writer.close()
        await self._server.wait_closed()
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            while await self._serve_one(reader, writer):
                pass
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request and its response; whether the connection stays open."""
        line = await asyncio.wait_for(reader.readline(), IDLE_TIMEOUT)
        if not line.strip():
            return False  # closed (or a stray blank line: not worth the bytes)
        parts = line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await _respond(writer, "GET", 400, "text/plain", b"malformed request line\n", False)
            return False
        method, target, version = parts
        try:
            async with asyncio.timeout(REQUEST_TIMEOUT):
                headers = await _read_headers(reader)
                keep = _keep_alive(version, headers.get("connection", ""))
                if headers.get("expect", "").lower() == "100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = await self._read_body(reader, headers)
        except BadRequest as exc:
            body = f"{HTTPStatus(exc.status).phrase}: {exc}\n".encode()
            await _respond(writer, method, exc.status, "text/plain", body, False)
            return False
        handler = self.routes.get(target.split("?", 1)[0])
        if handler is None:
            status, content_type, payload = 404, "text/plain", b"Not Found\n"
        else:
            status, content_type, payload = await handler(method, body)
        await _respond(writer, method, status, content_type, payload, keep)
        return keep

    async def _read_body(self, reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
        if "chunked" in headers.get("transfer-encoding", "").lower():
            return await _read_chunked(reader, self.max_body)
        length_text = headers.get("content-length", "0").strip()
        if not length_text.isdigit():
            raise BadRequest(400, f"bad Content-Length {length_text!r}")
        length = int(length_text)
        if length > self.max_body:
            raise BadRequest(413, f"body of {length} bytes, more than {self.max_body}")
        return await reader.readexactly(length) if length else b""


async def _read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADERS + 1):
        line = await reader.readline()
        if line in (b"\r\n", b"\n"):
            return headers
        if not line:
            raise ConnectionError("closed in the headers")
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise BadRequest(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    raise BadRequest(431, f"more than {MAX_HEADERS} headers")


async def _read_chunked(reader: asyncio.StreamReader, limit: int) -> bytes:
    body = bytearray()
    while True:
        size_text = (await reader.readline()).split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError:
            raise BadRequest(400, "malformed chunk size") from None
        if size == 0:
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return bytes(body)
        if len(body) + size > limit:
            raise BadRequest(413, f"body of more than {limit} bytes")
        body += await reader.readexactly(size)
        await reader.readline()  # the CRLF after each chunk


def _keep_alive(version: str, connection: str) -> bool:
    tokens = {token.strip().lower() for token in connection.split(",")}
    if version == "HTTP/1.0":
        return "keep-alive" in tokens
    return "close" not in tokens


async def _respond(
    writer: asyncio.StreamWriter,
    method: str,
    status: int,
    content_type: str,
    body: bytes,
    keep: bool,
) -> None:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n"
    )
    writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
    await writer.drain()


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class _JsonCallContext:
    """What RateLimitServicer.should_rate_limit uses of a gRPC call's context: abort,
    and the time left (an HTTP call has no deadline: the store's bound applies)."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None


class GoEndpoints:
    """The handlers of ``/healthcheck`` and ``/json`` for :class:`HttpServer`."""

    def __init__(self, servicer: RateLimitServicer, healthy: Callable[[], bool]) -> None:
        self.servicer = servicer
        self.healthy = healthy

    def routes(self) -> dict[str, Handler]:
        return {"/healthcheck": self.healthcheck, "/json": self.json}

    async def healthcheck(self, method: str, body: bytes) -> PageResult:
        if self.healthy():
            return 200, "text/plain; charset=utf-8", b"OK"
        return 500, "text/plain; charset=utf-8", b"NOT SERVING\n"

    async def json(self, method: str, body: bytes) -> PageResult:
        try:
            message = json_format.Parse(body.decode("utf-8"), rls_pb2.RateLimitRequest())
        except (json_format.ParseError, UnicodeDecodeError, RecursionError) as exc:
            return _bad_request(f"not a JSON RateLimitRequest: {exc}")
        context = cast(grpc.aio.ServicerContext, _JsonCallContext())
        try:
            raw = await self.servicer.should_rate_limit(message.SerializeToString(), context)
        except _Aborted as exc:
            status = _ABORT_STATUS.get(exc.code, 500)
            text = f"{HTTPStatus(status).phrase}: {exc}\n"
            return status, "text/plain; charset=utf-8", text.encode()
        response = rls_pb2.RateLimitResponse.FromString(raw)
        text = json.dumps(json_format.MessageToDict(response), separators=(",", ":"))
        return _OVERALL_STATUS.get(response.overall_code, 500), "application/json", text.encode()


def _bad_request(message: str) -> PageResult:
    log.debug("/json: %s", message)
    return 400, "text/plain; charset=utf-8", f"Bad Request: {message}\n".encode()
