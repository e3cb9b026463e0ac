"""The Grafana dashboard and the alerting rules against what a real service exposes: a
service with --zone (its zone store and the global store on one real redis-server, two
databases) under load (RLS calls, some over their limit, and an RLQS stream), a real
Prometheus scraping it every second with k8s/monitoring/alerts.yml loaded. Every query
of every panel must return a number, and every rule must evaluate without error."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from google.protobuf import duration_pb2

from ratelimit_harness.envoy import ServiceProcess, running
from ratelimit_harness.fixtures import make_request
from ratelimit_harness.prometheus import Prometheus, prometheus_missing
from ratelimit_harness.redis import RedisServer
from ratelimit_harness.waiting import eventually_async

pytestmark = pytest.mark.slow  # starts redis-server, the service and Prometheus

MONITORING = Path(__file__).resolve().parents[2] / "k8s" / "monitoring"
RATE_INTERVAL = "5s"
"""What $__rate_interval stands for here: five scrapes."""

RULES = """\
domain: dash
descriptors:
  - key: exact
    mode: exact
    rate_limit: {unit: second, requests_per_unit: 20}
  - key: prob
    mode: probabilistic
    rate_limit: {unit: second, requests_per_unit: 1000}
---
domain: q
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
"""


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, query) for every target of every panel, variables substituted."""
    dashboard = json.loads((MONITORING / "grafana-dashboard.json").read_text())
    return [
        (panel["title"], target["expr"].replace("$__rate_interval", RATE_INTERVAL))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


async def rls_load(port: int) -> None:
    """40 calls a second: each with an exact descriptor (20/s allowed: half denied) and a
    probabilistic one."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(
            "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=lambda b: b,
        )
        request = make_request("dash", [("exact", "x")], [("prob", "y")])
        while True:
            await asyncio.gather(*(call(request, timeout=1) for _ in range(4)))
            await asyncio.sleep(0.1)  # pacing: the load's rate


async def rlqs_load(port: int) -> None:
    """One Envoy on StreamRateLimitQuotas, reporting one bucket twice a second."""
    usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage(
        bucket_id=rlqs_pb2.BucketId(bucket={"tenant": "t"}),
        time_elapsed=duration_pb2.Duration(nanos=500_000_000),
        num_requests_allowed=10,
    )
    report = rlqs_pb2.RateLimitQuotaUsageReports(domain="q", bucket_quota_usages=[usage])
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
        stream = stub.StreamRateLimitQuotas(metadata=(("x-envoy-node-id", "envoy-1"),))
        while True:
            await stream.write(report)
            await stream.read()
            await asyncio.sleep(0.5)  # pacing: Envoy's report period


def rule_selectors() -> list[tuple[str, str]]:
    """("rule", selector) for every series selector of the rules (their metric names,
    their label matchers), and the recording rules' own series."""
    text = (MONITORING / "alerts.yml").read_text()
    selectors = sorted(set(re.findall(r"\bratelimit_[a-z_]+(?:\{[^}]*\})?", text)))
    recorded = re.findall(r"record: (\S+)", text)
    return [("rule", selector) for selector in [*selectors, *recorded]]


def values(prometheus: Prometheus, query: str) -> dict[str, float]:
    """An instant query's samples, by their labels."""
    result = prometheus.api("query", query=query)["result"]
    return {json.dumps(row["metric"], sort_keys=True): float(row["value"][1]) for row in result}


def missing(prometheus: Prometheus, queries: list[tuple[str, str]]) -> list[str]:
    """The queries with no sample that is a number."""
    return [
        f"{title}: {query}"
        for title, query in queries
        if not any(math.isfinite(v) for v in values(prometheus, query).values())
    ]


async def test_every_panel_query_and_rule_works_on_a_live_service(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    if (reason := prometheus_missing()) is not None:
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    config = tmp_path / "config"
    config.mkdir()
    for number, text in enumerate(RULES.split("---\n")):
        (config / f"rules{number}.yaml").write_text(text)
    zone_url = re.sub(r"/0$", "/1", redis_server.url)
    service = ServiceProcess(
        config, tmp_path / "service", "--redis-url", zone_url,
        "--global-redis-url", redis_server.url, "--zone", "a",
    )  # fmt: skip
    prometheus = Prometheus(
        tmp_path / "prometheus",
        scrape_targets=[f"127.0.0.1:{service.admin_port}"],
        rule_files=[MONITORING / "alerts.yml"],
    )
    with running(service, prometheus):
        await asyncio.to_thread(service.start)
        loads = [
            asyncio.create_task(rls_load(service.grpc_port)),
            asyncio.create_task(rlqs_load(service.grpc_port)),
        ]
        try:
            await asyncio.to_thread(prometheus.start)
            queries = panel_queries() + rule_selectors()
            assert len(queries) >= 30
            await eventually_async(
                lambda: asyncio.to_thread(lambda: not missing(prometheus, queries)),
                timeout=30,
                what="every panel query returns data",
                context=lambda: "\n".join(missing(prometheus, queries)),
            )
            figures = {
                query: values(prometheus, query)
                for query in (
                    "sum by (zone) (ratelimit_zone_aggregating)",
                    "sum(ratelimit_rlqs_streams)",
                    'ratelimit_store{name=~"(zone_store_)?healthy"}',
                    "sum(rate(ratelimit_service_rate_limit_over_limit_total[5s]))",
                    "ratelimit:denied_share:rate5m",
                )
            }
            rules = await asyncio.to_thread(prometheus.api, "rules")
        finally:
            for task in loads:
                task.cancel()
            for task in loads:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    assert figures["sum by (zone) (ratelimit_zone_aggregating)"] == {'{"zone": "a"}': 1.0}
    assert figures["sum(ratelimit_rlqs_streams)"] == {"{}": 1.0}
    assert sorted(figures['ratelimit_store{name=~"(zone_store_)?healthy"}'].values()) == [1, 1]
    (over,) = figures["sum(rate(ratelimit_service_rate_limit_over_limit_total[5s]))"].values()
    assert 5 < over < 35  # 40 exact hits a second, 20 of them allowed
    (share,) = figures["ratelimit:denied_share:rate5m"].values()
    assert 0.1 < share < 0.4  # 20 of every 80 hits (40 exact, 40 probabilistic)
    evaluated: list[dict[str, Any]] = [r for g in rules["groups"] for r in g["rules"]]
    assert len(evaluated) == 8
    assert [(r["name"], r["health"], r.get("lastError", "")) for r in evaluated] == [
        (r["name"], "ok", "") for r in evaluated
    ]
