"""One pipelined connection to one Redis server, for the exact-mode request path.

redis-py's asyncio client spends more CPU per command than the rest of a ShouldRateLimit
call. Redis answers a connection's commands in order, so this module writes each command
at once and hands each reply (parsed by hiredis) to its command's callback in the loop
turn that read it: no future per command; a caller that gives up leaves nothing broken.

The socket is read here (``loop.add_reader``; TLS through an ``ssl.SSLObject`` on memory
buffers), not through an asyncio transport, so that :meth:`RedisPipe.poll` can read what
the kernel holds at any moment: a caller about to give up polls first (uvloop runs due
timers before it polls for I/O). :meth:`RedisPipe.silent_for` gives the evidence of a
peer gone without a reset: no byte for a while with commands outstanding.

Only single-server URLs (``redis://``, ``rediss://``, ``unix://``) use it; Sentinel and
Cluster stay with redis-py. Reconnecting is lazy and one at a time.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import ssl
from collections import deque
from collections.abc import Callable
from typing import Any

import hiredis
from redis.asyncio.connection import RedisSSLContext, SSLConnection, UnixDomainSocketConnection
from redis.asyncio.connection import parse_url as redis_parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

log = logging.getLogger(__name__)

MAX_OUTSTANDING = 10_000
"""Commands waiting for a reply on the connection; beyond it, new commands fail."""
RECV_SIZE = 256 * 1024


def supports(url: str) -> bool:
    return url.split("://", 1)[0] in ("redis", "rediss", "unix")


Deliver = Callable[[Any], None]
"""Gets a command's reply once (value, ResponseError, ConnectionError): quick, never raising."""
Observe = Callable[[float], None]
"""Gets the seconds from a command's write to its reply's read, for each reply."""

_Retry = tuple[str, tuple[Any, ...]]
"""A script's source and the EVALSHA command that runs it."""


