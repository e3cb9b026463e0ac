"""A TCP forwarder that a test controls: the address a service dials, in front of a
store whose failures the test stages as they happen in production.

- ``repoint(port)``: new connections go to another upstream, the ones already open stay
  where they are. That is a failover done by moving an address (a Kubernetes Service,
  DNS, a proxy): the demoted master keeps its clients' connections.
- ``blackhole()``: every connection, open or new, is accepted and never answered, and
  what the client sends is swallowed. That is a partition, or a store that hangs.
  ``forward()`` ends it (for the connections open and to come).
- ``delay(seconds)``: every chunk coming back from the store is written to the client
  that long after it arrived (in order, pipelined: one chunk's delay does not add to
  the next one's), so every round trip grows by it. That is a slow store (a busy one,
  a far one).
- ``hold()``: what clients send is kept, in order, and not forwarded; ``release()``
  forwards it all and lets the rest through; ``held()`` is the bytes kept. That is a
  request stuck in the network, which reaches the store after its sender has been
  replaced (a late write).
- ``reset()``: every open connection is closed at once; ``connections()`` counts them.

It runs as its own process (``python -m ratelimit_harness.forwarder``), so that
its timing does not depend on the test's event loop or GIL, and takes one command a
line on a control port (``upstream PORT``, ``blackhole``, ``forward``, ``delay MS``,
``hold``, ``release``, ``held``, ``reset``, ``count``). :class:`Forwarder` starts it
and speaks that protocol.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

CHUNK = 65536


class _State:
    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.blackhole = False
        self.delay = 0.0
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.held = 0
        """Bytes read from clients and not forwarded yet."""
        self.pairs: set[_Pair] = set()


class _Pair:
    """One client connection and its upstream side."""

    def __init__(self, client: asyncio.StreamWriter, upstream: asyncio.StreamWriter) -> None:
        self.writers = (client, upstream)
        self.tasks: list[asyncio.Future[Any]] = []

    def close(self) -> None:
        for writer in self.writers:
            with contextlib.suppress(Exception):
                writer.transport.abort()
        for task in self.tasks:
            task.cancel()


async def _upward(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    """Client to store: chunks queue while held, and go out in order once released; in
    a black hole they are read and dropped."""
    queue: asyncio.Queue[bytes] = asyncio.Queue()

    async def send() -> None:
        while data := await queue.get():
            await state.flowing.wait()
            state.held -= len(data)
            writer.write(data)
            await writer.drain()

    await _pump(reader, writer, state, send, lambda data: _queue_held(queue, data, state))


def _queue_held(queue: asyncio.Queue[bytes], data: bytes, state: _State) -> None:
    state.held += len(data)
    queue.put_nowait(data)


async def _downward(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    """Store to client: each chunk written ``state.delay`` after it arrived; in a black
    hole, read and dropped."""
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

    def put(data: bytes) -> None:
        queue.put_nowait((loop.time() + state.delay, data))

    await _pump(reader, writer, state, send, put)


async def _pump(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    state: _State,
    send: Callable[[], Awaitable[None]],
    put: Callable[[bytes], None],
) -> None:
    """Read chunks and hand them to ``put`` (dropped in a black hole) while ``send``
    writes them; an empty chunk ends ``send`` once the reader is done."""
    sender = asyncio.ensure_future(send())
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(CHUNK):
            if not state.blackhole:
                put(data)
    put(b"")
    with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
        await sender
    with contextlib.suppress(Exception):
        writer.close()


async def _serve_client(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    if state.blackhole:  # accepted, never answered
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
        asyncio.ensure_future(_upward(reader, up_writer, state)),
        asyncio.ensure_future(_downward(up_reader, writer, state)),
    ]
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*pair.tasks, return_exceptions=True)
    state.pairs.discard(pair)
    pair.close()


def _command(state: _State, words: list[str]) -> str:
    """One control command's answer ("ok", a number, or "error: ...")."""
    match words:
        case ["upstream", port]:
            state.upstream = int(port)
        case ["blackhole"]:
            state.blackhole = True
        case ["forward"]:
            state.blackhole = False
        case ["delay", ms]:
            state.delay = float(ms) / 1000
        case ["hold"]:
            state.flowing.clear()
        case ["release"]:
            state.flowing.set()
        case ["held"]:
            return str(state.held)
        case ["reset"]:
            for pair in list(state.pairs):
                pair.close()
            state.pairs.clear()
        case ["count"]:
            return str(len(state.pairs))
        case _:
            return f"error: unknown command {' '.join(words)!r}"
    return "ok"


async def _control(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: _State
) -> None:
    while line := await reader.readline():
        writer.write(_command(state, line.decode().split()).encode() + b"\n")
        await writer.drain()
    writer.close()


async def _main(listen: int, upstream: int, control: int) -> None:
    """Serve the forwarder and its control port; once both listen, print their ports on
    one line (port 0: the system picks one, so no other process can take it between a
    parent's pick and this bind)."""
    state = _State(upstream)
    server = await asyncio.start_server(
        lambda r, w: _serve_client(r, w, state), "127.0.0.1", listen, reuse_address=True
    )
    controller = await asyncio.start_server(
        lambda r, w: _control(r, w, state), "127.0.0.1", control, reuse_address=True
    )
    ports = [s.sockets[0].getsockname()[1] for s in (server, controller)]
    print(*ports, flush=True)
    async with server, controller:
        await asyncio.gather(server.serve_forever(), controller.serve_forever())


class Forwarder:
    """The forwarder process, listening on ``port`` (``url`` for Redis) in front of
    ``upstream``."""

    def __init__(self, upstream: int) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "ratelimit_harness.forwarder",
             "--listen", "0", "--upstream", str(upstream), "--control", "0"],
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert self._process.stdout is not None
        announced = self._process.stdout.readline().split()  # once both ports listen
        if len(announced) != 2:
            self._process.kill()
            raise RuntimeError(f"the forwarder did not start (exit {self._process.wait()})")
        self.port, self.control_port = int(announced[0]), int(announced[1])
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._control: socket.socket | None = None

    def _command(self, line: str) -> str:
        if self._control is None:
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

    def delay(self, seconds: float) -> None:
        self._command(f"delay {seconds * 1000}")

    def hold(self) -> None:
        self._command("hold")

    def release(self) -> None:
        self._command("release")

    def held(self) -> int:
        return int(self._command("held"))

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
