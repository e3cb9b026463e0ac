"""--tracing in a running service: spans over OTLP/HTTP to a receiver the test runs,
under the trace context each gRPC call carries (W3C traceparent or B3), with the
store call under the decision and the outcome as attributes; sampling as documented.
The service exports every 50 ms (OTEL_BSP_SCHEDULE_DELAY); the tests wait for spans
to arrive, never for a fixed time."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_harness.fixtures import make_request
from ratelimit_service.engine.tracing import RLQS_SPAN, RLS_SPAN, STORE_SPAN

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
RULES = """
domain: edge
descriptors:
  - key: tenant
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: user
    rate_limit: {unit: minute, requests_per_unit: 100}
"""


def traceparent(sampled: bool = True) -> tuple[str, str, str]:
    """A caller's trace id, span id and the traceparent header naming them."""
    trace, span = secrets.token_hex(16), secrets.token_hex(8)
    return trace, span, f"00-{trace}-{span}-{'01' if sampled else '00'}"


@pytest.fixture
async def traced(
    write_config: Any, start_service: Any, http_receiver: Any, monkeypatch: pytest.MonkeyPatch
) -> Any:
    """A service tracing every call to ``http_receiver`` over HTTP."""

    async def start(schedule_delay_ms: int = 50, **settings: Any) -> Any:
        monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", str(schedule_delay_ms))
        return await start_service(
            write_config(RULES),
            tracing=True,
            tracing_protocol="http",
            tracing_endpoint=http_receiver.endpoint,
            tracing_service_name="rls-under-test",
            **settings,
        )

    return start


async def call(service: Any, descriptor: tuple[str, str], metadata: Any = ()) -> int:
    request = make_request("edge", [descriptor])
    response = await service.stub.ShouldRateLimit(request, metadata=metadata)
    return int(response.overall_code)


def by_parent(spans: list[Any], parent: str) -> list[Any]:
    return [span for span in spans if span.parent_span_id == parent]


async def test_each_decision_is_a_span_under_the_callers_with_the_store_call_under_it(
    traced: Any, http_receiver: Any
) -> None:
    service = await traced()
    callers = [traceparent() for _ in range(3)]
    codes = [
        await call(service, ("tenant", "acme"), (("traceparent", header),))
        for _, _, header in callers
    ]
    assert codes == [OK, OK, OVER]
    spans = await http_receiver.wait_for_async(
        "three decisions and their store calls",
        lambda spans: len([s for s in spans if s.name == STORE_SPAN]) == 3,
    )
    for (trace, parent, _), code in zip(callers, ("OK", "OK", "OVER_LIMIT"), strict=True):
        (decision,) = by_parent(spans, parent)
        assert decision.name == RLS_SPAN
        assert decision.trace_id == trace
        assert decision.service == "rls-under-test"
        assert decision.kind == 2  # SERVER
        assert decision.attributes["ratelimit.overall_code"] == code
        assert decision.attributes["ratelimit.domain"] == "edge"
        assert decision.attributes["ratelimit.rules"] == ["edge.tenant"]
        assert decision.attributes["ratelimit.rule"] == "edge.tenant"  # the deciding rule
        denied = decision.attributes.get("ratelimit.over_limit_rules")
        assert denied == (["edge.tenant"] if code == "OVER_LIMIT" else None)
        (store,) = by_parent(spans, decision.span_id)
        assert store.name == STORE_SPAN
        assert store.trace_id == trace
        assert store.kind == 3  # CLIENT
        assert store.attributes["ratelimit.store"] == "embedded"
    assert len(spans) == 6


async def test_a_request_too_large_to_keep_still_names_its_rules(
    traced: Any, http_receiver: Any
) -> None:
    """A large request is parsed again for its span (it is not kept by its bytes):
    its rules are matched again, not lost."""
    service = await traced()
    _, parent, header = traceparent()
    assert await call(service, ("user", "u" * 600), (("traceparent", header),)) == OK
    spans = await http_receiver.wait_for_async(
        "the decision", lambda spans: bool(by_parent(spans, parent))
    )
    (decision,) = by_parent(spans, parent)
    assert decision.attributes["ratelimit.rules"] == ["edge.user"]


