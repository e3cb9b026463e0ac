"""envoy.service.rate_limit_quota.v3.RateLimitQuotaService over grpc.aio: usage reports in, bucket
assignments out (the decisions are engine/quota.py's).

One stream is one Envoy instance (Envoy 1.40 shares one RLQS stream per process, target and domain),
named by its ``x-envoy-node-id`` initial metadata, else by its peer address and the stream. Every
report is answered at once with an action for each of its buckets: the token bucket is re-sent each
time, which renews its TTL (an identical bucket keeps its tokens in Envoy); never
``requests_per_time_unit``, which Envoy 1.40 ignores. Between reports a stream also carries the
larger buckets another Envoy's report made room for. When the service stops, every stream ends with
UNAVAILABLE: an orderly end with a status, not the cancellation of gRPC's grace running out.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2
from envoy.type.v3 import ratelimit_strategy_pb2, token_bucket_pb2

from ratelimit_service.engine.quota import (
    ABANDON,
    ALLOW_ALL,
    DENY_ALL,
    Action,
    QuotaCoordinator,
    Usage,
)
from ratelimit_service.engine.tracing import Tracing

log = logging.getLogger(__name__)

RLQS_SERVICE = rlqs_pb2.DESCRIPTOR.services_by_name["RateLimitQuotaService"].full_name
NODE_ID_HEADER = "x-envoy-node-id"

_Strategy = ratelimit_strategy_pb2.RateLimitStrategy
_Action = rlqs_pb2.RateLimitQuotaResponse.BucketAction
_BLANKET = {ALLOW_ALL: _Strategy.ALLOW_ALL, DENY_ALL: _Strategy.DENY_ALL}
_streams = itertools.count(1)
SHUTTING_DOWN = "the rate limit service is shutting down: reconnect"
PUSH_QUEUE = 8
"""Pushed answers a stream may hold; beyond, a push is dropped (counted): a report brings all."""


class QuotaServicer:
    """Install with ``rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server``."""

    def __init__(self, coordinator: QuotaCoordinator, tracing: Tracing | None = None) -> None:
        self.coordinator = coordinator
        self.tracing = tracing
        """When set, each report is a span (engine/tracing.py)."""

    async def StreamRateLimitQuotas(
        self,
        request_iterator: AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rlqs_pb2.RateLimitQuotaResponse]:
        instance = instance_name(context)
        coordinator = self.coordinator
        coordinator.connected()
        pushed: asyncio.Queue[list[Action]] = asyncio.Queue(PUSH_QUEUE)
        coordinator.attach(instance, lambda actions: offer(pushed, actions))
        log.debug("RLQS stream from %s", instance)
        try:
            async for item in incoming(request_iterator, coordinator.closing, pushed):
                if isinstance(item, list):  # assignments pushed between reports
                    actions = item
                else:
                    usages = [usage_of(usage) for usage in item.bucket_quota_usages]
                    traced = None
                    if self.tracing is not None:
                        traced = self.tracing.report(
                            context.invocation_metadata(), report_attributes(instance, item)
                        )
                    with contextlib.nullcontext() if traced is None else traced:
                        actions = await coordinator.report(instance, item.domain, usages)
                if actions:
                    yield rlqs_pb2.RateLimitQuotaResponse(bucket_action=map(bucket_action, actions))
            if coordinator.closing.is_set():
                context.set_code(grpc.StatusCode.UNAVAILABLE)
                context.set_details(SHUTTING_DOWN)
        finally:
            coordinator.forget(instance)
            log.debug("RLQS stream from %s ended", instance)


def usage_of(usage: Any) -> Usage:
    """A bucket's usage in a report, as the coordinator counts it."""
    return Usage(
        dict(usage.bucket_id.bucket), usage.num_requests_allowed, usage.num_requests_denied
    )


def report_attributes(instance: str, report: Any) -> dict[str, Any]:
    """What a report's span says: the domain, the instance, its buckets and requests."""
    usages = report.bucket_quota_usages
    return {
        "ratelimit.domain": report.domain,
        "rlqs.instance": instance,
        "rlqs.buckets": len(usages),
        "rlqs.requests_allowed": sum(usage.num_requests_allowed for usage in usages),
        "rlqs.requests_denied": sum(usage.num_requests_denied for usage in usages),
    }


def offer(queue: asyncio.Queue[list[Action]], actions: list[Action]) -> bool:
    """Queue pushed assignments; False when the outbox is full (the next report brings them)."""
    try:
        queue.put_nowait(actions)
    except asyncio.QueueFull:
        return False
    return True


async def incoming(
    messages: AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports],
    closing: asyncio.Event,
    pushed: asyncio.Queue[list[Action]],
) -> AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports | list[Action]]:
    """The stream's reports and pushed assignments, until the client ends it or ``closing``."""
    stop = asyncio.ensure_future(closing.wait())
    next_message: asyncio.Future[rlqs_pb2.RateLimitQuotaUsageReports] | None = None
    next_push: asyncio.Future[list[Action]] | None = None
    try:
        while not closing.is_set():
            if next_message is None:
                next_message = asyncio.ensure_future(anext(messages))
            if next_push is None:
                next_push = asyncio.ensure_future(pushed.get())
            await asyncio.wait((next_message, next_push, stop), return_when=asyncio.FIRST_COMPLETED)
            if closing.is_set():
                return
            if next_push.done():
                actions, next_push = next_push.result(), None
                yield actions
                continue
            try:
                message = next_message.result()
            except StopAsyncIteration:
                return
            next_message = None
            yield message
    finally:
        stop.cancel()
        for future in (next_message, next_push):
            if future is not None:
                future.cancel()


def instance_name(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == NODE_ID_HEADER and value:
            return str(value)
    return f"{context.peer()}#{next(_streams)}"


def bucket_action(action: Action) -> Any:
    bucket_id = rlqs_pb2.BucketId(bucket=dict(action.bucket))
    if action.kind == ABANDON:
        return _Action(bucket_id=bucket_id, abandon_action=_Action.AbandonAction())
    if (tb := action.token_bucket) is not None:
        strategy = _Strategy(
            token_bucket=token_bucket_pb2.TokenBucket(
                max_tokens=tb.max_tokens,
                tokens_per_fill={"value": tb.tokens_per_fill},
                fill_interval={"seconds": tb.fill_seconds},
            )
        )
    else:
        strategy = _Strategy(blanket_rule=_BLANKET[action.kind])
    assignment = _Action.QuotaAssignmentAction(
        assignment_time_to_live={"seconds": action.ttl_seconds}, rate_limit_strategy=strategy
    )
    return _Action(bucket_id=bucket_id, quota_assignment_action=assignment)
