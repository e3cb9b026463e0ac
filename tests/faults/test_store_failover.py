"""Store faults as they happen in production, under load, seen by a client with Envoy's
20 ms deadline: a failover that repoints an address, a partition, a hung store.

Each test runs a real service process on a real redis-server behind a TCP forwarder the
test controls (testing/forwarder.py), a probe sending 200 calls a second on an exact
rule with ``failure_mode: open``, and asserts what the fault's row in
docs/reliability.md promises: no gRPC error at any time, at most 0.1 % of calls past
their deadline, the store deciding again within 5 s of being able to, one log line per
transition and no traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from ratelimit_service.testing.envoy import ServiceProcess
from ratelimit_service.testing.envoy_fixtures import scrape
from ratelimit_service.testing.faults import FAULTS_CONFIG, Probe, store_decides
from ratelimit_service.testing.forwarder import Forwarder
from ratelimit_service.testing.redis import RedisServer
from ratelimit_service.testing.waiting import eventually_async

pytestmark = [pytest.mark.slow, pytest.mark.serial]

RECOVERY = 5.0
"""Seconds from the store being able to answer again to the service deciding by it."""
MISSED_SHARE = 0.001
"""Calls past their 20 ms deadline, at most, at any time."""


@pytest.fixture
def redis_pair(tmp_path: Path) -> Iterator[tuple[RedisServer, RedisServer]]:
    """A master and its replica."""
    master, replica = RedisServer(tmp_path), RedisServer(tmp_path)
    master.start()
    try:
        replica.start(10.0, "--replicaof", "127.0.0.1", str(master.port))
        yield master, replica
    finally:
        for server in (master, replica):
            if server.process is not None:
                server.resume()
            server.stop()


def _service(tmp_path: Path, port: int) -> ServiceProcess:
    config = tmp_path / "config"
    config.mkdir(exist_ok=True)
    (config / "faults.yaml").write_text(FAULTS_CONFIG)
    return ServiceProcess(config, tmp_path / "service", "--redis-url", f"redis://127.0.0.1:{port}")


def _assert_clean(probe: Probe, service: ServiceProcess) -> None:
    """No gRPC error, deadlines kept, OVER_LIMIT never (the load rule never denies),
    and a log without a traceback."""
    outcomes = probe.outcomes(probe.calls)
    missed = outcomes.pop("DEADLINE_EXCEEDED", 0)
    assert set(outcomes) <= {"OK"}, outcomes
    assert missed <= max(1, MISSED_SHARE * len(probe.calls)), (missed, len(probe.calls))
    log = service.log(tail=1_000_000)
    assert "Traceback" not in log, log[-3000:]


async def _recovered_within(port: int, start: float, probe: Probe) -> float:
    await eventually_async(lambda: store_decides(port), timeout=RECOVERY + 5, what="store decides")
    took = probe.now() - start
    assert took <= RECOVERY, took
    return took


async def test_failover_by_repointed_address(
    tmp_path: Path, redis_pair: tuple[RedisServer, RedisServer]
) -> None:
    """The address moves to the promoted replica while the demoted master keeps the
    service's connections and answers READONLY: the service drops a connection that
    answers READONLY and dials again, reaching the new master."""
    master, replica = redis_pair
    with Forwarder(master.port) as forwarder:
        service = _service(tmp_path, forwarder.port).start()
        try:
            async with Probe(service.grpc_port) as probe:
                assert await store_decides(service.grpc_port)
                await asyncio.sleep(1.0)  # load before the fault
                replica.cli("REPLICAOF", "NO", "ONE")
                master.cli("REPLICAOF", "127.0.0.1", str(replica.port))
                forwarder.repoint(replica.port)
                moved = probe.now()
                await _recovered_within(service.grpc_port, moved, probe)
                await asyncio.sleep(1.0)  # load after recovery
            _assert_clean(probe, service)
            metrics = scrape(service)
            assert metrics['ratelimit_store{name="dropped_connections",store="redis"}'] >= 1
        finally:
            service.stop()


@pytest.mark.parametrize("fault", ["blackhole", "sigstop"])
async def test_store_that_stops_answering(
    tmp_path: Path, redis_pair: tuple[RedisServer, RedisServer], fault: str
) -> None:
    """A partition (the forwarder swallows every byte) or a hung store (SIGSTOP) for
    10 s: every call is answered within its deadline by failure_mode, however long it
    lasts, and the store decides again within 5 s of answering again."""
    master, _ = redis_pair
    with Forwarder(master.port) as forwarder:
        service = _service(tmp_path, forwarder.port).start()
        try:
            async with Probe(service.grpc_port) as probe:
                assert await store_decides(service.grpc_port)
                await asyncio.sleep(1.0)
                if fault == "blackhole":
                    forwarder.blackhole()
                else:
                    master.pause()
                await asyncio.sleep(5.0)
                during = scrape(service)
                await asyncio.sleep(5.0)
                after = scrape(service)
                if fault == "blackhole":
                    forwarder.forward()
                else:
                    master.resume()
                healed = probe.now()
                await _recovered_within(service.grpc_port, healed, probe)
                await asyncio.sleep(1.0)
            _assert_clean(probe, service)
            # What the outage costs an answer does not grow with it: hits owed are kept
            # per key (100 keys), and not sent again and again while the circuit is open.
            owed, sent = (
                f'ratelimit_store{{name="exact_owed_{n}",store="redis"}}'
                for n in ("entries", "sent")
            )
            assert during[owed] <= probe.keys and after[owed] <= probe.keys, (during, after)
            assert after[sent] - during[sent] <= 10 * probe.keys, (during[sent], after[sent])
            metrics = scrape(service)
            assert metrics[owed] == 0  # every owed hit has landed
            assert metrics['ratelimit_store{name="outages",store="redis"}'] == 1
            assert metrics['ratelimit_store{name="recoveries",store="redis"}'] == 1
        finally:
            service.stop()
