"""Counters kept as plain attributes on the request path and exported at scrape time.

prometheus_client's labelled counters take a lock and a dict lookup per ``inc``; the request path
instead bumps slot attributes, and a collector makes metric families when ``/metrics`` is read.
Names follow envoyproxy/ratelimit's stats as the Prometheus statsd exporter would name them.

A scrape runs on the event loop that answers calls, so the text is made in pieces of at most
:data:`SLICE` samples (:meth:`StatsCollector.exposition`), the server returning to the loop between
two. The per-key families are written straight from the counters (far cheaper than
prometheus_client's samples), byte for byte what ``generate_latest`` prints for
:meth:`StatsCollector.collect`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from typing import cast

from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _untyped_go_float

from ratelimit_service.core.histogram import Histogram
from ratelimit_service.core.lru import LruMap
from ratelimit_service.core.settings_table import default
from ratelimit_service.engine.counters import CATALOGUE, KEY_COUNTERS, Counter, Kind, Label

log = logging.getLogger(__name__)

_go_float = cast(Callable[[float], str], _untyped_go_float)
"""A value as the text format prints it (Go's float formatting, as generate_latest)."""

OVERFLOW_KEY = "_overflow"
SLICE = 250
"""Samples per piece of the exposition (and items per piece of other long walks) at most."""


class RuleStats:
    """Per stats-key counters: the slots are engine/counters.py's KEY_COUNTERS."""

    __slots__ = tuple(counter.attr for counter in KEY_COUNTERS)

    total_hits: int
    over_limit: int
    near_limit: int
    within_limit: int
    shadow_mode: int
    failure_mode_allowed: int
    """Hits failure_mode open admitted: the store failed (exact), a stale sync (probabilistic)."""
    failure_mode_denied: int
    """Hits denied by failure_mode closed, for the same reasons."""
    overloaded: int
    """Exact hits of requests that found too many others waiting for the store
    (refused with RESOURCE_EXHAUSTED, or denied by failure_mode: closed)."""

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, 0)


NEAR_KEYS = 1_000
"""Exact-mode keys remembered as near or over their limit, the least recently seen
forgotten first (the status page's closest keys: their counts live in the store)."""


class NearKey:
    """An exact-mode key as last seen near or over its limit."""

    __slots__ = ("limit", "rule", "seen", "used", "window_seconds")

    def __init__(self) -> None:
        self.rule = ""
        self.used = 0
        """Hits in the window after the call, at most the limit."""
        self.limit = 0
        self.window_seconds = 0
        self.seen = 0.0
        """time.monotonic() of the call."""


class Stats:
    """All service counters (engine/counters.py names them). Stats keys past ``max_keys``
    (overrides, detailed_metric on many values) are added up under ``_overflow``."""

    def __init__(self, max_keys: int = default("--max-stats-keys")) -> None:
        self.max_keys = max_keys
        self.rules: dict[str, RuleStats] = {}
        self.domain_not_found: dict[str, int] = {}
        self.overflowed_keys = 0
        self.service_error = 0
        self.store_error = 0
        self.store_overloaded = 0
        self.global_shadow_mode = 0
        self.total_requests = 0
        self.config_load_success = 0
        self.config_load_error = 0
        self.latency = Histogram()
        self.near_keys: LruMap[NearKey] = LruMap(NEAR_KEYS)

    def near_key(self, key: str, rule: str, used: int, limit: int, window_seconds: int) -> None:
        """Remember an exact-mode key seen near or over its limit (only such calls pay)."""
        entry = self.near_keys.get_or_create(key, NearKey)
        entry.rule = rule
        entry.used = used if used < limit else limit
        entry.limit = limit
        entry.window_seconds = window_seconds
        entry.seen = time.monotonic()

    def rule(self, key: str) -> RuleStats:
        stats = self.rules.get(key)
        if stats is None:
            if len(self.rules) >= self.max_keys:
                self.overflowed_keys += 1
                key = OVERFLOW_KEY
                stats = self.rules.get(key)
            if stats is None:
                stats = self.rules[key] = RuleStats()
        return stats

    def count_domain_not_found(self, domain: str) -> None:
        """Count a request for a domain no rule declares; log it once per domain."""
        if domain in self.domain_not_found:
            self.domain_not_found[domain] += 1
        elif len(self.domain_not_found) < self.max_keys:
            self.domain_not_found[domain] = 1
            log.warning(
                "request for domain %r, which no rule declares: answered OK (counted as"
                " domain_not_found on /metrics; said once per domain)",
                domain,
            )
        else:
            self.domain_not_found[OVERFLOW_KEY] = self.domain_not_found.get(OVERFLOW_KEY, 0) + 1


