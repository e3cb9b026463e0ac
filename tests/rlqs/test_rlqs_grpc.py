"""StreamRateLimitQuotas over real gRPC (loopback) against a real service: streams named
by their metadata, malformed reports answered without ending the stream, a limit
edited in the YAML applied at the next report, streams ended with a status when the
service stops."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import grpc
import pytest
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from google.protobuf import duration_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ratelimit_harness.envoy import ServiceProcess
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.rlqs.servicer import SHUTTING_DOWN

Usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE

RULES = """\
domain: q
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: LIMIT}
"""


def report(domain: str, *buckets: dict[str, str], allowed: int = 1):
    return rlqs_pb2.RateLimitQuotaUsageReports(
        domain=domain,
        bucket_quota_usages=[
            Usage(
                bucket_id=rlqs_pb2.BucketId(bucket=b),
                time_elapsed=duration_pb2.Duration(seconds=0),
                num_requests_allowed=allowed,
            )
            for b in buckets
        ],
    )


class Stream:
    """One Envoy's stream: send a report, read the answer."""

    def __init__(self, channel: grpc.aio.Channel, node: str) -> None:
        stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
        self.call = stub.StreamRateLimitQuotas(metadata=(("x-envoy-node-id", node),))

    async def ask(self, message) -> rlqs_pb2.RateLimitQuotaResponse:
        await self.call.write(message)
        return await asyncio.wait_for(self.call.read(), 5)

    async def end(self) -> tuple[grpc.StatusCode, str]:
        """Read until the server ends the stream: its status and details."""
        with contextlib.suppress(grpc.aio.AioRpcError):  # a status other than OK
            while await self.call.read() is not grpc.aio.EOF:
                pass
        return await self.call.code(), await self.call.details()


def tokens(response: rlqs_pb2.RateLimitQuotaResponse) -> list[int]:
    return [
        a.quota_assignment_action.rate_limit_strategy.token_bucket.tokens_per_fill.value
        for a in response.bucket_action
    ]


async def test_malformed_reports_leave_the_stream_up(start_service, write_config) -> None:
    service = await start_service(write_config(RULES.replace("LIMIT", "10")))
    stream = Stream(service.channel, "envoy-a")
    answer = await stream.ask(report("q", {}, {"tenant": "t"}))  # an empty id: skipped
    assert [dict(a.bucket_id.bucket) for a in answer.bucket_action] == [{"tenant": "t"}]
    assert tokens(answer) == [10]
    unknown = await stream.ask(report("nowhere", {"tenant": "t"}))
    (action,) = unknown.bucket_action
    assert action.quota_assignment_action.rate_limit_strategy.blanket_rule == 0  # ALLOW_ALL
    assert action.quota_assignment_action.assignment_time_to_live.seconds >= 1
    assert tokens(await stream.ask(report("q", {"tenant": "t"}))) == [10]  # still up
    assert service.service.quota.streams == 1
    stream.call.cancel()


async def test_two_streams_split_and_a_reload_applies_at_the_next_report(
    start_service, write_config
) -> None:
    config = write_config(RULES.replace("LIMIT", "10"))
    service = await start_service(config, watch_interval=0.1)
    a, b = Stream(service.channel, "envoy-a"), Stream(service.channel, "envoy-b")
    assert tokens(await a.ask(report("q", {"tenant": "t"}))) == [10]  # alone
    assert tokens(await b.ask(report("q", {"tenant": "t"}))) == [5]  # two, just seen
    (Path(config) / "rules.yaml").write_text(RULES.replace("LIMIT", "40"))

    def reloaded() -> bool:
        limits = service.service.limiter.config.domains["q"].root.defaults["tenant"].limits
        return [limit.requests_per_unit for limit in limits] == [40]

    await eventually_async(reloaded, timeout=5, what="the edited limit loaded")
    assert tokens(await a.ask(report("q", {"tenant": "t"}))) == [20]
    a.call.cancel()
    b.call.cancel()


