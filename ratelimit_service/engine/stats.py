"""Counters kept as plain attributes on the request path and exported at scrape time.

prometheus_client's labelled counters take a lock and a dict lookup per ``inc``;
we instead bump slot attributes of small objects and let a custom collector turn
them into metric families when ``/metrics`` is read. Metric names follow
envoyproxy/ratelimit's stats (``ratelimit.service.rate_limit.<key>.total_hits`` and
so on) as the Prometheus statsd exporter would name them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from ratelimit_service.core.histogram import Histogram

log = logging.getLogger(__name__)

OVERFLOW_KEY = "_overflow"


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


GaugeSource = Callable[[], Iterator[Metric]]


class StatsCollector(Collector):
    """Exposes :class:`Stats` plus any extra gauge sources (buckets, store) to Prometheus."""

    def __init__(self, stats: Stats, *sources: GaugeSource) -> None:
        self._stats = stats
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        prefix = "ratelimit_service_rate_limit_"
        families = {
            name: CounterMetricFamily(prefix + name, f"envoyproxy/ratelimit {name}", labels=["key"])
            for name in RuleStats.__slots__
        }
        for key, rule in list(stats.rules.items()):
            for name, family in families.items():
                family.add_metric([key], getattr(rule, name))
        yield from families.values()
        not_found = CounterMetricFamily(
            prefix + "domain_not_found", "Requests for a domain with no config", labels=["domain"]
        )
        for domain, count in list(stats.domain_not_found.items()):
            not_found.add_metric([domain], count)
        yield not_found
        yield from _service_counters(stats)
        yield histogram_family(
            "ratelimit_server_should_rate_limit_response_time_seconds",
            "ShouldRateLimit handling time",
            stats.latency,
        )
        for source in self._sources:
            yield from source()


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
