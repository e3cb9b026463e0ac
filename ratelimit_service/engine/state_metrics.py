"""Metrics read from live state at scrape time: probabilistic buckets, store, reconciler.

Off the request path: each function walks its state once per scrape, yielding metric
families and a None every SLICE items of a long walk, where the scrape returns to the loop.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ratelimit_service.core.config_model import RateLimitConfig
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.engine.quota import QuotaCoordinator
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.engine.stats import SLICE, histogram_family
from ratelimit_service.engine.zone_aggregator import ZoneAggregator
from ratelimit_service.storage.base import Store

MAX_BUCKET_SERIES = 1000
"""Per-bucket series are capped: bucket counts are unbounded in principle."""


def readable_bucket(bucket_key: str) -> str:
    """``domain.key=value.key2=value2/60s`` for a metric label."""
    values, _, window = bucket_key.rpartition("\x1f")
    return values.replace("\x1f", ".").replace("\x1e", "=").replace("\x1d", "#") + f"/{window}s"


def bucket_metrics(local: LocalBuckets) -> Iterator[Metric | None]:
    buckets = local.buckets()
    yield GaugeMetricFamily(
        "ratelimit_probabilistic_buckets", "Probabilistic buckets held", value=len(buckets)
    )
    evictions = CounterMetricFamily(
        "ratelimit_bucket_evictions", "Buckets forgotten", labels=["table", "reason"]
    )
    evictions.add_metric(["probabilistic", "overflow"], local.evicted_overflow)
    evictions.add_metric(["probabilistic", "idle"], local.evicted_idle)
    yield evictions
    per_bucket = GaugeMetricFamily(
        "ratelimit_drop_ratio",
        f"Drop ratio of probabilistic buckets that drop (at most {MAX_BUCKET_SERIES})",
        labels=["bucket"],
    )
    shown = 0
    ratio_by_rule: dict[str, float] = {}
    offered_by_rule: dict[str, float] = {}
    debt_by_rule: dict[str, float] = {}
    for count, bucket in enumerate(buckets, 1):
        if count % SLICE == 0:
            yield None
        ratio = local.drop_ratio(bucket)
        rule = bucket.rule
        ratio_by_rule[rule] = max(ratio_by_rule.get(rule, 0.0), ratio)
        offered_by_rule[rule] = offered_by_rule.get(rule, 0.0) + (bucket.fleet_rate or 0.0)
        debt_by_rule[rule] = debt_by_rule.get(rule, 0.0) + max(0.0, -bucket.tokens)
        if ratio > 0 and shown < MAX_BUCKET_SERIES:
            per_bucket.add_metric([readable_bucket(bucket.key)], ratio)
            shown += 1
    yield per_bucket
    yield from _by_rule(
        "ratelimit_rule_drop_ratio", "Highest drop ratio among a rule's buckets", ratio_by_rule
    )
    yield from _by_rule(
        "ratelimit_rule_fleet_offered_rate",
        "Hits per second offered to the whole fleet, summed over a rule's buckets",
        offered_by_rule,
    )
    yield from _by_rule(
        "ratelimit_rule_overshoot_hits",
        "Hits the fleet admitted beyond its token buckets (debt at the last sync)",
        debt_by_rule,
    )


def _by_rule(name: str, help_text: str, values: dict[str, float]) -> Iterator[Metric | None]:
    """One gauge per rule (per stats key: with detailed_metric, one per value)."""
    family = GaugeMetricFamily(name, help_text, labels=["key"])
    for count, (rule, value) in enumerate(values.items(), 1):
        family.add_metric([rule], value)
        if count % SLICE == 0:
            yield None
    yield family


def rule_limit_metrics(config: RateLimitConfig) -> Iterator[Metric | None]:
    """Every finite rule's limit by its hit counters' ``key``, with its period (``unit``:
    ``10 minutes``) and length in seconds: what a utilisation alert divides by."""
    family = GaugeMetricFamily(
        "ratelimit_rule_limit",
        "A rule's configured limit: hits allowed per period",
        labels=["key", "unit", "window_seconds"],
    )
    for count, limit in enumerate(config.limits(), 1):
        if not limit.unlimited:
            labels = [limit.stats_key, limit.period, str(limit.window_seconds)]
            family.add_metric(labels, limit.requests_per_unit)
        if count % SLICE == 0:
            yield None
    yield family


def store_metrics(store: Store, beside: Mapping[str, float] | None = None) -> Iterator[Metric]:
    """The store's figures; ``beside``: more under its name (with --zone, the aggregator's)."""
    family = GaugeMetricFamily("ratelimit_store", "Store state", labels=["store", "name"])
    # A store whose figures say "healthy" already (Redis; with --zone, the global store)
    # keeps its own: one sample per name, or Prometheus drops the second of the scrape.
    metrics = store.metrics()
    figures = {"healthy": 1.0 if store.healthy() else 0.0, **metrics.figures, **(beside or {})}
    for name, value in figures.items():
        family.add_metric([metrics.name, name], value)
    yield family
    for name, histogram in metrics.histograms.items():
        yield histogram_family(
            f"ratelimit_store_{name}_seconds",
            f"Store {name} time as this process saw it (from writing a call to reading"
            " its reply: includes time this process was not running)",
            histogram,
        )


def reconciler_metrics(reconciler: Reconciler) -> Iterator[Metric]:
    yield CounterMetricFamily("ratelimit_sync_rounds", "Reconciler rounds", value=reconciler.syncs)
    yield CounterMetricFamily(
        "ratelimit_sync_errors", "Failed sync rounds", value=reconciler.errors
    )
    yield CounterMetricFamily(
        "ratelimit_sync_bucket_updates",
        "Probabilistic bucket reports this replica sent to the store",
        value=reconciler.bucket_updates,
    )
    yield histogram_family(
        "ratelimit_sync_duration_seconds", "Duration of sync rounds", reconciler.durations
    )


def quota_metrics(quota: QuotaCoordinator) -> Iterator[Metric | None]:
    """RLQS: streams, reports, assignments, abandons, and each counter's instances."""
    yield GaugeMetricFamily("ratelimit_rlqs_streams", "RLQS streams open", value=quota.streams)
    counters = {
        "reports": ("RLQS usage reports received", quota.reports),
        "assignments": ("RLQS bucket assignments sent", quota.assignments),
        "pushed": (
            "RLQS assignments sent between an instance's reports (room another freed)",
            quota.pushed,
        ),
        "pushes_dropped": (
            "RLQS pushes dropped: the stream's outbox was full",
            quota.pushes_dropped,
        ),
        "abandons": ("RLQS buckets abandoned (idle)", quota.abandons),
        "malformed_buckets": ("RLQS buckets with an empty id (ignored)", quota.malformed),
        "publishes": ("RLQS publishes of this replica's totals to the store", quota.publishes),
        "bucket_updates": (
            "RLQS counter totals this replica sent to the store (one per counter per publish)",
            quota.bucket_updates,
        ),
        "store_errors": (
            "RLQS publishes that failed (the replica kept its last parts)",
            quota.store_errors,
        ),
    }
    for name, (text, value) in counters.items():
        yield CounterMetricFamily(f"ratelimit_rlqs_{name}", text, value=value)
    demand = GaugeMetricFamily(
        "ratelimit_rlqs_instance_demand",
        "Requests per second an Envoy instance offered a counter, as last reported",
        labels=["bucket", "instance"],
    )
    share = GaugeMetricFamily(
        "ratelimit_rlqs_instance_share",
        "Hits per window last assigned to an Envoy instance (this process's streams)",
        labels=["bucket", "instance"],
    )
    instances = GaugeMetricFamily(
        "ratelimit_rlqs_instances",
        "Envoy instances reporting a counter to this replica",
        labels=["bucket"],
    )
    part = GaugeMetricFamily(
        "ratelimit_rlqs_part",
        "Hits per window of a counter's limit this replica divides among its instances",
        labels=["bucket"],
    )
    fleet = GaugeMetricFamily(
        "ratelimit_rlqs_fleet",
        "A counter's totals over every replica, as last read from the store",
        labels=["bucket", "total"],
    )
    per_domain = GaugeMetricFamily(
        "ratelimit_rlqs_buckets", "RLQS counters with reports, per domain", labels=["domain"]
    )
    domains: dict[str, int] = {}
    shown = 0
    for view in quota.view():
        if view is None:
            yield None
            continue
        domain = view.key.split("\x1f", 1)[0]
        domains[domain] = domains.get(domain, 0) + 1
        if shown >= MAX_BUCKET_SERIES:
            continue
        shown += 1
        label = readable_bucket(view.key)
        instances.add_metric([label], len(view.instances))
        for name, rate, assigned, _ in view.instances:
            if rate is not None:
                demand.add_metric([label, name], rate)
            if assigned is not None:
                share.add_metric([label, name], assigned)
        if view.part is not None:
            part.add_metric([label], view.part)
            if (totals := view.totals) is not None:
                fleet.add_metric([label, "demand"], totals.demand)
                fleet.add_metric([label, "instances"], totals.instances)
                fleet.add_metric([label, "replicas"], totals.members)
                fleet.add_metric([label, "window_used"], totals.used)
    for domain, count in domains.items():
        per_domain.add_metric([domain], count)
    yield from (instances, demand, share, part, fleet, per_domain)


def zone_metrics(aggregator: ZoneAggregator) -> Iterator[Metric]:
    """``--zone``: whether this replica aggregates, labelled by zone, so that a rule can see
    a zone whose replicas all say 0."""
    family = GaugeMetricFamily(
        "ratelimit_zone_aggregating",
        "1 while this replica acts as its zone's aggregator (holds the zone's lease), else 0",
        labels=["zone"],
    )
    family.add_metric([aggregator.zone], 1.0 if aggregator.leading else 0.0)
    yield family
