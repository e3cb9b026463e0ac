"""The status page at scale, in a service process: 10,000 rules with traffic and 1,000
RLQS Envoys on open streams. /status.json stays under 64 KB with every table at its
bound (and the totals and "more" counts right), the page is the same few KB, and calls
arriving while the snapshot is made are answered without waiting: the service's own
work never holds its loop 50 ms (a canary calls every 5 ms beside it, as
tests/faults/test_stalls.py watches /metrics)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.rate_limit_quota.v3 import rlqs_pb2_grpc

from ratelimit_harness.fleet import SHOULD_RATE_LIMIT, histogram_over, scrape, service_fleet
from ratelimit_harness.rlqs_sim import usage_report
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.cli.client import build_request
from ratelimit_service.engine.quota import REPORT_INTERVAL
from ratelimit_service.engine.status import TOP

pytestmark = [pytest.mark.slow, pytest.mark.serial]

RULES = 10_000
ENVOYS = 1_000
COUNTERS = 100
PER_CALL = 64
SPREAD = 1.0
"""Seconds over which the Envoys' reports of one interval are spread."""
"""Descriptors per call (--max-descriptors' default): 10,000 rules in 157 calls."""


def _rules(tmp_path: Path) -> Path:
    many = "".join(
        f"  - key: r\n    value: v{n}\n    rate_limit: {{unit: minute, requests_per_unit: 1000}}\n"
        for n in range(RULES)
    )
    (tmp_path / "many.yaml").write_text("domain: many\ndescriptors:\n" + many)
    (tmp_path / "quota.yaml").write_text(
        "domain: q\ndescriptors:\n"
        "  - key: tenant\n    rate_limit: {unit: minute, requests_per_unit: 600}\n"
    )
    return tmp_path


async def _every_rule_called(port: int) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(SHOULD_RATE_LIMIT)
        for start in range(0, RULES, PER_CALL):
            values = [f"r=v{n}" for n in range(start, min(RULES, start + PER_CALL))]
            await call(build_request("many", values, 0).SerializeToString())


@contextlib.asynccontextmanager
async def _envoys(port: int) -> AsyncIterator[Callable[[], None]]:
    """ENVOYS streams over COUNTERS buckets, each with one report answered, held open;
    yields what starts their reports again, every REPORT_INTERVAL a hit each, spread
    over the interval, as Envoy's (an instance silent for FORGET_AFTER is forgotten, and one
    idle for ABANDON_AFTER reports told to abandon the bucket: its counter goes with
    its last instance)."""
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(10)]
    calls: list[Any] = []
    refresher: list[asyncio.Task[None]] = []

    def report(n: int, elapsed: int = 0) -> Any:
        return usage_report("q", {"tenant": f"t{n % COUNTERS}"}, 1, 0, elapsed)

    async def envoy(n: int) -> None:
        stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channels[n % len(channels)])
        call = stub.StreamRateLimitQuotas(metadata=(("x-envoy-node-id", f"envoy-{n}"),))
        calls.append(call)
        await call.write(report(n))
        await asyncio.wait_for(call.read(), 30)

    async def reporting() -> None:
        """Each Envoy at its own moment, as a fleet's timers (started when each Envoy
        did) are spread: not a thousand reports in one burst. The first round within
        SPREAD seconds, well inside FORGET_AFTER of the reports before the tenure wait."""
        loop = asyncio.get_running_loop()
        begun = loop.time()
        for round_ in itertools.count():
            for n, call in enumerate(calls):
                due = begun + round_ * REPORT_INTERVAL + n / len(calls) * SPREAD
                await asyncio.sleep(max(0.0, due - loop.time()))  # pacing: Envoy's interval
                await call.write(report(n, int(REPORT_INTERVAL)))

    def start() -> None:
        refresher.append(asyncio.ensure_future(reporting()))

    try:
        await asyncio.gather(*(envoy(n) for n in range(ENVOYS)))
        yield start
    finally:
        for task in refresher:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for call in calls:
            call.cancel()
        for channel in channels:
            await channel.close()


async def _canary(port: int, waits: list[float], stop: asyncio.Event) -> None:
    """A call every 5 ms until ``stop``, of 10 hits each (its rule the busiest by far,
    beside the RLQS reports' hit every five seconds an Envoy); each call's wait kept."""
    loop = asyncio.get_running_loop()
    request = build_request("many", ["r=v0"], 10).SerializeToString()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_unary(SHOULD_RATE_LIMIT)

        async def one() -> None:
            sent = loop.time()
            await call(request)
            waits.append(loop.time() - sent)

        pending: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            task = asyncio.ensure_future(one())
            pending.add(task)
            task.add_done_callback(pending.discard)
            await asyncio.sleep(0.005)  # pacing: the load's rate
        await asyncio.gather(*pending)


