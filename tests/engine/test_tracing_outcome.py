"""engine/tracing.py without a receiver: what a decision's span says, and the one-line
error when tracing is asked for and the extra cannot run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ratelimit_service.core.request import Descriptor, Request
from ratelimit_service.engine.tracing import (
    REINSTALL_PROTO,
    Tracing,
    TracingUnavailable,
    outcome_attributes,
)


def test_the_outcome_names_the_rules_and_those_that_denied() -> None:
    request = Request("edge", [Descriptor((("ip", "1"),)), Descriptor((("tenant", "a"),))])
    rules = [(0, "edge.ip"), (1, "edge.tenant"), (1, "edge.tenant_burst")]
    attributes = outcome_attributes(
        request, rules, "OVER_LIMIT", ["OK", "OVER_LIMIT"], "edge.tenant_burst"
    )
    assert attributes == {
        "ratelimit.overall_code": "OVER_LIMIT",
        "ratelimit.rule": "edge.tenant_burst",
        "ratelimit.domain": "edge",
        "ratelimit.descriptors": 2,
        "ratelimit.rules": ["edge.ip", "edge.tenant", "edge.tenant_burst"],
        "ratelimit.over_limit_rules": ["edge.tenant", "edge.tenant_burst"],
    }
    admitted = outcome_attributes(request, rules, "OK", ["OK", "OK"])
    assert "ratelimit.over_limit_rules" not in admitted
    assert outcome_attributes(None, [], "OK", []) == {"ratelimit.overall_code": "OK"}


def test_without_the_extra_the_error_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(TracingUnavailable) as caught:
        Tracing(protocol="grpc")
    message = str(caught.value)
    assert "\n" not in message
    assert "opentelemetry.sdk.trace" in message
    assert "pip install 'ratelimit-service[tracing]'" in message


def test_xds_protos_copy_of_the_otlp_protos_is_named_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.proto.common.v1.common_pb2", None)
    for name in [n for n in sys.modules if n.startswith("opentelemetry.exporter")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(TracingUnavailable) as caught:
        Tracing(protocol="http")
    assert "xds-protos" in str(caught.value)
    assert str(caught.value).endswith(REINSTALL_PROTO)


def test_an_unknown_protocol_is_refused() -> None:
    with pytest.raises(ValueError, match="choose grpc or http"):
        Tracing(protocol="udp")


def test_the_request_path_imports_nothing_of_opentelemetry() -> None:
    """The servicer, the limiter and this module, imported as a service does with
    tracing off: not one opentelemetry module (a fresh interpreter)."""
    code = (
        "import sys, ratelimit_service.rls.servicer, ratelimit_service.engine.tracing\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
