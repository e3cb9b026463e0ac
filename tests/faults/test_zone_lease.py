"""Zones keep one aggregator each through a global store that hangs, answers late or is
cut off, and a deposed aggregator's late write is refused (docs/scale.md, "What each
failure does").

Real processes: two zones (a redis-server each) under a global redis-server, two
``serve --zone`` replicas per zone, each dialling the global store through its own
forwarder (ratelimit_harness/forwarder.py), and eight simulated Envoys on RLQS streams asking
twice the limit (zone a's twice zone b's). Intervals are shortened (zones every 0.5 s,
replicas every 0.25 s, Envoys report every second) so that a fault of 10 s spans twenty
passes.
"""

from __future__ import annotations

import asyncio
import re
import shutil
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis

from ratelimit_harness.envoy import ServiceProcess
from ratelimit_harness.envoy_fixtures import scrape
from ratelimit_harness.forwarder import Forwarder
from ratelimit_harness.redis import RedisServer
from ratelimit_harness.rlqs_sim import SimEnvoy, StreamingEnvoy
from ratelimit_harness.waiting import eventually_async

pytestmark = [pytest.mark.slow, pytest.mark.serial]

ZONE_INTERVAL = 0.5
LIMIT = 1000
RULES = f"""\
domain: q
descriptors:
  - key: tenant
    rate_limit: {{unit: second, requests_per_unit: {LIMIT}}}
"""
FAULT_SECONDS = 10.0
SAMPLE_EVERY = 0.25
NAMES = ("a1", "a2", "b1", "b2")


@dataclass
class Zones:
    servers: dict[str, RedisServer]
    replicas: dict[str, ServiceProcess]
    proxies: dict[str, Forwarder]
    envoys: list[StreamingEnvoy] = field(default_factory=list)

    def stat(self, name: str, stat: str) -> float:
        return scrape(self.replicas[name])[f'ratelimit_store{{name="{stat}",store="zoned"}}']

    def stats(self, stat: str) -> dict[str, float]:
        return {name: self.stat(name, stat) for name in NAMES}

    def aggregators(self) -> dict[str, int]:
        """Replicas that act as their zone's aggregator now, per zone."""
        leading = self.stats("zone_aggregating")
        return {zone: sum(leading[n] > 0 for n in NAMES if n[0] == zone) for zone in "ab"}

    def ratio(self) -> float:
        """The fleet's assigned rate (every Envoy's token bucket) over the limit."""
        return sum(e.envoy.assigned_rate() for e in self.envoys) / LIMIT

    def zone_part(self, zone: str) -> float:
        client = redis.Redis(port=self.servers[zone].port)
        try:
            (key,) = client.zrange(f"rl:zone:{zone}:counters", 0, -1)
            return int(client.hget(key, "Z") or 0) / 1000
        finally:
            client.close()

    def held(self, zone: str) -> float:
        """What ``zone``'s Envoys hold (the n-th Envoy's home is NAMES[n % 4])."""
        envoys = [e for n, e in enumerate(self.envoys) if NAMES[n % 4][0] == zone]
        return sum(e.envoy.assigned_rate() for e in envoys)

    def settled(self) -> bool:
        """The zones' parts 2:1 and each zone's Envoys holding its part: an Envoy keeps
        the bucket it was assigned until its next report, so a zone's part that shrank
        leaves its Envoys over it for up to a report interval."""
        if not 0.9 <= self.ratio() <= 1.05:
            return False  # (before that, a zone store may have no counter yet)
        parts = {zone: self.zone_part(zone) for zone in "ab"}
        return (
            abs(parts["a"] / (LIMIT * 2 / 3) - 1) < 0.1
            and abs(parts["b"] / (LIMIT / 3) - 1) < 0.1
            and all(0.9 <= self.held(zone) / parts[zone] <= 1.05 for zone in "ab")
            and self.aggregators() == {"a": 1, "b": 1}
        )

    def leader(self, zone: str) -> str:
        (name,) = [n for n in NAMES if n[0] == zone and self.stat(n, "zone_aggregating")]
        return name

    def describe(self) -> str:
        """What the zones look like now, for a failure's message."""
        stats = ("zone_aggregating", "zone_takeovers", "zone_lease_lost", "zone_global_away")
        table = {s: self.stats(s) for s in stats}
        parts = {z: self.zone_part(z) for z in "ab"}
        return f"{table}; zone parts {parts}; fleet ratio {self.ratio():.2f}"

    def log(self, name: str) -> str:
        return self.replicas[name].log(tail=1_000_000)