async def _get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    raw = await asyncio.wait_for(reader.read(), 30)
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    return body


async def _tenures(port: int) -> float:
    """The service's tenure rounds so far (server/gc_policy.py Tenuring)."""
    metrics = (await _get(port, "/metrics")).decode()
    (line,) = [x for x in metrics.splitlines() if x.startswith("ratelimit_gc_tenures_total ")]
    return float(line.split()[1])


def _held(port: int) -> int:
    """Lags of the service's event loop of 50 ms or more that its own work made, so far."""
    return histogram_over(scrape(port), "ratelimit_event_loop_blocked_seconds", "0.05")


async def test_status_stays_bounded_and_calls_are_answered_meanwhile(tmp_path: Path) -> None:
    keys = ("--max-stats-keys", str(RULES + 1))  # every rule its own row, q.tenant too
    with service_fleet(1, _rules(tmp_path), None, keys) as (node,):
        await _every_rule_called(node.grpc_port)
        async with _envoys(node.grpc_port) as keep_reporting:
            # The state just made (10,000 rules' stats, 1,000 streams) tenured first, as
            # a serving process's is within seconds: a full collection over it before
            # then can land in any piece of work (the stalls tests watch those).
            tenured = await _tenures(node.admin_port)

            async def tenured_since() -> bool:
                return await _tenures(node.admin_port) > tenured

            await eventually_async(tenured_since, what="the new state tenured")
            keep_reporting()  # from here on, as long as the snapshots take
            held_before = _held(node.admin_port)
            waits: list[float] = []
            stop = asyncio.Event()
            canary = asyncio.ensure_future(_canary(node.grpc_port, waits, stop))
            await eventually_async(lambda: len(waits) >= 20, what="the canary answered")
            first = json.loads(await _get(node.admin_port, "/status.json"))

            async def next_snapshot() -> tuple[bytes, Any] | None:
                body = await _get(node.admin_port, "/status.json")
                status = json.loads(body)
                return (body, status) if status["generated_at"] > first["generated_at"] else None

            body, status = await eventually_async(next_snapshot, what="a second snapshot")
            page = await _get(node.admin_port, "/status")
            before = len(waits)
            await eventually_async(lambda: len(waits) >= before + 5, what="the canary after")
            stop.set()
            await canary
            held = _held(node.admin_port) - held_before
    took = [snapshot["took"] for snapshot in (first, status)]
    print(  # the figures in docs/benchmarks.md (pytest -s shows them)
        f"\nstatus page: JSON {len(body)} bytes, page {len(page)} bytes; snapshots"
        f" {[(t['work_seconds'], t['pieces'], t['longest_piece_seconds']) for t in took]}"
        f" (work s, pieces, longest s); canary: {len(waits)} calls, slowest"
        f" {max(waits) * 1e3:.1f} ms"
    )
    assert len(body) < 64_000, len(body)
    assert len(page) < 16_000, len(page)
    rules = status["rules"]
    assert rules["loaded"] == RULES + 1
    assert rules["total"] == RULES + 1  # and q.tenant, counted from the RLQS reports
    assert status["service"]["stats_keys"] == RULES + 1  # none under _overflow
    assert (rules["shown"], rules["more"]) == (TOP, RULES + 1 - TOP)
    assert rules["rows"][0]["key"] == "many.r_v0"  # the canary's: the busiest
    keys = status["keys"]
    assert (keys["total"], keys["shown"]) == (RULES + COUNTERS, TOP)
    envoys, counters = status["rlqs"]["envoys"], status["rlqs"]["counters"]
    assert (envoys["total"], envoys["shown"], envoys["more"]) == (ENVOYS, TOP, ENVOYS - TOP)
    assert (counters["total"], counters["shown"]) == (COUNTERS, TOP)
    assert status["rlqs"]["streams"] == ENVOYS
    # The service's own work never held its loop 50 ms (its loop thread's CPU time, which
    # a busy machine's pauses do not add to); the wall-clock figures leave room for those.
    assert held == 0, f"{held} lags of 50 ms or more of the service's own work"
    assert all(t["longest_piece_seconds"] < 0.100 for t in took), took
    assert max(waits) < 0.250, f"slowest canary waits (s): {sorted(waits)[-5:]}"
