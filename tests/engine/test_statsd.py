"""statsd: the Go service's stat names over UDP, received by a socket the test binds,
after real gRPC calls to a real service."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from ratelimit_harness.fixtures import REPO, RunningService, make_request
from ratelimit_harness.redis import free_port
from ratelimit_service.core.config_model import Mode
from ratelimit_service.engine.stats import Stats
from ratelimit_service.engine.statsd import MAX_DATAGRAM, pack, stat_name

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
RL = "ratelimit.service.rate_limit"
SERVER = "ratelimit_server.ShouldRateLimit"

RULES = """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: h
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: s
    shadow_mode: true
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: user
    detailed_metric: true
    rate_limit: {unit: hour, requests_per_unit: 100}
"""

Starter = Callable[..., Awaitable[RunningService]]
BOTH_MODES = pytest.mark.parametrize(
    "mode", [Mode.EXACT, Mode.PROBABILISTIC], ids=lambda m: m.value
)


class Received:
    """What a statsd agent would have: counters summed, timer samples, datagrams."""

    def __init__(self) -> None:
        self.datagrams: list[bytes] = []
        self.counters: dict[str, int] = {}
        self.timers: dict[str, list[tuple[float, float]]] = {}

    def add(self, datagram: bytes) -> None:
        self.datagrams.append(datagram)
        for line in datagram.decode().split("\n"):
            name, _, rest = line.partition(":")
            fields = rest.split("|")
            value, kind = fields[0], fields[1]
            rate = float(fields[2][1:]) if len(fields) > 2 else 1.0
            if kind == "c":
                assert rate == 1.0, line
                self.counters[name] = self.counters.get(name, 0) + int(value)
            else:
                assert kind == "ms", line
                self.timers.setdefault(name, []).append((float(value), rate))

    def timer_count(self, name: str) -> int:
        """Calls the timer samples stand for: a sample at rate ``1/n`` is ``n`` calls.

        The rate goes on the wire with six significant digits (``@0.333333``), so each
        sample's count is rounded to the whole number of calls it stands for.
        """
        return sum(round(1 / rate) for _, rate in self.timers.get(name, []))


class Agent:
    """A UDP socket on loopback, read on the test's loop."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port = int(self.sock.getsockname()[1])
        self.addr = f"127.0.0.1:{self.port}"

    async def receive(
        self, until: Callable[[Received], bool] | None = None, timeout: float = 10.0
    ) -> Received:
        """Datagrams until ``until`` holds (or, without it, until none came for 0.3 s)."""
        received = Received()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            if until is not None and until(received):
                return received
            wait = 0.3 if until is None else deadline - loop.time()
            try:
                datagram = await asyncio.wait_for(loop.sock_recv(self.sock, 65536), wait)
            except TimeoutError:
                if until is None:
                    return received
                break
            received.add(datagram)
        assert until is None or until(received), f"not received in time: {received.counters}"
        return received

    def receive_blocking(self, until: Callable[[Received], bool], timeout: float) -> Received:
        received = Received()
        deadline = time.monotonic() + timeout
        self.sock.settimeout(0.2)
        while not until(received) and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                received.add(self.sock.recv(65536))
        return received


@pytest.fixture
def agent() -> Iterator[Agent]:
    receiver = Agent()
    yield receiver
    receiver.sock.close()


@pytest.fixture
def start(write_config: Callable[..., Path], start_service: Starter, agent: Agent) -> Starter:
    async def run(mode: Mode = Mode.EXACT, **settings: Any) -> RunningService:
        settings.setdefault("statsd_addr", agent.addr)
        settings.setdefault("statsd_flush_interval", 3600.0)  # flushed by the test
        settings.setdefault("sync_interval", 30.0)
        settings.setdefault("stale_after", 300.0)
        return await start_service(write_config(RULES), mode=mode, **settings)

    return run


# -- counts after real calls ------------------------------------------------------------


