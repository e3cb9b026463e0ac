"""The admin HTTP listener of a real service: /healthcheck, /metrics, /rlconfig.

HTTP goes over raw asyncio sockets on the test's own loop (the service shares it, so a
blocking client would deadlock), after real gRPC traffic.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ratelimit.v3 import rls_pb2
from prometheus_client.parser import text_string_to_metric_families

from ratelimit_harness.fixtures import RunningService, free_port, make_request
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.config_model import Mode
from ratelimit_service.server.app import RateLimitService, Settings

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
MINUTE = rls_pb2.RateLimitResponse.RateLimit.Unit.Value("MINUTE")

RULES = """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: h
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: ip
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: p
    mode: probabilistic
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: e
    mode: exact
    rate_limit: {unit: hour, requests_per_unit: 7, name: e_rule}
  - key: free
    rate_limit: {unlimited: true}
  - key: s
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 3}
  - key: route
    value: /api/*
    quota_mode: true
    rate_limit: {unit: day, requests_per_unit: 1000}
    descriptors:
      - key: method
        value: GET
        rate_limit: {unit: second, requests_per_unit: 20}
"""

BOTH_MODES = pytest.mark.parametrize(
    "mode", [Mode.EXACT, Mode.PROBABILISTIC], ids=lambda m: m.value
)

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
Starter = Callable[..., Awaitable[RunningService]]


@pytest.fixture
def start(write_config: Callable[..., Path], start_service: Starter) -> Starter:
    async def run(mode: Mode = Mode.PROBABILISTIC, **settings: Any) -> Any:
        settings.setdefault("sync_interval", 30.0)  # no sync during a test
        settings.setdefault("stale_after", 300.0)
        return await start_service(write_config(RULES), mode=mode, **settings)

    return run


async def http(svc: RunningService, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 request on a fresh connection; returns status, headers, body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", svc.service.admin.port)
    try:
        writer.write(f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return parse_response(raw)


def parse_response(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


async def scrape(svc: RunningService) -> Samples:
    status, headers, body = await http(svc, "GET", "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    assert int(headers["content-length"]) == len(body)
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def rule(samples: Samples, counter: str, key: str) -> float:
    return samples[(f"ratelimit_service_rate_limit_{counter}_total", frozenset({("key", key)}))]


def plain(samples: Samples, metric: str, /, **labels: str) -> float:
    return samples[(metric, frozenset(labels.items()))]


# -- /healthcheck ------------------------------------------------------------------------


async def test_healthcheck_ok_while_serving(start: Starter) -> None:
    svc = await start()
    status, headers, body = await http(svc, "GET", "/healthcheck")
    assert status == 200
    assert body.startswith(b"OK")
    assert int(headers["content-length"]) == len(body)
    status, headers, body = await http(svc, "HEAD", "/healthcheck")
    assert (status, body) == (200, b"")
    assert int(headers["content-length"]) > 0
    # With a query string too (load balancers add them).
    assert (await http(svc, "GET", "/healthcheck?probe=1"))[0] == 200


async def test_healthcheck_503_once_stop_begins(start: Starter) -> None:
    svc = await start()
    # A connection opened while serving, used once shutdown has begun.
    reader, writer = await asyncio.open_connection("127.0.0.1", svc.service.admin.port)
    stopping = asyncio.create_task(svc.service.stop())
    await eventually_async(
        lambda: svc.service._healthcheck_page()[0] == 503, timeout=5, what="503 once stopping"
    )
    writer.write(b"GET /healthcheck HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    status, _, body = parse_response(raw)
    assert status == 503
    assert body.startswith(b"NOT SERVING")
    await asyncio.wait_for(stopping, 10)
    with pytest.raises(OSError):
        await http(svc, "GET", "/healthcheck")


# -- /metrics ---------------------------------------------------------------------------------


@BOTH_MODES
async def test_rule_counters_after_known_traffic(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    codes = [(await svc.call("d", [("k", "x")])).overall_code for _ in range(12)]
    assert codes == [OK] * 10 + [OVER] * 2
    # hits_addend: 7 (before 0, after 7: under the near threshold 8), then 3 (after 10:
    # 2 of the 3 past the threshold are near), then 1 (over the limit).
    for hits, expected in [(7, OK), (3, OK), (1, OVER)]:
        assert (await svc.call("d", [("h", "x")], hits_addend=hits)).overall_code == expected
    samples = await scrape(svc)
    assert rule(samples, "total_hits", "d.k") == 12
    assert rule(samples, "within_limit", "d.k") == 10
    assert rule(samples, "near_limit", "d.k") == 2  # the 9th and 10th hits
    assert rule(samples, "over_limit", "d.k") == 2
    assert rule(samples, "shadow_mode", "d.k") == 0
    assert rule(samples, "total_hits", "d.h") == 11
    assert rule(samples, "within_limit", "d.h") == 10
    assert rule(samples, "near_limit", "d.h") == 2
    assert rule(samples, "over_limit", "d.h") == 1
    assert plain(samples, "ratelimit_server_should_rate_limit_total_requests_total") == 15
    assert plain(samples, "ratelimit_service_config_load_success_total") == 1


async def test_stats_keys_of_wildcards_and_nested_rules(start: Starter) -> None:
    svc = await start()
    for value in ("/api/a", "/api/b", "/api/c"):
        await svc.call("d", [("route", value)], [("route", value), ("method", "GET")])
    samples = await scrape(svc)
    assert rule(samples, "total_hits", "d.route_/api/*") == 3
    assert rule(samples, "total_hits", "d.route_/api/*.method_GET") == 3


async def test_shadow_mode_counter(start: Starter) -> None:
    svc = await start(Mode.EXACT)
    for _ in range(5):
        assert (await svc.call("d", [("s", "x")])).overall_code == OK
    samples = await scrape(svc)
    assert rule(samples, "total_hits", "d.s") == 5
    assert rule(samples, "within_limit", "d.s") == 3
    assert rule(samples, "shadow_mode", "d.s") == 2


async def test_domain_not_found_counts(start: Starter) -> None:
    svc = await start()
    for domain, times in (("nope", 3), ("other", 2)):
        for _ in range(times):
            assert (await svc.call(domain, [("k", "x")])).overall_code == OK
    samples = await scrape(svc)
    name = "ratelimit_service_rate_limit_domain_not_found_total"
    assert plain(samples, name, domain="nope") == 3
    assert plain(samples, name, domain="other") == 2
    assert (name, frozenset({("domain", "d")})) not in samples


async def test_latency_histogram_counts_every_call(start: Starter) -> None:
    svc = await start()
    for index in range(9):
        await svc.call("d", [("k", str(index))], [("free", "x")])
    samples = await scrape(svc)
    histogram = "ratelimit_server_should_rate_limit_response_time_seconds"
    assert plain(samples, histogram + "_count") == 9
    assert plain(samples, histogram + "_bucket", le="+Inf") == 9
    assert plain(samples, histogram + "_sum") > 0
    buckets = sorted(
        (float(dict(labels)["le"]), value)
        for (name, labels), value in samples.items()
        if name == histogram + "_bucket"
    )
    counts = [value for _, value in buckets]
    assert counts == sorted(counts)  # cumulative


async def test_latency_histogram_includes_refused_calls(start: Starter) -> None:
    """Every ShouldRateLimit call is timed (the Go service's response_time is recorded for
    errors too), so the histogram count matches total_requests."""
    svc = await start()
    for _ in range(3):
        await svc.call("d", [("k", "x")])
    for bad in (make_request("", [("k", "x")]), make_request("d")):
        with pytest.raises(Exception, match="INVALID_ARGUMENT"):
            await svc.stub.ShouldRateLimit(bad)

    async def counted() -> tuple[float, float, float] | None:
        # A refused call's time is recorded as the handler ends, which may be just
        # after its client has the error.
        samples = await scrape(svc)
        total = plain(samples, "ratelimit_server_should_rate_limit_total_requests_total")
        errors = plain(samples, "ratelimit_service_call_should_rate_limit_service_error_total")
        count = plain(samples, "ratelimit_server_should_rate_limit_response_time_seconds_count")
        return (total, errors, count) if count >= total else None

    assert await eventually_async(counted, timeout=5.0, what="every call timed") == (5, 2, 5)


async def test_drop_ratio_gauge_for_a_dropping_bucket(start: Starter) -> None:
    svc = await start()
    codes = [(await svc.call("d", [("p", "hot")])).overall_code for _ in range(4)]
    assert codes == [OK, OK, OVER, OVER]
    assert (await svc.call("d", [("p", "cool")])).overall_code == OK  # 1 of 2: not dropping
    samples = await scrape(svc)
    ratios = {
        dict(labels)["bucket"]: value
        for (name, labels), value in samples.items()
        if name == "ratelimit_drop_ratio"
    }
    assert set(ratios) == {"d.p=hot/60s"}
    assert 0 < ratios["d.p=hot/60s"] <= 1
    assert plain(samples, "ratelimit_probabilistic_buckets") == 2
    # Per rule: the highest ratio among the rule's buckets ("hot" drops, "cool" does not).
    assert plain(samples, "ratelimit_rule_drop_ratio", key="d.p") == ratios["d.p=hot/60s"]
    assert plain(samples, "ratelimit_rule_overshoot_hits", key="d.p") == 0
    assert ("ratelimit_sync_duration_seconds_count", frozenset()) in samples


async def test_rule_limit_gauge_carries_every_finite_rule(start: Starter) -> None:
    """ratelimit_rule_limit: each rule's configured limit by the key its hit counters
    carry, with its period, so that hits over limit is one query."""
    svc = await start()
    samples = await scrape(svc)
    limits = {
        dict(labels)["key"]: (dict(labels)["unit"], dict(labels)["window_seconds"], value)
        for (name, labels), value in samples.items()
        if name == "ratelimit_rule_limit"
    }
    assert limits["d.k"] == ("minute", "60", 10.0)
    assert limits["d.e"] == ("hour", "3600", 7.0)
    assert limits["d.s"] == ("second", "1", 3.0)
    assert "d.free" not in limits  # unlimited: no limit to show
    finite = [limit for limit in svc.service.limiter.config.limits() if not limit.unlimited]
    assert len(limits) == len(finite)


@BOTH_MODES
async def test_state_is_bounded_under_a_flood_of_distinct_values(
    start: Starter, mode: Mode
) -> None:
    svc = await start(mode, max_buckets=500)
    values = [f"10.{i // 250}.{i % 250}.1" for i in range(5000)]
    batches = [values[i : i + 10] for i in range(0, len(values), 10)]
    for group in range(0, len(batches), 100):
        responses = await asyncio.gather(
            *(
                svc.call("d", *[[("ip", v)] for v in batch])
                for batch in batches[group : group + 100]
            )
        )
        assert all(r.overall_code == OK for r in responses)
    samples = await scrape(svc)
    if mode is Mode.PROBABILISTIC:
        held = plain(samples, "ratelimit_probabilistic_buckets")
        overflow = plain(
            samples, "ratelimit_bucket_evictions_total", table="probabilistic", reason="overflow"
        )
        idle = plain(
            samples, "ratelimit_bucket_evictions_total", table="probabilistic", reason="idle"
        )
        assert held <= 500
        assert overflow > 0
        assert overflow + idle >= 5000 - held
    else:
        held = plain(samples, "ratelimit_store", store="embedded", name="exact_keys")
        evictions = plain(samples, "ratelimit_store", store="embedded", name="evictions")
        assert held <= 500
        assert evictions >= 5000 - held
    assert rule(samples, "total_hits", "d.ip") == 5000
    # Still deciding correctly after the flood.
    fresh = [(await svc.call("d", [("ip", "192.0.2.1")])).overall_code for _ in range(6)]
    assert fresh == [OK] * 5 + [OVER]


async def test_stats_keys_are_bounded(start: Starter) -> None:
    svc = await start(max_stats_keys=20)
    for index in range(60):
        override = {"entries": [("user", str(index))], "limit": (5, MINUTE)}
        assert (await svc.call("d", override)).overall_code == OK
    samples = await scrape(svc)
    keys = {
        dict(labels)["key"]
        for (name, labels), _ in samples.items()
        if name == "ratelimit_service_rate_limit_total_hits_total"
    }
    assert len(keys) <= 21
    assert "_overflow" in keys
    assert sum(rule(samples, "total_hits", key) for key in keys) == 60
    assert plain(samples, "ratelimit_service_stats_keys_overflowed_total") > 0


# -- /rlconfig and the rest -------------------------------------------------------------------


async def test_rlconfig_lists_every_rule(start: Starter) -> None:
    svc = await start(Mode.EXACT)
    status, headers, body = await http(svc, "GET", "/rlconfig")
    assert status == 200
    assert headers["content-type"].startswith("text/plain")
    lines = body.decode().splitlines()
    by_key = {line.split(":", 1)[0]: line for line in lines}
    assert set(by_key) == {
        "d.k",
        "d.h",
        "d.ip",
        "d.p",
        "d.e",
        "d.free",
        "d.s",
        "d.route_/api/*",
        "d.route_/api/*.method_GET",
    }
    assert "unit=MINUTE requests_per_unit=10" in by_key["d.k"]
    assert "mode=exact" in by_key["d.k"]  # the service default, --mode exact
    assert "unit=MINUTE requests_per_unit=2" in by_key["d.p"]
    assert "mode=probabilistic" in by_key["d.p"]  # the rule's own mode
    assert "unit=HOUR requests_per_unit=7" in by_key["d.e"]
    assert "e_rule" in by_key["d.e"]
    assert "unlimited" in by_key["d.free"]
    assert "shadow_mode" in by_key["d.s"]
    assert "unit=SECOND requests_per_unit=3" in by_key["d.s"]
    assert "quota_mode" in by_key["d.route_/api/*"]
    assert "unit=DAY requests_per_unit=1000" in by_key["d.route_/api/*"]
    assert "unit=SECOND requests_per_unit=20" in by_key["d.route_/api/*.method_GET"]


async def test_index_unknown_path_and_wrong_method(start: Starter) -> None:
    svc = await start()
    status, _, body = await http(svc, "GET", "/")
    assert status == 200
    assert set(body.decode().split()) >= {"/healthcheck", "/metrics", "/rlconfig"}
    assert (await http(svc, "GET", "/nope"))[0] == 404
    assert (await http(svc, "GET", "/metrics/extra"))[0] == 404
    for method in ("POST", "PUT", "DELETE"):
        assert (await http(svc, method, "/metrics"))[0] == 405
        assert (await http(svc, method, "/healthcheck"))[0] == 405
    assert (await http(svc, "POST", "/nope"))[0] == 404
    # Garbage does not take the listener down.
    reader, writer = await asyncio.open_connection("127.0.0.1", svc.service.admin.port)
    writer.write(b"\x00\x01garbage\r\n\r\n")
    await writer.drain()
    await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert (await http(svc, "GET", "/healthcheck"))[0] == 200


async def test_busy_admin_port_fails_start_and_leaves_nothing_listening(
    write_config: Callable[..., Path],
) -> None:
    grpc_port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        service = RateLimitService(
            Settings(
                config_path=str(write_config(RULES)),
                grpc_addr=f"127.0.0.1:{grpc_port}",
                admin_addr=f"127.0.0.1:{holder.getsockname()[1]}",
                shutdown_grace=0.1,
            )
        )
        try:
            with pytest.raises(OSError):
                await service.start()
            # A failed start must not leave the gRPC listener serving on its own.
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", grpc_port)
            except OSError:
                pass
            else:
                writer.close()
                pytest.fail("the gRPC port still accepts connections after start() failed")
        finally:
            await service.stop()
