"""Which rule decided, through a real Envoy: the service's dynamic_metadata lands in
the request's metadata under the ratelimit filter's namespace, where Envoy's access
log reads it, and --header-rule names the same rule to the client. The shipped
bootstrap and rules, with an access log added."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ratelimit_harness.envoy import Envoy, ServiceProcess, Upstream
from ratelimit_harness.envoy_fixtures import CONFIG_DIR, shipped_bootstrap
from ratelimit_harness.waiting import eventually

pytestmark = pytest.mark.slow

NAMESPACE = "envoy.filters.http.ratelimit"
LOG_FORMAT = (
    f"%RESPONSE_CODE% %DYNAMIC_METADATA({NAMESPACE}:domain)%"
    f" %DYNAMIC_METADATA({NAMESPACE}:rule)% %DYNAMIC_METADATA({NAMESPACE}:descriptors)%\n"
)
"""The line docs/operations.md gives: status, domain, deciding rule, every descriptor."""
FILE_LOG = "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog"


def with_access_log(bootstrap: dict[str, Any], path: Path) -> dict[str, Any]:
    (listener,) = bootstrap["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["access_log"] = [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": FILE_LOG,
                "path": str(path),
                "log_format": {"text_format_source": {"inline_string": LOG_FORMAT}},
            },
        }
    ]
    return bootstrap


def test_the_access_log_shows_the_deciding_rule(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
    tmp_path: Path,
) -> None:
    service = spawn_service(CONFIG_DIR, "--header-rule", "x-ratelimit-rule")
    log = tmp_path / "access.log"
    envoy = start_envoy(with_access_log(shipped_bootstrap(upstream, [service]), log))
    allowed = envoy.request("/", {"x-tenant": "premium"})
    denied = envoy.request("/", {"x-tenant": "blocked"})
    assert (allowed.status, denied.status) == (200, 429)
    # The header: the rule nearest its limit on the 200, the denying one on the 429.
    assert allowed.headers["x-ratelimit-rule"] == "edge.remote_address"
    assert denied.headers["x-ratelimit-rule"] == "edge.tenant_blocked"

    lines = eventually(
        lambda: (text := log.read_text()).count("\n") >= 2 and text.splitlines(),
        what="two access log lines",
    )
    ok_line, over_line = lines
    status, domain, rule, descriptors = ok_line.split(" ", 3)
    assert (status, domain, rule) == ("200", "edge", "edge.remote_address")
    # remote_address (50/s), then tenant=premium's two limits: the tighter one reported.
    assert json.loads(descriptors) == [
        {"rule": "edge.remote_address", "limit": 50, "unit": "second", "remaining": 49},
        {"rule": "burst", "limit": 200, "unit": "second", "remaining": 199},
    ]
    status, domain, rule, descriptors = over_line.split(" ", 3)
    assert (status, domain, rule) == ("429", "edge", "edge.tenant_blocked")
    assert json.loads(descriptors)[1] == {
        "rule": "edge.tenant_blocked", "limit": 0, "unit": "second", "remaining": 0
    }  # fmt: skip


GO_RULES = """
domain: edge
descriptors:
  - key: remote_address
    metadata: {backend: green, zone: a}
    rate_limit: {unit: second, requests_per_unit: 50}
  - key: tenant
    value: acme
    metadata: {backend: blue, tier: {name: gold}}
    rate_limit: {unit: minute, requests_per_unit: 2}
"""
GO_LOG_FORMAT = (
    f"%RESPONSE_CODE% %DYNAMIC_METADATA({NAMESPACE}:metadata)%"
    f" %DYNAMIC_METADATA({NAMESPACE}:metadata:backend)%"
    f" %DYNAMIC_METADATA({NAMESPACE}:descriptors)%\n"
)


def test_go_dynamic_metadata_reaches_envoy_with_the_passed_rules_metadata(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
    tmp_path: Path,
) -> None:
    """--go-dynamic-metadata (RESPONSE_DYNAMIC_METADATA=true): Envoy's access log reads
    envoyproxy/ratelimit's keys, the merged metadata of the rules that passed among
    them (the first rule's value wins on a key both have): both rules pass on the first
    two requests, only the address rule once the tenant's 2 a minute are spent."""
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "edge.yaml").write_text(GO_RULES)
    service = spawn_service(rules, "--go-dynamic-metadata", "--mode", "exact")
    log = tmp_path / "access.log"
    bootstrap = with_access_log(shipped_bootstrap(upstream, [service]), log)
    (listener,) = bootstrap["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["access_log"][0]["typed_config"]["log_format"]["text_format_source"] = {
        "inline_string": GO_LOG_FORMAT
    }
    envoy = start_envoy(bootstrap)
    statuses = [envoy.request("/", {"x-tenant": "acme"}).status for _ in range(3)]
    assert statuses == [200, 200, 429]
    lines = eventually(
        lambda: (text := log.read_text()).count("\n") >= 3 and text.splitlines(),
        what="three access log lines",
    )
    both = {"backend": "green", "zone": "a", "tier": {"name": "gold"}}
    expected = [("200", both), ("200", both), ("429", {"backend": "green", "zone": "a"})]
    for line, (code, metadata) in zip(lines, expected, strict=True):
        status, passed, backend, descriptors = line.split(" ", 3)
        assert (status, json.loads(passed)) == (code, metadata), line
        assert backend == "green", line
        sent = json.loads(descriptors)
        assert sent[0]["entries"][0].startswith("remote_address="), line
        assert sent[1] == {"entries": ["tenant=acme"]}, line