class _Tls:
    """TLS over memory buffers: the connection moves the bytes itself."""

    def __init__(self, context: ssl.SSLContext, host: str | None) -> None:
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.obj = context.wrap_bio(self.incoming, self.outgoing, server_hostname=host)

    async def handshake(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        while True:
            try:
                self.obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                await _send_all(loop, sock, self.outgoing.read())
                data = await loop.sock_recv(sock, RECV_SIZE)
                if not data:
                    raise ConnectionError("connection closed during the TLS handshake") from None
                self.incoming.write(data)
        await _send_all(loop, sock, self.outgoing.read())

    def decrypt(self, data: bytes) -> bytes:
        """The plain bytes ``data`` completes (maybe none); ssl.SSLError, also on TLS close."""
        self.incoming.write(data)
        chunks = []
        while True:
            try:
                chunks.append(self.obj.read(RECV_SIZE))
            except ssl.SSLWantReadError:
                return b"".join(chunks)

    def encrypt(self, data: bytes) -> bytes:
        if data:
            self.obj.write(data)
        return self.outgoing.read()


async def _send_all(loop: asyncio.AbstractEventLoop, sock: socket.socket, data: bytes) -> None:
    if data:
        await loop.sock_sendall(sock, data)


class _Connection:
    """One socket, read and written here; replies delivered in command order."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        tls: _Tls | None,
        observe: Observe | None,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._tls = tls
        self._observe = observe
        self._reader = hiredis.Reader()
        # (whom to deliver to, sent at, the script and EVALSHA to retry as EVAL on NOSCRIPT)
        self._waiting: deque[tuple[Deliver, float, _Retry | None]] = deque()
        self._unsent = bytearray()
        self.closed = False
        self.last_read = loop.time()
        loop.add_reader(self._fd, self.poll)

    def poll(self) -> None:
        """Read everything the socket holds now and deliver the replies in it."""
        while not self.closed:
            try:
                data = self._sock.recv(RECV_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._fail(RedisConnectionError(f"redis connection lost: {exc}"))
                return
            if not data:
                self._fail(RedisConnectionError("redis connection lost: closed by the server"))
                return
            self.last_read = self._loop.time()
            received = len(data)
            if self._tls is not None:
                try:
                    data = self._tls.decrypt(data)
                    self._write_raw(self._tls.encrypt(b""))  # session tickets, key updates
                except ssl.SSLError as exc:
                    self._fail(RedisConnectionError(f"redis TLS error: {exc}"))
                    return
            self._parse(data)
            if received < RECV_SIZE:
                return  # the socket is drained (a full read may have left more)

    def _parse(self, data: bytes) -> None:
        reader, waiting = self._reader, self._waiting
        try:
            reader.feed(data)
            while not self.closed and (reply := reader.gets()) is not False:
                if not waiting:
                    raise hiredis.ProtocolError("a reply nobody asked for")
                deliver, sent_at, retry = waiting.popleft()
                if isinstance(reply, hiredis.ReplyError):
                    if retry is not None and str(reply).startswith("NOSCRIPT"):
                        # Redis lost the script (restart, SCRIPT FLUSH): send it whole.
                        # The EVAL goes to the back of the line, so order still holds.
                        self._write(deliver, _pack_eval(retry), None)
                        continue
                    reply = ResponseError(str(reply))
                if self._observe is not None:
                    self._observe(self.last_read - sent_at)
                try:
                    deliver(reply)
                except Exception:  # a bug in a caller: keep the connection in step
                    log.exception("redis reply callback failed")
        except hiredis.ProtocolError as exc:
            self._fail(RedisConnectionError(f"redis protocol error: {exc!r}"))

    def request(self, packed: bytes, deliver: Deliver, retry: _Retry | None = None) -> None:
        """Send a command; ``deliver`` gets its reply (at once if it cannot be sent)."""
        if self.closed:
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
        self._waiting.append((deliver, self._loop.time(), retry))
        if self._tls is not None:
            packed = self._tls.encrypt(packed)
        self._write_raw(packed)

    def _write_raw(self, data: bytes) -> None:
        if not data or self.closed:
            return
        if self._unsent:  # earlier bytes are still waiting for room: keep the order
            self._unsent += data
            return
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self._fail(RedisConnectionError(f"redis connection lost: {exc}"))
            return
        if sent < len(data):
            self._unsent += data[sent:]
            self._loop.add_writer(self._fd, self._writable)

    def _writable(self) -> None:
        try:
            sent = self._sock.send(self._unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._fail(RedisConnectionError(f"redis connection lost: {exc}"))
            return
        del self._unsent[:sent]
        if not self._unsent:
            self._loop.remove_writer(self._fd)

    def silent_for(self) -> float:
        """Seconds since the last byte read and the oldest command's sending; 0: none out."""
        if not self._waiting:
            return 0.0
        since = max(self.last_read, self._waiting[0][1])
        return max(0.0, self._loop.time() - since)

    def _fail(self, error: Exception) -> None:
        if not self.closed:
            self.closed = True
            self._loop.remove_reader(self._fd)
            if self._unsent:
                self._loop.remove_writer(self._fd)
            self._sock.close()
        while self._waiting:
            deliver = self._waiting.popleft()[0]
            try:
                deliver(RedisConnectionError(str(error)))
            except Exception:
                log.exception("redis reply callback failed")

    def abort(self, reason: str = "redis connection dropped") -> None:
        self._fail(RedisConnectionError(reason))


def _resolve(future: asyncio.Future[Any], reply: Any) -> None:
    if future.done():  # its caller gave up
        return
    if isinstance(reply, Exception):
        future.set_exception(reply)
    else:
        future.set_result(reply)


class RedisPipe:
    def __init__(self, url: str, *, connect_timeout: float, observe: Observe | None = None) -> None:
        self._options: dict[str, Any] = dict(redis_parse_url(url))
        self._connect_timeout = connect_timeout
        self._observe = observe
        self._connection: _Connection | None = None
        self._connecting: asyncio.Task[_Connection] | None = None
        self.connects = 0

    def _live(self) -> _Connection | None:
        connection = self._connection
        return connection if connection is not None and not connection.closed else None

    async def connected(self) -> _Connection:
        """The open connection, opened if needed in a task shared by every caller and shielded from
        their deadlines: attempts cancelled one after another would never connect."""
        task = self._connecting
        if task is None or task.done():
            task = self._connecting = asyncio.ensure_future(self._connect())
            task.add_done_callback(forget)
        return await asyncio.shield(task)

    async def evalsha(self, sha: str, script: str, keys: list[str], args: list[Any]) -> Any:
        """The script's reply, connecting first if needed."""
        connection = await self.connected()
        future = asyncio.get_running_loop().create_future()
        _evalsha(connection, sha, script, keys, args, functools.partial(_resolve, future))
        return await future

    def evalsha_now(
        self, sha: str, script: str, keys: list[str], args: list[Any], deliver: Deliver
    ) -> bool:
        """:meth:`evalsha` by callback; False, and nothing sent, when no connection is open."""
        connection = self._live()
        if connection is None:
            return False
        _evalsha(connection, sha, script, keys, args, deliver)
        return True

    def poll(self) -> None:
        """Read and deliver the replies already on the socket, now."""
        if (connection := self._live()) is not None:
            connection.poll()

    def silent_for(self) -> float:
        """Seconds with commands outstanding and no byte read (see _Connection)."""
        connection = self._live()
        return 0.0 if connection is None else connection.silent_for()

    def drop(self, reason: str) -> None:
        """Close the connection (its commands fail with ``reason``; the next one reopens)."""
        if (connection := self._live()) is not None:
            connection.abort(reason)

    async def _connect(self) -> _Connection:
        if (live := self._live()) is not None:
            return live
        async with asyncio.timeout(self._connect_timeout):
            connection = await self._open()
            await self._handshake(connection)
        self._connection = connection
        self.connects += 1
        return connection

    async def _open(self) -> _Connection:
        loop = asyncio.get_running_loop()
        options = self._options
        cls = options.get("connection_class")
        if cls is UnixDomainSocketConnection:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            await _sock_connect(loop, sock, options["path"])
            return _Connection(loop, sock, None, self._observe)
        host = options.get("host", "localhost")
        port = int(options.get("port", 6379))
        sock = await _tcp_connect(loop, host, port)
        tls = None
        if cls is SSLConnection:
            try:
                tls = _Tls(_tls_context(options), host)
                await tls.handshake(loop, sock)
            except BaseException:
                sock.close()
                raise
        return _Connection(loop, sock, tls, self._observe)

    async def _handshake(self, connection: _Connection) -> None:
        options = self._options
        commands: list[tuple[Any, ...]] = []
        if (password := options.get("password")) is not None:
            user = options.get("username")
            commands.append(("AUTH", user, password) if user else ("AUTH", password))
        if int(options.get("db", 0)):
            commands.append(("SELECT", int(options["db"])))
        try:
            await asyncio.gather(
                *(connection.request_future(hiredis.pack_command(c)) for c in commands)
            )
        except BaseException:
            connection.abort()
            raise

    async def close(self) -> None:
        if self._connection is not None:
            self._connection.abort("redis connection closed")
            self._connection = None


async def _sock_connect(loop: asyncio.AbstractEventLoop, sock: socket.socket, address: Any) -> None:
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise


async def _tcp_connect(loop: asyncio.AbstractEventLoop, host: str, port: int) -> socket.socket:
    """A connected non-blocking TCP socket to the first address of ``host`` that answers."""
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        try:
            await _sock_connect(loop, sock, address)
        except OSError as exc:
            error = exc
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise error


def _evalsha(
    connection: _Connection,
    sha: str,
    script: str,
    keys: list[str],
    args: list[Any],
    deliver: Deliver,
) -> None:
    command = ("EVALSHA", sha, len(keys), *keys, *args)
    connection.request(hiredis.pack_command(command), deliver, (script, command))


def _pack_eval(retry: _Retry) -> bytes:
    script, command = retry
    packed: bytes = hiredis.pack_command(("EVAL", script, *command[2:]))
    return packed


def forget(task: asyncio.Future[Any]) -> None:
    """Collect the outcome of a task nobody may wait for any more."""
    if not task.cancelled():
        task.exception()


def _tls_context(options: dict[str, Any]) -> ssl.SSLContext:
    """A ``rediss://`` URL's TLS settings, with redis-py's defaults: both clients agree."""
    names = ("keyfile", "certfile", "cert_reqs", "ca_certs", "ca_data", "ca_path", "check_hostname")
    kwargs: dict[str, Any] = {"cert_reqs": "required", "check_hostname": True}
    kwargs.update({name: options[f"ssl_{name}"] for name in names if f"ssl_{name}" in options})
    if isinstance(kwargs["check_hostname"], str):
        kwargs["check_hostname"] = kwargs["check_hostname"].lower() in ("1", "true", "yes")
    context: ssl.SSLContext = RedisSSLContext(**kwargs).get()
    return context
