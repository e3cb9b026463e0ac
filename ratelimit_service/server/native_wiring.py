"""The native front door's routes (server/native_grpc.py): ShouldRateLimit by the RLS
servicer, health Check from the statuses the app publishes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from ratelimit_service.rls.servicer import RLS_SERVICE, CallFailed, RateLimitServicer
from ratelimit_service.server.native_grpc import Context, Route

HEALTH_CHECK = "/grpc.health.v1.Health/Check"


def native_routes(servicer: RateLimitServicer, health: Mapping[str, int]) -> dict[str, Route]:
    """ShouldRateLimit (answered at once when no store is asked, else when the store's
    future is done; with tracing on, every call goes through the traced coroutine) and
    Health/Check (``health``: each service name's status, as published to grpcio's
    health servicer)."""

    async def traced(raw: bytes, context: Context) -> bytes:
        return await servicer.traced_should_rate_limit(raw, _as_grpc(context))

    def never(raw: bytes) -> bytes | None:
        return None

    rls = Route(never, start=servicer.begin) if servicer.tracing is None else Route(never, traced)
    return {
        f"/{RLS_SERVICE}/ShouldRateLimit": rls,
        HEALTH_CHECK: Route(lambda raw: _health_check(raw, health)),
    }


def _health_check(raw: bytes, health: Mapping[str, int]) -> bytes:
    """grpc.health.v1's Check, as grpcio's health servicer answers it."""
    try:
        service = health_pb2.HealthCheckRequest.FromString(raw).service
    except DecodeError as exc:
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {exc}") from exc
    status = health.get(service)
    if status is None:  # no details, as grpcio's servicer (context.abort(NOT_FOUND))
        raise CallFailed(grpc.StatusCode.NOT_FOUND, "")
    return bytes(health_pb2.HealthCheckResponse(status=status).SerializeToString())


def _as_grpc(context: Context) -> Any:
    """The context where the servicer expects grpc.aio's (it uses time_remaining, abort and
    invocation_metadata, which Context has)."""
    return context
