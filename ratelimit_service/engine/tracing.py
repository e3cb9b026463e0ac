"""OpenTelemetry spans for decisions, exported over OTLP (``serve --tracing``).

Off by default, and then free: nothing imports opentelemetry until :class:`Tracing` is built, and
the service installs the traced paths (the servicer's handler, the limiter's store call) only then.

Each ShouldRateLimit call (and each RLQS usage report) is one SERVER span, a child of the caller's
span when its gRPC metadata carries a context (W3C ``traceparent`` / ``tracestate``, or B3 as ``b3``
or ``x-b3-*``), as Envoy's ratelimit filter sends it. A decision that asks the store has a CLIENT
span for that call under its own; the outcome goes on the decision's span
(:func:`outcome_attributes`).

Sampling: a call its caller sampled out is not traced (a span of ours would hang from nothing), nor
a store call outside a traced decision. Any other call is traced with probability ``sampling_rate``:
drawn here for a root span, decided on the trace id otherwise, so services with the same rate keep
the same traces. Spans leave in batches from an SDK thread (BatchSpanProcessor: a bounded queue),
never on the request path; ``OTEL_BSP_*`` tune it and the exporters read ``OTEL_EXPORTER_OTLP_*``
themselves.
"""

from __future__ import annotations

import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from ratelimit_service.core.request import Request
from ratelimit_service.core.settings_table import choices_of, default

PROTOCOLS = choices_of("--tracing-protocol")
INSTRUMENTATION = "ratelimit_service"
RLS_SPAN = "envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
RLQS_SPAN = "envoy.service.rate_limit_quota.v3.RateLimitQuotaService report"
STORE_SPAN = "ratelimit store hit"


def _rpc(service: str, method: str) -> dict[str, str]:
    """A gRPC server span's RPC attributes."""
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


_RPC = _rpc("envoy.service.ratelimit.v3.RateLimitService", "ShouldRateLimit")
_RLQS = _rpc("envoy.service.rate_limit_quota.v3.RateLimitQuotaService", "StreamRateLimitQuotas")
_PROPAGATED = frozenset({"traceparent", "b3", "x-b3-traceid"})
"""Metadata keys that carry a caller's trace context (W3C, B3 single, B3 multi)."""
FLUSH_TIMEOUT_MS = 5000
"""How long stopping waits for the last spans to leave."""
_NEEDS = "pip install 'ratelimit-service[tracing]'"
REINSTALL_PROTO = "pip install --force-reinstall --no-deps opentelemetry-proto"
_Metadata = Sequence[tuple[str, str | bytes]] | None
"""A call's gRPC metadata (``invocation_metadata()``)."""
_Traced = AbstractContextManager[Any] | None
"""A span to enter, or None for a call not traced."""


class TracingUnavailable(RuntimeError):
    """Tracing cannot run here (the extra missing or broken); the message says what to install."""


class Tracing:
    """A tracer provider exporting to one OTLP endpoint, the propagators, and the spans."""

    def __init__(
        self,
        *,
        protocol: str = default("--tracing-protocol"),
        endpoint: str | None = default("--tracing-endpoint"),
        sampling_rate: float = default("--tracing-sampling-rate"),
        service_name: str = default("--tracing-service-name"),
        service_namespace: str = default("--tracing-service-namespace"),
        service_instance_id: str = default("--tracing-service-instance-id"),
    ) -> None:
        """``endpoint``: the OTLP receiver's base URL, as ``OTEL_EXPORTER_OTLP_ENDPOINT``
        (HTTP posts to its ``/v1/traces``); None: the exporter's own default."""
        if protocol not in PROTOCOLS:
            raise ValueError(f"tracing protocol: choose grpc or http, got {protocol!r}")
        sdk = _Sdk(protocol)
        resource = sdk.Resource.create(
            {
                "service.name": service_name,
                "service.namespace": service_namespace,
                # A random one when none is given, as the Go service does.
                "service.instance.id": service_instance_id or str(uuid.uuid4()),
            }
        )
        sampling = sdk.sampling
        sampler = sampling.ParentBased(
            root=sampling.ALWAYS_ON,  # decision() draws for root spans itself
            remote_parent_sampled=sampling.TraceIdRatioBased(sampling_rate),
            remote_parent_not_sampled=sampling.ALWAYS_OFF,
        )
        self._rate = sampling_rate
        self._draw = random.random
        self.provider = sdk.TracerProvider(resource=resource, sampler=sampler)
        self.provider.add_span_processor(sdk.BatchSpanProcessor(sdk.exporter(endpoint)))
        self.tracer = self.provider.get_tracer(INSTRUMENTATION)
        self._propagator = sdk.propagator
        self._current = sdk.get_current_span
        self._server = sdk.SpanKind.SERVER
        self._client = sdk.SpanKind.CLIENT
        self._stopped = False

    def decision(self, metadata: _Metadata) -> _Traced:
        """The span of one ShouldRateLimit call (the store's span goes under it)."""
        return self._span(RLS_SPAN, metadata, _RPC)

    def report(self, metadata: _Metadata, attributes: dict[str, Any]) -> _Traced:
        """The span of one RLQS usage report, under the stream's opening trace context."""
        return self._span(RLQS_SPAN, metadata, {**_RLQS, **attributes})

    def _span(self, name: str, metadata: _Metadata, attributes: dict[str, Any]) -> _Traced:
        """A SERVER span, sampled as the module docstring says; calls not traced are told
        apart here, before the SDK (whose unsampled span costs more)."""
        carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
        parent = None
        if _PROPAGATED.intersection(carrier):
            if carrier.get("traceparent", "").endswith("-00"):
                return None  # W3C: the caller did not sample it (B3: the SDK tells)
            parent = self._propagator.extract(carrier)
            if not self._current(parent).get_span_context().is_valid:
                parent = None  # a context that does not parse: a root span, drawn for
        if parent is None and self._rate < 1.0 and self._draw() >= self._rate:
            return None
        # A root span is sampled here (the SDK's root sampler: always on).
        return self.tracer.start_as_current_span(
            name, context=parent, kind=self._server, attributes=attributes
        )

    def traced_hit(
        self, hit: Callable[..., Awaitable[Any]], store_name: str
    ) -> Callable[..., Awaitable[Any]]:
        """``hit`` (Store.hit) with a CLIENT span per call under a traced decision's span."""
        tracer, kind, current = self.tracer, self._client, self._current

        async def traced(
            hits: Sequence[Any], commit: int, owe: bool = False, deadline: float | None = None
        ) -> Any:
            if not current().is_recording():
                return await hit(hits, commit, owe, deadline)
            attributes: dict[str, Any] = {"ratelimit.store": store_name}
            attributes["ratelimit.store.keys"] = len(hits)
            if store_name.startswith("redis"):
                attributes["db.system"] = "redis"
            with tracer.start_as_current_span(STORE_SPAN, kind=kind, attributes=attributes):
                return await hit(hits, commit, owe, deadline)

        return traced

    def shutdown(self) -> None:
        """Send queued spans (up to FLUSH_TIMEOUT_MS), then stop the exporter, once. Blocking:
        run it off the event loop."""
        if self._stopped:
            return
        self._stopped = True
        self.provider.force_flush(FLUSH_TIMEOUT_MS)
        self.provider.shutdown()


