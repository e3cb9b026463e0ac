"""The client command's printout: codes, limits, resets, and the codes shadow mode made
OK, read from answers the service's own limiter and wire encoder wrote."""

from __future__ import annotations

import textwrap

from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_service.cli.client import format_response
from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.request import Descriptor, Request
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.rls.wire import LimitHeads, encode_response
from ratelimit_service.storage.embedded import EmbeddedStore

RULES = """\
domain: d
descriptors:
  - key: shadowed
    mode: exact
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: plain
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 1}
"""
NOW = 1_000_000.5
"""Half a second into a one-second slice: a hit's slice leaves the minute 60.5 s later,
said as 60 s (a reset is at most the window)."""


def limiter(*, global_shadow: bool = False) -> RateLimiter:
    config = load_config([ConfigFile("d.yaml", textwrap.dedent(RULES))])
    store = EmbeddedStore(clock=lambda: NOW)
    return RateLimiter(config, store, global_shadow=global_shadow, clock=lambda: NOW)


async def printed(rate: RateLimiter, *descriptors: str) -> list[str]:
    """What ``client`` prints for one call with ``descriptors`` (``k=v`` each)."""
    request = Request("d", [Descriptor((tuple(d.split("=")),)) for d in descriptors])
    response = await rate.should_rate_limit(request)
    wire = encode_response(response, None, LimitHeads(rate.config.limits()), "d")
    answer = rls_pb2.RateLimitResponse.FromString(wire)
    return [line.strip() for line in format_response(descriptors, answer).splitlines()]


async def test_a_shadow_rule_over_its_limit_is_marked() -> None:
    rate = limiter()
    assert await printed(rate, "shadowed=a", "plain=a") == [
        "overall: OK",
        "[shadowed=a] OK limit=1/MINUTE remaining=0 reset=60.000s",
        "[plain=a] OK limit=1/MINUTE remaining=0 reset=60.000s",
    ]
    # Both over now: the shadow rule says OK, marked; the enforced one denies.
    assert await printed(rate, "shadowed=a") == [
        "overall: OK",
        "[shadowed=a] OK (shadow: OVER_LIMIT) limit=1/MINUTE remaining=0 reset=60.000s",
    ]
    assert await printed(rate, "shadowed=a", "plain=a") == [
        "overall: OVER_LIMIT",
        "[shadowed=a] OK (shadow: OVER_LIMIT) limit=1/MINUTE remaining=0 reset=60.000s",
        "[plain=a] OVER_LIMIT limit=1/MINUTE remaining=0 reset=60.000s",
    ]
    # Another key of the shadow rule is under its limit: not marked.
    assert (await printed(rate, "shadowed=b"))[1:] == [
        "[shadowed=b] OK limit=1/MINUTE remaining=0 reset=60.000s"
    ]


async def test_global_shadow_mode_marks_the_overall_code() -> None:
    rate = limiter(global_shadow=True)
    assert await printed(rate, "plain=a") == [
        "overall: OK",
        "[plain=a] OK limit=1/MINUTE remaining=0 reset=60.000s",
    ]
    assert await printed(rate, "plain=a") == [
        "overall: OK (shadow: OVER_LIMIT)",
        "[plain=a] OVER_LIMIT limit=1/MINUTE remaining=0 reset=60.000s",
    ]


def test_an_answer_without_decision_metadata_prints_its_codes() -> None:
    """envoyproxy/ratelimit sends no dynamic_metadata: nothing is marked, nothing fails."""
    R = rls_pb2.RateLimitResponse
    answer = R(
        overall_code=R.OK,
        statuses=[
            R.DescriptorStatus(
                code=R.OK,
                current_limit=R.RateLimit(requests_per_unit=5, unit=R.RateLimit.SECOND),
                limit_remaining=0,
            ),
            R.DescriptorStatus(code=R.OK),
        ],
    )
    assert format_response(["k=v", "x=y"], answer).splitlines() == [
        "overall: OK",
        "  [k=v] OK limit=5/SECOND remaining=0 reset=0.000s",
        "  [x=y] OK no limit",
    ]
