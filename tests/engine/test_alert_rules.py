"""What k8s/monitoring/ ships: promtool checks the alerting rules and runs their unit
tests (alerts-test.yml: synthetic series, each alert firing and not firing), the
PrometheusRule holds the same groups as the plain rules file, every alert has both
kinds of case, and the Grafana dashboard's panels are well formed. That the rules'
metrics and the panels' queries return data from a real service:
tests/server/test_dashboard_live.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

MONITORING = Path(__file__).resolve().parents[2] / "k8s" / "monitoring"
RULES = MONITORING / "alerts.yml"


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    if shutil.which("promtool") is None:
        message = "promtool is not installed (Debian package prometheus)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return subprocess.run(
        ["promtool", *args], cwd=MONITORING, capture_output=True, text=True, timeout=60
    )


def alerts() -> set[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return {rule["alert"] for group in groups for rule in group["rules"] if "alert" in rule}


@pytest.mark.slow  # runs promtool
def test_promtool_checks_the_rules() -> None:
    result = promtool("check", "rules", RULES.name)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 8 rules found" in result.stdout


@pytest.mark.slow  # runs promtool
def test_promtool_runs_the_rules_unit_tests() -> None:
    result = promtool("test", "rules", "alerts-test.yml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    cases: dict[str, set[bool]] = {}
    for test in yaml.safe_load((MONITORING / "alerts-test.yml").read_text())["tests"]:
        for case in test.get("alert_rule_test", []):
            cases.setdefault(case["alertname"], set()).add(bool(case["exp_alerts"]))
    assert cases == {alert: {True, False} for alert in alerts()}
    assert alerts() == {
        "RateLimitStoreDown",
        "RateLimitBreakerOpen",
        "RateLimitFailureModeAnswers",
        "RateLimitDeniedShareSpike",
        "RateLimitZoneWithoutAggregator",
        "RateLimitEventLoopLag",
    }


def test_the_prometheus_rule_holds_the_rules_file() -> None:
    resource: dict[str, Any] = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert (resource["apiVersion"], resource["kind"]) == (
        "monitoring.coreos.com/v1",
        "PrometheusRule",
    )
    assert resource["spec"] == yaml.safe_load(RULES.read_text()), (
        "prometheusrule.yaml's spec must be alerts.yml (indented under spec:)"
    )


def test_the_monitoring_kustomization_lists_its_manifests() -> None:
    kustomization = yaml.safe_load((MONITORING / "kustomization.yaml").read_text())
    manifests = {p.name for p in MONITORING.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(manifests)
    (generated,) = kustomization["configMapGenerator"]
    assert [(MONITORING / name).is_file() for name in generated["files"]] == [True]
    for name in manifests:
        assert yaml.safe_load((MONITORING / name).read_text())["metadata"]["namespace"] == (
            "ratelimit"
        )


def test_the_dashboards_panels_are_well_formed() -> None:
    """Unique ids, the datasource variable everywhere, unique refIds per panel, panels
    side by side within the 24 columns and not over one another."""
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    (variable,) = dashboard["templating"]["list"]
    assert (variable["name"], variable["type"], variable["query"]) == (
        "datasource",
        "datasource",
        "prometheus",
    )
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        area = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        if panel["type"] == "row":
            continue
        targets = panel["targets"]
        assert targets and len({t["refId"] for t in targets}) == len(targets), panel["title"]
        for where in (panel, *targets):
            assert where["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
