"""Response headers (opt-in): the pure choice and format (core/headers.py), then over gRPC."""

from __future__ import annotations

from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_service.core.config_model import HeaderStyle, RateLimit
from ratelimit_service.core.decision import verdict
from ratelimit_service.core.headers import HeaderNames, rate_limit_headers
from ratelimit_service.core.request import Code, DescriptorStatus
from ratelimit_service.core.units import Unit

OVER = rls_pb2.RateLimitResponse.OVER_LIMIT


def status(code: Code, count: int, remaining: int, quota: bool = False) -> DescriptorStatus:
    limit = RateLimit(count, Unit.MINUTE, quota_mode=quota)
    return DescriptorStatus(code, limit, remaining, reset_after=12.2)


def test_smallest_remaining_is_chosen() -> None:
    statuses = [status(Code.OK, 10, 7), status(Code.OK, 5, 2), DescriptorStatus(Code.OK)]
    assert verdict(statuses)[1] is statuses[1]


def test_over_limit_wins_unless_quota_and_last_wins() -> None:
    first_over, second_over = status(Code.OVER_LIMIT, 10, 0), status(Code.OVER_LIMIT, 20, 0)
    quota_over = status(Code.OVER_LIMIT, 1, 0, quota=True)
    statuses = [first_over, status(Code.OK, 5, 0), second_over, quota_over]
    assert verdict(statuses)[1] is second_over


def test_no_limit_no_headers() -> None:
    none = [DescriptorStatus(Code.OK), DescriptorStatus(Code.OK, remaining=2**32 - 1)]
    assert verdict(none)[1] is None
    assert rate_limit_headers(None, HeaderStyle.RATELIMIT, HeaderNames()) == []
    assert rate_limit_headers(status(Code.OK, 1, 1), HeaderStyle.OFF, HeaderNames()) == []


def test_header_values_and_styles() -> None:
    decided = status(Code.OK, 10, 4)
    assert rate_limit_headers(decided, HeaderStyle.RATELIMIT, HeaderNames()) == [
        ("RateLimit-Limit", "10"),
        ("RateLimit-Remaining", "4"),
        ("RateLimit-Reset", "13"),
    ]
    names = HeaderNames("X-Quota", "X-Left", "X-Retry")
    assert [n for n, _ in rate_limit_headers(decided, HeaderStyle.RATELIMIT, names)] == [
        "X-Quota",
        "X-Left",
        "X-Retry",
    ]
    assert rate_limit_headers(decided, HeaderStyle.DRAFT03, names) == [
        ("X-RateLimit-Limit", "10, 10;w=60"),
        ("X-RateLimit-Remaining", "4"),
        ("X-RateLimit-Reset", "13"),
    ]


async def test_headers_over_grpc(write_config, start_service) -> None:
    config = write_config(
        """
        domain: d
        descriptors:
          - key: a
            mode: exact
            rate_limit: {unit: minute, requests_per_unit: 2}
          - key: b
            mode: exact
            rate_limit: {unit: hour, requests_per_unit: 100}
        """
    )
    svc = await start_service(
        config,
        response_headers=HeaderStyle.RATELIMIT,
        header_names=HeaderNames("X-Limit", "X-Remaining", "X-Reset"),
    )
    response = await svc.call("d", [("a", "1")], [("b", "1")])
    headers = {h.key: h.value for h in response.response_headers_to_add}
    assert headers["X-Limit"] == "2" and headers["X-Remaining"] == "1"
    assert 1 <= int(headers["X-Reset"]) <= 62
    await svc.call("d", [("a", "1")])
    denied = await svc.call("d", [("b", "1")], [("a", "1")])
    assert denied.overall_code == OVER
    headers = {h.key: h.value for h in denied.response_headers_to_add}
    assert (headers["X-Limit"], headers["X-Remaining"]) == ("2", "0")


async def test_no_headers_by_default(write_config, start_service) -> None:
    config = write_config(
        "domain: d\ndescriptors:\n  - key: a\n"
        "    rate_limit: {unit: minute, requests_per_unit: 2}\n"
    )
    svc = await start_service(config)
    response = await svc.call("d", [("a", "1")])
    assert list(response.response_headers_to_add) == []
