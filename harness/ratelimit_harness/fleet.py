"""Start a real redis-server and N real service processes, and drive open-loop traffic.

Open loop: request i leaves at its scheduled time whatever happened to earlier ones,
so a slow or denying service cannot slow the offered rate down (a closed loop would
hide overload). Each answer is recorded in the time bucket of its send time.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from ratelimit_harness.redis import RedisServer, free_port
from ratelimit_harness.waiting import eventually
from ratelimit_service.cli.client import build_request

OVER_LIMIT = 2
SHOULD_RATE_LIMIT = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[RedisServer]:
    server = RedisServer(directory)
    server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            server.resume()
        server.stop()


def wait_port(port: int, timeout: float = 15.0) -> None:
    """Until something accepts connections on ``port`` (loopback)."""

    def accepts() -> bool:
        socket.create_connection(("127.0.0.1", port), 0.2).close()
        return True

    eventually(accepts, timeout=timeout, what=f"something listening on port {port}")


def wait_healthy(
    admin_port: int,
    timeout: float = 20.0,
    context: Callable[[], str] | None = None,
    process: subprocess.Popen[bytes] | None = None,
) -> None:
    """Until the service's /healthcheck answers 200; ``context`` (its log, say) goes into
    the error when it does not. With its ``process``: an error at once if it exited."""
    url = f"http://127.0.0.1:{admin_port}/healthcheck"

    def healthy() -> bool:
        if process is not None and process.poll() is not None:
            extra = f"\n{context()}" if context is not None else ""
            raise RuntimeError(f"service exited with {process.returncode} before healthy{extra}")
        with urllib.request.urlopen(url, timeout=0.5) as response:
            return bool(response.status == 200)

    what = f"service with admin port {admin_port} healthy"
    eventually(healthy, timeout=timeout, what=what, context=context)


@dataclass
class Node:
    process: subprocess.Popen[bytes]
    grpc_port: int
    admin_port: int


@contextlib.contextmanager
def service_fleet(
    count: int,
    config: Path,
    redis_url: str | None,
    extra: Sequence[str] = (),
    each: Sequence[Sequence[str]] = (),
) -> Iterator[list[Node]]:
    """``count`` service processes on ``redis_url`` (None: the embedded store, or the
    stores ``each`` names); ``each``: more arguments for each process in turn."""
    nodes: list[Node] = []
    try:
        for n in range(count):
            grpc_port, admin_port = free_port(), free_port()
            process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ratelimit_service",
                    "serve",
                    "--config",
                    str(config),
                    "--grpc-addr",
                    f"127.0.0.1:{grpc_port}",
                    "--admin-addr",
                    f"127.0.0.1:{admin_port}",
                    *(["--redis-url", redis_url] if redis_url else []),
                    *extra,
                    *(each[n] if n < len(each) else ()),
                ],
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
            nodes.append(Node(process, grpc_port, admin_port))
        for node in nodes:
            wait_healthy(node.admin_port, process=node.process)
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
    admitted_at: list[float] = field(default_factory=list)

    def record(self, at: float, admitted: bool, latency: float) -> None:
        index = int(at / self.bucket)
        self.offered[index] = self.offered.get(index, 0) + 1
        if admitted:
            self.admitted[index] = self.admitted.get(index, 0) + 1
            self.admitted_at.append(at)
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
    rate_at: Callable[[float], float],
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
        timeline.record(sent - start, response.overall_code != OVER_LIMIT, loop.time() - sent)

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


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@contextlib.contextmanager
def cpu_hog(seconds: float = 300.0) -> Iterator[None]:
    """A busy-loop process beside the services, as on any busy node."""
    process = multiprocessing.get_context("spawn").Process(target=_spin, args=(seconds,))
    process.start()
    try:
        yield
    finally:
        process.terminate()
        process.join(5)


def scrape(admin_port: int) -> dict[str, float]:
    """Every sample of a service's /metrics, by its name and labels as printed."""
    url = f"http://127.0.0.1:{admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def histogram_over(samples: dict[str, float], histogram: str, bound: str) -> int:
    """How many observations of a histogram in ``samples`` (as :func:`scrape` returns
    them) lie above one of its bucket bounds (``bound`` as /metrics prints it)."""
    return int(samples[f"{histogram}_count"] - samples[f'{histogram}_bucket{{le="{bound}"}}'])


