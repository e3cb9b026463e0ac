"""envoyproxy/ratelimit's HTTP endpoints: ``/healthcheck`` and ``/json`` (its ``PORT``).

``POST /json`` takes a RateLimitRequest in the protobuf JSON mapping (as the Go service's
protojson accepts it) and answers the RateLimitResponse in JSON: 200 for OK, 429 for
OVER_LIMIT, 500 for UNKNOWN, 400 with the reason for a body that is no such request or a
request the service refuses. The decision is the gRPC one: the request goes through the
same :class:`RateLimitServicer` as wire bytes. ``GET /healthcheck`` is 200 ``OK`` while
the service serves and 500 once it is not (draining or stopping), as the Go service's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import cast

import grpc
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import json_format

from ratelimit_service.rls.servicer import RateLimitServicer
from ratelimit_service.server.http_server import Handler, PageResult

log = logging.getLogger(__name__)

_RESPONSE = rls_pb2.RateLimitResponse
_OVERALL_STATUS = {_RESPONSE.OK: 200, _RESPONSE.OVER_LIMIT: 429, _RESPONSE.UNKNOWN: 500}
_ABORT_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 503}


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code


class _JsonCallContext:
    """What should_rate_limit uses of a call's context (an HTTP call has no deadline)."""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise _Aborted(code, details)

    def time_remaining(self) -> float | None:
        return None


class GoEndpoints:
    """The handlers of ``/healthcheck`` and ``/json`` for :class:`HttpServer`."""

    def __init__(self, servicer: RateLimitServicer, healthy: Callable[[], bool]) -> None:
        self.servicer = servicer
        self.healthy = healthy

    def routes(self) -> dict[str, Handler]:
        return {"/healthcheck": self.healthcheck, "/json": self.json}

    async def healthcheck(self, method: str, body: bytes, query: str) -> PageResult:
        if self.healthy():
            return 200, "text/plain; charset=utf-8", b"OK"
        return 500, "text/plain; charset=utf-8", b"NOT SERVING\n"

    async def json(self, method: str, body: bytes, query: str) -> PageResult:
        try:
            message = json_format.Parse(body.decode("utf-8"), rls_pb2.RateLimitRequest())
        except (json_format.ParseError, UnicodeDecodeError, RecursionError) as exc:
            log.debug("/json: not a JSON RateLimitRequest: %s", exc)
            return _error(400, f"not a JSON RateLimitRequest: {exc}")
        context = cast(grpc.aio.ServicerContext, _JsonCallContext())
        try:
            raw = await self.servicer.should_rate_limit(message.SerializeToString(), context)
        except _Aborted as exc:
            return _error(_ABORT_STATUS.get(exc.code, 500), str(exc))
        response = _RESPONSE.FromString(raw)
        text = json.dumps(json_format.MessageToDict(response), separators=(",", ":"))
        return _OVERALL_STATUS.get(response.overall_code, 500), "application/json", text.encode()


def _error(status: int, message: str) -> PageResult:
    return status, "text/plain; charset=utf-8", f"{HTTPStatus(status).phrase}: {message}\n".encode()
