"""One trace across a real Envoy and the service: Envoy's OpenTelemetry tracer and the
service's gRPC exporter both send to an OTLP receiver the test runs. The service's
decision span is a child of the span Envoy made for its call to the service, and its
Redis call a child of the decision.

Envoy flushes each span as it ends (runtime ``tracing.opentelemetry.min_flush_spans``
1) and the service every 50 ms (OTEL_BSP_SCHEDULE_DELAY): the test waits for spans to
arrive, never for a fixed time.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ratelimit_harness.envoy import Envoy, ServiceProcess, Upstream
from ratelimit_harness.envoy_fixtures import shipped_bootstrap
from ratelimit_service.engine.tracing import RLS_SPAN, STORE_SPAN

pytestmark = pytest.mark.slow

RULES = """
domain: edge
descriptors:
  - key: tenant
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 2}
"""
EGRESS = "async envoy.service.ratelimit.v3.RateLimitService.ShouldRateLimit egress"


def traced_bootstrap(
    upstream: Upstream, service: ServiceProcess, receiver_port: int
) -> dict[str, Any]:
    """The shipped bootstrap with Envoy's OpenTelemetry tracer on, every request
    sampled, spans sent to ``receiver_port`` over gRPC as soon as each ends."""
    bootstrap = shipped_bootstrap(upstream, [service])
    (listener,) = bootstrap["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["tracing"] = {
        "random_sampling": {"value": 100},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": "otlp"}, "timeout": "1s"},
                "service_name": "edge-envoy",
            },
        },
    }
    bootstrap["static_resources"]["clusters"].append(
        {
            "name": "otlp",
            "type": "STATIC",
            "connect_timeout": "1s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
            "load_assignment": {
                "cluster_name": "otlp",
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": "127.0.0.1",
                                            "port_value": receiver_port,
                                        }
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
        }
    )
    bootstrap["layered_runtime"] = {
        "layers": [
            {
                "name": "flush-each-span",
                "static_layer": {
                    "tracing.opentelemetry.min_flush_spans": 1,
                    "tracing.opentelemetry.flush_interval_ms": 100,
                },
            }
        ]
    }
    return bootstrap


def test_the_decision_is_a_child_of_envoys_call_and_redis_a_child_of_the_decision(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
    redis_server: Any,
    grpc_receiver: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "edge.yaml").write_text(RULES)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    service = spawn_service(
        rules, "--redis-url", redis_server.url, "--tracing", "--tracing-protocol", "grpc",
        "--tracing-endpoint", grpc_receiver.endpoint, "--tracing-service-name", "rls",
    )  # fmt: skip
    envoy = start_envoy(traced_bootstrap(upstream, service, grpc_receiver.port))
    statuses = [envoy.request("/api/write/1", {"x-tenant": "acme"}).status for _ in range(3)]
    assert statuses == [200, 200, 429]

    def complete(spans: list[Any]) -> bool:
        egress = [s for s in spans if s.name == EGRESS]
        ours = {s.parent_span_id for s in spans if s.name == RLS_SPAN}
        stores = [s for s in spans if s.name == STORE_SPAN]
        return len(egress) == 3 and {s.span_id for s in egress} <= ours and len(stores) == 3

    spans = grpc_receiver.wait_for("Envoy's and the service's spans of 3 requests", complete)
    codes = []
    for egress in [s for s in spans if s.name == EGRESS]:
        assert egress.service == "edge-envoy"
        # Envoy's request span is the egress span's parent, in the same trace.
        (ingress,) = [s for s in spans if s.span_id == egress.parent_span_id]
        assert ingress.service == "edge-envoy"
        assert ingress.trace_id == egress.trace_id
        (decision,) = [s for s in spans if s.parent_span_id == egress.span_id]
        assert decision.name == RLS_SPAN
        assert decision.service == "rls"
        assert decision.trace_id == egress.trace_id
        assert decision.attributes["ratelimit.domain"] == "edge"
        assert decision.attributes["ratelimit.rules"] == ["edge.tenant"]
        assert decision.attributes["ratelimit.rule"] == "edge.tenant"  # the deciding rule
        codes.append(decision.attributes["ratelimit.overall_code"])
        if codes[-1] == "OVER_LIMIT":
            assert decision.attributes["ratelimit.over_limit_rules"] == ["edge.tenant"]
        (store,) = [s for s in spans if s.parent_span_id == decision.span_id]
        assert store.name == STORE_SPAN
        assert store.trace_id == egress.trace_id
        assert store.attributes["db.system"] == "redis"
    assert sorted(codes) == ["OK", "OK", "OVER_LIMIT"]