async def test_close_streams_ends_every_stream_with_unavailable(
    start_service, write_config
) -> None:
    service = await start_service(write_config(RULES.replace("LIMIT", "10")))
    a, b = Stream(service.channel, "envoy-a"), Stream(service.channel, "envoy-b")
    assert tokens(await a.ask(report("q", {"tenant": "t"}))) == [10]
    assert tokens(await b.ask(report("q", {"tenant": "t"}))) == [5]
    service.service.quota.close_streams()
    for stream in (a, b):  # each waiting for its next report: ended at once, orderly
        assert await asyncio.wait_for(stream.end(), 2) == (UNAVAILABLE, SHUTTING_DOWN)
    late = Stream(service.channel, "envoy-c")  # one opened while stopping ends too
    # Ended at its start, it may be over before the report is written: the write then
    # fails with the stream's status, which end() reads.
    with contextlib.suppress(grpc.aio.AioRpcError):
        await late.call.write(report("q", {"tenant": "t"}))
    assert await asyncio.wait_for(late.end(), 2) == (UNAVAILABLE, SHUTTING_DOWN)
    assert service.service.quota.streams == 0


@pytest.mark.slow  # starts a process
async def test_sigterm_ends_rlqs_streams_with_a_status_and_at_once(
    write_config, tmp_path: Path
) -> None:
    """``ratelimit-service serve`` getting SIGTERM: health goes NOT_SERVING and the
    streams are still answered while it drains (1 s without an RLS call), then each
    ends with UNAVAILABLE, not cancelled after the shutdown grace (5 s), and the
    process exits soon after."""
    service = ServiceProcess(write_config(RULES.replace("LIMIT", "10")), tmp_path / "svc")
    service.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
            stream = Stream(channel, "envoy-a")
            assert tokens(await stream.ask(report("q", {"tenant": "t"}))) == [10]
            started = time.monotonic()
            service.terminate()
            await eventually_async(  # draining: reports are still answered
                lambda: not_serving(channel), timeout=5, what="health NOT_SERVING",
                ignore=(grpc.aio.AioRpcError,),
            )  # fmt: skip
            assert tokens(await stream.ask(report("q", {"tenant": "t"}))) == [10]
            status = await asyncio.wait_for(stream.end(), 10)
            ended = time.monotonic() - started
            assert status == (UNAVAILABLE, SHUTTING_DOWN)
        assert await asyncio.to_thread(service.wait, 10) == 0
        exited = time.monotonic() - started
        print(f"stream ended {ended:.2f} s after SIGTERM, process exited after {exited:.2f} s")
        assert ended < 3.0 and exited < 4.0  # drain (1 s quiet) + a little, no 5 s grace
    finally:
        service.stop()
        print(service.log())


async def not_serving(channel: grpc.aio.Channel) -> bool:
    health = health_pb2_grpc.HealthStub(channel)
    answer = await health.Check(health_pb2.HealthCheckRequest(), timeout=1)
    return bool(answer.status == health_pb2.HealthCheckResponse.NOT_SERVING)


async def test_a_fleet_starting_together_is_not_held_to_one_token(
    start_service, write_config
) -> None:
    """The first of a fleet gets the whole limit, the next an even share: first shares
    add up to more than the limit. At its next report an instance's room counts an
    instance not measured yet at its even share, not at the whole limit it was first
    given: b gets its half, not 1 token per fill until a reports again."""
    service = await start_service(write_config(RULES.replace("LIMIT", "10")))
    a, b = Stream(service.channel, "envoy-a"), Stream(service.channel, "envoy-b")
    assert tokens(await a.ask(report("q", {"tenant": "t"}))) == [10]  # alone
    assert tokens(await b.ask(report("q", {"tenant": "t"}))) == [5]  # just seen
    await asyncio.sleep(0.6)  # the subject: a demand is measured over 0.5 s of real time
    assert tokens(await b.ask(report("q", {"tenant": "t"}, allowed=30))) == [5]
    a.call.cancel()
    b.call.cancel()