GaugeSource = Callable[[], Iterator[Metric | None]]
"""Metric families read from live state at scrape time; a None marks a point to yield."""


class StatsCollector(Collector):
    """Exposes :class:`Stats` and any gauge sources (buckets, store) to Prometheus."""

    def __init__(self, stats: Stats, *sources: GaugeSource) -> None:
        self._stats = stats
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        """Every family at once, for prometheus_client (the server uses exposition())."""
        stats = self._stats
        rules = list(stats.rules.items())
        for counter in CATALOGUE:
            if counter.label is None:
                yield _plain_family(counter, stats)
                continue
            family = CounterMetricFamily(counter.metric, counter.help, labels=[counter.label.value])
            for label_value, value in _rows(counter, stats, rules):
                family.add_metric([label_value], value)
            yield family
        for source in self._sources:
            yield from (family for family in source() if family is not None)

    def exposition(self) -> Iterator[bytes]:
        """:meth:`collect` as text, in pieces of bounded work; an empty one is a point to yield."""
        stats = self._stats
        rules = list(stats.rules.items())
        for counter in CATALOGUE:
            if counter.label is None:
                yield from _family_text(_plain_family(counter, stats))
            else:
                rows = _rows(counter, stats, rules)
                yield from _labelled_counter(counter, counter.label.value, rows)
        for source in self._sources:
            for item in source():
                if item is None:
                    yield b""
                else:
                    yield from _family_text(item)


def _rows(
    counter: Counter, stats: Stats, rules: list[tuple[str, RuleStats]]
) -> list[tuple[str, float]]:
    """A labelled counter's (label value, count) pairs."""
    if counter.label is Label.KEY:
        value = attrgetter(counter.attr)
        return [(key, value(rule)) for key, rule in rules]
    counts: dict[str, int] = getattr(stats, counter.attr)
    return list(counts.items())


def _plain_family(counter: Counter, stats: Stats) -> Metric:
    """An unlabelled counter's family, or the latency histogram's."""
    value = getattr(stats, counter.attr)
    if counter.kind is Kind.HISTOGRAM:
        return histogram_family(counter.metric, counter.help, value)
    return CounterMetricFamily(counter.metric, counter.help, value=value)


def _labelled_counter(
    counter: Counter, label: str, rows: Iterable[tuple[str, float]]
) -> Iterator[bytes]:
    """A counter family with one label, as generate_latest prints it, SLICE lines a piece."""
    sample = counter.metric + "_total"
    lines = [f"# HELP {sample} {_help(counter.help)}\n# TYPE {sample} counter\n"]
    for label_value, value in rows:
        lines.append(f'{sample}{{{label}="{_escape(label_value)}"}} {_go_float(value)}\n')
        if len(lines) >= SLICE:
            yield "".join(lines).encode()
            lines = []
    if lines:
        yield "".join(lines).encode()


def _help(text: str) -> str:
    return text.replace("\\", r"\\").replace("\n", r"\n")


def _escape(value: str) -> str:
    """A label value escaped as the text format wants it (and generate_latest does)."""
    return _help(value).replace('"', r"\"")


class _One:
    """A collector of one family, for generate_latest."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        yield self.family


def _family_text(family: Metric) -> Iterator[bytes]:
    """One family as generate_latest prints it, in pieces of SLICE samples (its header once;
    our families have no _created samples, which generate_latest would move)."""
    samples = family.samples
    if len(samples) <= SLICE:
        yield generate_latest(_One(family))
        return
    for start in range(0, len(samples), SLICE):
        part = Metric(family.name, family.documentation, family.type, family.unit)
        part.samples = samples[start : start + SLICE]
        text = generate_latest(_One(part))
        if start:  # the header (HELP and TYPE lines) only once
            text = text.split(b"\n", 2)[2]
        yield text
        yield b""


def histogram_family(name: str, help_text: str, histogram: Histogram) -> Metric:
    buckets = [
        ("+Inf" if bound == float("inf") else repr(bound), count)
        for bound, count in histogram.cumulative()
    ]
    return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=histogram.sum)
