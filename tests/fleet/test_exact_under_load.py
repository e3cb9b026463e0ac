"""Exact mode under load: three real service processes on one real redis-server, a
CPU-bound process beside them, bursts far above the limit driven by h2load (a client
fast enough to saturate the services). Admitted equals the limit exactly, and no
request is answered with a gRPC error or by failure_mode."""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from ratelimit_harness.fleet import cpu_hog, fleet_sum, redis_server, service_fleet
from ratelimit_harness.fleet import rule_counter as _rule_counter
from ratelimit_service.cli.client import build_request

pytestmark = [
    pytest.mark.serial,  # timing: run alone, after the parallel part
    pytest.mark.slow,  # starts processes
    pytest.mark.skipif(
        shutil.which("redis-server") is None or shutil.which("h2load") is None,
        reason="needs redis-server and h2load (nghttp2-client) on the PATH",
    ),
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
"""


def grpc_body(directory: Path, descriptor: str) -> Path:
    """A ShouldRateLimit request as h2load sends it: one length-prefixed gRPC message."""
    message = build_request("load", [descriptor], 0).SerializeToString()
    path = directory / f"{descriptor.replace('=', '-')}.bin"
    path.write_bytes(b"\x00" + struct.pack(">I", len(message)) + message)
    return path


def burst(ports: list[int], body: Path, count: int, in_flight: int) -> None:
    """``count`` requests split evenly over ``ports``, ``in_flight`` at a time in all,
    one h2load per port, all at once."""
    per_port, streams = count // len(ports), max(1, in_flight // (4 * len(ports)))
    route = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
    grpc_headers = ["-H", "content-type: application/grpc", "-H", "te: trailers"]
    runs = [
        subprocess.Popen(
            [
                *("h2load", "-n", str(per_port), "-c", "4", "-m", str(streams), "-t", "1"),
                *(*grpc_headers, "-d", str(body), f"http://127.0.0.1:{port}{route}"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for port in ports
    ]
    for run in runs:
        out, _ = run.communicate(timeout=60)
        assert run.returncode == 0, out
        assert re.search(rf"{per_port} succeeded, 0 failed, 0 errored", out), out


def test_three_processes_beside_cpu_hogs_admit_exactly_the_limit(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "load.yaml").write_text(RULES)
    # 100/minute: bursts of 1,500 with 192 in flight (the services saturated, batches
    # held, queues long); 40/second: a burst short enough to fall in one window.
    bursts = [("slow=a", 1500, 192), ("slow=b", 1500, 192), ("burst=a", 300, 64)]
    with redis_server(tmp_path) as redis, service_fleet(3, config, redis.url) as nodes:
        ports = [node.grpc_port for node in nodes]
        admin = [node.admin_port for node in nodes]
        with cpu_hog():
            for key, count, in_flight in bursts:
                burst(ports, grpc_body(tmp_path, key), count, in_flight)
        slow = _rule_counter(admin, "within_limit", "load.slow")
        fast = _rule_counter(admin, "within_limit", "load.burst")
        by_failure_mode = _rule_counter(admin, "failure_mode_allowed", "load.slow")
        total = fleet_sum(admin, "ratelimit_server_should_rate_limit_total_requests_total")
        errors = fleet_sum(admin, "ratelimit_service_call_should_rate_limit_store_error_total")
        timeouts = fleet_sum(admin, 'ratelimit_store{name="timeouts",store="redis"}')
    assert total == 3300
    assert (errors, timeouts, by_failure_mode) == (0, 0, 0)
    assert slow == 200  # 100 per key, two keys
    assert fast == 40
