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
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from ratelimit_service.core.config_model import RateLimit, RateLimitConfig
from ratelimit_service.core.headers import HeaderNames, HeaderStyle, rate_limit_headers
from ratelimit_service.core.request import (
    UINT32_MAX,
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
        entries = tuple([(entry.key, entry.value) for entry in descriptor.entries])
        if not descriptor.HasField("limit") and not descriptor.HasField("hits_addend"):
            descriptors.append(Descriptor(entries))  # the common case: entries only
            continue
        override = None
        if descriptor.HasField("limit"):
            override = (
                descriptor.limit.requests_per_unit,
                unit_from_wire(descriptor.limit.unit),
            )
        hits = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else None
        descriptors.append(Descriptor(entries, override, hits))
    return Request(message.domain, descriptors, message.hits_addend)


class _LimitProtos:
    """``current_limit`` messages built once per configured limit, not per response.
    Limits from per-request overrides are built each time (they are not kept)."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[RateLimit, Any]] = {}

    def get(self, limit: RateLimit) -> Any:
        entry = self._by_id.get(id(limit))
        if entry is not None and entry[0] is limit:
            return entry[1]
        return _limit_proto(limit)

    def install(self, config: RateLimitConfig) -> None:
        self._by_id = {id(limit): (limit, _limit_proto(limit)) for limit in config.limits()}


_NO_CACHE = _LimitProtos()


def _limit_proto(limit: RateLimit) -> Any:
    return _RateLimit(
        name=limit.name, requests_per_unit=limit.requests_per_unit, unit=int(limit.unit)
    )


def response_to_proto(
    response: Response,
    headers: list[tuple[str, str]] | None = None,
    limit_protos: _LimitProtos | None = None,
) -> Any:
    protos = limit_protos or _NO_CACHE
    statuses = []
    for status in response.statuses:
        out = _Status(code=int(status.code), limit_remaining=min(status.remaining, UINT32_MAX))
        limit = status.limit
        if limit is not None:
            out.current_limit.CopyFrom(protos.get(limit))
            reset = status.reset_after or 0.0
            seconds = math.floor(reset)
            out.duration_until_reset.seconds = seconds
            out.duration_until_reset.nanos = int((reset - seconds) * 1e9)
        statuses.append(out)
    message = rls_pb2.RateLimitResponse(overall_code=int(response.overall), statuses=statuses)
    if headers:
        message.response_headers_to_add.extend(
            base_pb2.HeaderValue(key=key, value=value) for key, value in headers
        )
    return message


class RateLimitServicer(rls_pb2_grpc.RateLimitServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        limiter: RateLimiter,
        header_style: HeaderStyle = HeaderStyle.OFF,
        header_names: HeaderNames | None = None,
    ) -> None:
        self.limiter = limiter
        self.header_style = header_style
        self.header_names = header_names or HeaderNames()
        self._limit_protos = _LimitProtos()
        self._protos_for: RateLimitConfig | None = None

    async def ShouldRateLimit(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        stats = self.limiter.stats
        stats.total_requests += 1
        try:
            config = self.limiter.config
            if config is not self._protos_for:  # a reload: rebuild the prebuilt limits
                self._limit_protos.install(config)
                self._protos_for = config
            response = await self.limiter.should_rate_limit(request_from_proto(request))
            headers = None
            if self.header_style is not HeaderStyle.OFF:
                headers = rate_limit_headers(
                    response.statuses, self.header_style, self.header_names
                )
            return response_to_proto(response, headers, self._limit_protos)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:
            log.exception("ShouldRateLimit failed")
            await context.abort(grpc.StatusCode.INTERNAL, "internal error")
        finally:
            stats.latency.observe(time.perf_counter() - started)
