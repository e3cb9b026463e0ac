"""The hand-written response encoding and the request cache, checked against the
protobuf runtime (and, for malformed bytes, through a real gRPC server)."""

from __future__ import annotations

import math
import random

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_service.core.config_model import OverLimitAnswer, RateLimit
from ratelimit_service.core.decision import answer
from ratelimit_service.core.request import (
    UINT32_MAX,
    Code,
    Descriptor,
    DescriptorStatus,
    Request,
    Response,
)
from ratelimit_service.core.units import Unit
from ratelimit_service.rls import wire as rls_wire
from ratelimit_service.rls.servicer import RLS_SERVICE

R = rls_pb2.RateLimitResponse


def reference(response: Response, headers: list[tuple[str, str]]) -> rls_pb2.RateLimitResponse:
    """The same response built with protobuf objects, field by field."""
    message = R(overall_code=int(response.overall))
    for status in response.statuses:
        out = message.statuses.add(code=int(status.code))
        out.limit_remaining = min(status.remaining, UINT32_MAX)
        if status.limit is not None:
            limit = status.limit
            out.current_limit.name = limit.name
            out.current_limit.requests_per_unit = limit.requests_per_unit
            out.current_limit.unit = int(limit.unit)
            millis = math.ceil((status.reset_after or 0.0) * 1000)  # whole ms, rounded up
            out.duration_until_reset.seconds = millis // 1000
            out.duration_until_reset.nanos = millis % 1000 * 1_000_000
    for key, value in headers:
        message.response_headers_to_add.append(base_pb2.HeaderValue(key=key, value=value))
    return message


def random_response(rng: random.Random) -> tuple[Response, list[tuple[str, str]]]:
    limits = [
        RateLimit(requests_per_unit=rng.choice([0, 1, 127, 128, 300, 2**31, UINT32_MAX]),
                  unit=rng.choice(list(Unit)), name=rng.choice(["", "n", "ünï-" * 40]))
        for _ in range(3)
    ]  # fmt: skip
    statuses = []
    for _ in range(rng.randint(0, 6)):
        limit = rng.choice([None, *limits])
        statuses.append(
            DescriptorStatus(
                code=rng.choice(list(Code)),
                limit=limit,
                remaining=rng.choice(  # every varint length, each side of its boundary
                    [
                        0,
                        1,
                        127,
                        128,
                        16383,
                        16384,
                        2**21 - 1,
                        2**21,
                        2**28 - 1,
                        2**28,
                        UINT32_MAX,
                        UINT32_MAX + 5,
                    ]
                ),
                reset_after=rng.choice(
                    [None, 0.0, 0.0004, 0.5, 1.0, 1.0001, 59.999999, 3600.25, 86400 * 400.0]
                ),
            )
        )
    headers = [(f"h{i}", rng.choice(["", "1", "ä" * 200])) for i in range(rng.randint(0, 3))]
    return Response(rng.choice(list(Code)), statuses), headers


def test_encoding_parses_to_the_same_message() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        response, headers = random_response(rng)
        encoded = rls_wire.encode_response(response, headers)
        assert R.FromString(encoded) == reference(response, headers)


def test_encoding_with_prebuilt_heads_parses_to_the_same_message(monkeypatch) -> None:
    """Heads prebuilt for some limits (a config's), serialized on the spot for the
    others (per-request overrides); the high-part cache small enough to be cleared."""
    monkeypatch.setattr(rls_wire, "MAX_CACHED_HIGHS", 4)
    monkeypatch.setattr(rls_wire, "_HIGHS", {})
    rng = random.Random(11)
    for _ in range(1000):
        response, headers = random_response(rng)
        limits = [status.limit for status in response.statuses if status.limit is not None]
        heads = rls_wire.LimitHeads(limits[: rng.randint(0, len(limits))])
        encoded = rls_wire.encode_response(response, headers, heads)
        assert R.FromString(encoded) == reference(response, headers)
        assert len(rls_wire._HIGHS) <= 4


def test_limit_heads_are_found_by_identity_only() -> None:
    limit = RateLimit(requests_per_unit=5, unit=Unit.SECOND, name="a")
    equal = RateLimit(requests_per_unit=5, unit=Unit.SECOND, name="a")
    heads = rls_wire.LimitHeads([limit])
    assert id(limit) in heads.by_code[Code.OK] and id(equal) not in heads.by_code[Code.OK]
    renamed = RateLimit(requests_per_unit=5, unit=Unit.SECOND, name="b")
    response = Response(Code.OK, [DescriptorStatus(Code.OK, renamed, 1, 1.0)])
    expected = reference(response, [])
    assert R.FromString(rls_wire.encode_response(response, None, heads)) == expected


