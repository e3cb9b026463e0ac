"""Exact decisions that Redis cannot make before the caller's deadline are answered at
once by the rule's failure_mode, counted, and owed to the window, rather than each
waiting out its deadline (after which Envoy stops listening). Real processes: a
redis-server behind a forwarder that slows its replies, the service, and a grpc.aio
client calling at a fixed rate with Envoy's 20 ms deadline."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_harness.envoy import ServiceProcess
from ratelimit_harness.faults import Probe
from ratelimit_harness.fixtures import make_request
from ratelimit_harness.fleet import redis_server, scrape
from ratelimit_harness.forwarder import Forwarder
from ratelimit_harness.waiting import eventually_async

pytestmark = [pytest.mark.slow, pytest.mark.serial]

LIMIT = 100_000
RULES = f"""\
domain: faults
descriptors:
  - key: load
    mode: exact
    failure_mode: open
    rate_limit: {{unit: minute, requests_per_unit: {LIMIT}}}
"""
SLOW = 0.04
"""Redis's added round trip: longer than the 15 ms a call with Envoy's 20 ms deadline
waits for it (the service answers 5 ms before the deadline)."""


def store_figure(admin_port: int, name: str) -> float:
    return scrape(admin_port).get(f'ratelimit_store{{name="{name}",store="redis"}}', 0.0)


async def test_behind_a_redis_slower_than_the_deadline_calls_are_answered_at_once(
    tmp_path: Path,
) -> None:
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "rules.yaml").write_text(RULES)
    with redis_server(tmp_path / "redis") as redis, Forwarder(redis.port) as forwarder:
        service = ServiceProcess(rules, tmp_path, "--redis-url", forwarder.url).start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
                call = channel.unary_unary(
                    "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
                    request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=rls_pb2.RateLimitResponse.FromString,
                )
                request = make_request("faults", [("load", "v0")])
                assert (await call(request, timeout=1)).overall_code == 1  # decided, quick
                forwarder.delay(SLOW)
                async with Probe(service.grpc_port, rate=200, keys=1) as probe:
                    # The service follows a slower Redis within two of its windows (its
                    # figure is the quickest reply of the last second or two).
                    await eventually_async(
                        lambda: (
                            store_figure(service.admin_port, "exact_prompt_seconds") >= 0.9 * SLOW
                        ),
                        timeout=10,
                        what="the service saw that Redis takes 40 ms",
                        context=lambda: str(
                            store_figure(service.admin_port, "exact_prompt_seconds")
                        ),
                    )
                    since = probe.now()
                    late_before = store_figure(service.admin_port, "exact_late")
                    await eventually_async(
                        lambda: len(probe.between(since)) >= 400, timeout=30, what="400 calls"
                    )
                    late = store_figure(service.admin_port, "exact_late") - late_before
                calls = probe.between(since, since + 2.0)
                # Redis answers in 40 ms: a call finding one in flight is answered at
                # once; one finding none goes to Redis, and is answered by failure_mode
                # 5 ms before its deadline (its reply keeps the service's figure current).
                assert late >= 0.6 * len(calls), (late, len(calls))
                quick = sorted(c.latency for c in calls)[len(calls) // 2]
                assert quick < 0.010, f"median latency {quick * 1000:.1f} ms: not at once"
                outcomes = {c.outcome for c in calls}
                assert outcomes <= {"OK", "DEADLINE_EXCEEDED"}, outcomes  # failure_mode: open
                missed = sum(c.outcome == "DEADLINE_EXCEEDED" for c in calls)
                assert missed <= 0.02 * len(calls), missed
                # Counted: every call answered without Redis's word is a failure_mode answer.
                text = scrape(service.admin_port)
                allowed = text.get(
                    'ratelimit_service_rate_limit_failure_mode_allowed_total{key="faults.load"}'
                )
                assert allowed is not None and allowed >= late
                # Redis quick again: decisions are Redis's, and the window holds every call
                # admitted meanwhile (the late ones' hits were owed, not lost).
                forwarder.delay(0.0)
                admitted = 1 + sum(c.outcome == "OK" for c in probe.calls)
                # A call the client gave up on (its deadline, or the probe's end) may
                # still have been admitted: counted, but unseen.
                unseen = probe.cut + sum(c.outcome not in ("OK", "OVER_LIMIT") for c in probe.calls)

                async def remaining() -> int:
                    response = await call(request, timeout=1)
                    return int(response.statuses[0].limit_remaining)

                seen: list[int] = []

                async def settled() -> bool:
                    seen.append(await remaining())
                    owed = store_figure(service.admin_port, "exact_owed_entries")
                    return owed == 0 and len(seen) >= 2 and seen[-1] == seen[-2] - 1

                await eventually_async(settled, timeout=10, what="the owed hits landed")
                # Each remaining() call is admitted and counted too.
                counted = LIMIT - len(seen) - seen[-1]
                assert admitted <= counted <= admitted + unseen, (counted, admitted, unseen)
        finally:
            service.stop()
