"""The catalogue of service counters (engine/counters.py) is what the outputs print:
every counter, set to a value of its own, reaches /metrics under its Prometheus name
and statsd under its Go name where it has one (tests/engine/test_status.py holds
/status.json to it)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from ratelimit_service.engine.counters import (
    CATALOGUE,
    DOMAIN_NOT_FOUND,
    KEY_COUNTERS,
    LATENCY,
    SERVICE_COUNTERS,
    Kind,
    Label,
)
from ratelimit_service.engine.stats import Stats, StatsCollector
from ratelimit_service.engine.statsd import StatsdDeltas


def counted() -> tuple[Stats, dict[str, int]]:
    """Stats with every counter at a value of its own (by attribute), for key
    ``d.k|x`` and domain ``nope``."""
    stats = Stats()
    values: dict[str, int] = {}
    rule = stats.rule("d.k|x")
    for n, counter in enumerate(KEY_COUNTERS, 1):
        setattr(rule, counter.attr, values.setdefault(counter.attr, n))
    stats.domain_not_found["nope"] = values.setdefault(DOMAIN_NOT_FOUND.attr, 50)
    for n, counter in enumerate(SERVICE_COUNTERS, 100):
        setattr(stats, counter.attr, values.setdefault(counter.attr, n))
    stats.latency.observe(0.002)
    return stats, values


LABELS = {None: {}, Label.KEY: {"key": "d.k|x"}, Label.DOMAIN: {"domain": "nope"}}


def test_metrics_print_every_counter_of_the_catalogue() -> None:
    stats, values = counted()
    text = b"".join(StatsCollector(stats).exposition()).decode()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert list(families) == [counter.metric for counter in CATALOGUE]  # in its order
    for counter in CATALOGUE:
        family = families[counter.metric]
        assert family.documentation == counter.help
        assert family.type == counter.kind.value
        if counter.kind is Kind.HISTOGRAM:
            count = [s.value for s in family.samples if s.name.endswith("_count")]
            assert count == [1.0]
            continue
        (sample,) = family.samples
        assert sample.name == counter.metric + "_total"
        labels = LABELS[counter.label]
        assert (sample.labels, sample.value) == (labels, values[counter.attr])


def test_statsd_sends_the_counters_with_a_go_name_and_only_those() -> None:
    stats, values = counted()
    lines = StatsdDeltas(stats).lines()
    counters = dict(line.removesuffix("|c").split(":") for line in lines if line.endswith("|c"))
    expected = {}
    for counter in CATALOGUE:
        if counter.statsd is None or counter.kind is Kind.HISTOGRAM:
            continue
        name = counter.statsd.format(key="d.k_x", domain="nope")  # ":" and "|" made "_"
        expected[name] = str(values[counter.attr])
    assert counters == expected
    assert "ratelimit.service.rate_limit.d.k_x.total_hits" in counters  # the Go service's
    timers = [line for line in lines if line.endswith("|ms")]
    assert len(timers) == 1 and timers[0].startswith(f"{LATENCY.statsd}:")
