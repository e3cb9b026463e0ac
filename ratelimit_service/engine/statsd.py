"""statsd: the service's counters under envoyproxy/ratelimit's stat names, over UDP.

Nothing is added to the request path: every flush interval a background task reads the counters
(engine/stats.py), turns what changed since the last flush into statsd lines, and sends them in
datagrams of at most :data:`MAX_DATAGRAM` bytes. The names are the Go service's, declared in
engine/counters.py; counters it does not have stay on /metrics. A flush reads every stats key in
pieces of SLICE keys (background.in_stretches).

The timer comes from the latency histogram: each bucket that gained ``n`` calls is one sample with
sample rate ``1/n`` (statsd counts it ``n`` times), its value the interval's mean latency held
inside that bucket's bounds. Counts are exact; each value lies in its call's bucket.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterable, Iterator
from operator import attrgetter

from ratelimit_service.core.histogram import LATENCY_BOUNDS, Histogram
from ratelimit_service.core.settings_table import default
from ratelimit_service.engine.background import BackgroundTask, in_stretches
from ratelimit_service.engine.counters import (
    DOMAIN_NOT_FOUND,
    KEY_COUNTERS,
    LATENCY,
    SERVICE_COUNTERS,
)
from ratelimit_service.engine.stats import SLICE, Stats

log = logging.getLogger(__name__)

MAX_DATAGRAM = 1432
"""Bytes per datagram at most: a 1500-byte MTU less IP and UDP headers, as statsd clients do."""
_UNSAFE = str.maketrans({":": "_", "|": "_", "\n": "_", "\r": "_"})


def stat_name(name: str) -> str:
    """A name statsd can carry: ``:`` and ``|`` become ``_`` as in the Go service's
    stats keys, and so do line breaks (they would end the line)."""
    return name.translate(_UNSAFE)


def _around(template: str | None, label: str) -> tuple[str, str]:
    """A labelled statsd name's parts before and after its label's value."""
    head, _, tail = (template or "").partition("{" + label + "}")
    return head, tail


_PER_KEY = [(c.attr, _around(c.statsd, "key")) for c in KEY_COUNTERS if c.statsd is not None]
_PER_KEY_VALUES = attrgetter(*(attr for attr, _ in _PER_KEY))
"""A stats key's counters that statsd carries, as a tuple."""
_PER_KEY_NAMES = [names for _, names in _PER_KEY]
_NOT_FOUND_NAME = _around(DOMAIN_NOT_FOUND.statsd, "domain")
_TIMER = LATENCY.statsd
_SERVICE = [(c.attr, c.statsd) for c in SERVICE_COUNTERS if c.statsd is not None]


class StatsdDeltas:
    """What changed in :class:`Stats` since the previous call, as statsd lines."""

    def __init__(self, stats: Stats) -> None:
        self._stats = stats
        self._rules: dict[str, tuple[int, ...]] = {}
        self._plain: dict[str, int] = {}
        self._latency_buckets = [0] * (len(LATENCY_BOUNDS) + 1)
        self._latency_sum = 0.0

    def lines(self) -> list[str]:
        return [line for piece in self.pieces() for line in piece]

    def pieces(self) -> Iterator[list[str]]:
        """The lines, SLICE stats keys (or domains) at a time, then the service's own."""
        stats = self._stats
        out: list[str] = []
        nothing = (0,) * len(_PER_KEY)
        for count, (key, rule) in enumerate(list(stats.rules.items()), 1):
            now: tuple[int, ...] = _PER_KEY_VALUES(rule)
            before = self._rules.get(key, nothing)
            self._rules[key] = now
            name = stat_name(key)
            for (head, tail), value, old in zip(_PER_KEY_NAMES, now, before, strict=True):
                delta = _delta(value, old)
                if delta:
                    out.append(f"{head}{name}{tail}:{delta}|c")
            if count % SLICE == 0:
                yield out
                out = []
        head, tail = _NOT_FOUND_NAME
        not_found: dict[str, int] = getattr(stats, DOMAIN_NOT_FOUND.attr)
        for count, (domain, found) in enumerate(list(not_found.items()), 1):
            out.extend(self._counter(f"{head}{stat_name(domain)}{tail}", found))
            if count % SLICE == 0:
                yield out
                out = []
        for attr, name in _SERVICE:
            out.extend(self._counter(name, getattr(stats, attr)))
        out.extend(self._timer_lines())
        yield out

    def _counter(self, name: str, value: int) -> Iterator[str]:
        delta = _delta(value, self._plain.get(name, 0))
        self._plain[name] = value
        if delta:
            yield f"{name}:{delta}|c"

    def _timer_lines(self) -> Iterator[str]:
        latency: Histogram = getattr(self._stats, LATENCY.attr)
        buckets, total = list(latency.buckets), latency.sum
        gained = [_delta(now, old) for now, old in zip(buckets, self._latency_buckets, strict=True)]
        calls = sum(gained)
        spent = total - self._latency_sum if total >= self._latency_sum else total
        self._latency_buckets, self._latency_sum = buckets, total
        if not calls:
            return
        mean_ms = spent * 1000.0 / calls
        lower = 0.0
        for upper, count in zip((*LATENCY_BOUNDS, float("inf")), gained, strict=True):
            if count:
                value = min(max(mean_ms, lower * 1000.0), upper * 1000.0)
                rate = "" if count == 1 else f"|@{1.0 / count:.6g}"
                yield f"{_TIMER}:{value:.6g}|ms{rate}"
            lower = upper


