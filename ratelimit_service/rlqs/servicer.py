"""envoy.service.rate_limit_quota.v3.RateLimitQuotaService over grpc.aio: usage
reports in, bucket assignments out (the decisions are engine/quota.py's).

One stream is one Envoy instance (Envoy 1.40 shares one RLQS client and stream per
process, target and domain). It is named by the ``x-envoy-node-id`` initial metadata
when Envoy sends it (``rlqs_server.grpc_service.initial_metadata``), else by its peer
address and the stream, so two Envoys behind one address still count as two. Every
report is answered at once with an action for each of its buckets: the token bucket
is re-sent each time, which renews its TTL (an identical bucket keeps its tokens in
Envoy). Never ``requests_per_time_unit``: Envoy 1.40 ignores it.
"""

from __future__ import annotations

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

log = logging.getLogger(__name__)

RLQS_SERVICE = rlqs_pb2.DESCRIPTOR.services_by_name["RateLimitQuotaService"].full_name
NODE_ID_HEADER = "x-envoy-node-id"

_Strategy = ratelimit_strategy_pb2.RateLimitStrategy
_Action = rlqs_pb2.RateLimitQuotaResponse.BucketAction
_BLANKET = {ALLOW_ALL: _Strategy.ALLOW_ALL, DENY_ALL: _Strategy.DENY_ALL}
_streams = itertools.count(1)


class QuotaServicer:
    """Install with ``rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server``."""

    def __init__(self, coordinator: QuotaCoordinator) -> None:
        self.coordinator = coordinator

    async def StreamRateLimitQuotas(
        self,
        request_iterator: AsyncIterator[rlqs_pb2.RateLimitQuotaUsageReports],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[rlqs_pb2.RateLimitQuotaResponse]:
        instance = instance_name(context)
        coordinator = self.coordinator
        coordinator.connected()
        log.debug("RLQS stream from %s", instance)
        try:
            async for reports in request_iterator:
                usages = [
                    Usage(
                        dict(usage.bucket_id.bucket),
                        usage.num_requests_allowed,
                        usage.num_requests_denied,
                    )
                    for usage in reports.bucket_quota_usages
                ]
                actions = await coordinator.report(instance, reports.domain, usages)
                if actions:
                    yield rlqs_pb2.RateLimitQuotaResponse(
                        bucket_action=[bucket_action(a) for a in actions]
                    )
        finally:
            coordinator.forget(instance)
            log.debug("RLQS stream from %s ended", instance)


def instance_name(context: grpc.aio.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == NODE_ID_HEADER and value:
            return str(value)
    return f"{context.peer()}#{next(_streams)}"


def bucket_action(action: Action) -> Any:
    bucket_id = rlqs_pb2.BucketId(bucket=dict(action.bucket))
    if action.kind == ABANDON:
        return _Action(bucket_id=bucket_id, abandon_action=_Action.AbandonAction())
    if action.token_bucket is not None:
        tb = action.token_bucket
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
        assignment_time_to_live={"seconds": action.ttl_seconds},
        rate_limit_strategy=strategy,
    )
    return _Action(bucket_id=bucket_id, quota_assignment_action=assignment)
