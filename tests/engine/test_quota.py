"""RLQS's pure parts and the coordinator on an injected clock: fair shares, token
buckets, bucket ids ordered by the rules, assignments per report."""

from __future__ import annotations

import pytest

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.matching import bucket_entries
from ratelimit_service.core.shares import (
    TokenBucket,
    fill_seconds,
    token_bucket,
    water_level,
)
from ratelimit_service.engine.quota import (
    ABANDON,
    ABANDON_AFTER,
    ALLOW_ALL,
    DENY_ALL,
    Action,
    CounterView,
    QuotaCoordinator,
    Usage,
)
from ratelimit_service.engine.stats import Stats
from ratelimit_service.storage.embedded import EmbeddedStore

RULES = """\
domain: q
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
    descriptors:
      - key: path
        value: /w*
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: daily
    rate_limit: {unit: day, requests_per_unit: 50}
  - key: watch
    shadow_mode: true
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: path
    value: /healthz
    rate_limit: {unlimited: true}
"""


def fair_shares(limit: float, demands: dict[str, float | None]) -> dict[str, float]:
    """Each instance's share of ``limit`` as engine/quota.py divides it: the water
    level's, an instance with no demand measured yet (None) asking for an even share."""
    even = limit / len(demands)
    asked = {name: even if d is None else d for name, d in demands.items()}
    split = water_level(limit, asked)
    return {name: split.share(a) for name, a in asked.items()}


@pytest.mark.parametrize(
    ("demands", "expected"),
    [
        ({"a": 10.0, "b": 200.0}, {"a": 10.0, "b": 90.0}),  # the small one gets its demand
        ({"a": 60.0, "b": 60.0}, {"a": 50.0, "b": 50.0}),  # both over: an even split
        ({"a": 10.0, "b": 20.0}, {"a": 45.0, "b": 55.0}),  # both under: the rest spread
        ({"a": None, "b": 200.0}, {"a": 50.0, "b": 50.0}),  # just seen: an even share
        ({"a": 0.0, "b": 0.0, "c": 300.0}, {"a": 0.0, "b": 0.0, "c": 100.0}),
    ],
)
def test_fair_shares(demands: dict[str, float | None], expected: dict[str, float]) -> None:
    assert fair_shares(100.0, demands) == pytest.approx(expected)
    assert sum(fair_shares(100.0, demands).values()) == pytest.approx(100.0)


def test_token_buckets_use_whole_seconds_and_at_least_one_token() -> None:
    assert token_bucket(50.0, 100, 1) == TokenBucket(50, 50, 1)
    # A burst below the rate: few tokens held, the refill at the share.
    assert token_bucket(30.0, 100, 1, burst=20) == TokenBucket(6, 30, 1)
    assert token_bucket(2.5, 5, 60) == TokenBucket(2, 1, 12)  # 5/min: a token every 12 s
    assert fill_seconds(5, 60) == 12 and fill_seconds(1000, 60) == 1
    assert token_bucket(0.1, 10, 1).tokens_per_fill == 1  # never 0: Envoy would not refill


def test_bucket_ids_are_ordered_as_the_rules_nest_their_keys() -> None:
    domain = load_config([ConfigFile("q.yaml", RULES)]).domains["q"]
    assert bucket_entries(domain, {"path": "/w/1", "tenant": "t"}) == (
        ("tenant", "t"),
        ("path", "/w/1"),
    )
    # a key no rule nests goes last, so the id reaches no limit
    assert bucket_entries(domain, {"zone": "z", "tenant": "t"}) == (("tenant", "t"), ("zone", "z"))


KEY = "q\x1ftenant\x1et\x1f1"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def coordinator(store: EmbeddedStore | None = None) -> tuple[QuotaCoordinator, Clock, Stats]:
    config = load_config([ConfigFile("q.yaml", RULES)])
    clock, stats = Clock(), Stats()
    store = store if store is not None else EmbeddedStore(clock=clock)
    return QuotaCoordinator(lambda: config, stats, store, clock=clock, wall=clock), clock, stats


def counters(quota: QuotaCoordinator) -> dict[str, CounterView]:
    """The coordinator's read-out (what /status.json and /metrics show), by counter."""
    return {view.key: view for view in quota.view() if view is not None}


