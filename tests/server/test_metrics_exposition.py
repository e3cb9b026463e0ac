"""/metrics in pieces: the text is what prometheus_client prints, byte for byte, however
it is cut; no piece holds more than SLICE samples; the HTTP server takes pieces for a
bounded time before it returns to the event loop, and sends the page whole, with its
Content-Length."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric

from ratelimit_service.engine.background import WORK
from ratelimit_service.engine.stats import SLICE, Stats, StatsCollector
from ratelimit_service.server.http_server import HttpServer, pages

AWKWARD_KEYS = ['a"quoted"', "back\\slash", "new\nline", "plain.key_1", "ünïcode"]


def _stats(keys: int) -> Stats:
    stats = Stats(max_keys=keys)
    for n in range(keys + 10):  # past the cap: _overflow
        rule = stats.rule(AWKWARD_KEYS[n] if n < len(AWKWARD_KEYS) else f"d.k_v{n}")
        rule.total_hits += n * 1_000_003  # past 1e7 too: Go's exponent form
        rule.over_limit += n % 3
        rule.near_limit += 1
    for domain in ("nowhere", 'x"y'):
        stats.count_domain_not_found(domain)
    for seconds in (0.0001, 0.003, 0.2, 4.0):
        stats.latency.observe(seconds)
    return stats


def _long_source() -> Iterator[Metric | None]:
    family = GaugeMetricFamily("test_per_bucket", "one per bucket\nand escaped", labels=["b"])
    for n in range(2 * SLICE + 7):
        family.add_metric([f"bucket{n}"], n / 7)
    yield None
    yield family
    yield None
    yield GaugeMetricFamily("test_plain", "a plain gauge", value=3.5)


def test_pieces_join_into_what_prometheus_client_prints() -> None:
    collector = StatsCollector(_stats(2 * SLICE + 3), _long_source)
    pieces = list(collector.exposition())
    assert b"".join(pieces) == generate_latest(collector)
    assert b"" in pieces  # the sources' pause points come through
    for piece in pieces:
        samples = [line for line in piece.split(b"\n") if line and not line.startswith(b"#")]
        assert len(samples) <= SLICE


def test_an_empty_service_prints_the_same_too() -> None:
    collector = StatsCollector(Stats())
    assert b"".join(collector.exposition()) == generate_latest(collector)


async def _exchange(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(request)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    return raw


async def test_the_server_returns_to_the_loop_between_stretches_of_pieces() -> None:
    """Pieces that take 0.4 ms each: no more than WORK's worth of them in a row, then
    the loop runs other work; the page arrives whole, with its Content-Length."""
    turns = 0

    async def count_turns() -> None:
        nonlocal turns
        while True:
            turns += 1
            await asyncio.sleep(0)

    seen: list[int] = []

    def body() -> Iterator[bytes]:
        for n in range(20):
            seen.append(turns)
            end = time.perf_counter() + 0.0004
            while time.perf_counter() < end:
                pass
            yield b"" if n == 2 else f"piece {n}\n".encode()

    server = HttpServer(pages({"/p": lambda: (200, "text/plain", body())}))
    await server.start("127.0.0.1", 0)
    counter = asyncio.ensure_future(count_turns())
    try:
        raw = await _exchange(server.port, b"GET /p HTTP/1.1\r\nConnection: close\r\n\r\n")
        head, _, whole = raw.partition(b"\r\n\r\n")
        expected = b"".join(f"piece {n}\n".encode() for n in range(20) if n != 2)
        assert whole == expected
        assert f"Content-Length: {len(expected)}".encode() in head
        in_a_row = max(len(list(run)) for _, run in itertools.groupby(seen))
        assert in_a_row <= 1 + WORK / 0.0004, seen
        raw = await _exchange(server.port, b"HEAD /p HTTP/1.1\r\nConnection: close\r\n\r\n")
        assert raw.endswith(b"\r\n\r\n") and b"piece" not in raw
    finally:
        counter.cancel()
        await server.stop()
