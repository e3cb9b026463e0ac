"""Fleet accuracy harness: N service processes on one Redis, open-loop skewed traffic.

Starts redis-server (unless --redis-url is given) and N `ratelimit-service serve`
processes, sends requests at a scheduled rate split across the processes by
--skew, and records per time bucket how many were offered and admitted.

    python bench/fleet.py --nodes 3 --limit 300 --rate 600 --seconds 10 --skew 0.6,0.3,0.1

Writes a CSV (--csv) with one row per --bucket seconds and prints a summary. Used
by tests/test_fleet.py (short runs) and docs/benchmarks.md (long runs).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from ratelimit_service.client import build_request

OVER_LIMIT = 2


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(directory)],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_port(port)
        yield f"redis://127.0.0.1:{port}/0", process
    finally:
        process.kill()
        process.wait()


def wait_port(port: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def wait_healthy(admin_port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    url = f"http://127.0.0.1:{admin_port}/healthcheck"
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=0.5) as response:
                if response.status == 200:
                    return
        time.sleep(0.1)
    raise RuntimeError(f"service with admin port {admin_port} never became healthy")


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    grpc_port: int
    admin_port: int


@contextlib.contextmanager
def service_fleet(
    count: int, config: Path, redis_url: str, extra: Sequence[str] = ()
) -> Iterator[list[Node]]:
    nodes: list[Node] = []
    try:
        for _ in range(count):
            grpc_port, admin_port = free_port(), free_port()
            process = subprocess.Popen(
                [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(config),
                 "--grpc-addr", f"127.0.0.1:{grpc_port}",
                 "--admin-addr", f"127.0.0.1:{admin_port}", "--redis-url", redis_url, *extra],
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            nodes.append(Node(process, grpc_port, admin_port))
        for node in nodes:
            wait_healthy(node.admin_port)
        yield nodes
    finally:
        for node in nodes:
            node.process.send_signal(signal.SIGTERM)
        for node in nodes:
            try:
                node.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                node.process.kill()


@dataclass
class Timeline:
    bucket: float
    offered: dict[int, int] = field(default_factory=dict)
    admitted: dict[int, int] = field(default_factory=dict)
    errors: int = 0
    latencies: list[float] = field(default_factory=list)

    def record(self, at: float, admitted: bool, latency: float) -> None:
        index = int(at / self.bucket)
        self.offered[index] = self.offered.get(index, 0) + 1
        if admitted:
            self.admitted[index] = self.admitted.get(index, 0) + 1
        self.latencies.append(latency)

    def rows(self) -> list[tuple[float, int, int]]:
        last = max(self.offered, default=-1)
        return [
            (i * self.bucket, self.offered.get(i, 0), self.admitted.get(i, 0))
            for i in range(last + 1)
        ]


async def drive(
    ports: Sequence[int],
    skew: Sequence[float],
    rate_at: callable,  # type: ignore[valid-type]
    seconds: float,
    domain: str,
    descriptor: str,
    bucket: float = 0.25,
) -> Timeline:
    """Open-loop traffic: request i is sent at its scheduled time whatever the answers."""
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in ports]
    stubs = [rls_pb2_grpc.RateLimitServiceStub(channel) for channel in channels]
    request = build_request(domain, [descriptor], 0)
    timeline = Timeline(bucket)
    weights = [w / sum(skew) for w in skew]
    debt = [0.0] * len(stubs)
    tasks: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def one(stub: rls_pb2_grpc.RateLimitServiceStub, at: float) -> None:
        sent = loop.time()
        try:
            response = await stub.ShouldRateLimit(request, timeout=2)
        except grpc.aio.AioRpcError:
            timeline.errors += 1
            return
        timeline.record(at, response.overall_code != OVER_LIMIT, loop.time() - sent)

    now = 0.0
    tick = 0.002
    while now < seconds:
        rate = rate_at(now)
        for index, weight in enumerate(weights):
            debt[index] += rate * weight * tick
            while debt[index] >= 1:
                debt[index] -= 1
                task = asyncio.create_task(one(stubs[index], now))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        now += tick
        # Always yield, even when behind schedule, so responses get processed.
        await asyncio.sleep(max(0.0, start + now - loop.time()))
    if tasks:
        await asyncio.gather(*tasks)
    for channel in channels:
        await channel.close()
    return timeline


def write_config(directory: Path, limit: int, unit: str, mode: str) -> Path:
    path = directory / "fleet.yaml"
    path.write_text(
        f"domain: fleet\ndescriptors:\n  - key: k\n    mode: {mode}\n"
        f"    rate_limit: {{unit: {unit}, requests_per_unit: {limit}}}\n"
    )
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--limit", type=int, default=300, help="requests per second")
    parser.add_argument("--rate", type=float, default=600, help="offered requests per second")
    parser.add_argument("--step-to", type=float, default=None, help="rate after --step-at")
    parser.add_argument("--step-at", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--skew", default="0.6,0.3,0.1")
    parser.add_argument("--mode", default="probabilistic")
    parser.add_argument("--sync-interval", default="0.25")
    parser.add_argument("--bucket", type=float, default=0.25)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed")
    skew = [float(x) for x in args.skew.split(",")][: args.nodes]

    def rate_at(t: float) -> float:
        if args.step_to is not None and t >= args.step_at:
            return float(args.step_to)
        return float(args.rate)

    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as (url, _):
        config = write_config(Path(tmp), args.limit, "second", args.mode)
        with service_fleet(args.nodes, config, url, ["--sync-interval", args.sync_interval]) as nodes:
            timeline = asyncio.run(
                drive([n.grpc_port for n in nodes], skew, rate_at, args.seconds, "fleet", "k=v",
                      args.bucket)
            )
    rows = timeline.rows()
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["t", "offered", "admitted"])
            writer.writerows(rows)
    steady = rows[int(2 / args.bucket):]
    offered = sum(r[1] for r in steady)
    admitted = sum(r[2] for r in steady)
    span = len(steady) * args.bucket
    print(f"errors={timeline.errors} steady offered/s={offered / span:.1f} "
          f"admitted/s={admitted / span:.1f} limit={args.limit} "
          f"ratio={admitted / span / args.limit:.3f}")
    lat = sorted(timeline.latencies)
    if lat:
        print(f"latency p50={lat[len(lat) // 2] * 1000:.2f} ms p99={lat[int(len(lat) * 0.99)] * 1000:.2f} ms")
    for t, o, a in rows:
        print(f"{t:6.2f} offered={o:5d} admitted={a:5d}")


if __name__ == "__main__":
    main()
