"""Several real service processes on one real Redis: the fleet behaviours of both modes.

The rates and durations are small so the suite stays quick on two cores; the
tolerances here are test tolerances, and the benchmark figures (docs/benchmarks.md)
are the accuracy claims.
"""

from __future__ import annotations

import asyncio
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from ratelimit_harness.fleet import (
    Node,
    Timeline,
    drive,
    service_fleet,
    write_config,
)
from ratelimit_service.cli.client import build_request

pytestmark = [
    pytest.mark.serial,  # timing: run alone, after the parallel part
    pytest.mark.slow,
]

OVER_LIMIT = 2


@pytest.fixture
def fleet_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory() as tmp:
        yield Path(tmp)


def steady_rate(timeline: Timeline, start: float, end: float) -> tuple[float, float]:
    """Offered and admitted per second over [start, end) by send time."""
    rows = [row for row in timeline.rows() if start <= row[0] < end]
    span = len(rows) * timeline.bucket
    return sum(r[1] for r in rows) / span, sum(r[2] for r in rows) / span


async def concurrent_calls(nodes: list[Node], per_node: int, descriptor: str) -> list[bool]:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{n.grpc_port}") for n in nodes]
    request = build_request("fleet", [descriptor], 0)
    try:
        stubs = [rls_pb2_grpc.RateLimitServiceStub(c) for c in channels]
        calls = [stub.ShouldRateLimit(request) for stub in stubs for _ in range(per_node)]
        responses = await asyncio.gather(*calls)
    finally:
        for channel in channels:
            await channel.close()
    return [r.overall_code != OVER_LIMIT for r in responses]


def test_exact_limit_holds_across_three_processes(redis_server, fleet_dir: Path) -> None:
    config = write_config(fleet_dir, 100, "minute", "exact")
    with service_fleet(3, config, redis_server.url, ["--redis-timeout", "0.5"]) as nodes:
        admitted = asyncio.run(concurrent_calls(nodes, 100, "k=v"))
    assert len(admitted) == 300
    assert sum(admitted) == 100


def test_exact_window_never_exceeds_limit(redis_server, fleet_dir: Path) -> None:
    """3 processes, 20 per second, offered 60 per second for 3.5 s across window edges."""
    config = write_config(fleet_dir, 20, "second", "exact")
    with service_fleet(3, config, redis_server.url, ["--redis-timeout", "0.5"]) as nodes:
        timeline = asyncio.run(
            drive([n.grpc_port for n in nodes], [1, 1, 1], lambda t: 60, 3.5, "fleet", "k=v")
        )
    assert timeline.errors == 0
    sends = sorted(timeline.admitted_at)
    assert len(sends) >= 50  # about 20 per second were admitted
    # Any 21 admitted requests span more than a window (less the latency of one call).
    spans = [sends[i + 20] - sends[i] for i in range(len(sends) - 20)]
    assert min(spans) > 0.95


def test_probabilistic_accuracy_with_skewed_traffic(redis_server, fleet_dir: Path) -> None:
    config = write_config(fleet_dir, 200, "second", "probabilistic")
    with service_fleet(3, config, redis_server.url) as nodes:
        timeline = asyncio.run(
            drive([n.grpc_port for n in nodes], [0.6, 0.3, 0.1], lambda t: 400, 6, "fleet", "k=v")
        )
    assert timeline.errors == 0
    offered, admitted = steady_rate(timeline, 2.0, 6.0)
    assert offered == pytest.approx(400, rel=0.05)
    assert admitted == pytest.approx(200, rel=0.10)


def test_probabilistic_under_the_limit_admits_everything(redis_server, fleet_dir: Path) -> None:
    config = write_config(fleet_dir, 200, "second", "probabilistic")
    with service_fleet(3, config, redis_server.url) as nodes:
        timeline = asyncio.run(
            drive([n.grpc_port for n in nodes], [0.6, 0.3, 0.1], lambda t: 140, 5, "fleet", "k=v")
        )
    offered, admitted = steady_rate(timeline, 0.0, 5.0)
    assert admitted / offered >= 0.99


async def round_robin(nodes: list[Node], count: int, gap: float, descriptor: str) -> list[bool]:
    """``count`` calls, one every ``gap`` seconds, to each process in turn."""
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{n.grpc_port}") for n in nodes]
    request = build_request("fleet", [descriptor], 0)
    answers: list[bool] = []
    try:
        stubs = [rls_pb2_grpc.RateLimitServiceStub(c) for c in channels]
        for i in range(count):
            response = await stubs[i % len(stubs)].ShouldRateLimit(request, timeout=2)
            answers.append(response.overall_code != OVER_LIMIT)
            await asyncio.sleep(gap)  # the traffic's shape: one call every gap seconds
    finally:
        for channel in channels:
            await channel.close()
    return answers


def test_probabilistic_small_limit_over_more_processes_admits_light_traffic(
    redis_server, fleet_dir: Path
) -> None:
    """3 per second over 4 processes: each one's equal share of the bucket is under one
    hit. Half the limit, one call every 0.67 s to each process in turn (each sees the
    key every 2.7 s): every call is admitted (a credit of one hit at least, the
    bucket's view kept between visits)."""
    config = write_config(fleet_dir, 3, "second", "probabilistic")
    with service_fleet(4, config, redis_server.url) as nodes:
        answers = asyncio.run(round_robin(nodes, 12, 1 / 1.5, "k=v"))
    assert answers == [True] * 12


