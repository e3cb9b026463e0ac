"""One pipelined connection to one Redis server, for the exact-mode request path.

redis-py's asyncio client spends about 60 µs of CPU per command (connection pool,
per-command locking, stream reads), more than the rest of a ShouldRateLimit call.
Redis answers the commands of one connection in order, so one connection can carry
any number of outstanding commands: this module writes each command to the socket
at once and, as replies arrive (hiredis parses them), hands each to the callback its
command came with, in order. The request path needs no future per command, and the
reply reaches the batcher in the same loop turn that read it. A caller that gives up
early leaves nothing broken: its reply is read and dropped.

Only single-server URLs (``redis://``, ``rediss://``, ``unix://``) use it; Sentinel
and Cluster stay with redis-py, which follows failovers and slots. Reconnecting is
lazy (the next command after a loss) and one at a time; the store's circuit breaker
decides how often that may happen.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import hiredis
from redis.asyncio.connection import RedisSSLContext, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.connection import parse_url as redis_parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

log = logging.getLogger(__name__)

MAX_OUTSTANDING = 10_000
"""Commands waiting for a reply on the connection; beyond it, new commands fail."""
STUCK_AFTER = 3.0
"""Seconds the oldest command may wait before the connection is presumed dead and
dropped (a silent network partition would otherwise hold it forever)."""


def supports(url: str) -> bool:
    return url.split("://", 1)[0] in ("redis", "rediss", "unix")


Deliver = Callable[[Any], None]
"""Receives a command's reply exactly once: the reply's value, or the exception it
failed with (ResponseError for an error reply, ConnectionError for a lost connection).
It runs inside the protocol's reading, so it must be quick and must not raise."""


