"""engine/explain: the rules a request matches and their counts, read without recording
a hit (a limiter on the embedded store, with an injected clock)."""

from __future__ import annotations

import textwrap

import pytest

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.explain import Explanation
from ratelimit_service.core.request import Code, Descriptor, InvalidRequest, Request
from ratelimit_service.engine.explain import explain
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.embedded import EmbeddedStore

RULES = """
domain: d
descriptors:
  - key: ex
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 3, name: ex-rule}
  - key: prob
    rate_limit: {unit: minute, unit_multiplier: 10, requests_per_unit: 5}
  - key: both
    rate_limits:
      - {name: burst, unit: second, requests_per_unit: 2}
      - {name: sustained, unit: hour, requests_per_unit: 100}
  - key: free
    rate_limit: {unlimited: true}
  - key: zero
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: new
    rate_limit: {unit: second, requests_per_unit: 9, name: new, replaces: [{name: burst}]}
  - key: bursty
    rate_limit: {unit: minute, requests_per_unit: 10, burst: 4}
"""


def limiter() -> RateLimiter:
    text = textwrap.dedent(RULES)
    rules = load_config([ConfigFile("rules.yaml", text)])
    clock = [1_000_000.0]
    return RateLimiter(rules, EmbeddedStore(clock=lambda: clock[0]), clock=lambda: clock[0])


def request(*descriptors: tuple[tuple[str, str], ...]) -> Request:
    return Request("d", [Descriptor(entries) for entries in descriptors])


async def counts(rl: RateLimiter, entries: tuple[tuple[str, str], ...]) -> list[int | None]:
    explained = await explain(rl, request(entries))
    return [rule.count for rule in explained.descriptors[0].rules]


EX = (("ex", "a"),)
PROB = (("prob", "a"),)


async def test_counts_follow_hits_and_explain_records_none() -> None:
    rl = limiter()
    for _ in range(2):
        assert (await rl.should_rate_limit(request(EX, PROB))).overall is Code.OK
    for _ in range(5):  # asked many times: nothing is counted
        assert await counts(rl, EX) == [2]
        assert await counts(rl, PROB) == [2]
    # Still room for exactly one more exact hit: explain consumed none.
    assert (await rl.should_rate_limit(request(EX))).overall is Code.OK
    assert (await rl.should_rate_limit(request(EX))).overall is Code.OVER_LIMIT
    assert await counts(rl, EX) == [3]
    assert rl.stats.rules["d.ex"].total_hits == 4  # the four decided calls only


async def test_what_each_descriptor_matches() -> None:
    rl = limiter()
    both, free, zero, none = (("both", "x"),), (("free", "x"),), (("zero", "x"),), (("no", "x"),)
    explained = await explain(rl, request(EX, PROB, both, free, zero, none))
    ex, prob, two, unlimited, zeroed, unmatched = explained.descriptors
    assert explained.domain_found
    rule = ex.rules[0]
    assert (rule.rule, rule.stats_key, rule.limit, rule.unit, rule.window_seconds) == (
        "ex-rule", "d.ex", 3, "minute", 60
    )  # fmt: skip
    assert (rule.mode, rule.count) == ("exact", 0)
    assert (prob.rules[0].rule, prob.rules[0].unit, prob.rules[0].mode) == (
        "d.prob", "10 minutes", "probabilistic"
    )  # fmt: skip
    assert prob.rules[0].count == 0  # no bucket yet: and explain made none
    assert (
        rl.local.peek(rl.matches(rl.config.domains["d"], [Descriptor(PROB)])[0][0][1].bucket_key)
        is None
    )
    assert [r.rule for r in two.rules] == ["burst", "sustained"]
    assert (unlimited.rules[0].limit, unlimited.rules[0].count) == (None, None)
    assert (zeroed.rules[0].limit, zeroed.rules[0].count) == (0, 0)
    assert unmatched.rules == ()
    assert Explanation.from_dict(explained.to_dict()) == explained
    text = explained.text()
    assert "ex=a: rule ex-rule (d.ex): 3 per minute, exact, count 0 of 3" in text
    assert "both=x: rule sustained (d.both.sustained): 100 per hour" in text
    assert "no=x: no rule matches" in text


async def test_replaced_rules_are_left_out() -> None:
    explained = await explain(limiter(), request((("both", "x"),), (("new", "y"),)))
    assert [r.rule for r in explained.descriptors[0].rules] == ["sustained"]


async def test_unknown_domain_and_bad_requests() -> None:
    rl = limiter()
    explained = await explain(rl, Request("other", [Descriptor(EX)]))
    assert not explained.domain_found and explained.descriptors[0].rules == ()
    assert explained.text().startswith("domain other: not in the loaded rules")
    with pytest.raises(InvalidRequest, match="descriptor 0 has an entry with an empty key"):
        await explain(rl, request((("", "v"),)))


async def test_without_counts_and_with_the_store_away(monkeypatch: pytest.MonkeyPatch) -> None:
    rl = limiter()
    await rl.should_rate_limit(request(EX))
    assert [
        r.count for r in (await explain(rl, request(EX), counts=False)).descriptors[0].rules
    ] == [None]

    async def away(*args: object, **kwargs: object) -> list[object]:
        raise StoreUnavailable("down")

    monkeypatch.setattr(rl.store, "hit", away)  # the store fails: the count is unknown
    assert await counts(rl, EX) == [None]
    assert "count unknown" in (await explain(rl, request(EX))).text()


async def test_a_probabilistic_count_is_of_its_bucket_burst_included() -> None:
    """A rule of 10/minute with a burst of 4 holds 4 when full: one hit is 1, not 7."""
    rl = limiter()
    bursty = (("bursty", "a"),)
    assert (await rl.should_rate_limit(request(bursty))).overall is Code.OK
    assert await counts(rl, bursty) == [1]


async def test_exact_counts_come_in_one_call_to_the_store() -> None:
    rl = limiter()
    calls = []
    hit = rl.store.hit

    async def counted(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return await hit(*args, **kwargs)  # type: ignore[arg-type]

    rl.store.hit = counted  # type: ignore[method-assign]
    await explain(rl, request(EX, (("ex", "b"),), PROB))
    assert len(calls) == 1 and len(calls[0][0]) == 2  # type: ignore[arg-type]
