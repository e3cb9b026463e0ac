"""Store faults staged as they happen in production, under load, with real processes:
one function per fault, shared by the fault tests (tests/faults/) and the longer runs
of bench/faults.py.

Each scenario starts a service process on real redis-servers (behind a TCP forwarder
where the fault needs one), runs a :class:`~ratelimit_harness.faults.Probe`
with Envoy's 20 ms deadline, lets ``CONTROL`` seconds of load pass (the control: what
the machine alone makes miss), stages the fault, measures how long after the store can
answer again it decides again, lets a second of load pass, and returns a
:class:`FaultRun` that says what the client saw.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import redis.asyncio as aioredis
from envoy.service.ratelimit.v3 import rls_pb2_grpc
from redis.crc import key_slot

from ratelimit_harness.envoy import ServiceProcess
from ratelimit_harness.faults import (
    FAULTS_CONFIG,
    Probe,
    fresh_decided,
    fresh_key,
    store_decides,
    touch_probabilistic,
)
from ratelimit_harness.fleet import scrape
from ratelimit_harness.forwarder import Forwarder
from ratelimit_harness.redis import (
    RedisCluster,
    RedisSentinelSetup,
    RedisServer,
    masters_in,
)
from ratelimit_harness.waiting import eventually_async

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
    able_at: float = 0.0
    """Seconds from the fault to the store being able to answer again (seen by the
    scenario: a promotion), where the scenario records it."""
    live_checks: list[tuple[float, bool]] = field(default_factory=list)
    """Checks of the slots a fault leaves served (a Cluster's live masters): seconds
    since the fault, and whether the store decided (see faults.fresh_decided)."""

    @property
    def decided_at(self) -> float:
        """Seconds from the fault to the store deciding again."""
        return self.able_at + self.recovery

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


CHECK_EVERY = 0.1
"""Seconds between two checks of the slots a fault leaves served."""


async def cluster_master_killed(directory: Path, full_coverage: bool = True) -> FaultRun:
    """A Redis Cluster master SIGKILLed; its replica is promoted after the cluster's node
    timeout (1 s). Recovery counts from the promotion, over values on every node. From
    the kill to the end, a fresh value in the live masters' slots is checked every
    CHECK_EVERY (``live_checks``). ``full_coverage``: the cluster's
    cluster-require-full-coverage (see ratelimit_harness.redis.RedisCluster)."""
    cluster = RedisCluster(
        directory, masters=3, replicas=1, node_timeout_ms=1000, full_coverage=full_coverage
    )
    cluster.start()
    try:
        async with _served(directory, cluster.url) as (service, probe):
            # Chosen at the kill, as every node sees the cluster then (a master chosen
            # earlier may have been failed over while the service started).
            killed, *live = await asyncio.to_thread(cluster.agreed_masters)
            (heir,) = await asyncio.to_thread(cluster.replicas_of, killed)
            dead_slots = await asyncio.to_thread(cluster.slot_ranges, killed)
            checks = _LiveSlots(service.grpc_port, probe, dead_slots)
            await checks.verify(cluster)
            async with (
                aioredis.Redis(port=live[0], decode_responses=True) as watcher,
                checks.running(fault_at := probe.now()),
            ):
                cluster.kill(killed)

                async def promoted() -> bool:
                    masters = await _masters_seen(watcher)
                    return heir in masters and killed not in masters and len(masters) == 3

                await eventually_async(promoted, timeout=30, what="its replica promoted")
                able_at = probe.now() - fault_at
                recovery = await _until_decides(service, probe, values=12)
                coverage = "yes" if full_coverage else "no"
                name = f"Cluster master killed, require-full-coverage {coverage}"
                run = await _finish(name, service, probe, fault_at, recovery)
    finally:
        cluster.stop()
    run.able_at, run.live_checks = able_at, checks.results
    run.log = _log(service)
    return run


async def _masters_seen(client: Any) -> list[int]:
    """The masters a node sees (CLUSTER NODES on the loop: no redis-cli process to
    spawn every look while the probe runs)."""
    return masters_in(await client.execute_command("CLUSTER", "NODES"))


class _LiveSlots:
    """Checks, every CHECK_EVERY, that the store decides a fresh value whose slot is
    not among ``dead_slots``."""

    def __init__(self, port: int, probe: Probe, dead_slots: list[tuple[int, int]]) -> None:
        self.port, self.probe, self.dead_slots = port, probe, dead_slots
        self.results: list[tuple[float, bool]] = []
        self._values = (f"live{n}" for n in itertools.count() if self._live(f"live{n}"))

    def _live(self, value: str) -> bool:
        slot = key_slot(fresh_key(value).encode())
        return not any(start <= slot <= end for start, end in self.dead_slots)

    async def verify(self, cluster: RedisCluster) -> None:
        """Before the fault: a checked value is decided, and its key is where
        fresh_key says (so the slots checked are the ones the store uses)."""
        value = next(self._values)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            decided = await fresh_decided(rls_pb2_grpc.RateLimitServiceStub(channel), value)
        key = fresh_key(value)
        found = [
            port
            for port in await asyncio.to_thread(cluster.masters)
            if (await asyncio.to_thread(cluster.cli, port, "exists", key)).strip() == "1"
        ]
        if not decided or len(found) != 1:
            raise RuntimeError(f"fresh value {value} not decided or its key not found")

    @contextlib.asynccontextmanager
    async def running(self, fault_at: float) -> AsyncIterator[None]:
        """Checks from now until the block ends."""
        stop = asyncio.Event()
        task = asyncio.ensure_future(self._run(fault_at, stop))
        try:
            yield
        finally:
            stop.set()
            await task

    async def _run(self, fault_at: float, stop: asyncio.Event) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            while not stop.is_set():
                decided = await fresh_decided(stub, next(self._values))
                self.results.append((round(self.probe.now() - fault_at, 2), decided))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), CHECK_EVERY)


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