async def test_two_instances_share_a_limit_by_demand() -> None:
    quota, clock, _ = coordinator()
    bucket = {"tenant": "t"}
    (a,) = await quota.report("a", "q", [Usage(bucket, 1, 0)])  # alone: all of it
    (b,) = await quota.report("b", "q", [Usage(bucket, 1, 0)])  # just seen, both: even shares
    assert a.token_bucket == TokenBucket(100, 100, 1) and b.token_bucket == TokenBucket(50, 50, 1)
    clock.now += 5.0
    (a,) = await quota.report("a", "q", [Usage(bucket, 100, 0)])  # 20/s
    (b,) = await quota.report("b", "q", [Usage(bucket, 250, 1000)])  # 250/s
    assert a.token_bucket is not None and b.token_bucket is not None
    # a asks 20 and gets it; b asks 250 and gets what a leaves
    assert (a.token_bucket.tokens_per_fill, b.token_bucket.tokens_per_fill) == (20, 80)
    await quota.tick()  # the next publish divides the part by the demands measured
    clock.now += 5.0
    (a,) = await quota.report("a", "q", [Usage(bucket, 100, 0)])
    (b,) = await quota.report("b", "q", [Usage(bucket, 1250, 0)])
    assert a.token_bucket is not None and b.token_bucket is not None
    assert (a.token_bucket.tokens_per_fill, b.token_bucket.tokens_per_fill) == (20, 80)
    assert a.ttl_seconds >= 10  # a few report intervals, whole seconds


async def test_unknown_rules_allow_and_shadow_rules_count_what_they_would_deny() -> None:
    quota, clock, stats = coordinator()
    usages = [Usage({"path": "/healthz"}, 5, 0), Usage({"nothing": "x"}, 1, 0), Usage({}, 1, 0)]
    actions = await quota.report("a", "q", usages)
    assert [a.kind for a in actions] == [ALLOW_ALL, ALLOW_ALL]  # the empty id is skipped
    assert quota.malformed == 1
    elsewhere = await quota.report("a", "other", [Usage({"k": "v"}, 1, 0)])
    assert [a.kind for a in elsewhere] == [ALLOW_ALL]
    assert stats.domain_not_found == {"other": 1}
    await quota.report("a", "q", [Usage({"watch": "w"}, 1, 0)])
    clock.now += 5.0
    (action,) = await quota.report("a", "q", [Usage({"watch": "w"}, 80, 0)])  # 10/s allows 50
    assert action.kind == ALLOW_ALL
    rule = stats.rules["q.watch"]
    assert (rule.shadow_mode, rule.total_hits) == (30, 81)


async def test_a_daily_limit_denies_until_the_window_resets_once_used() -> None:
    quota, clock, _ = coordinator()
    clock.now = 86_400 * 20_000 + 3600.0  # one hour into a day
    (first,) = await quota.report("a", "q", [Usage({"daily": "d"}, 30, 0)])
    assert first.token_bucket is not None
    clock.now += 5.0
    (used,) = await quota.report("a", "q", [Usage({"daily": "d"}, 20, 0)])  # 50 of 50
    assert used.kind == DENY_ALL and used.ttl_seconds == 86_400 - 3605
    clock.now += 86_400  # the next day
    (fresh,) = await quota.report("a", "q", [Usage({"daily": "d"}, 0, 0)])
    assert fresh.token_bucket is not None


async def test_idle_buckets_are_abandoned_and_a_closed_stream_is_forgotten() -> None:
    quota, clock, _ = coordinator()
    bucket = {"tenant": "t"}
    quota.connected()
    await quota.report("a", "q", [Usage(bucket, 1, 0)])
    kinds = []
    for _ in range(ABANDON_AFTER):
        clock.now += 5.0
        kinds += [a.kind for a in await quota.report("a", "q", [Usage(bucket, 0, 0)])]
    assert kinds[-1] == ABANDON and ABANDON not in kinds[:-1]
    await quota.report("b", "q", [Usage(bucket, 1, 0)])
    quota.forget("b")
    clock.now += 16.0  # past FORGET_AFTER: the store no longer counts b (nor idle a)
    await quota.report("c", "q", [Usage(bucket, 1, 0)])
    assert [name for name, *_ in counters(quota)[KEY].instances] == ["c"]


