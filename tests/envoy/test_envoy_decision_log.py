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

from ratelimit_service.testing.envoy import Envoy, ServiceProcess, Upstream
from ratelimit_service.testing.envoy_fixtures import CONFIG_DIR, shipped_bootstrap
from ratelimit_service.testing.waiting import eventually

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
