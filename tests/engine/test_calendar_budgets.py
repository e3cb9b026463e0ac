"""Calendar budgets through RateLimiter on a set clock: a month budget counts from
local midnight on the 1st, starts again at the next 1st, and its answers'
duration_until_reset is the time to that midnight; on the embedded store and on a
real Redis (whose script counts the period under a key of its own)."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.core.request import Code, Descriptor, Request
from ratelimit_service.engine.explain import explain
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.storage.base import Store
from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore

RULES = """
domain: ai
descriptors:
  - key: tenant
    rate_limits:
      - {name: per_month, unit: month, requests_per_unit: 3, calendar: Europe/Paris}
      - {name: per_minute, unit: minute, requests_per_unit: 100}
"""
PARIS = ZoneInfo("Europe/Paris")
OK, OVER = Code.OK, Code.OVER_LIMIT


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def paris(*fields: int) -> float:
    return datetime(*fields, tzinfo=PARIS).timestamp()


@pytest.fixture(params=["embedded", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[Callable[[Clock], Store]]:
    """A store for a clock: the embedded one reads it; Redis reads its own (TIME)."""
    made: list[Store] = []

    def make(clock: Clock) -> Store:
        if request.param == "embedded":
            built: Store = EmbeddedStore(clock=clock)
        else:
            server: Any = request.getfixturevalue("redis_server")
            built = RedisStore(server.url, request_timeout=2.0)
        made.append(built)
        return built

    yield make
    for built in made:
        await built.close()


def tenant(name: str) -> Request:
    return Request("ai", [Descriptor((("tenant", name),))])


@pytest.mark.slow  # the Redis half starts redis-server
async def test_a_month_budget_starts_again_at_local_midnight_on_the_1st(
    store: Callable[[Clock], Store],
) -> None:
    clock = Clock()
    config = load_config([ConfigFile("ai.yaml", textwrap.dedent(RULES))])
    limiter = RateLimiter(config, store(clock), local=LocalBuckets(), clock=clock)

    clock.now = paris(2026, 1, 31, 23, 50)
    answers = [await limiter.should_rate_limit(tenant("acme")) for _ in range(4)]
    assert [a.overall for a in answers] == [OK, OK, OK, OVER]
    # The month's status is the tightest: its reset is the time to February 1st, 00:00
    # in Paris (10 minutes), for the admitted and the denied alike.
    for answer in answers:
        month = answer.statuses[0]
        assert month.limit is not None and month.limit.name == "per_month"
        assert month.reset_after == pytest.approx(600.0)
    assert [a.statuses[0].remaining for a in answers] == [2, 1, 0, 0]

    clock.now = paris(2026, 2, 1, 0, 0, 1)  # a second into February: a fresh budget
    answers = [await limiter.should_rate_limit(tenant("acme")) for _ in range(4)]
    assert [a.overall for a in answers] == [OK, OK, OK, OVER]
    assert answers[0].statuses[0].reset_after == pytest.approx(paris(2026, 3, 1) - clock.now)
    # explain reads the same period's count.
    explained = await explain(limiter, tenant("acme"))
    month_rule = explained.descriptors[0].rules[0]
    assert month_rule.count == 3

    # Another tenant has its own budget in the same month.
    assert (await limiter.should_rate_limit(tenant("globex"))).overall is OK