async def test_a_demand_shift_is_rebalanced_within_two_reports() -> None:
    quota, clock, _ = coordinator()
    bucket = {"tenant": "t"}
    for name in ("a", "b"):
        await quota.report(name, "q", [Usage(bucket, 1, 0)])

    async def both(a: int, b: int) -> tuple[int, int]:
        clock.now += 5.0
        (x,) = await quota.report("a", "q", [Usage(bucket, a, 0)])
        (y,) = await quota.report("b", "q", [Usage(bucket, b, 0)])
        await quota.tick()  # publishes come between the reports
        assert x.token_bucket is not None and y.token_bucket is not None
        return x.token_bucket.tokens_per_fill, y.token_bucket.tokens_per_fill

    await both(400, 50)  # a asks 80/s, b 10/s
    await both(400, 50)
    assert await both(400, 50) == (85, 15)  # each its demand, and half the 10 spare
    # The traffic moves to b: a shrinks at its next report, b grows into the room a
    # left; both are rebalanced within two rounds of reports, and the two together
    # never hold more than the limit.
    first = await both(50, 400)
    assert sum(first) <= 100 and first[1] > 15
    assert await both(50, 400) == (15, 85)


async def test_room_a_report_frees_is_pushed_to_the_instance_that_waits() -> None:
    """b asks for more while a still holds most of the limit: b is held to the room
    left. When a reports its smaller demand, b's larger bucket is pushed at the next
    publish, not at b's next report; the two never hold more than the limit."""
    quota, clock, _ = coordinator()
    bucket = {"tenant": "t"}
    pushed: dict[str, list[list[Action]]] = {"a": [], "b": []}
    for name in ("a", "b"):
        quota.attach(name, lambda actions, name=name: pushed[name].append(actions) or True)
        await quota.report(name, "q", [Usage(bucket, 1, 0)])

    async def one(name: str, hits: int) -> int:
        (action,) = await quota.report(name, "q", [Usage(bucket, hits, 0)])
        assert action.token_bucket is not None
        return action.token_bucket.tokens_per_fill

    for _ in range(3):
        clock.now += 5.0
        held = (await one("a", 400), await one("b", 50))  # a asks 80/s, b 10/s
        await quota.tick()
    assert held == (85, 15)
    pushed["a"].clear()
    pushed["b"].clear()
    before = quota.pushed
    clock.now += 5.0
    assert await one("b", 400) == 15  # b now asks 80/s: the room a leaves is 15
    assert pushed == {"a": [], "b": []}
    assert await one("a", 50) == 15  # a asks 10/s: its demand and half the spare
    assert pushed["b"] == []
    await quota.tick()  # within a publish interval (1 s), not b's next report (5 s)
    ((grown,),) = pushed["b"]
    assert grown.bucket == bucket and grown.token_bucket is not None
    assert grown.token_bucket.tokens_per_fill == 85  # into the room, not beyond it
    assert pushed["a"] == [] and quota.pushed == before + 1
    # The traffic moves back, and a's outbox is full: the push is dropped (counted),
    # and a's next report brings its bucket.
    quota.attach("a", lambda actions: False)
    clock.now += 5.0
    assert await one("a", 400) == 15  # a is held to the room b leaves
    assert await one("b", 50) == 15
    await quota.tick()
    assert quota.pushes_dropped == 1
    clock.now += 5.0
    assert await one("a", 400) == 85


def test_a_bucket_counts_what_it_holds_and_what_it_lost_to_being_full() -> None:
    from ratelimit_service.core.shares import stored

    # held 4, earned 10 in 5 s at 2/s, allowed 6: 8 left, all of it fits in 10
    assert stored(4.0, 2.0, 5.0, 6, 0, 10.0) == (8.0, 0.0)
    # allowed 1: 13 would be left, the bucket holds 10 and lost at least 3
    assert stored(4.0, 2.0, 5.0, 1, 0, 10.0) == (10.0, 3.0)
    # it denied hits: it ran out meanwhile, counted empty whatever the sums say
    assert stored(10.0, 2.0, 5.0, 12, 30, 10.0) == (0.0, 0.0)
    assert stored(0.0, 2.0, 5.0, 10, 0, 10.0) == (0.0, 0.0)


