"""The fault tests' Probe accounts for every call it sent: answered (in ``calls``), or
still out when it ended (``cut``), by the time its ``async with`` block is left."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from ratelimit_harness import faults
from ratelimit_harness.faults import Probe
from ratelimit_harness.waiting import eventually_async


async def test_calls_still_out_when_the_probe_ends_are_cut(monkeypatch) -> None:
    # A service that never answers, and a deadline that outlasts the probe: every call
    # that reached the service is still out when the probe ends.
    monkeypatch.setattr(faults, "DEADLINE", 30.0)
    received = 0

    class Stalled(rls_pb2_grpc.RateLimitServiceServicer):
        async def ShouldRateLimit(self, request: Any, context: Any) -> Any:
            nonlocal received
            received += 1
            await asyncio.Event().wait()

    server = grpc.aio.server()
    rls_pb2_grpc.add_RateLimitServiceServicer_to_server(Stalled(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with Probe(port, rate=200, keys=1) as probe:
            await eventually_async(lambda: received >= 3, timeout=10, what="3 calls out")
        # Read at once, as a test does: no turn of the loop for the calls to notice
        # that they were cancelled.
        assert probe.calls == []
        assert probe.cut >= received >= 3, (probe.cut, received)
    finally:
        await server.stop(None)
