"""Exact mode on a busy node, with real processes: three services on one redis-server,
a busy-loop beside them, and a Python grpc.aio client (as heavy as a real one: it
competes for the same two cores). Replies Redis sent in time are used, so the limit
holds exactly and nothing is answered by failure_mode; a Redis that is really slow
still gets failure_mode at the caller's deadline; a killed Redis opens the breaker."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_harness.fleet import (
    cpu_hog,
    fleet_sum,
    python_burst,
    redis_server,
    rule_counter,
    scrape,
    service_fleet,
    wait_port,
)
from ratelimit_harness.redis import free_port
from ratelimit_harness.waiting import eventually

pytestmark = [
    pytest.mark.serial,  # timing: run alone, after the parallel part
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server"),
    pytest.mark.slow,
]

RULES = """\
domain: load
descriptors:
  - key: burst
    mode: exact
    rate_limit: {unit: second, requests_per_unit: 40}
  - key: slow
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: tenant
    value: blocked
    mode: exact
    rate_limit: {unit: second, requests_per_unit: 0}
"""
OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT


def rules(tmp_path: Path) -> Path:
    config = tmp_path / "config"
    config.mkdir(exist_ok=True)
    (config / "load.yaml").write_text(RULES)
    return config


def test_busy_node_python_client_admits_exactly_the_limit_ten_bursts_in_a_row(
    tmp_path: Path,
) -> None:
    """The scenario that admitted up to 300 of 100/minute: bursts of 300 at 64 in flight
    over three processes, a busy-loop beside them. Each burst uses a fresh key of the
    100/minute rule, so each must admit exactly 100."""
    with redis_server(tmp_path) as redis, service_fleet(3, rules(tmp_path), redis.url) as nodes:
        ports = [node.grpc_port for node in nodes]
        admin = [node.admin_port for node in nodes]
        with cpu_hog():
            admitted = []
            for burst in range(10):
                outcomes = asyncio.run(python_burst(ports, "load", f"slow=b{burst}", 300, 64))
                assert sum(outcomes.values()) == 300
                assert set(outcomes) <= {"OK", "OVER_LIMIT"}, outcomes
                admitted.append(outcomes["OK"])
        by_failure_mode = sum(
            rule_counter(admin, name, "load.slow")
            for name in ("failure_mode_allowed", "failure_mode_denied", "overloaded")
        )
        timeouts = fleet_sum(admin, 'ratelimit_store{name="timeouts",store="redis"}')
        outages = fleet_sum(admin, 'ratelimit_store{name="outages",store="redis"}')
        store_errors = fleet_sum(
            admin, "ratelimit_service_call_should_rate_limit_store_error_total"
        )
        replies = fleet_sum(admin, "ratelimit_store_reply_seconds_count")
        lag = fleet_sum(admin, "ratelimit_event_loop_lag_seconds_count")
    assert admitted == [100] * 10
    assert (by_failure_mode, timeouts, outages, store_errors) == (0, 0, 0, 0)
    assert replies > 0 and lag > 0  # both histograms are filled


def test_really_slow_redis_gets_failure_mode_at_the_caller_s_deadline(tmp_path: Path) -> None:
    """Redis behind a proxy that holds every reply 400 ms. A caller with a 250 ms deadline
    is answered by failure_mode before it (the rule fails open); a caller without one
    waits for Redis's real answer. Late replies still arrive: no breaker transition."""
    proxy_port = free_port()
    with redis_server(tmp_path) as redis:
        proxy = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).resolve().parents[2] / "bench" / "redis_delay_proxy.py"),
                *("--listen-port", str(proxy_port), "--upstream-port", str(redis.port)),
                *("--delay-ms", "400"),
            ]
        )
        try:
            wait_port(proxy_port)
            url = f"redis://127.0.0.1:{proxy_port}/0"
            # A margin of 100 ms: the answer reaches the client before its deadline even
            # on a busy machine (the default 2 ms suits Envoy on the same node).
            margin = ["--deadline-margin", "0.1"]
            with service_fleet(1, rules(tmp_path), url, margin) as nodes:
                port, admin = nodes[0].grpc_port, nodes[0].admin_port
                started = time.monotonic()
                hurried = asyncio.run(python_burst([port], "load", "slow=x", 5, 5, timeout=0.25))
                hurried_took = time.monotonic() - started
                patient = asyncio.run(python_burst([port], "load", "slow=x", 3, 3, timeout=None))
                metrics = scrape(admin)
        finally:
            proxy.terminate()
            proxy.wait(5)
    # Answered by failure_mode (open), in time for the caller (not DEADLINE_EXCEEDED,
    # though a busy machine may make one late).
    assert hurried == Counter({"OK": 5})  # answered by failure_mode, in time
    assert hurried_took < 0.4  # not Redis's 400 ms
    assert patient == Counter({"OK": 3})
    assert metrics['ratelimit_service_rate_limit_failure_mode_allowed_total{key="load.slow"}'] == 5
    # within_limit counts every admitted hit: 5 by failure_mode, 3 by Redis.
    assert metrics['ratelimit_service_rate_limit_within_limit_total{key="load.slow"}'] == 8
    assert metrics['ratelimit_store{name="timeouts",store="redis"}'] == 5
    assert metrics['ratelimit_store{name="outages",store="redis"}'] == 0
    # Every call's reply was read, the late ones included (the exact calls, however the
    # batcher shared them out, and each sync round, one call each): 0.4 s each.
    calls = metrics['ratelimit_store{name="exact_batches",store="redis"}']
    calls += metrics["ratelimit_sync_rounds_total"]
    assert calls >= 2  # a hurried call given up, a patient one answered
    assert metrics["ratelimit_store_reply_seconds_count"] >= calls
    assert metrics['ratelimit_store_reply_seconds_bucket{le="0.25"}'] <= 1  # (the warm-up)
    assert metrics['ratelimit_store_reply_seconds_bucket{le="1.0"}'] >= calls


def test_killed_redis_opens_the_breaker_and_a_zero_limit_still_denies(tmp_path: Path) -> None:
    with redis_server(tmp_path) as redis, service_fleet(1, rules(tmp_path), redis.url) as nodes:
        port, admin = nodes[0].grpc_port, nodes[0].admin_port
        assert asyncio.run(python_burst([port], "load", "slow=k", 3, 3)) == Counter({"OK": 3})
        redis.stop()  # killed: connections reset, reconnects refused

        def opened() -> bool:
            asyncio.run(python_burst([port], "load", "slow=k", 3, 3))
            return scrape(admin)['ratelimit_store{name="outages",store="redis"}'] == 1

        eventually(opened, timeout=10, what="the breaker opens")
        metrics = scrape(admin)
        assert metrics['ratelimit_store{name="healthy",store="redis"}'] == 0
        assert asyncio.run(python_burst([port], "load", "slow=k", 5, 5)) == Counter({"OK": 5})
        assert asyncio.run(python_burst([port], "load", "tenant=blocked", 5, 5)) == Counter(
            {"OVER_LIMIT": 5}
        )
        redis.start()

        def recovered() -> bool:
            asyncio.run(python_burst([port], "load", "slow=k2", 1, 1))
            return scrape(admin)['ratelimit_store{name="recoveries",store="redis"}'] == 1

        eventually(recovered, timeout=15, what="the breaker closes again")
        assert scrape(admin)['ratelimit_store{name="healthy",store="redis"}'] == 1
