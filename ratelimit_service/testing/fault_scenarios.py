"""Store faults staged as they happen in production, under load, with real processes:
one function per fault, shared by the fault tests (tests/faults/) and the longer runs
of bench/faults.py.

Each scenario starts a service process on real redis-servers (behind a TCP forwarder
where the fault needs one), runs a :class:`~ratelimit_service.testing.faults.Probe`
with Envoy's 20 ms deadline, lets ``CONTROL`` seconds of load pass (the control: what
the machine alone makes miss), stages the fault, measures how long after the store can
answer again it decides again, lets a second of load pass, and returns a
:class:`FaultRun` that says what the client saw.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ratelimit_service.testing.envoy import ServiceProcess
from ratelimit_service.testing.faults import (
    FAULTS_CONFIG,
    Probe,
    store_decides,
    touch_probabilistic,
)
from ratelimit_service.testing.fleet import scrape
from ratelimit_service.testing.forwarder import Forwarder
from ratelimit_service.testing.redis import RedisCluster, RedisSentinelSetup, RedisServer
from ratelimit_service.testing.waiting import eventually_async

CONTROL = 2.0
"""Seconds of load before each fault: the control."""
CONTROL_FROM = 0.5
"""The probe's first half second (connections, the first calls) is not the control."""
AFTER = 1.0
"""Seconds of load after the store decides again."""
RECOVERY_LIMIT = 15.0
"""Seconds a scenario waits for the store to decide again before it gives up."""


def store_metric(name: str) -> str:
    """The sample name of one of the Redis store's numbers in /metrics."""
    return f'ratelimit_store{{name="{name}",store="redis"}}'


@dataclass
class FaultRun:
    fault: str
    probe: Probe
    fault_at: float
    """When the fault began, on the probe's clock."""
    recovery: float
    """Seconds from the store being able to answer again to the service deciding by it
    (inf: not within RECOVERY_LIMIT)."""
    log: str
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    """/metrics at moments the scenario names ("during", "later", "end")."""

    @property
    def control_share(self) -> float:
        """Share of the calls before the fault that missed their deadline."""
        before = self.probe.between(CONTROL_FROM, self.fault_at)
        return self.probe.outcomes(before)["DEADLINE_EXCEEDED"] / max(1, len(before))

    @property
    def during(self) -> int:
        return len(self.probe.between(self.fault_at))

    def missed(self) -> list[float]:
        """When each call from the fault on that missed its deadline was sent."""
        return [
            round(c.sent, 2)
            for c in self.probe.between(self.fault_at)
            if c.outcome == "DEADLINE_EXCEEDED"
        ]

    def errors(self) -> dict[str, int]:
        """Outcomes other than OK and a missed deadline (the load rule never denies)."""
        outcomes = self.probe.outcomes(self.probe.calls)
        return {k: v for k, v in outcomes.items() if k not in ("OK", "DEADLINE_EXCEEDED")}

    def row(self) -> dict[str, object]:
        """The figures for a table."""
        return {
            "fault": self.fault,
            "calls": len(self.probe.calls),
            "missed_control": f"{self.control_share:.2%}",
            "missed_fault": f"{len(self.missed()) / max(1, self.during):.2%}",
            "recovery_s": round(self.recovery, 2),
            "errors": sum(self.errors().values()),
            "tracebacks": self.log.count("Traceback"),
        }


async def _until_decides(service: ServiceProcess, probe: Probe, values: int = 1) -> float:
    """Seconds until the store decides exact rules again and a probabilistic sync
    succeeds, from now."""
    start = probe.now()
    await touch_probabilistic(service.grpc_port)
    try:
        await eventually_async(
            lambda: store_decides(service.grpc_port, values),
            timeout=RECOVERY_LIMIT,
            what="the store decides",
        )
        await eventually_async(
            lambda: _syncs(service), timeout=RECOVERY_LIMIT, what="a probabilistic sync"
        )
    except AssertionError:
        return float("inf")
    return probe.now() - start


async def _syncs(service: ServiceProcess) -> bool:
    """Whether the reconciler's syncs succeed now: a round completes with no error."""
    before = await asyncio.to_thread(scrape, service.admin_port)
    rounds = before["ratelimit_sync_rounds_total"]
    while True:
        await asyncio.sleep(0.05)
        after = await asyncio.to_thread(scrape, service.admin_port)
        if after["ratelimit_sync_rounds_total"] > rounds:
            return after["ratelimit_sync_errors_total"] == before["ratelimit_sync_errors_total"]


def _config(directory: Path) -> Path:
    config = directory / "config"
    config.mkdir(parents=True, exist_ok=True)
    (config / "faults.yaml").write_text(FAULTS_CONFIG)
    return config


