"""Zones with real processes: two zones (a redis-server each) under a global
redis-server, two ``serve --zone`` replicas per zone, in both modes. The fleet's limit
holds across the zones; the global store killed and restarted; the aggregator killed
(the other replica of its zone takes the lease); a replica restarted.

Intervals are shortened (replicas publish every 0.25 s, zones every 0.5 s, simulated
Envoys report every second) so that each step settles in seconds."""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from ratelimit_harness.envoy import ServiceProcess
from ratelimit_harness.envoy_fixtures import scrape
from ratelimit_harness.redis import RedisServer
from ratelimit_harness.rlqs_sim import SimEnvoy, StreamingEnvoy
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.cli.client import build_request

pytestmark = [pytest.mark.slow, pytest.mark.serial]  # starts processes; timing: run alone

ZONE_INTERVAL = 0.5
LIMIT = 1000
RULES = f"""\
domain: q
descriptors:
  - key: tenant
    rate_limit: {{unit: second, requests_per_unit: {LIMIT}}}
  - key: prob
    mode: probabilistic
    rate_limit: {{unit: second, requests_per_unit: 300}}
"""
OVER_LIMIT = 2


@pytest.fixture
def zones(tmp_path: Path) -> Iterator[tuple[dict[str, RedisServer], dict[str, ServiceProcess]]]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "q.yaml").write_text(RULES)
    servers = {name: RedisServer(tmp_path) for name in ("a", "b", "global")}
    replicas: dict[str, ServiceProcess] = {}
    try:
        for server in servers.values():
            server.start()
        for name in ("a1", "a2", "b1", "b2"):
            replicas[name] = ServiceProcess(
                rules, tmp_path / name, "--zone", name[0],
                "--redis-url", servers[name[0]].url,
                "--global-redis-url", servers["global"].url,
                "--zone-interval", str(ZONE_INTERVAL), "--rlqs-publish-interval", "0.25",
            ).start()  # fmt: skip
        yield servers, replicas
    finally:
        for replica in replicas.values():
            if replica.process is not None and replica.process.poll() is None:
                replica.kill()
        for server in servers.values():
            server.stop()


def store_stat(replica: ServiceProcess, name: str) -> float:
    return scrape(replica)[f'ratelimit_store{{name="{name}",store="zoned"}}']


def zone_part(server: RedisServer, zone: str) -> float:
    client = redis.Redis(port=server.port)
    try:
        (key,) = client.zrange(f"rl:zone:{zone}:counters", 0, -1)
        return int(client.hget(key, "Z") or 0) / 1000
    finally:
        client.close()


def within(envoys: list[StreamingEnvoy], low: float = 0.9, high: float = 1.05) -> bool:
    return low * LIMIT <= sum(e.envoy.assigned_rate() for e in envoys) <= high * LIMIT


async def test_rlqs_zones_hold_one_limit_through_failures(zones) -> None:
    servers, replicas = zones
    address = {name: f"127.0.0.1:{r.grpc_port}" for name, r in replicas.items()}
    envoys = []
    for n in range(8):  # zone a's four Envoys ask 400/s each, zone b's 200/s
        home = ("a1", "a2", "b1", "b2")[n % 4]
        other = {"a1": "a2", "a2": "a1", "b1": "b2", "b2": "b1"}[home]
        sim = SimEnvoy(f"envoy-{n}", 400 if home[0] == "a" else 200)
        envoys.append(StreamingEnvoy(sim, [address[home], address[other]], "q", {"tenant": "t"}))
    for envoy in envoys:
        envoy.start()
    try:
        # 1,600/s against 800/s asked: the zones' parts are 2:1.
        await eventually_async(
            lambda: within(envoys)
            and abs(zone_part(servers["a"], "a") / (LIMIT * 2 / 3) - 1) < 0.1
            and abs(zone_part(servers["b"], "b") / (LIMIT / 3) - 1) < 0.1,
            timeout=30, what="the fleet at its limit, the zones' parts 2:1",
        )  # fmt: skip

        # The global store dies: each zone keeps its part.
        parts = (zone_part(servers["a"], "a"), zone_part(servers["b"], "b"))
        servers["global"].stop()
        await eventually_async(
            lambda: any(store_stat(r, "zone_global_away") for r in replicas.values()),
            timeout=10, what="an aggregator to see the global store away",
        )  # fmt: skip
        for _ in range(3):  # the subject: the limit holds, looked at over three seconds
            await asyncio.sleep(1.0)
            assert within(envoys, 0.85, 1.05)
        assert (zone_part(servers["a"], "a"), zone_part(servers["b"], "b")) == parts
        servers["global"].start()  # back, and empty
        await eventually_async(
            lambda: not any(store_stat(r, "zone_global_away") for r in replicas.values())
            and within(envoys), timeout=30, what="the zones back on the global store",
        )  # fmt: skip

        # The aggregator of zone a dies: the other replica takes its lease.
        (leader,) = [n for n in ("a1", "a2") if store_stat(replicas[n], "zone_aggregating")]
        follower = "a2" if leader == "a1" else "a1"
        replicas[leader].kill()
        killed_at = time.monotonic()
        await eventually_async(
            lambda: store_stat(replicas[follower], "zone_aggregating") == 1,
            timeout=10, what=f"{follower} to take zone a's lease",
        )  # fmt: skip
        assert time.monotonic() - killed_at <= 2 * ZONE_INTERVAL + 1.0  # with scrape slack
        assert store_stat(replicas[follower], "zone_takeovers") == 1
        await eventually_async(lambda: within(envoys), timeout=30, what="the limit again")

        # The replica comes back (its Envoys stay where they moved): nothing changes.
        replicas[leader].start()
        await asyncio.sleep(2 * ZONE_INTERVAL)  # an absence (no lease taken back): nothing to await
        assert store_stat(replicas[leader], "zone_aggregating") == 0
        await eventually_async(lambda: within(envoys), timeout=30, what="the limit, still")
    finally:
        for envoy in envoys:
            await envoy.stop()