@pytest.fixture
async def zones(tmp_path: Path) -> AsyncIterator[Zones]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "q.yaml").write_text(RULES)
    servers = {name: RedisServer(tmp_path) for name in ("a", "b", "global")}
    for server in servers.values():
        server.start()
    proxies = {name: Forwarder(servers["global"].port) for name in NAMES}
    fleet = Zones(servers, {}, proxies)
    try:
        for name in NAMES:
            proxies[name].wait_ready()
            fleet.replicas[name] = ServiceProcess(
                rules, tmp_path / name, "--zone", name[0],
                "--redis-url", servers[name[0]].url,
                "--global-redis-url", proxies[name].url,
                "--zone-interval", str(ZONE_INTERVAL), "--rlqs-publish-interval", "0.25",
            ).start()  # fmt: skip
        address = {name: f"127.0.0.1:{r.grpc_port}" for name, r in fleet.replicas.items()}
        for n in range(8):  # zone a's four Envoys ask 400/s each, zone b's 200/s
            home = NAMES[n % 4]
            other = {"a1": "a2", "a2": "a1", "b1": "b2", "b2": "b1"}[home]
            sim = SimEnvoy(f"envoy-{n}", 400 if home[0] == "a" else 200)
            envoy = StreamingEnvoy(sim, [address[home], address[other]], "q", {"tenant": "t"})
            fleet.envoys.append(envoy)
            envoy.start()
        await eventually_async(
            fleet.settled, timeout=30, what="the fleet at its limit, the zones' parts 2:1"
        )
        yield fleet
    finally:
        for envoy in fleet.envoys:
            await envoy.stop()
        for replica in fleet.replicas.values():
            if replica.process is not None and replica.process.poll() is None:
                replica.process.send_signal(signal.SIGCONT)
                replica.kill()
        for proxy in proxies.values():
            proxy.stop()
        for server in servers.values():
            if server.process is not None:
                server.resume()
            server.stop()


@dataclass
class Samples:
    aggregators: list[dict[str, int]] = field(default_factory=list)
    ratios: list[float] = field(default_factory=list)

    def figures(self) -> str:
        """The samples in one line, for a failure's message."""
        most = max(max(a.values()) for a in self.aggregators)
        none = sum(min(a.values()) == 0 for a in self.aggregators)
        return (
            f"{len(self.aggregators)} samples: most aggregators in a zone at once {most},"
            f" a zone without one in {none}; fleet ratio {min(self.ratios):.2f}"
            f" to {max(self.ratios):.2f}; ratios {[round(r, 3) for r in self.ratios]};"
            f" per sample {self.aggregators}"
        )


