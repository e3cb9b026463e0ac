"""The one HTTP/1.1 server of the service: admin pages, the metrics listener, and
envoyproxy/ratelimit's HTTP and debug ports.

Small on purpose, on asyncio streams and the service's own loop: a handful of read-only
pages and one JSON endpoint do not justify a web framework. Keep-alive, bounded request
bodies (Content-Length or chunked), ``Expect: 100-continue``, and timeouts.

A page may answer with its body in pieces (/metrics): the server takes them and writes
the page in stretches that leave the loop to the calls between them
(engine/background.in_stretches). Every page has a Content-Length (the simplest
clients, the supervisor's among them, need no chunked coding).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Iterator
from http import HTTPStatus

from ratelimit_service.engine.background import in_stretches

Body = bytes | Iterator[bytes]
"""A whole body, or its pieces (an empty piece: only a point to return to the loop)."""
PageResult = tuple[int, str, Body]
Handler = Callable[[str, bytes, str], Awaitable[PageResult]]
"""Called with the method, the body and the query string (after ``?``, or empty)."""
MAX_LINE = 8192
MAX_HEADERS = 100
IDLE_TIMEOUT = 60.0
"""Seconds a kept-alive connection may wait for its next request."""
REQUEST_TIMEOUT = 10.0
"""Seconds one request may take to arrive, once its first line has."""
BLOCK = 1 << 18
"""Bytes written at a time of a page in pieces."""
_PHRASES = {status.value: status.phrase for status in HTTPStatus}


class BadRequest(Exception):
    """A request the HTTP layer refuses before any handler runs."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpServer:
    """Routes by exact path; a handler gets the method, the body and the query string."""

    def __init__(self, routes: dict[str, Handler], max_body: int = 1 << 20) -> None:
        self.routes = routes
        self.max_body = max_body
        self.port = 0
        self._server: asyncio.Server | None = None
        self._closing = False
        """Stopping: a request still being answered is answered with Connection: close."""
        self._idle: set[asyncio.StreamWriter] = set()
        """Kept-alive connections waiting for their next request (closed at stop)."""

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        self._server = await asyncio.start_server(
            self._handle, host, port, limit=MAX_LINE, reuse_port=reuse_port or None
        )
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self._server is None:
            return
        self._closing = True
        self._server.close()
        for writer in list(self._idle):
            writer.close()
        await self._server.wait_closed()
        self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while await self._serve_one(reader, writer, served):
                served += 1
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            self._idle.discard(writer)
            writer.close()

    async def _serve_one(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, served: int
    ) -> bool:
        """One request and its response; whether the connection stays open."""
        if served:
            self._idle.add(writer)
        try:
            line = await asyncio.wait_for(reader.readline(), IDLE_TIMEOUT)
        finally:
            self._idle.discard(writer)
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
            body = f"{_PHRASES[exc.status]}: {exc}\n".encode()
            await _respond(writer, method, exc.status, "text/plain", body, False)
            return False
        path, _, query = target.partition("?")
        handler = self.routes.get(path)
        payload: Body = b"Not Found\n"
        status, content_type = 404, "text/plain"
        if handler is not None:
            status, content_type, payload = await handler(method, body, query)
        keep = keep and not self._closing
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
    body: Body,
    keep: bool,
) -> None:
    reason = _PHRASES.get(status, "")
    blocks = [body] if isinstance(body, bytes) else await _in_blocks(body)
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {sum(map(len, blocks))}\r\n"
        f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n"
    )
    if method == "HEAD" or len(blocks) == 1:
        writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else blocks[0]))
        await writer.drain()
        return
    writer.write(head.encode("latin-1"))
    async for block in in_stretches(blocks):
        writer.write(block)
        await writer.drain()


async def _in_blocks(pieces: Iterator[bytes]) -> list[bytes]:
    """A body's pieces, taken in stretches, joined into blocks of about BLOCK bytes."""
    blocks: list[bytes] = []
    block: list[bytes] = []
    size = 0
    async for piece in in_stretches(pieces):
        block.append(piece)
        size += len(piece)
        if size >= BLOCK:
            blocks.append(b"".join(block))
            block, size = [], 0
    blocks.append(b"".join(block))
    return blocks


Page = Callable[[], PageResult | Awaitable[PageResult]]
"""A read-only page: GET (and HEAD) only."""
QueryPage = Callable[[str], Awaitable[PageResult]]
"""A read-only page that reads its query string."""
INDEX = b"/healthcheck\n/metrics\n/rlconfig\n/status\n/status.json\n/explain\n"
"""The admin port's index page (the service's and the supervisor's)."""


def pages(routes: dict[str, Page]) -> dict[str, Handler]:
    """Handlers for read-only pages: other methods get 405."""
    return {path: query_page(_without_query(page)) for path, page in routes.items()}


def _without_query(page: Page) -> QueryPage:
    async def read(query: str) -> PageResult:
        result = page()
        if inspect.isawaitable(result):
            return await result
        return result

    return read


def query_page(page: QueryPage) -> Handler:
    """The handler of a read-only page given its query string: other methods get 405."""

    async def handle(method: str, body: bytes, query: str) -> PageResult:
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"method not allowed\n"
        return await page(query)

    return handle
