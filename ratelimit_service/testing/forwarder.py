"""A TCP forwarder that a test controls: the address a service dials, in front of a
store whose failures the test stages as they happen in production.

- ``repoint(port)``: new connections go to another upstream, the ones already open stay
  where they are. That is a failover done by moving an address (a Kubernetes Service,
  DNS, a proxy): the demoted master keeps its clients' connections.
- ``blackhole()``: every connection, open or new, is accepted and never answered, and
  what the client sends is swallowed. That is a partition, or a store that hangs.
- ``forward()``: back to normal for the connections opened from now on and for the
  black-holed ones (their upstream side is still open).
- ``reset()``: every open connection is closed at once.

It runs as its own process (``python -m ratelimit_service.testing.forwarder``), so that
its latency does not depend on the test's event loop or GIL, and takes one command a
line on a control port: ``upstream PORT``, ``blackhole``, ``forward``, ``reset``,
``count`` (open connections). :class:`Forwarder` starts it and speaks that protocol.
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


class _Pair:
    """One client connection and its upstream side."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream = upstream
        self.tasks: list[asyncio.Task[None]] = []

    def close(self) -> None:
        for writer in (self.client, self.upstream):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        for task in self.tasks:
            task.cancel()


class _State:
    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.blackhole = asyncio.Event()
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.pairs: set[_Pair] = set()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State) -> None:
    """Copy bytes one way; in a black hole, read and drop them (the peer's kernel
    buffers do not fill, as with a host that is gone but a route that is not)."""
    with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
        while data := await reader.read(CHUNK):
            if state.blackhole.is_set():
                continue
            writer.write(data)
            await writer.drain()
    with contextlib.suppress(Exception):
        writer.close()


async def _serve_client(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    if state.blackhole.is_set():  # accepted, never answered
        with contextlib.suppress(ConnectionError, OSError):
            while await reader.read(CHUNK):
                pass
        writer.close()
        return
    try:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", state.upstream)
    except OSError:
        writer.transport.abort()
        return
    pair = _Pair(writer, up_writer)
    state.pairs.add(pair)
    pair.tasks = [
        asyncio.ensure_future(_pump(reader, up_writer, state)),
        asyncio.ensure_future(_pump(up_reader, writer, state)),
    ]
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*pair.tasks, return_exceptions=True)
    state.pairs.discard(pair)
    pair.close()


async def _control(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    while line := await reader.readline():
        words = line.decode().split()
        answer = "ok"
        if words[:1] == ["upstream"]:
            state.upstream = int(words[1])
        elif words == ["blackhole"]:
            state.blackhole.set()
        elif words == ["forward"]:
            state.blackhole.clear()
        elif words == ["reset"]:
            for pair in list(state.pairs):
                pair.close()
            state.pairs.clear()
        elif words == ["count"]:
            answer = str(len(state.pairs))
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


class Forwarder:
    """The forwarder process, listening on ``port`` in front of ``upstream``."""

    def __init__(self, upstream: int) -> None:
        self.port = free_port()
        self.control_port = free_port()
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ratelimit_service.testing.forwarder",
                "--listen",
                str(self.port),
                "--upstream",
                str(upstream),
                "--control",
                str(self.control_port),
            ]
        )
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
                raise ConnectionError("the forwarder's control port closed")
            answer += chunk
        text = answer.decode().strip()
        if text.startswith("error"):
            raise ValueError(text)
        return text

    def wait_ready(self) -> None:
        self._command("count")

    def repoint(self, upstream: int) -> None:
        self._command(f"upstream {upstream}")

    def blackhole(self) -> None:
        self._command("blackhole")

    def forward(self) -> None:
        self._command("forward")

    def reset(self) -> None:
        self._command("reset")

    def connections(self) -> int:
        return int(self._command("count"))

    def stop(self) -> None:
        if self._control is not None:
            self._control.close()
        self._process.kill()
        self._process.wait()

    def __enter__(self) -> Forwarder:
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
