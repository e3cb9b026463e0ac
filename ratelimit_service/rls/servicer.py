"""envoy.service.ratelimit.v3.RateLimitService over grpc.aio: bytes in, core types, bytes out.

On the gRPC path, this module and rls/wire.py are the only ones that touch Envoy's RLS
wire types (server/go_http.py translates the Go HTTP port's JSON with them too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import grpc
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf.message import DecodeError

from ratelimit_service.core.config_model import HeaderStyle, RateLimitConfig
from ratelimit_service.core.exact import ExactResult
from ratelimit_service.core.headers import HeaderNames, rate_limit_headers
from ratelimit_service.core.request import Descriptor, InvalidRequest, Request, Response
from ratelimit_service.core.settings_table import default
from ratelimit_service.core.units import unit_from_wire
from ratelimit_service.engine.limiter import Deciding, Overloaded, RateLimiter
from ratelimit_service.engine.loop_lag import LoopLag
from ratelimit_service.engine.tracing import Tracing, outcome_attributes
from ratelimit_service.rls.wire import LimitHeads, RequestCache, encode_response

log = logging.getLogger(__name__)

RLS_SERVICE = rls_pb2.DESCRIPTOR.services_by_name["RateLimitService"].full_name


def request_from_proto(message: Any) -> Request:
    descriptors = []
    for descriptor in message.descriptors:
        entries = tuple([(entry.key, entry.value) for entry in descriptor.entries])
        if not descriptor.HasField("limit") and not descriptor.HasField("hits_addend"):
            descriptors.append(Descriptor(entries))  # the common case: entries only
            continue
        override = None
        if descriptor.HasField("limit"):
            override = (descriptor.limit.requests_per_unit, unit_from_wire(descriptor.limit.unit))
        hits = descriptor.hits_addend.value if descriptor.HasField("hits_addend") else None
        descriptors.append(Descriptor(entries, override, hits))
    return Request(message.domain, descriptors, message.hits_addend)


class CallFailed(Exception):
    """A call answered with a gRPC status instead of a response."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code = code
        self.details = details


class _MalformedRequest(InvalidRequest):
    """Bytes that are not a RateLimitRequest."""


def _parse(raw: bytes) -> Request:
    try:
        message = rls_pb2.RateLimitRequest.FromString(raw)
    except DecodeError as exc:
        raise _MalformedRequest(f"malformed RateLimitRequest: {exc}") from exc
    return request_from_proto(message)


class Answering:
    """A call waiting for the store (RateLimitServicer.begin): ``waiting`` is done when the
    store has answered, failed or given up; :meth:`finish` then gives the answer's bytes."""

    __slots__ = ("_decision", "_request", "_servicer", "_started", "_waited", "waiting")

    def __init__(
        self,
        servicer: RateLimitServicer,
        request: Request,
        decision: Deciding,
        started: float,
        waited: float,
    ) -> None:
        self._servicer, self._request, self._decision = servicer, request, decision
        self._started, self._waited = started, waited
        waiting = decision.waiting
        if not isinstance(waiting, asyncio.Future):  # a Redis Cluster's call: a coroutine
            waiting = asyncio.ensure_future(waiting)
        self.waiting: asyncio.Future[list[ExactResult]] = waiting
        """The store's reply: the batcher's future, or a task of its own."""

    def finish(self) -> bytes:
        """The answer, once ``waiting`` is done and not cancelled; raises CallFailed."""
        servicer = self._servicer
        try:
            return servicer._encode(self._request, self._decision.settle(self.waiting))
        except Exception as exc:
            raise servicer._failed(exc) from exc
        finally:
            servicer._observe(self._started, self._waited)