def outcome_attributes(
    request: Request | None,
    rules: Sequence[tuple[int, str]],
    overall: str,
    codes: Sequence[str],
    deciding: str | None = None,
) -> dict[str, Any]:
    """A decision span's attributes: the domain, the overall code, the ``deciding`` rule (as
    the answer's metadata names it), the stats keys of ``rules`` ((descriptor index, stats
    key) per matched rule) and of those whose descriptor's entry in ``codes`` is OVER_LIMIT."""
    attributes: dict[str, Any] = {"ratelimit.overall_code": overall}
    if deciding is not None:
        attributes["ratelimit.rule"] = deciding
    if request is not None:
        attributes["ratelimit.domain"] = request.domain
        attributes["ratelimit.descriptors"] = len(request.descriptors)
    if rules:
        attributes["ratelimit.rules"] = [key for _, key in rules]
    over = [key for index, key in rules if index < len(codes) and codes[index] == "OVER_LIMIT"]
    if over:
        attributes["ratelimit.over_limit_rules"] = over
    return attributes


class _Sdk:
    """The opentelemetry names this module uses, imported on demand (else TracingUnavailable)."""

    def __init__(self, protocol: str) -> None:
        try:
            from opentelemetry.propagators.b3 import B3MultiFormat, B3SingleFormat
            from opentelemetry.propagators.composite import CompositePropagator
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider, sampling
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind, get_current_span
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

            exporter: Any
            if protocol == "grpc":
                from opentelemetry.exporter.otlp.proto.grpc import trace_exporter as exporter
            else:
                from opentelemetry.exporter.otlp.proto.http import trace_exporter as exporter
        except ImportError as exc:
            raise TracingUnavailable(_unavailable(exc)) from None
        self.Resource = Resource
        self.TracerProvider = TracerProvider
        self.BatchSpanProcessor = BatchSpanProcessor
        self.sampling = sampling
        self.SpanKind = SpanKind
        self.get_current_span = get_current_span
        self.propagator = CompositePropagator(
            [TraceContextTextMapPropagator(), B3MultiFormat(), B3SingleFormat()]
        )
        self._exporter = exporter.OTLPSpanExporter
        self._protocol = protocol

    def exporter(self, endpoint: str | None) -> Any:
        if endpoint is None:
            return self._exporter()
        if self._protocol == "http":
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return self._exporter(endpoint=endpoint)


def check_sdk() -> None:
    """Raise TracingUnavailable unless both exporters and the receivers' protos import."""
    for protocol in PROTOCOLS:
        _Sdk(protocol)
    try:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc  # noqa: F401
    except ImportError as exc:
        raise TracingUnavailable(_unavailable(exc)) from None


def _unavailable(exc: ImportError) -> str:
    """What to install, in one line."""
    if exc.name is None or exc.name.startswith("opentelemetry.proto"):
        # xds-protos carries an older copy of opentelemetry-proto's modules; when pip
        # installs it last, its copy replaces the exporters' (a name is then missing).
        return (
            "tracing: opentelemetry-proto's modules are xds-protos's older copy"
            f" ({exc}); run: {REINSTALL_PROTO}"
        )
    return f"tracing needs the tracing extra (no module {exc.name}): {_NEEDS}"
