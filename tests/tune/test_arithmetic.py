"""tune/arithmetic.py: the tuner's arithmetic and its in-place edits, without Prometheus."""

from __future__ import annotations

import re

import pytest

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.tune.arithmetic import (
    edit,
    excluded_patterns,
    parse_duration,
    parse_stat,
    peak,
    propose,
    resolution,
    rule_places,
    rules,
    should_promote,
)


def test_stat_and_duration_parse_or_say_why() -> None:
    assert parse_stat("max") is None
    assert parse_stat("p99.9") == pytest.approx(0.999)
    assert parse_stat("p50") == 0.5
    for bad in ("p0", "p101", "99", "mean"):
        with pytest.raises(ValueError, match="expected max or pNN"):
            parse_stat(bad)
    assert parse_duration("14d") == 14 * 86400
    assert parse_duration("1h30m") == 5400
    assert parse_duration("2w") == 1209600
    for bad in ("14", "d", "1x", "0s", "1h 30m"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_peak_is_the_max_or_a_nearest_rank_quantile() -> None:
    values = [float(v) for v in range(1, 1001)]  # 1..1000
    assert peak(values, None) == 1000
    assert peak(values, 0.999) == 999
    assert peak(values, 0.5) == 500
    assert peak([7.0], 0.999) == 7
    with pytest.raises(ValueError):
        peak([], None)


def test_propose_holds_the_floor_unless_allowed_lower() -> None:
    assert propose(100, 0.3, 50) == 130
    assert propose(225, 0.3, 50) == 293  # 292.5 rounds up
    assert propose(100.0000000001, 0.3, 50) == 130  # float noise does not add one
    assert propose(40, 0.3, 1000) == 1000  # never lowered by default
    assert propose(40, 0.3, 1000, allow_lower=True) == 52
    assert propose(40, 0.3, 1000, floor=60, allow_lower=True) == 60
    assert propose(0, 0.3, 1000, allow_lower=True) == 1  # never 0: that denies all
    assert propose(40, 0.3, 1000, floor=60) == 1000  # --floor alone cannot lower
    assert propose(40, 0.3, 10, floor=60) == 60  # but it raises


def test_promotion_needs_a_small_share_and_no_lowering() -> None:
    assert should_promote(0.0005, 0.001, lowered=False)
    assert not should_promote(0.001, 0.001, lowered=False)
    assert not should_promote(0.0, 0.001, lowered=True)


def test_resolution_is_the_coarser_of_unit_and_scrape() -> None:
    second = resolution(15, 1)
    assert (second.step_seconds, second.range_seconds) == (15, 30)
    assert second.describe() == (
        "per-second demand from rates over 30 s windows every 15 s (scrape interval 15 s);"
        " bursts shorter than 30 s are averaged out"
    )
    minute = resolution(15, 60)
    assert (minute.step_seconds, minute.range_seconds) == (60, 60)
    assert minute.describe() == (
        "per-minute demand from rates over 1 min windows every 1 min (scrape interval 15 s)"
    )
    assert (resolution(1.0, 3600).step_seconds, resolution(0.5, 1).range_seconds) == (3600, 1)


RULES = """\
domain: d   # the domain
descriptors:
  - key: tenant
    detailed_metric: true
    rate_limit: &shared
      unit: second
      requests_per_unit: 20    # keep me
    descriptors:
      - key: path
        detailed_metric: true
        rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    value: premium
    shadow_mode: true
    rate_limit: *shared
  - key: ip
    shadow_mode: yes
    rate_limit:
      unit: hour
      requests_per_unit: 5
"""


def test_places_find_the_scalars_and_the_edit_keeps_everything_else() -> None:
    text = RULES
    places = rule_places(text)
    assert sorted(places) == ["d.ip", "d.tenant", "d.tenant.path", "d.tenant_premium"]
    assert places["d.tenant"].shared and places["d.tenant_premium"].shared
    path, ip = places["d.tenant.path"], places["d.ip"]
    assert not path.shared and path.shadow_mode is None
    assert path.requests_per_unit is not None and path.requests_per_unit.line == 11
    assert ip.requests_per_unit is not None and ip.shadow_mode is not None
    edited = edit(text, {path.requests_per_unit: "130", ip.shadow_mode: "false"})
    assert edited == text.replace("requests_per_unit: 100}", "requests_per_unit: 130}").replace(
        "shadow_mode: yes", "shadow_mode: false"
    )


def test_per_value_keys_and_what_their_patterns_leave_out() -> None:
    config = load_config([ConfigFile("r.yaml", RULES)])
    found = {r.key: r for r in rules(config)}
    assert list(found) == ["d.tenant", "d.tenant.path", "d.tenant_premium", "d.ip"]
    tenant, path, premium, ip = found.values()
    assert tenant.per_value() and tenant.series_by_value()
    assert ip.per_value() and not ip.series_by_value() and ip.key_pattern() is None
    assert not premium.per_value() and premium.key_pattern() is None
    assert tenant.key_pattern() == r"d\.tenant_.*"
    assert path.key_pattern() == r"d\.tenant_.*\.path_.*"
    # The tenant rule's pattern meets the path rule's keys and premium's own key.
    assert excluded_patterns(tenant, list(found.values())) == [
        r"d\.tenant_.*\.path_.*",
        r"d\.tenant_premium",
    ]
    assert excluded_patterns(path, list(found.values())) == []
    keys = ["d.tenant_acme", "d.tenant_acme.path_/x", "d.tenant_premium"]
    left_out = re.compile("|".join(excluded_patterns(tenant, list(found.values()))))
    assert [k for k in keys if not left_out.fullmatch(k)] == ["d.tenant_acme"]
