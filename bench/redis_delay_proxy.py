"""A TCP proxy that delays every chunk coming back from Redis by a fixed time.

Put it between the service and Redis to see what a slower Redis (another zone, a
busy server) does to each mode: client -> Redis bytes pass at once, Redis -> client
chunks are held ``--delay-ms`` after their arrival (in order, pipelined: a chunk's
delay does not add to the next one's), so each Redis round trip grows by the delay.

    python bench/redis_delay_proxy.py --listen-port 16380 --upstream-port 6379 --delay-ms 5

``bench/throughput.py --suite redis-delay`` starts one proxy per delay and measures
the round trip it really adds (``ping_rtts``) before using it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import socket
import time


async def _forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            writer.close()


async def _forward_delayed(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, delay: float
) -> None:
    """Read chunks as they come, write each one ``delay`` seconds after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def release() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                return
            wait = due - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    releaser = asyncio.create_task(release())
    try:
        while data := await reader.read(65536):
            queue.put_nowait((loop.time() + delay, data))
    except (ConnectionError, OSError):
        pass
    queue.put_nowait((0.0, b""))
    with contextlib.suppress(ConnectionError, OSError):
        await releaser
    with contextlib.suppress(OSError, RuntimeError):
        writer.close()


async def serve(listen_port: int, upstream_host: str, upstream_port: int, delay: float) -> None:
    async def handle(
        client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(upstream_host, upstream_port)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(
            _forward(client_reader, up_writer),
            _forward_delayed(up_reader, client_writer, delay),
        )

    server = await asyncio.start_server(handle, "127.0.0.1", listen_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def ping_rtts(port: int, count: int = 300) -> list[float]:
    """Round trips (seconds) of ``count`` sequential PINGs to ``port`` (Redis or a proxy)."""
    rtts: list[float] = []
    with socket.create_connection(("127.0.0.1", port), timeout=2) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            started = time.perf_counter()
            sock.sendall(b"PING\r\n")
            reply = b""
            while not reply.endswith(b"\r\n"):
                chunk = sock.recv(64)
                if not chunk:
                    raise ConnectionError("closed during PING")
                reply += chunk
            rtts.append(time.perf_counter() - started)
    return rtts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen-port", type=int, required=True)
    parser.add_argument("--upstream-host", default="127.0.0.1")
    parser.add_argument("--upstream-port", type=int, default=6379)
    parser.add_argument("--delay-ms", type=float, default=5.0)
    args = parser.parse_args()
    asyncio.run(serve(args.listen_port, args.upstream_host, args.upstream_port,
                      args.delay_ms / 1000))  # fmt: skip


if __name__ == "__main__":
    main()
