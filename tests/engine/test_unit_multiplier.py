"""unit_multiplier: a period of several units ("100 per 10 minutes"), in the loader,
both modes, the response headers, RLQS's token buckets and the rule dump."""

from __future__ import annotations

import asyncio
import shutil
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from ratelimit_harness.fleet import python_burst, redis_server, service_fleet
from ratelimit_service.core.config_loader import ConfigFile, check_config, load_config
from ratelimit_service.core.config_model import HeaderStyle, RateLimit
from ratelimit_service.core.headers import HeaderNames, rate_limit_headers
from ratelimit_service.core.matching import find_limit
from ratelimit_service.core.request import Code, Descriptor, Request
from ratelimit_service.core.shares import token_bucket
from ratelimit_service.core.units import Unit
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.storage.embedded import EmbeddedStore

RULES = """\
domain: d
descriptors:
  - key: ten
    mode: exact
    rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 5}
  - key: pten
    rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 5}
  - key: long
    rate_limit: {unit: minute, unit_multiplier: 10, requests_per_unit: 100}
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def limiter() -> tuple[RateLimiter, Clock]:
    clock = Clock()
    config = load_config([ConfigFile("r.yaml", RULES)])
    return RateLimiter(config, EmbeddedStore(clock=clock), clock=clock, draw=lambda: 0.0), clock


async def synced(rate: RateLimiter, clock: Clock, seconds: float) -> None:
    """``seconds`` pass with a probabilistic sync every 0.25 s."""
    reconciler = Reconciler(rate.local, rate.store, 0.25, clock=clock)
    for _ in range(round(seconds / 0.25)):
        clock.now += 0.25
        await reconciler.sync_once()


async def send(limiter: RateLimiter, value: str, count: int) -> int:
    key, _, val = value.partition("=")
    admitted = 0
    for _ in range(count):
        response = await limiter.should_rate_limit(Request("d", [Descriptor(((key, val),))]))
        admitted += response.overall is Code.OK
    return admitted


def test_the_period_is_the_unit_times_the_multiplier() -> None:
    config = load_config([ConfigFile("r.yaml", RULES)])
    domain = config.domains["d"]
    long = find_limit(domain, [("long", "x")])
    assert long is not None
    assert long.limit.window_seconds == 600 and long.limit.period == "10 minutes"
    assert "unit=MINUTE requests_per_unit=100 unit_multiplier=10" in config.dump()


@pytest.mark.parametrize(
    ("value", "shown"),
    [("0", "0"), ("-2", "-2"), ("1.5", "1.5"), ("ten", "'ten'"), ("true", "true")],
)
def test_a_bad_multiplier_is_an_error_with_its_line(value: str, shown: str) -> None:
    text = (
        "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: minute\n"
        f"      unit_multiplier: {value}\n      requests_per_unit: 1\n"
    )
    errors = [str(e) for e in check_config([ConfigFile("r.yaml", text)])]
    assert len(errors) == 1 and errors[0].startswith("r.yaml:6: unit_multiplier must be"), errors


def test_unlimited_takes_no_multiplier() -> None:
    text = textwrap.dedent(
        """\
        domain: d
        descriptors:
          - key: k
            rate_limit: {unlimited: true, unit_multiplier: 2}
        """
    )
    errors = [str(e) for e in check_config([ConfigFile("r.yaml", text)])]
    assert errors == ["r.yaml:4: should not specify unit_multiplier when unlimited"]


async def test_exact_5_per_10_seconds() -> None:
    """5 of 7 sent at once, none of 3 sent two seconds later, 5 again once the ten
    seconds have passed."""
    rate, clock = limiter()
    assert await send(rate, "ten=a", 7) == 5
    clock.now += 2
    assert await send(rate, "ten=a", 3) == 0
    clock.now += 8.5
    assert await send(rate, "ten=a", 7) == 5


async def test_probabilistic_refills_over_the_whole_period() -> None:
    """The bucket of 5 per 10 s refills at 0.5 a second: about one hit in two seconds,
    not five (as a bucket of 5 per second would)."""
    rate, clock = limiter()
    assert await send(rate, "pten=a", 7) == 5
    await synced(rate, clock, 2)
    assert await send(rate, "pten=a", 3) <= 2
    await synced(rate, clock, 12)
    assert await send(rate, "pten=a", 7) == 5


async def test_the_status_and_the_headers_follow_the_period() -> None:
    rate, _ = limiter()
    response = await rate.should_rate_limit(Request("d", [Descriptor((("long", "x"),))]))
    status = response.statuses[0]
    assert status.limit is not None and status.limit.unit is Unit.MINUTE
    headers = dict(rate_limit_headers(response.decided, HeaderStyle.DRAFT03, HeaderNames()))
    assert headers["X-RateLimit-Limit"] == "100, 100;w=600"
    exact = await rate.should_rate_limit(Request("d", [Descriptor((("ten", "x"),))]))
    # When its hit leaves the 10 s window (up to T + T/60 later), said as at most T.
    assert exact.statuses[0].reset_after == 10.0


def test_rlqs_token_buckets_spread_the_period_in_whole_second_fills() -> None:
    limit = RateLimit(100, Unit.MINUTE, unit_multiplier=10)
    bucket = token_bucket(100.0, limit.requests_per_unit, limit.window_seconds)
    assert bucket.fill_seconds >= 1 and bucket.fill_seconds == int(bucket.fill_seconds)
    rate = bucket.tokens_per_fill / bucket.fill_seconds
    assert rate == pytest.approx(100 / 600, rel=0.05)  # not 100 a minute


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_exact_5_per_10_seconds_across_three_processes_on_redis(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "r.yaml").write_text(RULES)
    with redis_server(tmp_path) as redis, service_fleet(3, config, redis.url) as nodes:
        ports = [node.grpc_port for node in nodes]
        first = asyncio.run(python_burst(ports, "d", "ten=a", 7, 7))
        time.sleep(2)  # the second burst must come two seconds later: the period's point
        second = asyncio.run(python_burst(ports, "d", "ten=a", 3, 3))
    assert first == Counter({"OK": 5, "OVER_LIMIT": 2})
    assert second == Counter({"OVER_LIMIT": 3})
