"""OTLP trace receivers on loopback, for tests of tracing: one over gRPC
(opentelemetry.proto.collector.trace.v1.TraceService/Export, what Envoy's
OpenTelemetry tracer and the gRPC exporter send) and one over HTTP (POST /v1/traces
with a protobuf body, what the HTTP exporter sends). Both keep every span they
receive, flattened with its resource's service.name, for tests to look through.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from ratelimit_harness.waiting import eventually, eventually_async

_Request = trace_service_pb2.ExportTraceServiceRequest
_Reply = trace_service_pb2.ExportTraceServiceResponse


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    """The service.name of the resource that sent it."""
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    """Hex, as the ids are in ``traceparent``; empty for a root span."""
    kind: int
    attributes: dict[str, Any]
    status_code: int


def _value(any_value: Any) -> Any:
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def spans_of(request: Any) -> list[ReceivedSpan]:
    """An ExportTraceServiceRequest's spans, flattened."""
    found = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                found.append(
                    ReceivedSpan(
                        service=str(resource.get("service.name", "")),
                        name=span.name,
                        trace_id=span.trace_id.hex(),
                        span_id=span.span_id.hex(),
                        parent_span_id=span.parent_span_id.hex(),
                        kind=span.kind,
                        attributes={a.key: _value(a.value) for a in span.attributes},
                        status_code=span.status.code,
                    )
                )
    return found


class _Spans:
    """What a receiver has been sent, shared with its threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.requests = 0

    def add(self, request: Any) -> None:
        received = spans_of(request)
        with self._lock:
            self._spans.extend(received)
            self.requests += 1

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def wait_for(
        self, what: str, found: Callable[[list[ReceivedSpan]], bool], timeout: float = 15.0
    ) -> list[ReceivedSpan]:
        """Every span received, once ``found`` holds for them."""
        eventually(lambda: found(self.spans()), timeout=timeout, what=what, context=self._seen)
        return self.spans()

    async def wait_for_async(
        self, what: str, found: Callable[[list[ReceivedSpan]], bool], timeout: float = 15.0
    ) -> list[ReceivedSpan]:
        """:meth:`wait_for` for a test on the event loop (which keeps running)."""
        await eventually_async(
            lambda: found(self.spans()), timeout=timeout, what=what, context=self._seen
        )
        return self.spans()

    def _seen(self) -> str:
        return "\n".join(map(repr, self.spans())) or "(no span received)"


class GrpcReceiver(_Spans):
    """TraceService/Export on a free loopback port; ``endpoint`` is its URL."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: grpc.ServicerContext) -> Any:
                receiver.add(request)
                return _Reply()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        add = trace_service_pb2_grpc.add_TraceServiceServicer_to_server  # untyped: generated
        add(Service(), self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def start(self) -> GrpcReceiver:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(0)


class HttpReceiver(_Spans):
    """POST /v1/traces (protobuf, gzip or not) on a free loopback port; ``endpoint``
    is its base URL (the exporter appends /v1/traces)."""

    def __init__(self) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_error(404)
                    return
                receiver.add(_Request.FromString(body))
                reply = _Reply().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> HttpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