@BOTH_MODES
async def test_names_and_counts_after_grpc_calls(start: Starter, agent: Agent, mode: Mode) -> None:
    svc = await start(mode, statsd_flush_interval=0.1)  # flushed by its own timer
    codes = [(await svc.call("d", [("k", "x")])).overall_code for _ in range(12)]
    assert codes == [OK] * 10 + [OVER] * 2
    for hits, expected in [(7, OK), (3, OK), (1, OVER)]:
        assert (await svc.call("d", [("h", "x")], hits_addend=hits)).overall_code == expected
    for _ in range(5):
        assert (await svc.call("d", [("s", "x")])).overall_code == OK
    for _ in range(3):
        assert (await svc.call("nope", [("k", "x")])).overall_code == OK
    for bad in (make_request("", [("k", "x")]), make_request("d")):
        with pytest.raises(grpc.aio.AioRpcError):
            await svc.stub.ShouldRateLimit(bad)
    total = 12 + 3 + 5 + 3 + 2

    got = await agent.receive(lambda r: r.counters.get(f"{SERVER}.total_requests", 0) >= total)
    for datagram in (await agent.receive()).datagrams:  # later flushes must add nothing
        got.add(datagram)
    expected = {
        f"{RL}.d.k.total_hits": 12,
        f"{RL}.d.k.within_limit": 10,
        f"{RL}.d.k.near_limit": 2,
        f"{RL}.d.k.over_limit": 2,
        f"{RL}.d.h.total_hits": 11,
        f"{RL}.d.h.within_limit": 10,
        f"{RL}.d.h.near_limit": 2,
        f"{RL}.d.h.over_limit": 1,
        f"{RL}.d.s.total_hits": 5,
        f"{RL}.d.s.within_limit": 3,
        f"{RL}.d.s.near_limit": 1,
        f"{RL}.d.s.shadow_mode": 2,
        f"{RL}.d.s.over_limit": 2,
        f"{RL}.nope.domain_not_found": 3,
        "ratelimit.service.config_load_success": 1,
        "ratelimit.service.call.should_rate_limit.service_error": 2,
        f"{SERVER}.total_requests": total,
    }
    # Every counter the service holds, under the Go name: nothing missing, nothing else
    # (a counter that stayed 0 sends no line).
    assert got.counters == expected
    assert got.timer_count(f"{SERVER}.response_time") == total
    for value, _ in got.timers[f"{SERVER}.response_time"]:
        assert 0 < value < 1000  # milliseconds
    assert all(len(d) <= MAX_DATAGRAM for d in got.datagrams)


async def test_each_flush_sends_what_changed_since_the_last(start: Starter, agent: Agent) -> None:
    svc = await start()
    sink = svc.service.statsd
    assert sink is not None
    for _ in range(3):
        await svc.call("d", [("k", "x")])
    assert await sink.flush() == 1
    first = await agent.receive()
    assert first.counters[f"{RL}.d.k.total_hits"] == 3
    assert first.counters[f"{SERVER}.total_requests"] == 3
    assert first.counters["ratelimit.service.config_load_success"] == 1
    for _ in range(2):
        await svc.call("d", [("k", "x")])
    await sink.flush()
    second = await agent.receive()
    assert second.counters == {
        f"{RL}.d.k.total_hits": 2,
        f"{RL}.d.k.within_limit": 2,
        f"{SERVER}.total_requests": 2,
    }
    assert second.timer_count(f"{SERVER}.response_time") == 2
    assert await sink.flush() == 0  # nothing changed: nothing sent
    assert (await agent.receive()).datagrams == []


async def test_stop_sends_the_last_counts(start: Starter, agent: Agent) -> None:
    svc = await start()
    for _ in range(4):
        await svc.call("d", [("h", "x")])
    await svc.service.stop()
    got = await agent.receive()
    assert got.counters[f"{RL}.d.h.total_hits"] == 4
    assert got.counters[f"{SERVER}.total_requests"] == 4


async def test_config_reloads_are_counted(
    start: Starter, agent: Agent, write_config: Callable[..., Path]
) -> None:
    svc = await start()
    directory = Path(svc.service.settings.config_path)
    (directory / "rules.yaml").write_text("domain: d\ndescriptors:\n  - key: [\n")
    assert svc.service.watcher.reload() is False
    (directory / "rules.yaml").write_text(RULES)
    assert svc.service.watcher.reload() is True
    assert svc.service.statsd is not None
    await svc.service.statsd.flush()
    got = await agent.receive()
    assert got.counters["ratelimit.service.config_load_error"] == 1
    assert got.counters["ratelimit.service.config_load_success"] == 2  # start + reload


async def test_many_keys_are_packed_into_datagrams_of_at_most_1432_bytes(
    start: Starter, agent: Agent
) -> None:
    svc = await start()
    for index in range(300):  # detailed_metric: one stats key per value
        await svc.call("d", [("user", f"u{index:03d}")])
    assert svc.service.statsd is not None
    sent = await svc.service.statsd.flush()
    got = await agent.receive()
    assert sent == len(got.datagrams) > 1
    assert max(len(d) for d in got.datagrams) <= MAX_DATAGRAM
    # Packed: every datagram but the last is full enough that the next line did not fit.
    for datagram, following in zip(got.datagrams, got.datagrams[1:], strict=False):
        assert len(datagram) + 1 + len(following.split(b"\n")[0]) > MAX_DATAGRAM
    for index in range(300):
        assert got.counters[f"{RL}.d.user_u{index:03d}.total_hits"] == 1