async def sample_for(zones: Zones, seconds: float, samples: Samples) -> None:
    """Every SAMPLE_EVERY: how many replicas aggregate per zone, and the fleet's ratio."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        samples.aggregators.append(zones.aggregators())
        samples.ratios.append(zones.ratio())
        await asyncio.sleep(SAMPLE_EVERY)  # sampling period


@pytest.mark.parametrize("fault", ["hung", "slow", "partitioned"])
async def test_zones_keep_one_aggregator_each_through_a_global_store_fault(
    zones: Zones, fault: str
) -> None:
    """The global store hangs (SIGSTOP: its sockets open, no reply), answers every call
    two intervals late (the proxies delay its replies), or is cut off (the proxies hold
    what the replicas send) for 10 s. Throughout: exactly one aggregator per zone at
    every sample, no takeover, no lease lost, the fleet between 0.8x and 1.15x of the
    limit (the zones keep their parts); then the zones publish again. Each aggregator
    logs the outage once each way, and no traceback."""
    before = {s: zones.stats(s) for s in ("zone_takeovers", "zone_lease_lost")}
    outages = zones.stats("zone_global_outages")
    samples = Samples()
    await sample_for(zones, 1.0, samples)
    if fault == "hung":
        zones.servers["global"].pause()
    for proxy in zones.proxies.values():
        if fault == "slow":
            proxy.delay(2 * ZONE_INTERVAL)
        elif fault == "partitioned":
            proxy.hold()
    await sample_for(zones, FAULT_SECONDS, samples)
    away = zones.stats("zone_global_away")
    if fault == "hung":
        zones.servers["global"].resume()
    for proxy in zones.proxies.values():
        proxy.delay(0.0)
        proxy.release()
    figures = samples.figures()
    assert all(a == {"a": 1, "b": 1} for a in samples.aggregators), figures
    # Envoys' shares are token buckets assigned at each report: a share that grew
    # overlaps for up to a report interval with one not yet shrunk, more so when the
    # simulated Envoys (in this process) report late on a busy machine.
    assert all(0.8 <= r <= 1.15 for r in samples.ratios), figures
    await eventually_async(
        lambda: not any(zones.stats("zone_global_away").values()) and zones.settled(),
        timeout=30, what="the zones back on the global store", context=zones.describe,
    )  # fmt: skip
    await sample_for(zones, 1.0, samples)
    figures = samples.figures()
    assert all(a == {"a": 1, "b": 1} for a in samples.aggregators), figures
    # Envoys' shares are token buckets assigned at each report: a share that grew
    # overlaps for up to a report interval with one not yet shrunk, more so when the
    # simulated Envoys (in this process) report late on a busy machine.
    assert all(0.8 <= r <= 1.15 for r in samples.ratios), figures
    for stat, values in before.items():
        assert zones.stats(stat) == values, (stat, values, zones.stats(stat))
    leaders = [zones.leader("a"), zones.leader("b")]
    assert all(away[n] == 1 for n in leaders), away  # the aggregators saw the fault
    for name in leaders:
        assert zones.stat(name, "zone_global_outages") - outages[name] == 1
        log = zones.log(name)
        assert "Traceback" not in log, log[-3000:]
        assert len(re.findall("the global store is away", log)) == 1, log[-3000:]
        assert len(re.findall("the global store answers again", log)) == 1, log[-3000:]


def global_fences(zones: Zones, zone: str) -> set[int]:
    """The highest fencing token the global store has seen from ``zone``, per counter
    (its RLQS counter and the zones' presence)."""
    client = redis.Redis(port=zones.servers["global"].port)
    try:
        keys = [k for k in client.keys("rl:qt*") if not k.endswith((b":m", b":e"))]
        return {int(client.hget(k, f"f:{zone}") or 0) for k in keys}
    finally:
        client.close()


async def test_a_deposed_aggregators_late_publish_is_refused(zones: Zones) -> None:
    """Zone a's aggregator sends its publish to the global store, the network holds it
    (its proxy), and the process is paused (SIGSTOP) past its lease. The other replica
    takes the lease and publishes with the next token. Then the held publish reaches
    the global store, and the paused aggregator runs again (SIGCONT): the global store
    refuses its publish, it stops aggregating (the refusal counted and logged once
    when it reads it before its call's deadline), and the
    successor's entries stand: the global store's fence for zone a stays at the
    successor's token, and the zone keeps one aggregator."""
    leader = zones.leader("a")
    follower = {"a1": "a2", "a2": "a1"}[leader]
    token = zones.stat(leader, "zone_token")
    passes = zones.stat(follower, "zone_passes")
    proxy, process = zones.proxies[leader], zones.replicas[leader].process
    assert process is not None and token >= 1
    proxy.hold()
    await eventually_async(lambda: proxy.held() > 0, timeout=5, what="the leader's next publish")
    process.send_signal(signal.SIGSTOP)
    try:
        await eventually_async(
            lambda: zones.stat(follower, "zone_aggregating") == 1
            and zones.stat(follower, "zone_passes") > passes,
            timeout=10, what=f"{follower} to take zone a's lease and publish",
        )  # fmt: skip
        successor = zones.stat(follower, "zone_token")
        assert successor > token
        assert global_fences(zones, "a") == {successor}
        proxy.release()  # the held publish reaches the global store now
        await eventually_async(lambda: proxy.held() == 0, timeout=5, what="the held bytes sent")
    finally:
        process.send_signal(signal.SIGCONT)
    # Woken, the deposed aggregator hears its publish refused, or (its deadline having
    # passed while it was stopped, on a busy machine) gives the call up and hears from
    # the zone's lease that it lost it. Either way it stops; the global store refused
    # the publish in both (its fence stays at the successor's token, below).
    await eventually_async(
        lambda: zones.stat(leader, "zone_aggregating") == 0
        and zones.stat(leader, "zone_fenced") + zones.stat(leader, "zone_lease_lost") >= 1,
        timeout=10, what="the deposed aggregator to step down", context=zones.describe,
    )  # fmt: skip
    heard_refusal = zones.stat(leader, "zone_fenced") == 1
    assert global_fences(zones, "a") == {zones.stat(follower, "zone_token")}
    assert zones.stat(leader, "zone_aggregating") == 0
    assert zones.stat(leader, "zone_passes_abandoned") == 0  # it did send it
    await sample_for(zones, 2.0, samples := Samples())
    assert all(a == {"a": 1, "b": 1} for a in samples.aggregators), samples.figures()
    assert zones.leader("a") == follower and zones.stat(follower, "zone_fenced") == 0
    log = zones.log(leader)
    assert "Traceback" not in log, log[-3000:]
    refusals = re.findall(r"the global store refused its write with token (\d+)", log)
    assert refusals == ([str(int(token))] if heard_refusal else []), log[-3000:]