class _Protocol(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader = hiredis.Reader()
        # (whom to deliver to, sent at, the script and EVALSHA command to retry as EVAL
        # on NOSCRIPT)
        self._waiting: deque[tuple[Deliver, float, _Retry | None]] = deque()
        self._transport: asyncio.Transport | None = None
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport; they have its methods.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self._waiting
        try:
            reader.feed(data)
            while (reply := reader.gets()) is not False:
                if not waiting:
                    raise hiredis.ProtocolError("a reply nobody asked for")
                deliver, _, retry = waiting.popleft()
                if isinstance(reply, hiredis.ReplyError):
                    if retry is not None and str(reply).startswith("NOSCRIPT"):
                        # Redis lost the script (restart, SCRIPT FLUSH): send it whole.
                        # The EVAL goes to the back of the line, so order still holds.
                        self._write(deliver, _pack_eval(retry), None)
                        continue
                    reply = ResponseError(str(reply))
                try:
                    deliver(reply)
                except Exception:  # a bug in a caller: keep the connection in step
                    log.exception("redis reply callback failed")
        except hiredis.ProtocolError as exc:
            self._fail(RedisConnectionError(f"redis protocol error: {exc!r}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail_waiters(RedisConnectionError(f"redis connection lost: {exc or 'closed'}"))

    def request(self, packed: bytes, deliver: Deliver, retry: _Retry | None = None) -> None:
        """Send a command; ``deliver`` gets its reply (at once if it cannot be sent)."""
        if self.closed or self._transport is None:
            deliver(RedisConnectionError("redis connection closed"))
        elif len(self._waiting) >= MAX_OUTSTANDING:
            deliver(RedisConnectionError("redis: too many commands outstanding"))
        else:
            self._write(deliver, packed, retry)

    def request_future(self, packed: bytes) -> asyncio.Future[Any]:
        future = self._loop.create_future()
        self.request(packed, functools.partial(_resolve, future))
        return future

    def _write(self, deliver: Deliver, packed: bytes, retry: _Retry | None) -> None:
        assert self._transport is not None
        self._waiting.append((deliver, self._loop.time(), retry))
        self._transport.write(packed)

    def oldest_wait(self) -> float:
        return self._loop.time() - self._waiting[0][1] if self._waiting else 0.0

    def _fail(self, error: Exception) -> None:
        self.closed = True
        if self._transport is not None:
            self._transport.abort()
        self._fail_waiters(error)

    def _fail_waiters(self, error: Exception) -> None:
        while self._waiting:
            deliver = self._waiting.popleft()[0]
            try:
                deliver(RedisConnectionError(str(error)))
            except Exception:
                log.exception("redis reply callback failed")

    def abort(self) -> None:
        self._fail(RedisConnectionError("redis connection dropped: no reply in time"))


def _resolve(future: asyncio.Future[Any], reply: Any) -> None:
    if future.done():  # its caller gave up
        return
    if isinstance(reply, Exception):
        future.set_exception(reply)
    else:
        future.set_result(reply)


class RedisPipe:
    def __init__(self, url: str, *, connect_timeout: float) -> None:
        self._options: dict[str, Any] = dict(redis_parse_url(url))
        self._connect_timeout = connect_timeout
        self._protocol: _Protocol | None = None
        self._connecting: asyncio.Task[_Protocol] | None = None
        self.connects = 0

    async def connected(self) -> _Protocol:
        """The open connection, opening one if needed. The attempt runs as its own
        task, shared by every caller and shielded from their deadlines: a request's
        few milliseconds may be too short for a TLS handshake, and cancelling
        attempts one after the other would never connect."""
        task = self._connecting
        if task is None or task.done():
            task = self._connecting = asyncio.ensure_future(self._connect())
            task.add_done_callback(_retrieve)
        return await asyncio.shield(task)

    async def evalsha(self, sha: str, script: str, keys: list[str], args: list[Any]) -> Any:
        """The script's reply, connecting first if needed."""
        protocol = await self.connected()
        future = asyncio.get_running_loop().create_future()
        _evalsha(protocol, sha, script, keys, args, functools.partial(_resolve, future))
        return await future

    def evalsha_now(
        self, sha: str, script: str, keys: list[str], args: list[Any], deliver: Deliver
    ) -> bool:
        """Like :meth:`evalsha` but with neither a coroutine nor a future: ``deliver``
        gets the reply. False, and nothing sent, when there is no open connection (use
        :meth:`evalsha` then)."""
        protocol = self._protocol
        if protocol is None or protocol.closed:
            return False
        _evalsha(protocol, sha, script, keys, args, deliver)
        return True

    def drop_if_stuck(self) -> None:
        """Called after a timeout: a connection whose oldest command has waited far
        too long is dropped, so the next command opens a fresh one."""
        protocol = self._protocol
        if protocol is not None and not protocol.closed and protocol.oldest_wait() > STUCK_AFTER:
            protocol.abort()

    async def _connect(self) -> _Protocol:
        if self._protocol is not None and not self._protocol.closed:
            return self._protocol
        async with asyncio.timeout(self._connect_timeout):
            protocol = await self._open()
            await self._handshake(protocol)
        self._protocol = protocol
        self.connects += 1
        return protocol

    async def _open(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        options = self._options
        cls = options.get("connection_class")
        if cls is UnixDomainSocketConnection:
            _, protocol = await loop.create_unix_connection(
                lambda: _Protocol(loop), options["path"]
            )
            return protocol
        host = options.get("host", "localhost")
        port = int(options.get("port", 6379))
        context = _tls_context(options) if cls is SSLConnection else None
        _, protocol = await loop.create_connection(
            lambda: _Protocol(loop),
            host,
            port,
            ssl=context,
            server_hostname=host if context is not None else None,
        )
        return protocol

    async def _handshake(self, protocol: _Protocol) -> None:
        options = self._options
        commands: list[tuple[Any, ...]] = []
        if options.get("password") is not None:
            user = options.get("username")
            commands.append(
                ("AUTH", user, options["password"]) if user else ("AUTH", options["password"])
            )
        if int(options.get("db", 0)):
            commands.append(("SELECT", int(options["db"])))
        try:
            await asyncio.gather(
                *(protocol.request_future(hiredis.pack_command(c)) for c in commands)
            )
        except BaseException:
            protocol.abort()
            raise

    async def close(self) -> None:
        if self._protocol is not None:
            self._protocol.abort()
            self._protocol = None


_Retry = tuple[str, tuple[Any, ...]]
"""A script's source and the EVALSHA command that runs it."""


def _evalsha(
    protocol: _Protocol, sha: str, script: str, keys: list[str], args: list[Any], deliver: Deliver
) -> None:
    command = ("EVALSHA", sha, len(keys), *keys, *args)
    protocol.request(hiredis.pack_command(command), deliver, (script, command))


def _pack_eval(retry: _Retry) -> bytes:
    script, command = retry
    packed: bytes = hiredis.pack_command(("EVAL", script, *command[2:]))
    return packed


def _retrieve(task: asyncio.Task[Any]) -> None:
    """Collect a failed attempt's error: callers may all have given up on it."""
    if not task.cancelled():
        task.exception()


def _tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """The TLS settings of a ``rediss://`` URL's query, with redis-py's defaults
    (certificate and host name verified), so both clients of the store agree."""
    names = ("keyfile", "certfile", "cert_reqs", "ca_certs", "ca_data", "ca_path", "check_hostname")
    kwargs: dict[str, Any] = {"cert_reqs": "required", "check_hostname": True}
    kwargs.update({name: options[f"ssl_{name}"] for name in names if f"ssl_{name}" in options})
    if isinstance(kwargs["check_hostname"], str):
        kwargs["check_hostname"] = kwargs["check_hostname"].lower() in ("1", "true", "yes")
    context: ssl.SSLContext = RedisSSLContext(**kwargs).get()
    return context
