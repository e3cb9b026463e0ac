"""The admin HTTP listener: /healthcheck, /metrics, /rlconfig.

A tiny HTTP/1.1 server on asyncio streams: three read-only pages do not justify a
web framework dependency, and it runs on the service's own event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

PageResult = tuple[int, str, bytes]
Page = Callable[[], PageResult | Awaitable[PageResult]]
MAX_REQUEST_LINE = 8192
REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class AdminServer:
    def __init__(self, pages: dict[str, Page]) -> None:
        self.pages = pages
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_REQUEST_LINE)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await asyncio.wait_for(self._serve_one(reader, writer), timeout=10)
        except (TimeoutError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_line = (await reader.readline()).decode("latin-1").split()
        while (await reader.readline()) not in (b"\r\n", b"\n", b""):
            pass  # headers are not needed by any page
        if len(request_line) < 2:
            return
        method, target = request_line[0], request_line[1].split("?", 1)[0]
        page = self.pages.get(target)
        if page is None:
            status, content_type, body = 404, "text/plain", b"not found\n"
        elif method not in ("GET", "HEAD"):
            status, content_type, body = 405, "text/plain", b"method not allowed\n"
        else:
            result = page()
            if inspect.isawaitable(result):
                result = await result
            status, content_type, body = result
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, '')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        )
        writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
        await writer.drain()