async def test_b3_headers_are_a_parent_too(traced: Any, http_receiver: Any) -> None:
    service = await traced()
    trace, parent = secrets.token_hex(16), secrets.token_hex(8)
    assert await call(service, ("user", "u1"), (("b3", f"{trace}-{parent}-1"),)) == OK
    multi_trace, multi_parent = secrets.token_hex(16), secrets.token_hex(8)
    headers = (
        ("x-b3-traceid", multi_trace),
        ("x-b3-spanid", multi_parent),
        ("x-b3-sampled", "1"),
    )
    assert await call(service, ("user", "u1"), headers) == OK
    spans = await http_receiver.wait_for_async(
        "two decisions", lambda spans: len([s for s in spans if s.name == RLS_SPAN]) == 2
    )
    (single,) = by_parent(spans, parent)
    assert single.trace_id == trace
    (multi,) = by_parent(spans, multi_parent)
    assert multi.trace_id == multi_trace
    # A probabilistic rule decides in the process: no store call, no store span.
    assert [span.name for span in spans] == [RLS_SPAN, RLS_SPAN]


async def test_calls_the_caller_sampled_out_are_never_traced(
    traced: Any, http_receiver: Any
) -> None:
    service = await traced()
    _, dropped, header = traceparent(sampled=False)
    assert await call(service, ("user", "u1"), (("traceparent", header),)) == OK
    assert await call(service, ("tenant", "t1"), (("traceparent", header),)) == OK  # exact
    assert await call(service, ("user", "u1")) == OK  # no caller: a root span at rate 1
    _, kept, header = traceparent()
    assert await call(service, ("user", "u1"), (("traceparent", header),)) == OK
    spans = await http_receiver.wait_for_async(
        "the last call's span", lambda spans: bool(by_parent(spans, kept))
    )
    assert not by_parent(spans, dropped)
    assert [span.parent_span_id for span in spans] == ["", kept]  # no store span either


async def test_at_a_sampling_rate_of_0_nothing_is_traced(traced: Any, http_receiver: Any) -> None:
    service = await traced(tracing_sampling_rate=0.0)
    for _ in range(5):
        _, _, header = traceparent()
        assert await call(service, ("user", "u1"), (("traceparent", header),)) == OK
    # A context that does not parse is no parent: the call is a root, drawn for too.
    for carrier in (("traceparent", "00-not-a-trace-01"), ("x-b3-traceid", "a" * 32)):
        assert await call(service, ("user", "u1"), (carrier,)) == OK
    await service.service.stop()  # flushes what the processor holds
    assert http_receiver.spans() == []


async def test_stopping_sends_the_spans_still_queued(traced: Any, http_receiver: Any) -> None:
    service = await traced(schedule_delay_ms=600_000)  # no timed export: stopping sends them
    _, parent, header = traceparent()
    assert await call(service, ("user", "u1"), (("traceparent", header),)) == OK
    assert http_receiver.spans() == []
    await service.service.stop()
    assert [span.parent_span_id for span in http_receiver.spans()] == [parent]


async def test_each_rlqs_report_is_a_span_under_the_streams_context(
    traced: Any, http_receiver: Any
) -> None:
    service = await traced()
    trace, parent, header = traceparent()
    stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(service.channel)
    stream = stub.StreamRateLimitQuotas(
        metadata=(("x-envoy-node-id", "envoy-1"), ("traceparent", header))
    )
    usage = rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage
    for allowed in (3, 4):
        await stream.write(
            rlqs_pb2.RateLimitQuotaUsageReports(
                domain="edge",
                bucket_quota_usages=[
                    usage(
                        bucket_id=rlqs_pb2.BucketId(bucket={"user": "u1"}),
                        num_requests_allowed=allowed,
                        num_requests_denied=1,
                    )
                ],
            )
        )
        assert (await stream.read()).bucket_action
    stream.cancel()
    spans = await http_receiver.wait_for_async(
        "two reports", lambda spans: len(by_parent(spans, parent)) == 2
    )
    for span, allowed in zip(by_parent(spans, parent), (3, 4), strict=True):
        assert span.name == RLQS_SPAN
        assert span.trace_id == trace
        assert span.attributes["rlqs.instance"] == "envoy-1"
        assert span.attributes["rlqs.buckets"] == 1
        assert span.attributes["rlqs.requests_allowed"] == allowed
        assert span.attributes["rlqs.requests_denied"] == 1
        assert span.attributes["ratelimit.domain"] == "edge"


async def test_off_the_untraced_path_is_installed(write_config: Any, start_service: Any) -> None:
    service = (await start_service(write_config(RULES))).service
    assert service.tracing is None
    assert service.servicer.tracing is None  # handler() serves should_rate_limit itself
    assert service.limiter.hit_store == service.store.hit
