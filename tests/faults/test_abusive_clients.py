"""Abusive clients beside a well-behaved one: random bytes on hundreds of gRPC
connections, a slowloris on the admin port, oversized and malformed requests. Each gets
a clear refusal (or the connection closed), the service logs no traceback, and a
canary calling at 100 a second with Envoy's 20 ms deadline keeps its deadlines as well
as it did before the abuse began."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import urllib.request
from pathlib import Path

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_harness.envoy import ServiceProcess
from ratelimit_harness.faults import FAULTS_CONFIG, Probe
from ratelimit_service.rls.servicer import RLS_SERVICE

pytestmark = [pytest.mark.slow, pytest.mark.serial]

MISSED_SHARE = 0.001
MISSED_FLOOR = 3
"""The canary sends about 500 calls during the abuse, so 0.1 % of them is half a call:
the floor is what a busy 2-core machine's scheduling alone makes the canary miss
(2 of 527 seen beside a busy-loop); a service stalled by the abuse misses dozens."""
MAX_REQUEST_BYTES = 4096


async def _random_bytes(port: int, connections: int) -> None:
    """Each connection sends 4 KB of random bytes (no HTTP/2 preface) and waits for the
    server to close it."""

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(os.urandom(4096))
        try:
            await asyncio.wait_for(reader.read(), timeout=5)
        finally:
            writer.close()

    results = await asyncio.gather(*(one() for _ in range(connections)), return_exceptions=True)
    closed = sum(not isinstance(r, BaseException) or isinstance(r, OSError) for r in results)
    assert closed == connections, [r for r in results if isinstance(r, BaseException)][:3]


async def _slowloris(port: int, connections: int, seconds: float) -> None:
    """Connections that send an HTTP request's headers a byte at a time."""
    writers = []
    for _ in range(connections):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writers.append(writer)
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 1000
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    index = 0
    while loop.time() < end and index < len(request):
        for writer in writers:
            if not writer.is_closing():
                writer.write(request[index : index + 1])
        index += 1
        await asyncio.sleep(0.05)  # pacing: a byte every 50 ms is the abuse
    for writer in writers:
        writer.close()


def _abuse(grpc_port: int, admin_port: int) -> None:
    """Random bytes on 500 gRPC connections and a 200-connection slowloris on the admin
    port at once (a child process: an assertion failing exits non-zero)."""

    async def both() -> None:
        await asyncio.gather(_random_bytes(grpc_port, 500), _slowloris(admin_port, 200, 3.0))

    asyncio.run(both())


async def _bad_requests(port: int) -> tuple[grpc.StatusCode, grpc.StatusCode]:
    """A malformed request and an oversized one: their status codes."""
    codes = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(f"/{RLS_SERVICE}/ShouldRateLimit")  # bytes in and out
        big = rls_pb2.RateLimitRequest(domain="faults")
        big.descriptors.add().entries.add(key="load", value="x" * (2 * MAX_REQUEST_BYTES))
        for payload in (b"\xff\xff\xff", big.SerializeToString()):
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call(payload, timeout=2)
            codes.append(error.value.code())
    return codes[0], codes[1]


async def test_abusive_clients_beside_a_canary(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "faults.yaml").write_text(FAULTS_CONFIG.replace("mode: exact", "mode: probabilistic"))
    service = ServiceProcess(
        config, tmp_path / "service", "--max-request-bytes", str(MAX_REQUEST_BYTES)
    ).start()
    try:
        async with Probe(service.grpc_port, rate=100) as canary:
            await asyncio.sleep(2.0)  # the scenario: two seconds of control first
            abuse_at = canary.now()
            malformed, oversized = await _bad_requests(service.grpc_port)
            # The abusers run in a process of their own: the canary's client must not
            # share a loop (or a core's time slices) with them.
            abusers = multiprocessing.get_context("spawn").Process(
                target=_abuse, args=(service.grpc_port, service.admin_port)
            )
            abusers.start()
            await asyncio.to_thread(abusers.join, 60)
            assert abusers.exitcode == 0
            await asyncio.sleep(1.0)  # the scenario: the canary goes on a second after it
        assert malformed is grpc.StatusCode.INVALID_ARGUMENT
        assert oversized is grpc.StatusCode.RESOURCE_EXHAUSTED
        outcomes = canary.outcomes(canary.calls)
        outcomes.pop("DEADLINE_EXCEEDED", None)
        assert set(outcomes) <= {"OK"}, outcomes
        before = canary.between(0.5, abuse_at)
        during = canary.between(abuse_at)
        share = canary.outcomes(before)["DEADLINE_EXCEEDED"] / len(before)
        missed = canary.outcomes(during)["DEADLINE_EXCEEDED"]
        assert missed <= max(MISSED_FLOOR, len(during) * (MISSED_SHARE + 2 * share)), (
            missed,
            share,
        )
        url = f"http://127.0.0.1:{service.admin_port}/healthcheck"
        with urllib.request.urlopen(url, timeout=5) as page:
            assert page.status == 200
    finally:
        service.stop()
    log = service.log(tail=1_000_000)
    assert "Traceback" not in log, log[-3000:]
