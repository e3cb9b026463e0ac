"""A TCP proxy that a test slows down or holds: the address a service dials, in front of
a store that answers late, or behind which a request waits in the network.

- ``delay(seconds)``: every chunk coming back from the store is written to the client
  that long after it arrived (in order, pipelined: one chunk's delay does not add to
  the next one's), so every round trip grows by it. That is a slow store (a busy one,
  a far one).
- ``hold()``: what clients send is kept in the proxy, in order, and not forwarded;
  ``release()`` forwards it all and lets the rest through. That is a request stuck in
  the network, which reaches the store after its sender has been replaced (a late
  write).
- ``held()``: bytes kept by ``hold`` and not forwarded yet.

It runs as its own process (``python -m ratelimit_service.testing.delay_proxy``), so its
timing does not depend on the test's event loop, and takes one command a line on a
control port: ``delay MS``, ``hold``, ``release``, ``held``. :class:`DelayProxy` starts
it and speaks that protocol. (testing/forwarder.py is the one for repointed addresses,
black holes and resets.)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
from typing import Any

from ratelimit_service.testing.redis import free_port

CHUNK = 65536


class _State:
    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.delay = 0.0
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.held = 0
        """Bytes read from clients and not forwarded yet."""


async def _upward(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    """Client to store: chunks queue up while held, and go out in order once released."""
    queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def send() -> None:
        while data := await queue.get():
            await state.flowing.wait()
            state.held -= len(data)
            writer.write(data)
            await writer.drain()

    sender = asyncio.ensure_future(send())
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(CHUNK):
            state.held += len(data)
            queue.put_nowait(data)
    queue.put_nowait(b"")
    with contextlib.suppress(ConnectionError, OSError):
        await sender
    with contextlib.suppress(Exception):
        writer.close()


async def _downward(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    """Store to client: each chunk written ``state.delay`` after it arrived."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, data = await queue.get()
            if not data:
                return
            if (wait := due - loop.time()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()

    sender = asyncio.ensure_future(send())
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(CHUNK):
            queue.put_nowait((loop.time() + state.delay, data))
    queue.put_nowait((0.0, b""))
    with contextlib.suppress(ConnectionError, OSError):
        await sender
    with contextlib.suppress(Exception):
        writer.close()


async def _serve_client(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    try:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", state.upstream)
    except OSError:
        writer.transport.abort()
        return
    await asyncio.gather(
        _upward(reader, up_writer, state),
        _downward(up_reader, writer, state),
        return_exceptions=True,
    )


async def _control(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    while line := await reader.readline():
        words = line.decode().split()
        answer = "ok"
        if words[:1] == ["delay"] and len(words) == 2:
            state.delay = float(words[1]) / 1000
        elif words == ["hold"]:
            state.flowing.clear()
        elif words == ["release"]:
            state.flowing.set()
        elif words == ["held"]:
            answer = str(state.held)
        else:
            answer = f"error: unknown command {line.decode().strip()!r}"
        writer.write(answer.encode() + b"\n")
        await writer.drain()
    writer.close()


async def _main(listen: int, upstream: int, control: int) -> None:
    state = _State(upstream)
    server = await asyncio.start_server(
        lambda r, w: _serve_client(r, w, state), "127.0.0.1", listen, reuse_address=True
    )
    controller = await asyncio.start_server(
        lambda r, w: _control(r, w, state), "127.0.0.1", control, reuse_address=True
    )
    async with server, controller:
        await asyncio.gather(server.serve_forever(), controller.serve_forever())


class DelayProxy:
    """The proxy process, listening on ``port`` in front of ``upstream``."""

    def __init__(self, upstream: int) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.control_port = free_port()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "ratelimit_service.testing.delay_proxy",
             "--listen", str(self.port), "--upstream", str(upstream),
             "--control", str(self.control_port)]
        )  # fmt: skip
        self._control: socket.socket | None = None

    def _command(self, line: str) -> str:
        if self._control is None:
            from ratelimit_service.testing.fleet import wait_port

            wait_port(self.control_port)
            self._control = socket.create_connection(("127.0.0.1", self.control_port), timeout=5)
        self._control.sendall(line.encode() + b"\n")
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = self._control.recv(256)
            if not chunk:
                raise ConnectionError("the proxy's control port closed")
            answer += chunk
        text = answer.decode().strip()
        if text.startswith("error"):
            raise ValueError(text)
        return text

    def wait_ready(self) -> None:
        self._command("held")

    def delay(self, seconds: float) -> None:
        self._command(f"delay {seconds * 1000:g}")

    def hold(self) -> None:
        self._command("hold")

    def release(self) -> None:
        self._command("release")

    def held(self) -> int:
        return int(self._command("held"))

    def stop(self) -> None:
        if self._control is not None:
            self._control.close()
        self._process.kill()
        self._process.wait()

    def __enter__(self) -> DelayProxy:
        self.wait_ready()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=int, required=True)
    parser.add_argument("--upstream", type=int, required=True)
    parser.add_argument("--control", type=int, required=True)
    options = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(options.listen, options.upstream, options.control))


if __name__ == "__main__":
    main()