def test_encoding_is_byte_identical_for_a_typical_answer() -> None:
    limit = RateLimit(requests_per_unit=100, unit=Unit.MINUTE, name="per-ip")
    response = Response(Code.OK, [DescriptorStatus(Code.OK, limit, 42, 12.5)])
    assert rls_wire.encode_response(response, None) == reference(response, []).SerializeToString()


def test_request_cache_keeps_small_requests_by_their_bytes(monkeypatch) -> None:
    converted: list[bytes] = []

    def convert(raw: bytes) -> Request:
        converted.append(raw)
        return Request("d", [Descriptor((("k", raw.decode()),))])

    cache = rls_wire.RequestCache(convert)
    first = cache.get(b"a")
    assert cache.get(b"a") is first and converted == [b"a"]
    big = b"x" * (rls_wire.MAX_CACHED_REQUEST_BYTES + 1)
    cache.get(big)
    cache.get(big)
    assert converted.count(big) == 2  # large requests are not kept
    monkeypatch.setattr(rls_wire, "MAX_CACHED_REQUESTS", 3)
    for key in (b"b", b"c", b"d"):
        cache.get(key)
    assert len(cache._kept) <= 3  # bounded: cleared when full
    cache.get(b"a")
    assert converted.count(b"a") == 2


def test_a_failed_conversion_is_not_kept() -> None:
    calls = 0

    def convert(raw: bytes) -> Request:
        nonlocal calls
        calls += 1
        raise ValueError("bad")

    cache = rls_wire.RequestCache(convert)
    for _ in range(2):
        with pytest.raises(ValueError):
            cache.get(b"bad")
    assert calls == 2


async def test_malformed_bytes_get_invalid_argument(start_service, write_config) -> None:
    directory = write_config("domain: d\ndescriptors:\n  - key: k\n")
    svc = await start_service(directory)
    call = svc.channel.unary_unary(f"/{RLS_SERVICE}/ShouldRateLimit")  # bytes in and out
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await call(b"\xff\xff\xff")
    assert error.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "malformed RateLimitRequest" in (error.value.details() or "")
    assert svc.service.limiter.stats.service_error == 1
    good = rls_pb2.RateLimitRequest(domain="d")
    good.descriptors.add().entries.add(key="k", value="v")
    answer = R.FromString(await call(good.SerializeToString()))
    assert answer.overall_code == R.OK  # and the service goes on serving


def test_a_denial_carries_the_deciding_rules_over_limit_answer() -> None:
    """The rule that decided a denial gives the 429 its body (raw_body) and content type
    (a response header); an OK answer, or a denial by a rule without one, carries none."""
    tokens = OverLimitAnswer(b'{"error": "tokens"}', "application/json")
    budget = RateLimit(6000, Unit.MINUTE, stats_key="ai.tenant", over_limit=tokens)
    plain = RateLimit(5, Unit.SECOND, stats_key="ai.user")
    bare = RateLimit(7, Unit.SECOND, stats_key="ai.k", over_limit=OverLimitAnswer(b"slow down"))
    for heads in (rls_wire.LimitHeads([budget, plain, bare]), rls_wire.LimitHeads([budget])):

        def encoded(*statuses: DescriptorStatus) -> rls_pb2.RateLimitResponse:
            response = answer(list(statuses))
            return rls_pb2.RateLimitResponse.FromString(
                rls_wire.encode_response(response, [("x-a", "1")], heads)  # noqa: B023
            )

        denied = encoded(
            DescriptorStatus(Code.OK, plain, 3), DescriptorStatus(Code.OVER_LIMIT, budget, 0)
        )
        assert denied.raw_body == b'{"error": "tokens"}'
        headers = [(h.key, h.value) for h in denied.response_headers_to_add]
        assert headers == [("x-a", "1"), ("content-type", "application/json")]
        by_plain = encoded(
            DescriptorStatus(Code.OVER_LIMIT, plain, 0), DescriptorStatus(Code.OK, budget, 9)
        )
        assert by_plain.raw_body == b""
        assert [h.key for h in by_plain.response_headers_to_add] == ["x-a"]
        allowed = encoded(DescriptorStatus(Code.OK, budget, 9))
        assert allowed.raw_body == b"" and len(allowed.response_headers_to_add) == 1
        untyped = encoded(DescriptorStatus(Code.OVER_LIMIT, bare, 0))
        assert untyped.raw_body == b"slow down"
        assert [h.key for h in untyped.response_headers_to_add] == ["x-a"]
