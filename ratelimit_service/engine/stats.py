"""Counters kept as plain attributes on the request path and exported at scrape time.

prometheus_client's labelled counters take a lock and a dict lookup per ``inc``;
we instead bump slot attributes of small objects and let a custom collector turn
them into metric families when ``/metrics`` is read. Metric names follow
envoyproxy/ratelimit's stats (``ratelimit.service.rate_limit.<key>.total_hits`` and
so on) as the Prometheus statsd exporter would name them.

A scrape runs on the event loop that answers calls, so the text is made in pieces of
bounded work (:meth:`StatsCollector.exposition`, :data:`SLICE` samples at most each)
and the HTTP server returns to the loop between two. The per-key families, eight lines
per stats key, are written straight from the counters (a tenth of the cost of building
prometheus_client samples and rendering them); the output is what
``prometheus_client.generate_latest`` prints for :meth:`StatsCollector.collect`, byte
for byte. At the 10,000 stats keys' cap that page is 7.7 MB: rendered in one go it held
the loop 1.2 s, and every call arriving meanwhile waited as long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from operator import attrgetter
from typing import cast

from prometheus_client import generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString as _untyped_go_float

from ratelimit_service.core.histogram import Histogram
from ratelimit_service.core.lru import LruMap

log = logging.getLogger(__name__)

_go_float = cast(Callable[[float], str], _untyped_go_float)
"""A value as the text format prints it (Go's float formatting, as generate_latest)."""

OVERFLOW_KEY = "_overflow"
RULE_PREFIX = "ratelimit_service_rate_limit_"
SLICE = 250
"""Samples per piece of the exposition at most: under 0.1 ms of work for the per-key
families on an idle core (see the module docstring)."""


class RuleStats:
    """Per stats-key counters, named as in envoyproxy/ratelimit."""

    __slots__ = (
        "failure_mode_allowed",
        "failure_mode_denied",
        "near_limit",
        "over_limit",
        "overloaded",
        "shadow_mode",
        "total_hits",
        "within_limit",
    )

    def __init__(self) -> None:
        self.total_hits = 0
        self.over_limit = 0
        self.near_limit = 0
        self.within_limit = 0
        self.shadow_mode = 0
        self.failure_mode_allowed = 0
        """Hits admitted by failure_mode: open because the store failed (exact) or the
        last sync is too old (probabilistic)."""
        self.failure_mode_denied = 0
        """Hits denied by failure_mode: closed, for the same reasons."""
        self.overloaded = 0
        """Exact hits of requests that found too many others waiting for the store
        (refused with RESOURCE_EXHAUSTED, or denied by failure_mode: closed)."""


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
    """All service counters. The number of distinct stats keys is bounded: keys past
    ``max_keys`` (per-request overrides or detailed_metric on high-cardinality values)
    are added up under ``_overflow``."""

    def __init__(self, max_keys: int = 10_000) -> None:
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
        """Remember an exact-mode key seen near or over its limit (only such calls pay
        for it: a map update, no allocation once the key is known)."""
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
        """Count a request for a domain no rule file declares; say so once per domain
        (the first time), not per request."""
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
"""Metric families read from live state at scrape time; a None between them marks a
point where the scrape may return to the event loop (a long walk over the state)."""


class StatsCollector(Collector):
    """Exposes :class:`Stats` plus any extra gauge sources (buckets, store) to Prometheus."""

    def __init__(self, stats: Stats, *sources: GaugeSource) -> None:
        self._stats = stats
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        """Every family at once, for prometheus_client (the server uses exposition())."""
        stats = self._stats
        families = {
            name: CounterMetricFamily(
                RULE_PREFIX + name, f"envoyproxy/ratelimit {name}", labels=["key"]
            )
            for name in RuleStats.__slots__
        }
        for key, rule in list(stats.rules.items()):
            for name, family in families.items():
                family.add_metric([key], getattr(rule, name))
        yield from families.values()
        not_found = CounterMetricFamily(
            RULE_PREFIX + "domain_not_found",
            NOT_FOUND_HELP,
            labels=["domain"],
        )
        for domain, count in list(stats.domain_not_found.items()):
            not_found.add_metric([domain], count)
        yield not_found
        yield from self._service_families()
        for source in self._sources:
            yield from (family for family in source() if family is not None)

    def exposition(self) -> Iterator[bytes]:
        """The Prometheus text exposition of :meth:`collect`, in pieces of bounded
        work; an empty piece is a point to return to the event loop at. Counters read
        later in a scrape may be newer than those read earlier (a scrape is not a
        snapshot, as with any client library)."""
        stats = self._stats
        rules = list(stats.rules.items())
        for name in RuleStats.__slots__:
            value = attrgetter(name)
            yield from _labelled_counter(
                RULE_PREFIX + name,
                f"envoyproxy/ratelimit {name}",
                "key",
                [(key, value(rule)) for key, rule in rules],
            )
        yield from _labelled_counter(
            RULE_PREFIX + "domain_not_found",
            NOT_FOUND_HELP,
            "domain",
            list(stats.domain_not_found.items()),
        )
        for family in self._service_families():
            yield from _family_text(family)
        for source in self._sources:
            for item in source():
                if item is None:
                    yield b""
                else:
                    yield from _family_text(item)

    def _service_families(self) -> Iterator[Metric]:
        stats = self._stats
        yield from _service_counters(stats)
        yield histogram_family(
            "ratelimit_server_should_rate_limit_response_time_seconds",
            LATENCY_HELP,
            stats.latency,
        )


NOT_FOUND_HELP = "Requests for a domain with no config"
LATENCY_HELP = (
    "ShouldRateLimit calls' time in the service: from the handler's start to its answer,"
    " plus the wait of calls held by a pause of the event loop (see rls/servicer.py)"
)


def _labelled_counter(
    name: str, help_text: str, label: str, rows: Iterable[tuple[str, float]]
) -> Iterator[bytes]:
    """A counter family with one label, as generate_latest prints it, SLICE lines per
    piece (the rows are read piece by piece)."""
    sample = name + "_total"
    lines = [f"# HELP {sample} {_help(help_text)}\n# TYPE {sample} counter\n"]
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
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


class _One:
    """A collector of one family, for generate_latest."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> Iterator[Metric]:
        yield self.family


def _family_text(family: Metric) -> Iterator[bytes]:
    """One family as generate_latest prints it; a family of more than SLICE samples in
    several pieces (its header once). Our families have no _created samples, which
    generate_latest would move to the end of their family."""
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


def _service_counters(stats: Stats) -> Iterator[Metric]:
    plain = {
        "ratelimit_service_config_load_success": ("Configs loaded", stats.config_load_success),
        "ratelimit_service_config_load_error": ("Configs rejected", stats.config_load_error),
        "ratelimit_service_global_shadow_mode": (
            "Requests let through by global shadow mode",
            stats.global_shadow_mode,
        ),
        "ratelimit_service_call_should_rate_limit_service_error": (
            "Invalid requests",
            stats.service_error,
        ),
        "ratelimit_service_call_should_rate_limit_store_error": (
            "Requests that met a store error",
            stats.store_error,
        ),
        "ratelimit_service_call_should_rate_limit_store_overloaded": (
            "Requests with exact descriptors that found too many others waiting for the store",
            stats.store_overloaded,
        ),
        "ratelimit_server_should_rate_limit_total_requests": (
            "ShouldRateLimit calls",
            stats.total_requests,
        ),
        "ratelimit_service_stats_keys_overflowed": (
            "Hits counted under _overflow because of the stats key bound",
            stats.overflowed_keys,
        ),
    }
    for name, (help_text, value) in plain.items():
        yield CounterMetricFamily(name, help_text, value=value)


def histogram_family(name: str, help_text: str, histogram: Histogram) -> Metric:
    buckets = [
        ("+Inf" if bound == float("inf") else repr(bound), count)
        for bound, count in histogram.cumulative()
    ]
    return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=histogram.sum)
