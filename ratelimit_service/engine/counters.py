"""The catalogue of service counters: each declared once, read by every output.

The request path bumps plain attributes (engine/stats.py :class:`Stats`, and per stats
key :class:`RuleStats`); three readers export them, each from :data:`CATALOGUE`:
Prometheus (engine/stats.py), statsd (engine/statsd.py) and ``/status.json``
(engine/status.py). An entry names the attribute, the Prometheus family and its help,
the statsd name (envoyproxy/ratelimit's, where the Go service has one) and the status
page's key; adding a counter is one entry here and one attribute there.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"
    """Call latencies: a Prometheus histogram, a statsd timer."""


class Label(enum.Enum):
    """What a counter is kept per (its one Prometheus label)."""

    KEY = "key"
    """Per stats key: an attribute of RuleStats, one per entry of Stats.rules."""
    DOMAIN = "domain"
    """Per domain: a Stats attribute that maps each domain to its count."""


@dataclass(frozen=True, slots=True)
class Counter:
    """One service counter, as every output names it."""

    attr: str
    """The attribute that holds it: on RuleStats with Label.KEY, else on Stats."""
    metric: str
    """The Prometheus family (a counter's samples end in ``_total``)."""
    help: str
    statsd: str | None = None
    """The statsd name (a timer's with Kind.HISTOGRAM); with a label, ``{key}`` or
    ``{domain}`` stands for the label's value. None: not sent (no Go name)."""
    status: str | None = None
    """The key in ``/status.json`` (per stats key: in each rule's row, counted over the
    rate interval); a per-domain counter shows as its sum. None: not shown."""
    label: Label | None = None
    kind: Kind = Kind.COUNTER


RULE_PREFIX = "ratelimit_service_rate_limit_"
_SERVICE = "ratelimit.service"
_SERVER = "ratelimit_server.ShouldRateLimit"
_PER_KEY = f"{_SERVICE}.rate_limit.{{key}}."


def _per_key(attr: str, *, statsd: bool = False, status: str | None = None) -> Counter:
    """A per stats-key counter, named as in envoyproxy/ratelimit."""
    return Counter(
        attr,
        RULE_PREFIX + attr,
        f"envoyproxy/ratelimit {attr}",
        statsd=_PER_KEY + attr if statsd else None,
        status=status,
        label=Label.KEY,
    )


def _service(attr: str, help_text: str, status: str) -> Counter:
    """A service-wide counter: ``ratelimit_service_<attr>``, ``ratelimit.service.<attr>``."""
    return Counter(attr, f"ratelimit_service_{attr}", help_text, f"{_SERVICE}.{attr}", status)


def _call(attr: str, help_text: str, status: str, statsd: str | None = None) -> Counter:
    """A counter of ShouldRateLimit calls; ``statsd``: the Go service's name for it (None: none)."""
    return Counter(
        attr,
        f"ratelimit_service_call_should_rate_limit_{attr}",
        help_text,
        f"{_SERVICE}.call.should_rate_limit.{statsd}" if statsd is not None else None,
        status,
    )


KEY_COUNTERS = (
    _per_key("failure_mode_allowed"),
    _per_key("failure_mode_denied"),
    _per_key("near_limit", statsd=True, status="near_limit"),
    _per_key("over_limit", statsd=True, status="denied"),
    _per_key("overloaded"),
    _per_key("shadow_mode", statsd=True, status="shadow_denied"),
    _per_key("total_hits", statsd=True, status="hits"),
    _per_key("within_limit", statsd=True),
)
"""The per stats-key counters (RuleStats' attributes, in its order)."""

DOMAIN_NOT_FOUND = Counter(
    "domain_not_found",
    RULE_PREFIX + "domain_not_found",
    "Requests for a domain with no config",
    statsd=f"{_SERVICE}.rate_limit.{{domain}}.domain_not_found",
    status="domains_not_found",
    label=Label.DOMAIN,
)

SERVICE_COUNTERS = (
    _service("config_load_success", "Configs loaded", "config_loads"),
    _service("config_load_error", "Configs rejected", "config_errors"),
    _service(
        "global_shadow_mode", "Requests let through by global shadow mode", "global_shadow_mode"
    ),
    _call("service_error", "Invalid requests", "service_errors", "service_error"),
    # The Go service's name, whichever the store.
    _call("store_error", "Requests that met a store error", "store_errors", "redis_error"),
    _call(
        "store_overloaded",
        "Requests with exact descriptors that found too many others waiting for the store",
        "store_overloaded",
    ),
    Counter(
        "total_requests",
        "ratelimit_server_should_rate_limit_total_requests",
        "ShouldRateLimit calls",
        statsd=f"{_SERVER}.total_requests",
        status="requests",
    ),
    Counter(
        "overflowed_keys",
        "ratelimit_service_stats_keys_overflowed",
        "Hits counted under _overflow because of the stats key bound",
        status="stats_keys_overflowed",
    ),
)
"""The service-wide counters (plain attributes of Stats)."""

LATENCY = Counter(
    "latency",
    "ratelimit_server_should_rate_limit_response_time_seconds",
    "ShouldRateLimit calls' time in the service: from the handler's start to its answer,"
    " plus the wait of calls held by a pause of the event loop (see rls/servicer.py)",
    statsd=f"{_SERVER}.response_time",
    kind=Kind.HISTOGRAM,
)

CATALOGUE = (*KEY_COUNTERS, DOMAIN_NOT_FOUND, *SERVICE_COUNTERS, LATENCY)
"""Every service counter, in the order /metrics prints them."""
