"""envoy.service.ratelimit.v3.RateLimitService over grpc.aio: protobuf in, core types out.

This module is the only one that touches the Envoy wire types (upb-backed classes
from xds-protos); everything it does is translation.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from ratelimit_service.core.request import (
    UINT32_MAX,
    Code,
    Descriptor,
    InvalidRequest,
    Request,
    Response,
)
from ratelimit_service.core.units import unit_from_wire
from ratelimit_service.limiter import RateLimiter

log = logging.getLogger(__name__)

_RateLimit = rls_pb2.RateLimitResponse.RateLimit
_Status = rls_pb2.RateLimitResponse.DescriptorStatus


def request_from_proto(message: Any) -> Request:
    descriptors = []
    for descriptor in message.descriptors:
        override = None
        if descriptor.HasField("limit"):
            override = (
                descriptor.limit.requests_per_unit,
                unit_from_wire(descriptor.limit.unit),
            )
        hits = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else None
        descriptors.append(
            Descriptor(
                entries=tuple((entry.key, entry.value) for entry in descriptor.entries),
                override=override,
                hits_addend=hits,
            )
        )
    return Request(message.domain, descriptors, message.hits_addend)


def response_to_proto(response: Response) -> Any:
    statuses = []
    for status in response.statuses:
        out = _Status(code=int(status.code), limit_remaining=min(status.remaining, UINT32_MAX))
        limit = status.limit
        if limit is not None:
            out.current_limit.CopyFrom(
                _RateLimit(
                    name=limit.name,
                    requests_per_unit=limit.requests_per_unit,
                    unit=int(limit.unit),
                )
            )
            reset = status.reset_after or 0.0
            seconds = math.floor(reset)
            out.duration_until_reset.seconds = seconds
            out.duration_until_reset.nanos = int((reset - seconds) * 1e9)
        statuses.append(out)
    return rls_pb2.RateLimitResponse(overall_code=int(response.overall), statuses=statuses)


class RateLimitServicer(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(self, limiter: RateLimiter) -> None:
        self.limiter = limiter

    async def ShouldRateLimit(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        stats = self.limiter.stats
        stats.total_requests += 1
        try:
            response = await self.limiter.should_rate_limit(request_from_proto(request))
            return response_to_proto(response)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:
            log.exception("ShouldRateLimit failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            stats.latency.observe(time.perf_counter() - started)


def code_name(code: int) -> str:
    return Code(code).name if code in (1, 2) else "UNKNOWN"
