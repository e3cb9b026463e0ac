"""Calendar budgets through RateLimiter on a set clock, in both modes: a month budget
counts from local midnight on the 1st, does not come back within the month, starts
again at the next 1st, and its answers' duration_until_reset is the time to that
midnight; on the embedded store and on a real Redis (exact mode's script counts the
period under a key of its own; probabilistic mode's fleet bucket is the period's, and
does not refill). In probabilistic mode the reconciler syncs between the steps, on the
same clock."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator, Callable
from datetime import datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.config_model import Mode
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.core.request import Code, Descriptor, Request, Response
from ratelimit_service.engine.explain import explain
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.storage.base import Store
from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore

RULES = """
domain: ai
descriptors:
  - key: tenant
    mode: {mode}
    rate_limits:
      - {{name: per_month, unit: month, requests_per_unit: 3, calendar: Europe/Paris}}
      - {{name: per_minute, unit: minute, requests_per_unit: 100}}
"""
PARIS = ZoneInfo("Europe/Paris")
OK, OVER = Code.OK, Code.OVER_LIMIT
MODES = [Mode.EXACT, Mode.PROBABILISTIC]


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


class Budget:
    """A limiter on the rules in one mode, with a reconciler on the same clock (synced by
    hand: probabilistic mode's counts reach the store only through it)."""

    def __init__(self, store: Store, clock: Clock, mode: Mode) -> None:
        self.clock = clock
        self.config = load_config(
            [ConfigFile("ai.yaml", textwrap.dedent(RULES.format(mode=mode.value)))]
        )
        self.local = LocalBuckets()
        self.limiter = RateLimiter(self.config, store, local=self.local, clock=clock)
        self.reconciler = Reconciler(self.local, store, 0.25, clock=clock)

    async def calls(self, who: str, count: int) -> list[Response]:
        answers = []
        for _ in range(count):
            answers.append(await self.limiter.should_rate_limit(tenant(who)))
            await self.reconciler.sync_once()
        return answers

    async def at(self, now: float) -> None:
        """Move the clock to ``now`` and sync there (a process that has run meanwhile)."""
        self.clock.now = now
        await self.reconciler.sync_once()


@pytest.mark.slow  # the Redis half starts redis-server
@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
async def test_a_month_budget_starts_again_at_local_midnight_on_the_1st(
    store: Callable[[Clock], Store], mode: Mode
) -> None:
    clock = Clock()
    budget = Budget(store(clock), clock, mode)
    clock.now = paris(2026, 1, 2, 9, 0)
    answers = await budget.calls("acme", 4)
    assert [a.overall for a in answers] == [OK, OK, OK, OVER]
    assert [a.statuses[0].remaining for a in answers] == [2, 1, 0, 0]

    # Spent on the 2nd, it does not come back within January: a rolling budget (a
    # window or a bucket refilled at 3 a month) would have admitted 2 or 3 again by the
    # 31st. The month's status is the tightest: its reset is the time to February 1st,
    # 00:00 in Paris (10 minutes), for the denied as for the admitted.
    for day in (10, 20, 31):
        await budget.at(paris(2026, 1, day, 23, 50))
    answers = await budget.calls("acme", 4)
    assert [a.overall for a in answers] == [OVER] * 4
    for answer in answers:
        month = answer.statuses[0]
        assert month.limit is not None and month.limit.name == "per_month"
        assert month.reset_after == pytest.approx(600.0)

    await budget.at(paris(2026, 2, 1, 0, 0, 1))  # a second into February: a fresh budget
    answers = await budget.calls("acme", 4)
    assert [a.overall for a in answers] == [OK, OK, OK, OVER]
    assert [a.statuses[0].remaining for a in answers] == [2, 1, 0, 0]
    assert answers[0].statuses[0].reset_after == pytest.approx(paris(2026, 3, 1) - clock.now)
    # explain reads the same period's count.
    explained = await explain(budget.limiter, tenant("acme"))
    month_rule = explained.descriptors[0].rules[0]
    assert month_rule.count == 3

    # Another tenant has its own budget in the same month.
    assert (await budget.limiter.should_rate_limit(tenant("globex"))).overall is OK


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
async def test_a_budget_reported_in_costs_counts_each_in_full_until_the_period_ends(
    mode: Mode,
) -> None:
    """Costs (an explicit hits_addend) count in full, the one that does not fit
    included; the checks (hits_addend 0) are then denied until the month ends, with
    the time to its end as their reset, and pass again in the next month."""
    clock = Clock()
    budget = Budget(EmbeddedStore(clock=clock), clock, mode)
    limiter = budget.limiter
    clock.now = paris(2026, 3, 30, 12, 0)
    check = Request("ai", [Descriptor((("tenant", "acme"),), hits_addend=0)])
    cost = Request("ai", [Descriptor((("tenant", "acme"),), hits_addend=2)])
    assert (await limiter.should_rate_limit(check)).overall is OK
    assert (await limiter.should_rate_limit(cost)).overall is OK  # 2 of 3
    assert (await limiter.should_rate_limit(cost)).overall is OVER  # 4 of 3: counted
    await budget.reconciler.sync_once()
    await budget.at(paris(2026, 3, 31, 23, 59))
    denied = await limiter.should_rate_limit(check)
    assert denied.overall is OVER
    assert denied.statuses[0].reset_after == pytest.approx(60.0)  # to April 1st, 00:00
    await budget.at(paris(2026, 4, 1, 0, 0, 1))
    assert (await limiter.should_rate_limit(check)).overall is OK


async def test_a_calendar_rule_follows_a_change_of_mode() -> None:
    """A reload that changes a calendar rule's mode decides it in the new mode: each mode
    counts the period apart (docs/operations.md), so the budget spent in one is whole
    in the other."""
    clock = Clock()
    clock.now = paris(2026, 5, 10, 8, 0)
    exact = Budget(EmbeddedStore(clock=clock), clock, Mode.EXACT)
    assert [a.overall for a in await exact.calls("acme", 4)] == [OK, OK, OK, OVER]
    assert exact.local.buckets() == []  # decided by the store's window
    flipped = load_config(
        [ConfigFile("ai.yaml", textwrap.dedent(RULES.format(mode="probabilistic")))]
    )
    exact.limiter.swap_config(flipped)
    assert [a.overall for a in await exact.calls("acme", 4)] == [OK, OK, OK, OVER]
    (month, _) = sorted(exact.local.buckets(), key=lambda b: b.window_seconds, reverse=True)
    assert month.key.endswith(f"@{int(paris(2026, 5, 1))}")
    assert month.reset_estimate(clock.now) == paris(2026, 6, 1) - clock.now