@contextlib.asynccontextmanager
async def _served(directory: Path, url: str) -> AsyncIterator[tuple[ServiceProcess, Probe]]:
    """A service on ``url`` with a probe running, from the end of the control on."""
    service = ServiceProcess(_config(directory), directory / "service", "--redis-url", url)
    service.start()
    try:
        async with Probe(service.grpc_port) as probe:
            if not await store_decides(service.grpc_port):
                raise RuntimeError("the store does not decide before the fault")
            await asyncio.sleep(CONTROL)
            yield service, probe
    finally:
        service.stop()


async def _finish(
    fault: str, service: ServiceProcess, probe: Probe, fault_at: float, recovery: float
) -> FaultRun:
    """AFTER seconds more of load, then the run with the service's metrics ("end")."""
    await asyncio.sleep(AFTER)
    metrics = await asyncio.to_thread(scrape, service.admin_port)
    return FaultRun(fault, probe, fault_at, recovery, "", {"end": metrics})


@contextlib.contextmanager
def _pair(directory: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and its replica."""
    master, replica = RedisServer(directory), RedisServer(directory)
    master.start()
    try:
        replica.start(10.0, "--replicaof", "127.0.0.1", str(master.port))
        yield master, replica
    finally:
        for server in (master, replica):
            if server.process is not None:
                server.resume()
            server.stop()


async def repointed_failover(directory: Path) -> FaultRun:
    """The replica is promoted and the address moves to it, while the demoted master
    keeps the service's connections (and answers READONLY to every write)."""
    with _pair(directory) as (master, replica), Forwarder(master.port) as forwarder:
        async with _served(directory, f"redis://127.0.0.1:{forwarder.port}") as (service, probe):
            fault_at = probe.now()
            await asyncio.to_thread(replica.cli, "REPLICAOF", "NO", "ONE")
            await asyncio.to_thread(master.cli, "REPLICAOF", "127.0.0.1", str(replica.port))
            forwarder.repoint(replica.port)
            recovery = await _until_decides(service, probe)
            run = await _finish(
                "failover by a repointed address", service, probe, fault_at, recovery
            )
    run.log = _log(service)
    return run


async def silent_store(directory: Path, how: str, seconds: float) -> FaultRun:
    """The store stops answering for ``seconds``: a partition (``blackhole``: the
    forwarder accepts and swallows every byte) or a hung server (``sigstop``)."""
    name = "partition (black hole)" if how == "blackhole" else "hung store (SIGSTOP)"
    with _pair(directory) as (master, _), Forwarder(master.port) as forwarder:
        url = f"redis://127.0.0.1:{forwarder.port}"
        async with _served(directory, url) as (service, probe):
            fault_at = probe.now()
            if how == "blackhole":
                forwarder.blackhole()
            else:
                master.pause()
            await asyncio.sleep(seconds / 2)
            during = await asyncio.to_thread(scrape, service.admin_port)
            await asyncio.sleep(seconds / 2)
            later = await asyncio.to_thread(scrape, service.admin_port)
            if how == "blackhole":
                forwarder.forward()
            else:
                master.resume()
            recovery = await _until_decides(service, probe)
            run = await _finish(f"{name}, {seconds:g} s", service, probe, fault_at, recovery)
    run.metrics.update(during=during, later=later)
    run.log = _log(service)
    return run


async def cluster_master_killed(directory: Path) -> FaultRun:
    """A Redis Cluster master SIGKILLed; its replica is promoted after the cluster's node
    timeout (1 s). Recovery counts from the promotion, over values on every node."""
    cluster = RedisCluster(directory, masters=3, replicas=1, node_timeout_ms=1000)
    cluster.start()
    try:
        killed = cluster.masters()[0]
        async with _served(directory, cluster.url) as (service, probe):
            fault_at = probe.now()
            cluster.kill(killed)

            async def promoted() -> bool:
                masters = await asyncio.to_thread(cluster.masters)  # redis-cli: off the loop
                return killed not in masters and len(masters) == 3

            await eventually_async(promoted, timeout=30, what="a replica promoted")
            recovery = await _until_decides(service, probe, values=12)
            run = await _finish("Cluster master killed", service, probe, fault_at, recovery)
    finally:
        cluster.stop()
    run.log = _log(service)
    return run


async def sentinel_master_killed(directory: Path) -> FaultRun:
    """The master SIGKILLed; the Sentinel promotes the replica. Recovery counts from the
    promotion."""
    setup = RedisSentinelSetup(directory)
    setup.start()
    try:
        first = setup.master()
        async with _served(directory, setup.url) as (service, probe):
            fault_at = probe.now()
            setup.kill_master()
            await eventually_async(
                lambda: asyncio.to_thread(lambda: setup.master() != first),
                timeout=30,
                what="the replica promoted",
                ignore=(OSError, IndexError, ValueError),  # no answer mid-failover
            )
            recovery = await _until_decides(service, probe)
            run = await _finish("Sentinel master killed", service, probe, fault_at, recovery)
    finally:
        setup.stop()
    run.log = _log(service)
    return run


def _log(service: ServiceProcess) -> str:
    return service.log(tail=1_000_000)
