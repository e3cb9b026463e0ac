"""What Prometheus saw of each rule over the window, selected by its stats key (or the
pattern of its per-value keys less other rules' keys): its demand per unit, summed across
replicas, of the busiest counter at each step the scrapes allow; the share of its hits
that were (in shadow mode: would have been) denied; and for shadow rules with per-value
keys, the most denied keys.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

from ratelimit_service.engine.counters import RULE_PREFIX
from ratelimit_service.tune.arithmetic import Resolution, Rule, excluded_patterns, resolution
from ratelimit_service.tune.prometheus import PrometheusClient

METRIC = RULE_PREFIX + "{}_total"
"""The per-rule counters (engine/counters.py) as Prometheus names them: ``_total`` added."""
TOP_KEYS = 5
ASSUMED_SCRAPE = 60.0
"""Prometheus's default scrape_interval, used when no recent sample shows the real one."""
PROBE_SECONDS = 6 * 3600


@dataclass(slots=True)
class Observation:
    """One rule's numbers. ``demand`` is empty for rules whose demand was not read."""

    rule: Rule
    resolution: Resolution | None = None
    scrape_measured: bool = True
    demand: list[tuple[float, float]] = field(default_factory=list)
    hits: float = 0.0
    denied: float = 0.0
    top_keys: list[tuple[str, float]] = field(default_factory=list)
    has_series: bool = False

    @property
    def share(self) -> float | None:
        return self.denied / self.hits if self.hits > 0 else None


def selector(rule: Rule, others: list[Rule]) -> str:
    pattern = rule.key_pattern()
    if pattern is None:
        return f'{{key="{_quote(rule.key)}"}}'
    matchers = [f'key=~"{_quote(pattern)}"']
    excluded = excluded_patterns(rule, others)
    if excluded:
        matchers.append(f'key!~"{_quote("|".join(excluded))}"')
    return "{" + ",".join(matchers) + "}"


def _quote(text: str) -> str:
    """A PromQL double-quoted string's content (Go escapes)."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


def scrape_interval(client: PrometheusClient, metric_selector: str, end: float) -> float | None:
    """The median spacing of the raw samples of one series in the hours before ``end``."""
    series = client.query(f"{METRIC.format('total_hits')}{metric_selector}[{PROBE_SECONDS}s]", end)
    for one in series:
        times = [t for t, _ in one.points]
        if len(times) >= 2:
            # Scrape timestamps wander by milliseconds; a tenth of a second is the grain.
            gaps = [b - a for a, b in itertools.pairwise(times)]
            return max(0.1, round(float(statistics.median(gaps)), 1))
    return None


def observe(
    client: PrometheusClient,
    rule: Rule,
    others: list[Rule],
    *,
    end: float,
    window: int,
    scrape: float | None,
) -> Observation:
    """Ask Prometheus about one rule: only the share when its stats add up the counters of
    every value (no counter's own demand to read)."""
    seen = Observation(rule)
    where = selector(rule, others)
    hits_metric = METRIC.format("total_hits") + where
    hits = client.query(f"sum(increase({hits_metric}[{window}s]))", end)
    seen.has_series = bool(hits)
    if not hits:
        return seen
    seen.hits = hits[0].points[0][1] if hits[0].points else 0.0
    denied = client.query(f"sum(increase({METRIC.format('over_limit')}{where}[{window}s]))", end)
    seen.denied = denied[0].points[0][1] if denied and denied[0].points else 0.0
    if rule.limit.shadow_mode and rule.series_by_value():
        shadow = METRIC.format("shadow_mode") + where
        top = client.query(
            f"topk({TOP_KEYS}, sum by (key) (increase({shadow}[{window}s])) > 0)", end
        )
        seen.top_keys = sorted(
            ((s.labels.get("key", ""), s.points[0][1]) for s in top if s.points),
            key=lambda kv: (-kv[1], kv[0]),
        )
    if rule.per_value() and not rule.series_by_value():
        return seen
    measured = scrape if scrape is not None else scrape_interval(client, where, end)
    seen.scrape_measured = measured is not None
    unit = rule.limit.window_seconds
    res = seen.resolution = resolution(ASSUMED_SCRAPE if measured is None else measured, unit)
    last = end - end % res.step_seconds
    first = last - window + res.step_seconds
    busiest = f"max(sum by (key) (rate({hits_metric}[{res.range_seconds}s])))"
    demand = client.query_range(busiest, first, last, res.step_seconds)
    seen.demand = sorted((t, round(v * unit, 6)) for s in demand for t, v in s.points)
    return seen