class RateLimitServicer:
    """ShouldRateLimit on raw bytes (see rls/wire.py): install with :meth:`handler`."""

    def __init__(
        self,
        limiter: RateLimiter,
        header_style: HeaderStyle = default("--response-headers"),
        header_names: HeaderNames | None = None,
        deadline_margin: float = default("--deadline-margin"),
        lag: LoopLag | None = None,
        tracing: Tracing | None = None,
        go_metadata: bool = False,
    ) -> None:
        self.limiter = limiter
        self.go_metadata = go_metadata
        """Answers carry envoyproxy/ratelimit's dynamic metadata keys beside ours."""
        self.tracing = tracing
        self.lag = lag if lag is not None else LoopLag()
        """Tells the latency histogram what a call waited for the loop before it."""
        self.deadline_margin = deadline_margin
        self.header_style = header_style
        self.header_names = header_names or HeaderNames()
        self._headers = header_style is not HeaderStyle.OFF or bool(self.header_names.rule)
        self._heads = LimitHeads()
        self._bytes_for: RateLimitConfig | None = None
        self._requests = RequestCache(_parse)

    def handler(self) -> grpc.GenericRpcHandler:
        """The RLS service, bytes in and out (with tracing on: :meth:`traced_should_rate_limit`)."""
        call = self.should_rate_limit if self.tracing is None else self.traced_should_rate_limit
        method = grpc.unary_unary_rpc_method_handler(call)
        return grpc.method_handlers_generic_handler(RLS_SERVICE, {"ShouldRateLimit": method})

    async def should_rate_limit(self, raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
        """The call's latency goes to the latency histogram: from the handler's start to its answer,
        plus the time the call waited behind a pause of the loop before it (LoopLag.held's
        estimate). Not in it: time in the network, the kernel and gRPC's core."""
        started = time.perf_counter()
        self.limiter.stats.total_requests += 1
        try:
            request, response = self._decide_locally(raw)
            if response is None:  # the store decides: it may wait until the caller's deadline
                remaining = context.time_remaining()
                deadline = None
                if remaining is not None:
                    deadline = asyncio.get_running_loop().time() + remaining - self.deadline_margin
                response = await self.limiter.should_rate_limit(request, deadline)
            return self._encode(request, response)
        except Exception as exc:
            failed = self._failed(exc)
            await context.abort(failed.code, failed.details)
        finally:
            self._observe(started)
        raise AssertionError("context.abort() returned")  # it always raises

    def begin(self, raw: bytes, deadline: float | None, waited: float) -> bytes | Answering:
        """:meth:`should_rate_limit` without a coroutine, for the native front door: the
        answer now (no store asked, or the store refused at once), or an :class:`Answering`
        whose ``waiting`` the front door watches, then finishes. ``deadline``: the call's,
        on the loop's clock; ``waited``: what it waited for the loop before it was read.
        Raises CallFailed where :meth:`should_rate_limit` aborts."""
        started = time.perf_counter()
        self.limiter.stats.total_requests += 1
        try:
            request, response = self._decide_locally(raw)
            if response is None:  # the store decides: it may wait until the caller's deadline
                if deadline is not None:
                    deadline -= self.deadline_margin
                decision = self.limiter.decide(request, deadline)
                if isinstance(decision, Deciding):
                    return Answering(self, request, decision, started, waited)
                response = decision
            answer = self._encode(request, response)
        except Exception as exc:
            self._observe(started, waited)
            raise self._failed(exc) from exc
        self._observe(started, waited)
        return answer

    def _decide_locally(self, raw: bytes) -> tuple[Request, Response | None]:
        """The request (parsed once per distinct bytes) and its answer if no store is asked."""
        config = self.limiter.config
        if config is not self._bytes_for:  # a reload: rebuild the prebuilt limits,
            self._heads = LimitHeads(config.limits())  # and forget requests planned
            self._requests.clear()  # under the old config (their plans keep it alive)
            self._bytes_for = config
        request = self._requests.find(raw)
        if request is None:
            request = self._requests.get(raw)
        return request, self.limiter.decide_locally(request)

    def _encode(self, request: Request, response: Response) -> bytes:
        headers = None
        if self._headers:
            headers = rate_limit_headers(response.decided, self.header_style, self.header_names)
        go_request = request if self.go_metadata else None
        return encode_response(response, headers, self._heads, request.domain, go_request)

    def _failed(self, exc: Exception) -> CallFailed:
        """The status a failed call is answered with (the limiter counted it, but a
        malformed request, counted here)."""
        if isinstance(exc, InvalidRequest):
            if isinstance(exc, _MalformedRequest):
                self.limiter.stats.service_error += 1
            return CallFailed(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if isinstance(exc, Overloaded):  # the client's policy decides
            return CallFailed(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        log.error("ShouldRateLimit failed", exc_info=exc)
        return CallFailed(grpc.StatusCode.INTERNAL, "internal error")

    def _observe(self, started: float, waited: float | None = None) -> None:
        elapsed = time.perf_counter() - started
        elapsed += self.lag.waited(started) if waited is None else waited
        self.limiter.stats.latency.observe(elapsed)

    async def traced_should_rate_limit(
        self, raw: bytes, context: grpc.aio.ServicerContext
    ) -> bytes:
        """:meth:`should_rate_limit` inside its span (engine/tracing.py), with the outcome
        read back from the answer's bytes when sampled: what the caller was told."""
        assert self.tracing is not None
        traced = self.tracing.decision(context.invocation_metadata())
        if traced is None:  # not sampled
            return await self.should_rate_limit(raw, context)
        with traced as span:
            answer = await self.should_rate_limit(raw, context)
            if span.is_recording():
                try:
                    span.set_attributes(self._outcome(raw, answer))
                except Exception:  # the answer stands; only its span lacks the outcome
                    log.debug("a decision's span attributes failed", exc_info=True)
            return answer

    def _outcome(self, raw: bytes, answer: bytes) -> dict[str, Any]:
        request = self._requests.get(raw)  # a large request, not kept, is parsed again
        response = rls_pb2.RateLimitResponse.FromString(answer)
        name = rls_pb2.RateLimitResponse.Code.Name
        deciding = response.dynamic_metadata.fields.get("rule")
        return outcome_attributes(
            request,
            self.limiter.rules_of(request),
            name(response.overall_code),
            [name(status.code) for status in response.statuses],
            None if deciding is None else deciding.string_value,
        )