def test_a_new_bucket_holds_what_was_stored_and_an_unchanged_rate_keeps_the_bucket() -> None:
    from ratelimit_service.core.shares import SMOOTH_SECONDS, next_bucket

    held = TokenBucket(10, 20, 1)  # 20/s of a limit of 100/s, holding 10
    # A new instance's first bucket starts full: its part of the burst (the limit).
    assert next_bucket(None, 20.0, None, 100, 1) == TokenBucket(20, 20, 1)
    # The rate is the same: the held bucket, so Envoy keeps its tokens ...
    assert next_bucket(held, 20.0, 0.0, 100, 1) is held
    assert next_bucket(held, 20.2, 12.0, 100, 1) is held
    # ... until it stored or lost enough for a bucket RAISE_AT times larger.
    assert next_bucket(held, 20.0, 13.0, 100, 1) == TokenBucket(13, 20, 1)
    assert next_bucket(held, 20.0, 50.0, 100, 1) == TokenBucket(20, 20, 1)  # at most its part
    # A new rate: Envoy starts the bucket full, so it holds what was stored (the
    # instance spent its bucket: a few tokens to absorb clumps, not a fresh burst) ...
    least = round(10.0 * SMOOTH_SECONDS)
    assert next_bucket(held, 10.0, 0.0, 100, 1) == TokenBucket(max(1, least), 10, 1)
    assert next_bucket(held, 30.0, 9.0, 100, 1) == TokenBucket(9, 30, 1)
    # ... and never more than its part of the burst (a smaller burst: less).
    assert next_bucket(held, 30.0, 70.0, 100, 1) == TokenBucket(30, 30, 1)
    assert next_bucket(held, 30.0, 70.0, 100, 1, burst=50) == TokenBucket(15, 30, 1)
    assert next_bucket(held, 20.0, 9.0, 100, 1, burst=20) == TokenBucket(4, 20, 1)


async def test_after_a_step_changed_buckets_hold_what_was_left_not_a_new_burst() -> None:
    """Envoy starts a changed bucket full. Two instances under the limit hold their
    whole parts of the burst; the load steps up and both spend theirs; at their next
    reports both shares change, and the new buckets hold what the instances had
    left (nothing: a few tokens), so the fleet is not handed a second burst."""
    quota, clock, _ = coordinator()
    bucket = {"tenant": "t"}
    for name in ("a", "b"):
        await quota.report(name, "q", [Usage(bucket, 1, 0)])

    async def both(a: tuple[int, int], b: tuple[int, int]) -> tuple[TokenBucket, TokenBucket]:
        clock.now += 5.0
        (x,) = await quota.report("a", "q", [Usage(bucket, *a)])
        (y,) = await quota.report("b", "q", [Usage(bucket, *b)])
        await quota.tick()
        assert x.token_bucket is not None and y.token_bucket is not None
        return x.token_bucket, y.token_bucket

    for _ in range(3):
        quiet = await both((100, 0), (150, 0))  # 20/s and 30/s of 100/s
    assert quiet == (TokenBucket(45, 45, 1), TokenBucket(55, 55, 1))  # full parts
    # 3x: each allowed its bucket and its share, and denied the rest
    step = await both((45 + 225, 300), (55 + 275, 400))
    assert step == quiet  # the same rates: the same buckets, which Envoy keeps (spent)
    # The demands measured, b's share changes (a is held to what b leaves): its new
    # bucket holds a quarter second of its share, not a fresh 50; a's stays as it is.
    hot = await both((225, 600), (275, 700))
    assert hot == (TokenBucket(45, 45, 1), TokenBucket(12, 50, 1))


def test_a_share_grows_only_into_room_and_small_rises_keep_the_bucket() -> None:
    from ratelimit_service.core.shares import settle_share

    assert settle_share(50.0, None, 0.0) == 50.0  # just seen: its even share
    assert settle_share(105.0, 100.0, 200.0) == 100.0  # within 10 %: the same bucket
    assert settle_share(130.0, 100.0, 200.0) == 130.0
    assert settle_share(130.0, 100.0, 120.0) == 120.0  # the others hold the rest
    assert settle_share(60.0, 100.0, 0.0) == 0.0  # shrinking is never held back