def _delta(now: int, before: int) -> int:
    """Growth since the last flush (a counter that went back started again)."""
    return now - before if now >= before else now


def pack(lines: Iterable[str], limit: int = MAX_DATAGRAM) -> list[bytes]:
    """Lines joined by newlines into datagrams of at most ``limit`` bytes; a line longer
    than that travels alone (cut, it would be a wrong stat)."""
    datagrams: list[bytes] = []
    current = bytearray()
    for line in lines:
        data = line.encode()
        if current and len(current) + 1 + len(data) > limit:
            datagrams.append(bytes(current))
            current = bytearray()
        if current:
            current += b"\n"
        current += data
    if current:
        datagrams.append(bytes(current))
    return datagrams


class StatsdSink:
    """Flushes :class:`StatsdDeltas` to ``host:port`` over UDP every ``interval`` seconds and
    when stopped, resolving the address each time; what cannot be sent is dropped, counted."""

    def __init__(
        self,
        stats: Stats,
        host: str,
        port: int,
        interval: float = default("--statsd-flush-interval"),
    ) -> None:
        if interval <= 0:
            raise ValueError("statsd flush interval must be positive")
        self.host, self.port, self.interval = host, port, interval
        self.deltas = StatsdDeltas(stats)
        self.datagrams_sent = 0
        self.datagrams_dropped = 0
        self._failing = False
        self._sockets: dict[int, socket.socket] = {}
        self._background = BackgroundTask("statsd", self._run)

    def start(self) -> None:
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()
        await self.flush()
        for sock in self._sockets.values():
            sock.close()
        self._sockets.clear()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.flush()

    async def flush(self) -> int:
        """Send what changed; returns the number of datagrams sent."""
        lines: list[str] = []
        async for piece in in_stretches(self.deltas.pieces()):
            lines += piece
        datagrams = pack(lines)
        if not datagrams:
            return 0
        sent = 0
        try:
            family, address = await self._resolve()
            sock = self._socket(family)
            for datagram in datagrams:
                sock.sendto(datagram, address)
                sent += 1
        except OSError as exc:
            self.datagrams_dropped += len(datagrams) - sent
            if not self._failing:
                log.warning("statsd: cannot send to %s:%d: %s", self.host, self.port, exc)
            self._failing = True
        else:
            if self._failing:
                log.info("statsd: sending to %s:%d again", self.host, self.port)
            self._failing = False
        self.datagrams_sent += sent
        return sent

    async def _resolve(self) -> tuple[int, tuple[str, int]]:
        infos = await asyncio.get_running_loop().getaddrinfo(
            self.host, self.port, type=socket.SOCK_DGRAM
        )
        family, _, _, _, address = infos[0]
        return int(family), (str(address[0]), int(address[1]))

    def _socket(self, family: int) -> socket.socket:
        sock = self._sockets.get(family)
        if sock is None:
            sock = self._sockets[family] = socket.socket(family, socket.SOCK_DGRAM)
            sock.setblocking(False)
        return sock