def fleet_sum(admin_ports: Sequence[int], name: str) -> float:
    """A sample summed over several services."""
    return sum(scrape(port).get(name, 0.0) for port in admin_ports)


def rule_counter(admin_ports: Sequence[int], name: str, rule: str) -> float:
    """A per-rule counter (``within_limit``, ``failure_mode_allowed`` ...) summed."""
    return fleet_sum(admin_ports, f'ratelimit_service_rate_limit_{name}_total{{key="{rule}"}}')


async def python_burst(
    ports: Sequence[int],
    domain: str,
    descriptor: str,
    count: int,
    in_flight: int,
    timeout: float | None = 5.0,
) -> Counter[str]:
    """``count`` ShouldRateLimit calls spread round-robin over ``ports``, ``in_flight``
    at a time, from grpc.aio stubs (a client as heavy as a real Python one): each
    outcome's name (OK, OVER_LIMIT, or the gRPC status code) and how many."""
    request = build_request(domain, [descriptor], 0)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in ports]
    stubs = [rls_pb2_grpc.RateLimitServiceStub(channel) for channel in channels]
    gate = asyncio.Semaphore(in_flight)
    outcomes: Counter[str] = Counter()

    async def one(i: int) -> None:
        async with gate:
            try:
                response = await stubs[i % len(stubs)].ShouldRateLimit(request, timeout=timeout)
            except grpc.aio.AioRpcError as exc:
                outcomes[exc.code().name] += 1
            else:
                outcomes[rls_pb2.RateLimitResponse.Code.Name(response.overall_code)] += 1

    try:
        await asyncio.gather(*(one(i) for i in range(count)))
    finally:
        for channel in channels:
            await channel.close()
    return outcomes


@dataclass
class KeyedLoad:
    """What a client saw of :func:`keyed_load`: each call's latency (seconds, in the
    order the calls ended; a failed call's is its time to fail) and the failures by
    gRPC status code."""

    latencies: array.array[float]
    failures: Counter[str]

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

    def over(self, seconds: float) -> int:
        return sum(1 for latency in self.latencies if latency > seconds)


async def keyed_load(
    port: int,
    domain: str,
    key: str,
    keys: int,
    rate: float,
    seconds: float,
    deadline: float | None = 0.020,
) -> KeyedLoad:
    """Open-loop ShouldRateLimit calls at ``rate`` per second for ``seconds``, the
    descriptor ``key=v<i>`` cycling over ``keys`` values, each call with ``deadline``
    (Envoy's 20 ms by default). The client keeps nothing per call that the collector
    would scan (requests as bytes, latencies in an array): its own pauses must not
    pass for the service's."""
    requests = [build_request(domain, [f"{key}=v{i}"], 0).SerializeToString() for i in range(keys)]
    latencies = array.array("d")
    failures: Counter[str] = Counter()
    loop = asyncio.get_running_loop()
    pending: set[asyncio.Task[None]] = set()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(SHOULD_RATE_LIMIT)

        async def one(request: bytes) -> None:
            sent = loop.time()
            try:
                await call(request, timeout=deadline)
            except grpc.aio.AioRpcError as exc:
                failures[exc.code().name] += 1
            latencies.append(loop.time() - sent)

        start = loop.time()
        total = int(rate * seconds)
        for n in range(total):
            due = start + n / rate
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            task = asyncio.ensure_future(one(requests[n % keys]))
            pending.add(task)
            task.add_done_callback(pending.discard)
        if pending:
            await asyncio.gather(*pending)
    return KeyedLoad(latencies, failures)


def rss_bytes(pid: int) -> int:
    """A process's resident set size, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for process {pid}")
