"""The gRPC runtime's count of calls on /metrics (server/grpc_calls.py): calls whose
deadline passes while the process cannot run (paused, as a process past its capacity
leaves calls queued in gRPC's core) are failed by the runtime, most without reaching a
handler, so the service's own counters never see them; the runtime's count does."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from ratelimit_harness.envoy import ServiceProcess
from ratelimit_harness.fixtures import make_request
from ratelimit_harness.fleet import scrape
from ratelimit_harness.waiting import eventually

pytestmark = [pytest.mark.slow]

RULES = """\
domain: calls
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 1000000}
"""
PAUSED = 10
"""Calls sent while the process is paused."""
PAUSED_DEADLINE = 0.2
"""Their deadline: long enough for a client on a busy machine to send them all (one that
passes before a call is sent never reaches the server), short beside the pause, which
lasts until every one has expired."""


def runtime(admin_port: int) -> dict[str, float]:
    page = scrape(admin_port)
    return {
        result: page.get(f'ratelimit_grpc_server_calls_total{{result="{result}"}}', -1.0)
        for result in ("started", "succeeded", "failed")
    }


def ended(now: dict[str, float], before: dict[str, float]) -> float:
    """Calls answered, either way, since ``before``."""
    return sum(now[result] - before[result] for result in ("succeeded", "failed"))


async def test_calls_that_expire_in_a_paused_process_are_counted_as_failed(
    tmp_path: Path,
) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "rules.yaml").write_text(RULES)
    service = ServiceProcess(rules, tmp_path).start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
            call = rls_pb2_grpc.RateLimitServiceStub(channel).ShouldRateLimit
            request = make_request("calls", [("k", "v")])
            for _ in range(3):
                assert (await call(request, timeout=5)).overall_code == 1
            before = runtime(service.admin_port)
            assert before["started"] >= 3 and before["failed"] == 0, before
            assert service.process is not None
            service.process.send_signal(signal.SIGSTOP)
            try:
                codes = await asyncio.gather(
                    *(call(request, timeout=PAUSED_DEADLINE) for _ in range(PAUSED)),
                    return_exceptions=True,
                )
            finally:
                service.process.send_signal(signal.SIGCONT)
            assert all(
                isinstance(c, grpc.aio.AioRpcError)
                and c.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                for c in codes
            ), codes
            assert (await call(request, timeout=5)).overall_code == 1  # serving again
        # The runtime fails the expired calls as it reads them, maybe after the last one.
        after = eventually(
            lambda: ended(now := runtime(service.admin_port), before) == PAUSED + 1 and now,
            timeout=10,
            what="every call ended",
            context=lambda: f"{before} -> {runtime(service.admin_port)}",
        )
        assert after["started"] - before["started"] == PAUSED + 1, (before, after)
        # A client's cancel is sent after its deadline has passed, so the last ones may reach
        # the resumed process after their calls: those are read as live (the deadline a
        # server sees is relative) and answered. The others are counted failed.
        assert after["failed"] - before["failed"] >= PAUSED - PAUSED // 3, (before, after)
    finally:
        service.stop()
