"""The deciding rule in the RLS answer: ``dynamic_metadata`` as rls/wire writes it is
core.decision.decision_metadata's content (parsed back by the protobuf runtime), and
the rule header names the same rule as the metadata."""

from __future__ import annotations

import random

from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import json_format

from ratelimit_service.core.config_model import HeaderStyle, RateLimit
from ratelimit_service.core.decision import answer, decision_metadata, go_metadata
from ratelimit_service.core.headers import HeaderNames, rate_limit_headers
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

R = rls_pb2.RateLimitResponse


def parsed_metadata(encoded: bytes) -> dict[str, object]:
    message = R.FromString(encoded)
    assert message.HasField("dynamic_metadata")
    return json_format.MessageToDict(message.dynamic_metadata)


def random_statuses(rng: random.Random) -> list[DescriptorStatus]:
    limits = [
        RateLimit(
            requests_per_unit=rng.choice([0, 1, 127, 300, 2**31, UINT32_MAX]),
            unit=rng.choice(list(Unit)),
            unit_multiplier=rng.choice([1, 10]),
            name=rng.choice(["", "per-ip", "ünï-" * 40]),
            stats_key=rng.choice(["edge.tenant", "edge.tenant_acme.path_/x*"]),
            quota_mode=rng.random() < 0.2,
            metadata=rng.choice([None, {"backend": "a", "tier": {"x": 1}}, {"tier": {"y": True}}]),
        )
        for _ in range(3)
    ]
    statuses = []
    for _ in range(rng.randint(0, 6)):
        limit = rng.choice([None, *limits])
        code = rng.choice(list(Code))
        remaining = 0 if limit is None else rng.randint(0, limit.requests_per_unit)
        shadow_over = limit is not None and code is Code.OK and rng.random() < 0.2
        statuses.append(DescriptorStatus(code, limit, remaining, rng.random() * 60, shadow_over))
    return statuses


def test_wire_metadata_is_decision_metadata() -> None:
    """With and without the per-config prebuilt parts, the bytes parse to the dict
    decision_metadata gives (numbers as doubles, as google.protobuf.Value holds them)."""
    rng = random.Random(3)
    checked = {"rule": 0, "shadow": 0, "shadow item": 0}
    for _ in range(1500):
        statuses = random_statuses(rng)
        domain = rng.choice(["edge", "d", "ü" * 300])
        limits = [s.limit for s in statuses if s.limit is not None]
        heads = rls_wire.LimitHeads(limits[: rng.randint(0, len(limits))])
        response = answer(statuses, admit=rng.random() < 0.5)
        encoded = rls_wire.encode_response(response, None, heads, domain)
        metadata = decision_metadata(domain, response)
        assert parsed_metadata(encoded) == metadata
        checked["rule"] += "rule" in metadata
        checked["shadow"] += "shadow" in metadata
        checked["shadow item"] += any(item and "shadow" in item for item in metadata["descriptors"])
    assert min(checked.values()) > 200, checked


def test_shadow_marks_what_shadow_mode_made_ok() -> None:
    """A shadow rule over its limit is marked in its item; an answer OK where its
    statuses deny (global shadow mode) is marked at the top; nothing else is."""
    tenant = RateLimit(10, Unit.SECOND, name="tenant", stats_key="edge.tenant")
    trial = RateLimit(5, Unit.MINUTE, name="trial", stats_key="edge.trial", shadow_mode=True)
    shadowed = [
        DescriptorStatus(Code.OK, tenant, 3),
        DescriptorStatus(Code.OK, trial, 0, 1.0, True),
    ]
    assert decision_metadata("edge", answer(shadowed)) == {
        "domain": "edge",
        "rule": "trial",
        "descriptors": [
            {"rule": "tenant", "limit": 10, "unit": "second", "remaining": 3},
            {"rule": "trial", "limit": 5, "unit": "minute", "remaining": 0, "shadow": "OVER_LIMIT"},
        ],
    }
    over = [DescriptorStatus(Code.OVER_LIMIT, tenant, 0)]
    shadow_mode = answer(over, admit=True)  # global shadow mode
    assert shadow_mode.overall is Code.OK and shadow_mode.shadowed
    assert decision_metadata("edge", shadow_mode)["shadow"] == "OVER_LIMIT"
    assert "shadow" not in decision_metadata("edge", answer(over))
    assert not answer(shadowed, admit=True).shadowed  # OK by its statuses already


def random_request(rng: random.Random, size: int) -> Request:
    descriptors = [
        Descriptor(
            tuple((f"k{n}", rng.choice(["v", "ü", ""])) for n in range(rng.randint(1, 3))),
            rng.choice([None, (7, Unit.MINUTE), (3, None)]),
            rng.choice([None, 0, 700]),
        )
        for _ in range(size)
    ]
    return Request("edge", descriptors, rng.choice([0, 0, 5]))


def test_wire_metadata_with_go_keys_is_decision_metadata() -> None:
    """--go-dynamic-metadata: the bytes parse to decision_metadata with the request."""
    rng = random.Random(5)
    merged = 0
    for _ in range(1000):
        statuses = random_statuses(rng)
        request = random_request(rng, len(statuses))
        limits = [s.limit for s in statuses if s.limit is not None]
        heads = rls_wire.LimitHeads(limits[: rng.randint(0, len(limits))])
        response = answer(statuses, admit=rng.random() < 0.5)
        encoded = rls_wire.encode_response(response, None, heads, "edge", request)
        expected = decision_metadata("edge", response, go_request=request)
        assert parsed_metadata(encoded) == expected
        assert "descriptors" in expected and "limits" in expected
        merged += "metadata" in expected
    assert merged > 200


