"""Simulated Envoys for RLQS tests and benchmarks: each enforces the token bucket the
service last assigned it, as Envoy 1.40 does, and reports its usage on a real gRPC
stream (node id in ``x-envoy-node-id``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping, Sequence

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from google.protobuf import duration_pb2


def usage_report(
    domain: str, bucket: Mapping[str, str], allowed: int, denied: int, elapsed: int
) -> rlqs_pb2.RateLimitQuotaUsageReports:
    usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage(
        bucket_id=rlqs_pb2.BucketId(bucket=dict(bucket)),
        time_elapsed=duration_pb2.Duration(seconds=elapsed),
        num_requests_allowed=allowed,
        num_requests_denied=denied,
    )
    return rlqs_pb2.RateLimitQuotaUsageReports(domain=domain, bucket_quota_usages=[usage])


class SimEnvoy:
    """One Envoy's bucket: offers ``rate`` hits per second, enforces its assigned token
    bucket (a changed bucket starts full, an identical one keeps its tokens; before
    any assignment everything is allowed)."""

    def __init__(self, name: str, rate: float) -> None:
        self.name = name
        self.rate = rate
        self.bucket: tuple[int, int, int] | None = None
        """(max_tokens, tokens_per_fill, fill_seconds) as last assigned."""
        self.tokens = 0.0
        self.last = time.monotonic()

    def assign(self, response: rlqs_pb2.RateLimitQuotaResponse) -> None:
        for action in response.bucket_action:
            strategy = action.quota_assignment_action.rate_limit_strategy
            if not strategy.HasField("token_bucket"):
                continue
            bucket = strategy.token_bucket
            new = (bucket.max_tokens, bucket.tokens_per_fill.value, bucket.fill_interval.seconds)
            if new != self.bucket:
                self.bucket, self.tokens = new, float(bucket.max_tokens)

    def usage(self, now: float) -> tuple[int, int]:
        """(allowed, denied) since the last call."""
        elapsed, self.last = now - self.last, now
        offered = round(self.rate * elapsed)
        if self.bucket is None:
            return offered, 0
        most, per_fill, fill = self.bucket
        self.tokens = min(float(most), self.tokens + per_fill / max(1, fill) * elapsed)
        allowed = min(offered, int(self.tokens))
        self.tokens -= allowed
        return allowed, offered - allowed

    def assigned_rate(self) -> float:
        """Tokens per second of the bucket it holds (0 before any)."""
        if self.bucket is None:
            return 0.0
        return self.bucket[1] / max(1, self.bucket[2])


class StreamingEnvoy:
    """A SimEnvoy on a stream to one of ``addresses`` (its own service replicas, in
    order): it reports every ``every`` seconds, and when its stream breaks it opens one
    to the next address, as Envoy's cluster would."""

    def __init__(
        self,
        envoy: SimEnvoy,
        addresses: Sequence[str],
        domain: str,
        bucket: Mapping[str, str],
        every: float = 1.0,
    ) -> None:
        self.envoy = envoy
        self.addresses = list(addresses)
        self.domain = domain
        self.bucket = bucket
        self.every = every
        self.reconnects = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        turn = 0
        while True:
            address = self.addresses[turn % len(self.addresses)]
            async with grpc.aio.insecure_channel(address) as channel:
                # A stream its replica ended (killed, restarted) may end a write too:
                # the call then says it already finished. Either way, connect again.
                with contextlib.suppress(
                    grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError
                ):
                    await self._stream(channel)
            turn += 1
            self.reconnects += 1
            await asyncio.sleep(0.1)

    async def _stream(self, channel: grpc.aio.Channel) -> None:
        stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
        call = stub.StreamRateLimitQuotas(metadata=(("x-envoy-node-id", self.envoy.name),))
        reader = asyncio.ensure_future(self._read(call))
        try:
            await call.write(usage_report(self.domain, self.bucket, 1, 0, 0))
            while not reader.done():
                await asyncio.wait({reader}, timeout=self.every)
                if reader.done():
                    break
                allowed, denied = self.envoy.usage(time.monotonic())
                await call.write(
                    usage_report(self.domain, self.bucket, allowed, denied, round(self.every))
                )
            reader.result()  # the stream's error, if it ended with one
        finally:
            reader.cancel()
            call.cancel()

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                return
            self.envoy.assign(response)