async def test_with_the_store_away_the_last_fleet_divides_the_limit() -> None:
    from ratelimit_service.storage.base import StoreUnavailable

    class Flaky(EmbeddedStore):
        down = False

        async def publish(self, reports, forget_after):  # type: ignore[no-untyped-def]
            if self.down:
                raise StoreUnavailable("down")
            return await super().publish(reports, forget_after)

    clock = Clock()
    store = Flaky(clock=clock)
    quota, _, _ = coordinator(store)
    quota._clock = quota._wall = clock  # type: ignore[method-assign]
    bucket = {"tenant": "t"}
    await quota.report("a", "q", [Usage(bucket, 1, 0)])
    await quota.report("b", "q", [Usage(bucket, 1, 0)])
    store.down = True
    clock.now += 5.0
    await quota.tick()
    (a,) = await quota.report("a", "q", [Usage(bucket, 100, 0)])
    assert a.token_bucket is not None  # still a share of the two, not the whole limit
    assert a.token_bucket.tokens_per_fill < 100
    assert quota.store_errors == 1 and counters(quota)[KEY].part == 100.0  # fail-static


async def test_what_is_kept_follows_the_buckets_in_use() -> None:
    """High-cardinality bucket ids (one per client address, say) do not pile up: a
    counter is forgotten once no stream of this process reports it."""
    quota, _, _ = coordinator()
    for n in range(50):
        quota.connected()
        await quota.report(f"e{n}", "q", [Usage({"tenant": f"t{n}"}, 1, 0)])
    assert len(counters(quota)) == 50
    for n in range(50):
        quota.forget(f"e{n}")
    assert counters(quota) == {}


async def test_with_the_store_away_a_used_up_window_resets_on_time() -> None:
    """A minute rule that reached DENY_ALL while the store is away gets buckets again
    once its minute has passed, not after the outage."""
    from ratelimit_service.storage.base import StoreUnavailable

    class Down(EmbeddedStore):
        async def publish(self, reports, forget_after):  # type: ignore[no-untyped-def]
            raise StoreUnavailable("down")

    config = load_config(
        [ConfigFile("q.yaml", "domain: q\ndescriptors:\n  - key: m\n"
                    "    rate_limit: {unit: minute, requests_per_unit: 10}\n")]
    )  # fmt: skip
    clock, stats = Clock(), Stats()
    clock.now = 60 * 1_000_000 + 10.0  # 10 s into a minute
    quota = QuotaCoordinator(lambda: config, stats, Down(clock=clock), clock=clock, wall=clock)
    bucket = {"m": "x"}
    (first,) = await quota.report("a", "q", [Usage(bucket, 4, 0)])
    assert first.token_bucket is not None
    clock.now += 5.0
    (used,) = await quota.report("a", "q", [Usage(bucket, 6, 3)])  # 10 of 10
    assert used.kind == DENY_ALL and used.ttl_seconds == 45
    clock.now += 5.0
    (still,) = await quota.report("a", "q", [Usage(bucket, 0, 9)])  # same minute
    assert still.kind == DENY_ALL
    clock.now += 45.0  # the next minute
    (fresh,) = await quota.report("a", "q", [Usage(bucket, 0, 9)])
    assert fresh.token_bucket is not None
    assert quota.store_errors == 1  # the first publish; no tick ran


async def test_a_limit_of_0_is_denied_without_the_store() -> None:
    from ratelimit_service.storage.base import StoreUnavailable

    class Down(EmbeddedStore):
        asked = 0

        async def publish(self, reports, forget_after):  # type: ignore[no-untyped-def]
            self.asked += 1
            raise StoreUnavailable("down")

    config = load_config(
        [ConfigFile("q.yaml", "domain: q\ndescriptors:\n  - key: tenant\n    value: blocked\n"
                    "    rate_limit: {unit: second, requests_per_unit: 0}\n")]
    )  # fmt: skip
    clock = Clock()
    store = Down(clock=clock)
    quota = QuotaCoordinator(lambda: config, Stats(), store, clock=clock, wall=clock)
    (action,) = await quota.report("a", "q", [Usage({"tenant": "blocked"}, 0, 3)])
    assert action.kind == DENY_ALL and store.asked == 0
