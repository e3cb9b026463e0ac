"""serve --workers N: processes sharing one port, one admin endpoint that adds up."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from ratelimit_harness.fleet import wait_healthy
from ratelimit_harness.redis import free_port
from ratelimit_harness.waiting import eventually
from ratelimit_service.cli.client import build_request
from ratelimit_service.server.supervisor import merge_metrics

pytestmark = pytest.mark.slow

RULES = """domain: d
descriptors:
  - key: exact
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 50}
  - key: prob
    mode: probabilistic
    rate_limit: {unit: minute, requests_per_unit: 100000}
"""


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def health(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0


def metrics(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def workers(tmp_path: Path, redis_server) -> Iterator[tuple[subprocess.Popen[bytes], int, int]]:
    config = tmp_path / "rules.yaml"
    config.write_text(RULES)
    grpc_port, admin_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(config),
         "--grpc-addr", f"127.0.0.1:{grpc_port}", "--admin-addr", f"127.0.0.1:{admin_port}",
         "--redis-url", redis_server.url, "--workers", "2", "--redis-timeout", "0.5"],
    )  # fmt: skip
    try:
        wait_healthy(admin_port)
        yield process, grpc_port, admin_port
    finally:
        if process.poll() is None:
            process.terminate()
            process.wait(timeout=20)


async def calls(port: int, channels: int, per_channel: int, descriptor: str) -> list[int]:
    opened = [
        grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(channels)
    ]
    request = build_request("d", [descriptor], 0)
    try:
        stubs = [rls_pb2_grpc.RateLimitServiceStub(c) for c in opened]
        responses = await asyncio.gather(
            *(stub.ShouldRateLimit(request) for stub in stubs for _ in range(per_channel))
        )
    finally:
        for channel in opened:
            await channel.close()
    return [r.overall_code for r in responses]


def test_embedded_store_with_workers_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text(RULES)
    result = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(config),
         "--workers", "2"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--workers > 1 needs --redis-url" in result.stderr


def test_workers_share_limits_and_metrics_add_up(workers) -> None:
    process, grpc_port, admin_port = workers
    codes = asyncio.run(calls(grpc_port, 12, 20, "exact=x"))
    assert codes.count(1) == 50 and codes.count(2) == 190
    asyncio.run(calls(grpc_port, 12, 5, "prob=x"))
    samples = metrics(admin_port)
    assert samples[("ratelimit_server_should_rate_limit_total_requests_total", ())] == 300
    total_hits = ("ratelimit_service_rate_limit_total_hits_total", (("key", "d.exact"),))
    assert samples[total_hits] == 240
    assert samples[("ratelimit_workers_serving", ())] == 2
    per_worker = [
        samples[("ratelimit_probabilistic_buckets", (("worker", str(i)),))] for i in range(2)
    ]
    assert per_worker == [1.0, 1.0]  # connections were spread over both workers
    # /explain through the supervisor: worker 0's answer, the exact count from Redis.
    url = f"http://127.0.0.1:{admin_port}/explain?domain=d&descriptor=exact=x&format=json"
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.headers["content-type"] == "application/json"
        (rule,) = json.loads(response.read())["descriptors"][0]["rules"]
    assert (rule["stats_key"], rule["count"]) == ("d.exact", 50)
    assert len(children(process.pid)) == 2
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/status.json", timeout=5) as r:
        snapshots = json.loads(r.read())["workers"]
    assert len(snapshots) == 2
    hits = [row["total_hits"] for s in snapshots for row in s["rules"]["rows"]]
    assert sum(hits) == 300  # 240 exact and 60 probabilistic, each worker its own
    (breaker,) = snapshots[0]["store"]["breakers"]
    assert (snapshots[0]["store"]["name"], breaker["open"], breaker["healthy"]) == (
        "redis", False, True,
    )  # fmt: skip
    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/status", timeout=5) as r:
        assert b'id="worker"' in r.read()


def test_dead_worker_is_restarted_and_health_follows(workers) -> None:
    process, grpc_port, admin_port = workers
    victim = children(process.pid)[0]
    os.kill(victim, signal.SIGKILL)
    eventually(lambda: health(admin_port) != 200, timeout=5, what="health noticing the dead worker")
    eventually(lambda: health(admin_port) == 200, timeout=30, what="the worker restarted")
    assert victim not in children(process.pid) and len(children(process.pid)) == 2
    assert asyncio.run(calls(grpc_port, 2, 2, "prob=y")) == [1, 1, 1, 1]


def test_sigterm_stops_every_worker(workers) -> None:
    process, _, admin_port = workers
    pids = children(process.pid)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=20) == 0
    assert health(admin_port) == 0
    for pid in pids:
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )


def test_merge_metrics_sums_counters_and_labels_gauges() -> None:
    one = (
        '# HELP hits_total Hits\n# TYPE hits_total counter\nhits_total{key="a"} 2.0\n'
        "# HELP buckets Buckets\n# TYPE buckets gauge\nbuckets 3.0\n"
    )
    two = one.replace("2.0", "5.0").replace("3.0", "4.0")
    merged = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(merge_metrics([one, two]))
        for s in family.samples
    }
    assert merged[("hits_total", (("key", "a"),))] == 7.0
    assert merged[("buckets", (("worker", "0"),))] == 3.0
    assert merged[("buckets", (("worker", "1"),))] == 4.0