def test_go_keys_hold_go_values() -> None:
    """What envoyproxy/ratelimit's ratelimitToMetadata writes for the same request:
    entries as key=value, the override and a descriptor's own hitsAddend when set,
    the request's hitsAddend when not 0, and the passed rules' metadata merged with the
    first rule winning (nested maps merged); an over-limit rule's metadata is left out."""
    first = RateLimit(5, Unit.MINUTE, stats_key="e.a", metadata={"backend": "a", "t": {"x": 1}})
    second = RateLimit(9, Unit.MINUTE, stats_key="e.b", metadata={"backend": "b", "t": {"y": 2}})
    denied = RateLimit(1, Unit.MINUTE, stats_key="e.c", metadata={"denied": True})
    request = Request(
        "edge",
        [
            Descriptor((("tenant", "acme"),)),
            Descriptor((("model", "gpt"), ("tier", "1")), (7, Unit.MINUTE), 0),
            Descriptor((("user", "u"),), None, 700),
            Descriptor((("plain", "x"),)),
        ],
        3,
    )
    statuses = [
        DescriptorStatus(Code.OK, first, 4),
        DescriptorStatus(Code.OK, second, 8),
        DescriptorStatus(Code.OVER_LIMIT, denied, 0),
        DescriptorStatus(Code.OK, None, UINT32_MAX),  # unlimited: not a passed rule
    ]
    assert go_metadata(request, statuses) == {
        "descriptors": [
            {"entries": ["tenant=acme"]},
            {
                "entries": ["model=gpt", "tier=1"],
                "limit": "requests_per_unit:7 unit:MINUTE",
                "hitsAddend": 0,
            },
            {"entries": ["user=u"], "hitsAddend": 700},
            {"entries": ["plain=x"]},
        ],
        "hitsAddend": 3,
        "metadata": {"backend": "a", "t": {"x": 1, "y": 2}},
    }
    # The rules' own metadata is unchanged by the merge.
    assert first.metadata == {"backend": "a", "t": {"x": 1}}
    no_pass = go_metadata(Request("edge", request.descriptors[2:3]), statuses[2:3])
    assert no_pass == {"descriptors": [{"entries": ["user=u"], "hitsAddend": 700}]}


def test_no_domain_no_metadata() -> None:
    limit = RateLimit(5, Unit.SECOND, stats_key="d.k")
    response = Response(Code.OK, [DescriptorStatus(Code.OK, limit, 4, 0.5)])
    assert not R.FromString(rls_wire.encode_response(response, None)).HasField("dynamic_metadata")


def deciding_rule(statuses: list[DescriptorStatus]) -> str | None:
    """The rule the answer's metadata names as the one that decided it."""
    rule = decision_metadata("edge", answer(statuses)).get("rule")
    assert rule is None or isinstance(rule, str)
    return rule


def test_the_denying_rule_decides_else_the_nearest() -> None:
    per_ip = RateLimit(100, Unit.MINUTE, stats_key="edge.remote_address")
    tenant = RateLimit(10, Unit.SECOND, name="tenant-burst", stats_key="edge.tenant")
    ok = [DescriptorStatus(Code.OK, per_ip, 3), DescriptorStatus(Code.OK, tenant, 7)]
    assert deciding_rule(ok) == "edge.remote_address"  # nearest its limit, by its stats key
    over = [DescriptorStatus(Code.OK, per_ip, 3), DescriptorStatus(Code.OVER_LIMIT, tenant, 0)]
    assert deciding_rule(over) == "tenant-burst"  # the YAML name when there is one
    metadata = decision_metadata("edge", answer([*over, DescriptorStatus(Code.OK)]))
    assert metadata == {
        "domain": "edge",
        "rule": "tenant-burst",
        "descriptors": [
            {"rule": "edge.remote_address", "limit": 100, "unit": "minute", "remaining": 3},
            {"rule": "tenant-burst", "limit": 10, "unit": "second", "remaining": 0},
            None,
        ],
    }
    assert deciding_rule([DescriptorStatus(Code.OK), DescriptorStatus(Code.OK, None, 9)]) is None
    assert "rule" not in decision_metadata("edge", answer([DescriptorStatus(Code.OK)]))


def test_rule_header_with_or_without_the_count_headers() -> None:
    tenant = RateLimit(10, Unit.SECOND, name="tenant-burst", stats_key="edge.tenant")
    over = [DescriptorStatus(Code.OVER_LIMIT, tenant, 0, 0.4)]
    named = HeaderNames(rule="X-RateLimit-Rule")
    decided = answer(over).decided
    assert rate_limit_headers(decided, HeaderStyle.OFF, named) == [
        ("X-RateLimit-Rule", "tenant-burst")
    ]
    both = rate_limit_headers(decided, HeaderStyle.RATELIMIT, named)
    assert both == [
        ("RateLimit-Limit", "10"),
        ("RateLimit-Remaining", "0"),
        ("RateLimit-Reset", "1"),
        ("X-RateLimit-Rule", "tenant-burst"),
    ]
    assert rate_limit_headers(decided, HeaderStyle.OFF, HeaderNames()) == []
    assert (
        rate_limit_headers(answer([DescriptorStatus(Code.OK)]).decided, HeaderStyle.OFF, named)
        == []
    )