def test_probabilistic_step_change(redis_server, fleet_dir: Path) -> None:
    """0.5x the limit, then 3x: after the burst the fleet is back near the limit."""
    config = write_config(fleet_dir, 150, "second", "probabilistic")
    with service_fleet(3, config, redis_server.url) as nodes:
        timeline = asyncio.run(
            drive(
                [n.grpc_port for n in nodes],
                [0.5, 0.3, 0.2],
                lambda t: 75 if t < 3 else 450,
                7,
                "fleet",
                "k=v",
            )
        )
    _, before = steady_rate(timeline, 1.0, 3.0)
    assert before == pytest.approx(75, rel=0.1)
    _, after = steady_rate(timeline, 4.5, 7.0)
    assert after == pytest.approx(150, rel=0.15)


def bucket_updates(nodes: list[Node]) -> float:
    """Bucket reports the processes sent to the store, ever (their /metrics)."""
    total = 0.0
    for node in nodes:
        url = f"http://127.0.0.1:{node.admin_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as page:
            for line in page.read().decode().splitlines():
                if line.startswith("ratelimit_sync_bucket_updates_total "):
                    total += float(line.split()[1])
    return total


def test_probabilistic_over_its_limit_in_a_fleet_of_eight_waits_paid_in_advance(
    redis_server, fleet_dir: Path
) -> None:
    """Eight processes (core/stretch.py PREPAID_NODES) offered twice the limit: once
    settled, each reports the bucket about once a second, not four times (waits are
    counted in syncs: a late sync on a busy machine does not end one early), its waits
    paid in advance through the real script, and the fleet holds the limit."""
    config = write_config(fleet_dir, 200, "second", "probabilistic")
    with service_fleet(8, config, redis_server.url) as nodes:
        ports, skew = [n.grpc_port for n in nodes], [1.0] * len(nodes)

        async def scenario() -> tuple[Timeline, float]:
            await drive(ports, skew, lambda t: 400, 6, "fleet", "k=v")  # settles, waits
            before = bucket_updates(nodes)
            timeline = await drive(ports, skew, lambda t: 400, 6, "fleet", "k=v")
            return timeline, (bucket_updates(nodes) - before) / len(nodes) / 6

        timeline, reports = asyncio.run(scenario())
    assert timeline.errors == 0
    assert reports < 2.0, reports  # of 4 a second without the waits (1.0-1.4 seen, busy or not)
    _, admitted = steady_rate(timeline, 1.0, 6.0)
    assert admitted == pytest.approx(200, rel=0.10)


def test_probabilistic_makes_no_redis_call_on_the_request_path(
    redis_server, fleet_dir: Path
) -> None:
    """Redis frozen with SIGSTOP: probabilistic answers keep coming, none waiting for
    Redis. A call that asked the frozen Redis would wait for its --redis-timeout (1 s);
    the bound on the tail is well under that and over what a busy 2-core machine adds
    to a call by descheduling the client or the service (tens of milliseconds)."""
    config = write_config(fleet_dir, 1000, "second", "probabilistic")
    with service_fleet(2, config, redis_server.url) as nodes:
        ports = [n.grpc_port for n in nodes]
        asyncio.run(drive(ports, [1, 1], lambda t: 100, 1, "fleet", "k=v"))
        redis_server.pause()
        try:
            frozen = asyncio.run(drive(ports, [1, 1], lambda t: 100, 2, "fleet", "k=v"))
        finally:
            redis_server.resume()
    assert frozen.errors == 0
    assert sum(frozen.admitted.values()) == sum(frozen.offered.values())
    latencies = sorted(frozen.latencies)
    assert latencies[int(len(latencies) * 0.99)] < 0.25


def test_redis_restart_under_load(redis_server, fleet_dir: Path) -> None:
    """Redis dies mid-run and comes back: no errors, fail open while down, limit again after."""
    config = write_config(fleet_dir, 100, "second", "probabilistic")
    extra = ["--stale-after", "0.5"]
    with service_fleet(3, config, redis_server.url, extra) as nodes:
        ports = [n.grpc_port for n in nodes]

        async def scenario() -> Timeline:
            task = asyncio.create_task(
                drive(ports, [0.5, 0.3, 0.2], lambda t: 200, 11, "fleet", "k=v")
            )
            await asyncio.sleep(2.5)  # the scenario: faults at set times of the load's timeline
            redis_server.stop()
            await asyncio.sleep(2.5)
            redis_server.start()
            return await task

        timeline = asyncio.run(scenario())
    assert timeline.errors == 0
    _, during = steady_rate(timeline, 3.5, 5.0)
    assert during > 150  # failing open (failure_mode: open) once the ratios went stale
    # The restarted Redis starts with full buckets (one burst of the limit), and nodes
    # reconnect within a backoff of at most 1.5 s: measure once that has passed.
    _, after = steady_rate(timeline, 8.5, 11.0)
    assert after == pytest.approx(100, rel=0.2)


def test_frozen_redis_keeps_the_last_rate(redis_server, fleet_dir: Path) -> None:
    """While syncs fail (Redis frozen, shorter than the staleness bound), buckets keep
    admitting at their last rate: neither running dry (0 admitted) nor failing open."""
    config = write_config(fleet_dir, 100, "second", "probabilistic")
    with service_fleet(2, config, redis_server.url) as nodes:
        ports = [n.grpc_port for n in nodes]

        async def scenario() -> Timeline:
            task = asyncio.create_task(drive(ports, [0.6, 0.4], lambda t: 200, 6, "fleet", "k=v"))
            await asyncio.sleep(3.0)  # the scenario: faults at set times of the load's timeline
            redis_server.pause()
            await asyncio.sleep(2.0)
            redis_server.resume()
            return await task

        timeline = asyncio.run(scenario())
    assert timeline.errors == 0
    _, before = steady_rate(timeline, 1.5, 3.0)
    _, frozen = steady_rate(timeline, 3.25, 5.0)
    assert before == pytest.approx(100, rel=0.2)
    assert 50 <= frozen <= 150