async def offer(stubs: dict[str, rls_pb2_grpc.RateLimitServiceStub], rates: dict[str, int],
                seconds: float) -> int:  # fmt: skip
    """Open loop: each replica gets its rate of requests for ``seconds``, in 20 ms
    ticks; returns how many were admitted."""
    request = build_request("q", ["prob=p"], 1)
    admitted = 0

    async def one(stub: rls_pb2_grpc.RateLimitServiceStub) -> None:
        nonlocal admitted
        answer = await stub.ShouldRateLimit(request, timeout=2)
        admitted += answer.overall_code != OVER_LIMIT

    tick, calls = 0.02, []
    start = time.monotonic()
    for step in range(round(seconds / tick)):
        for name, rate in rates.items():
            calls += [asyncio.ensure_future(one(stubs[name])) for _ in range(round(rate * tick))]
        await asyncio.sleep(max(0.0, start + (step + 1) * tick - time.monotonic()))  # pacing
    await asyncio.gather(*calls)
    return admitted


async def test_probabilistic_zones_hold_one_limit_through_failures(zones) -> None:
    servers, replicas = zones
    rates = {"a1": 200, "a2": 200, "b1": 100, "b2": 100}  # 600/s against 300/s
    channels: dict[str, grpc.aio.Channel] = {}

    def stubs() -> dict[str, rls_pb2_grpc.RateLimitServiceStub]:
        for name, replica in replicas.items():
            if name not in channels:
                channels[name] = grpc.aio.insecure_channel(f"127.0.0.1:{replica.grpc_port}")
        return {n: rls_pb2_grpc.RateLimitServiceStub(c) for n, c in channels.items()}

    async def at_the_limit(what: str) -> None:
        await offer(stubs(), rates, 3.0)  # demands and parts settle
        admitted = await offer(stubs(), rates, 4.0)
        assert 0.85 * 300 * 4 <= admitted <= 1.15 * 300 * 4, (what, admitted)

    try:
        await at_the_limit("both zones up")
        client = redis.Redis(port=servers["a"].port)
        (key,) = client.zrange("rl:zone:a:buckets", 0, -1)
        assert int(client.hget(key, "Z")) / 1000 == pytest.approx(200, rel=0.15)
        client.close()

        servers["global"].stop()  # the zones keep their parts
        admitted = await offer(stubs(), rates, 4.0)
        assert 0.85 * 300 * 4 <= admitted <= 1.15 * 300 * 4
        assert any(store_stat(r, "zone_global_away") for r in replicas.values())
        servers["global"].start()
        await at_the_limit("the global store back")
        assert not any(store_stat(r, "zone_global_away") for r in replicas.values())

        # Zone a's aggregator dies; its clients move to the other replica of the zone.
        (leader,) = [n for n in ("a1", "a2") if store_stat(replicas[n], "zone_aggregating")]
        follower = "a2" if leader == "a1" else "a1"
        replicas[leader].kill()
        await channels.pop(leader).close()
        moved = rates.pop(leader)
        rates[follower] += moved
        await eventually_async(
            lambda: store_stat(replicas[follower], "zone_aggregating") == 1,
            timeout=10, what=f"{follower} to take zone a's lease",
        )  # fmt: skip
        await at_the_limit("zone a on one replica")

        # The replica comes back and takes its clients again.
        replicas[leader].start()
        rates[follower] -= moved
        rates[leader] = moved
        await at_the_limit("the replica back")
    finally:
        for channel in channels.values():
            await channel.close()
