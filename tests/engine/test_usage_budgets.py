"""Usage budgets through RateLimiter (core types, embedded store, set clock): Envoy's
two-phase usage, a check (per-descriptor hits_addend 0) before the request and a report
of its cost (hits_addend = the response's tokens) once it is done, in both modes; a
cost counted whatever the request's other descriptors decided."""

from __future__ import annotations

import textwrap

import pytest

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.config_model import Mode
from ratelimit_service.core.exact import ExactHit
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.core.request import Code, Descriptor, Request
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.storage.embedded import EmbeddedStore

RULES = """
domain: ai
descriptors:
  - key: tokens
    mode: {mode}
    rate_limit: {{unit: minute, requests_per_unit: 6000}}
  - key: plain
    mode: {mode}
    rate_limit: {{unit: minute, requests_per_unit: 10}}
  - key: never
    mode: probabilistic
    rate_limit: {{unit: minute, requests_per_unit: 1}}
"""
OK, OVER = Code.OK, Code.OVER_LIMIT


class Clock:
    now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def limiter(mode: Mode, count_denied_costs: bool = True) -> tuple[RateLimiter, EmbeddedStore]:
    clock = Clock()
    store = EmbeddedStore(clock=clock)
    text = textwrap.dedent(RULES.format(mode=mode.value))
    return (
        RateLimiter(
            load_config([ConfigFile("t.yaml", text)]),
            store,
            local=LocalBuckets(),
            clock=clock,
            draw=lambda: 0.999,
            count_denied_costs=count_denied_costs,
        ),
        store,
    )


def request(*descriptors: tuple[str, int | None]) -> Request:
    return Request("ai", [Descriptor(((key, "u"),), hits_addend=hits) for key, hits in descriptors])


async def two_phase(rate_limiter: RateLimiter, cost: int, requests: int) -> int:
    admitted = 0
    for _ in range(requests):
        check = await rate_limiter.should_rate_limit(request(("tokens", 0)))
        if check.overall is OK:
            admitted += 1
            await rate_limiter.should_rate_limit(request(("tokens", cost)))
    return admitted


@pytest.mark.parametrize("mode", [Mode.EXACT, Mode.PROBABILISTIC], ids=lambda m: m.value)
async def test_twenty_requests_of_700_on_6000_admit_9(mode: Mode) -> None:
    rate_limiter, _ = limiter(mode)
    assert await two_phase(rate_limiter, 700, 20) == 9


@pytest.mark.parametrize("mode", [Mode.EXACT, Mode.PROBABILISTIC], ids=lambda m: m.value)
async def test_a_cost_that_divides_the_budget_admits_it_exactly(mode: Mode) -> None:
    rate_limiter, _ = limiter(mode)
    assert await two_phase(rate_limiter, 600, 20) == 10


@pytest.mark.parametrize("mode", [Mode.EXACT, Mode.PROBABILISTIC], ids=lambda m: m.value)
async def test_without_counting_denied_costs_every_check_passes(mode: Mode) -> None:
    """--count-denied-costs false (STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true): the
    report that does not fit counts nothing, as in the Go service."""
    rate_limiter, _ = limiter(mode, count_denied_costs=False)
    assert await two_phase(rate_limiter, 700, 20) == 20


async def test_an_exact_cost_counts_when_a_probabilistic_descriptor_denies() -> None:
    """The request is denied in the process (its ``never`` descriptor is spent); the
    store still counts its exact cost (and not its exact plain admission)."""
    rate_limiter, store = limiter(Mode.EXACT)
    await rate_limiter.should_rate_limit(request(("never", None)))
    response = await rate_limiter.should_rate_limit(
        request(("never", None), ("plain", None), ("tokens", 700))
    )
    assert response.overall is OVER
    looked = await store.hit(request_hits(rate_limiter, ("plain", None), ("tokens", 0)), False)
    assert [r.before for r in looked] == [0, 700]


async def test_a_probabilistic_cost_is_not_given_back_when_the_request_is_denied() -> None:
    """Denied by its spent ``never`` descriptor: the plain admission is given back, the
    cost stays counted (and reaches the fleet at the next sync)."""
    rate_limiter, _ = limiter(Mode.PROBABILISTIC)
    await rate_limiter.should_rate_limit(request(("never", None)))
    denied = request(("never", None), ("plain", None), ("tokens", 700))
    response = await rate_limiter.should_rate_limit(denied)
    assert response.overall is OVER
    _, plain, tokens = (rate_limiter.local.peek(step.bucket_key) for step in denied.plan.local)
    assert plain is not None and tokens is not None
    assert (plain.admitted, tokens.admitted) == (0, 700)


async def test_plain_admissions_of_a_denied_request_consume_nothing() -> None:
    rate_limiter, store = limiter(Mode.EXACT)
    for _ in range(12):
        await rate_limiter.should_rate_limit(request(("plain", None)))
    looked = await store.hit(request_hits(rate_limiter, ("plain", None)), False)
    assert looked[0].before == 10  # 10 admitted, the 2 denied not counted


def request_hits(rate_limiter: RateLimiter, *descriptors: tuple[str, int | None]) -> list[ExactHit]:
    """The exact hits the limiter would send for ``descriptors`` (to look at windows)."""
    plan = rate_limiter._plan(request(*descriptors))
    return list(plan.exact_hits)
