"""StreamRateLimitQuotas over real gRPC (loopback) against a real service: streams named
by their metadata, malformed reports answered without ending the stream, a limit
edited in the YAML applied at the next report."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from google.protobuf import duration_pb2

Usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage

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
    for _ in range(50):
        await asyncio.sleep(0.1)
        if service.service.limiter.config.domains["q"].root.defaults["tenant"].limit:
            limit = service.service.limiter.config.domains["q"].root.defaults["tenant"].limit
            if limit.requests_per_unit == 40:
                break
    assert tokens(await a.ask(report("q", {"tenant": "t"}))) == [20]
    a.call.cancel()
    b.call.cancel()