async def test_statsd_separators_in_values_are_replaced(start: Starter, agent: Agent) -> None:
    svc = await start()
    await svc.call("d", [("user", "10.0.0.1:80|x")])
    assert svc.service.statsd is not None
    await svc.service.statsd.flush()
    got = await agent.receive()
    assert got.counters[f"{RL}.d.user_10.0.0.1_80_x.total_hits"] == 1


async def test_an_unreachable_agent_drops_the_flush_and_the_service_goes_on(
    start: Starter,
) -> None:
    svc = await start(statsd_addr="nowhere.invalid:8125")
    sink = svc.service.statsd
    assert sink is not None
    await svc.call("d", [("k", "x")])
    assert await sink.flush() == 0
    assert sink.datagrams_dropped == 1 and sink.datagrams_sent == 0
    assert (await svc.call("d", [("k", "x")])).overall_code == OK


# -- packing and names ------------------------------------------------------------------


def test_pack_fills_datagrams_up_to_the_limit_and_keeps_the_order() -> None:
    lines = [f"metric.{i}:1|c" for i in range(10)]  # 12 bytes each
    assert pack(lines, limit=12 * 3 + 2) == [
        "\n".join(lines[0:3]).encode(),
        "\n".join(lines[3:6]).encode(),
        "\n".join(lines[6:9]).encode(),
        lines[9].encode(),
    ]
    assert pack(lines, limit=12 * 3 + 1)[0] == "\n".join(lines[0:2]).encode()
    assert pack([]) == []


def test_a_line_longer_than_a_datagram_travels_alone() -> None:
    long = "x" * 2000 + ":1|c"
    assert pack(["a:1|c", long, "b:1|c"]) == [b"a:1|c", long.encode(), b"b:1|c"]


def test_stat_names() -> None:
    assert stat_name("d.k_a:b|c\nd\re") == "d.k_a_b_c_d_e"
    assert stat_name("d.route_/api/*") == "d.route_/api/*"


def test_counters_that_went_back_count_from_zero() -> None:
    from ratelimit_service.engine.statsd import StatsdDeltas

    stats = Stats()
    deltas = StatsdDeltas(stats)
    stats.rule("d.k").total_hits = 5
    assert deltas.lines() == [f"{RL}.d.k.total_hits:5|c"]
    stats.rules.clear()
    stats.rule("d.k").total_hits = 2
    assert deltas.lines() == [f"{RL}.d.k.total_hits:2|c"]


def test_response_time_samples_fall_in_their_buckets() -> None:
    from ratelimit_service.engine.statsd import StatsdDeltas

    stats = Stats()
    deltas = StatsdDeltas(stats)
    for seconds in (0.0002, 0.0003, 0.003, 0.004, 0.004):
        stats.latency.observe(seconds)
    lines = deltas.lines()
    # Mean 2.3 ms, held inside each bucket: (0, 0.5] ms for the two fast calls,
    # (2.5, 5] ms for the three others.
    assert lines == [
        f"{SERVER}.response_time:0.5|ms|@0.5",
        f"{SERVER}.response_time:2.5|ms|@0.333333",
    ]
    assert deltas.lines() == []


# -- the command line -------------------------------------------------------------------


@pytest.mark.slow  # starts a process
def test_serve_with_the_statsd_address_from_the_environment(
    write_config: Callable[..., Path], agent: Agent
) -> None:
    grpc_at, admin_at = free_port(), free_port()
    env = {
        **os.environ,
        "RATELIMIT_STATSD_ADDR": agent.addr,
        "RATELIMIT_STATSD_FLUSH_INTERVAL": "0.2",
    }
    process = subprocess.Popen(
        [
            sys.executable, "-m", "ratelimit_service", "serve",
            "--config", str(write_config(RULES)), "--mode", "exact",
            "--grpc-addr", f"127.0.0.1:{grpc_at}", "--admin-addr", f"127.0.0.1:{admin_at}",
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_at}") as channel:
            grpc.channel_ready_future(channel).result(timeout=20)
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            for _ in range(11):
                stub.ShouldRateLimit(make_request("d", [("k", "cli")]), timeout=5)
        got = agent.receive_blocking(
            lambda r: r.counters.get(f"{RL}.d.k.total_hits", 0) >= 11, timeout=10
        )
        assert got.counters[f"{RL}.d.k.total_hits"] == 11
        assert got.counters[f"{RL}.d.k.over_limit"] == 1
        assert got.counters[f"{SERVER}.total_requests"] == 11
    finally:
        process.kill()
        process.wait()
