"""RLQS publishes that wait (core/stretch.py, steady_over): a counter steady well over
its limit is published every STRETCH rounds instead of every one; under its limit, on a
change in this replica's demand or instances, for a rule of more than a second, or with
the store away, every round. Then two replicas on a real Redis: a step on one while the
other waits is divided within STRETCH rounds, and the parts never add up to more than
the limit meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Sequence

import pytest

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.stretch import STRETCH, join_slot
from ratelimit_service.core.tiers import TierReport, TierTotals
from ratelimit_service.engine.quota import QuotaCoordinator, Usage
from ratelimit_service.engine.stats import Stats
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore

RULES = """\
domain: q
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 100}
  - key: daily
    rate_limit: {unit: minute, requests_per_unit: 6000}
"""
REPORT_EVERY = 5
KEY_T = "q\x1ftenant\x1et\x1f1"
"""Tenant t's counter key (its slot of the store's count of joins)."""
"""Publish rounds (a second each) between two reports of an instance, as Envoy's 5 s."""


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingStore(EmbeddedStore):
    """The embedded store (this replica is the whole fleet), keeping the counters each
    publish carried; failing while ``down``."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(clock=clock)
        self.publishes: list[list[str]] = []
        self.down = False

    async def publish(self, reports: Sequence[TierReport], forget_after: float) -> list[TierTotals]:
        self.publishes.append([r.key for r in reports])
        if self.down:
            raise StoreUnavailable("down")
        return await super().publish(reports, forget_after)


async def _rounds(
    rates: Sequence[float], bucket: dict[str, str], down: Sequence[int] = ()
) -> list[int]:
    """One instance offering ``rates[i]`` hits a second in round i (reported every
    REPORT_EVERY rounds), a publish round each second. The rounds that published."""
    config = load_config([ConfigFile("q.yaml", RULES)])
    clock = Clock()
    store = CountingStore(clock)
    quota = QuotaCoordinator(lambda: config, Stats(), store, clock=clock, wall=clock)
    offered = 0.0
    published = []
    for number, rate in enumerate(rates):
        offered += rate
        if number % REPORT_EVERY == 0:
            await quota.report("a", "q", [Usage(bucket, round(offered), 0)])
            offered = 0.0
        clock.now += 1.0
        store.down = number in down
        before = len(store.publishes)
        await quota.tick()
        if len(store.publishes) > before:
            published.append(number)
    return published


def _gaps(rounds: list[int]) -> set[int]:
    return {b - a for a, b in itertools.pairwise(rounds)}


async def test_a_counter_steady_well_over_its_limit_is_published_every_few_rounds() -> None:
    published = await _rounds([250.0] * 40, {"tenant": "t"})  # 2.5x the limit
    steady = [r for r in published if r >= 2 * REPORT_EVERY]  # demand measured since
    assert _gaps(steady) == {STRETCH}


async def test_under_its_limit_or_on_a_change_every_round() -> None:
    assert _gaps(await _rounds([80.0] * 30, {"tenant": "t"})) == {1}
    # 2.5x the limit, then 4x from round 20: the report that measures the step (round
    # 25) is published in its round, and the counter waits again after.
    published = await _rounds([250.0] * 20 + [400.0] * 30, {"tenant": "t"})
    assert 25 in published and 26 not in published
    assert _gaps([r for r in published if r >= 25]) == {STRETCH}


async def test_a_rule_of_a_minute_is_published_every_round() -> None:
    """Its fleet-wide count of the window's hits would come late."""
    assert _gaps(await _rounds([250.0] * 30, {"daily": "d"})) == {1}


async def test_a_changed_limit_is_published_in_the_next_round() -> None:
    configs = [load_config([ConfigFile("q.yaml", RULES.replace(n, m))]) for n, m in
               [("100}", "100}"), ("100}", "150}")]]  # fmt: skip
    clock = Clock()
    store = CountingStore(clock)
    chosen = [configs[0]]
    quota = QuotaCoordinator(lambda: chosen[0], Stats(), store, clock=clock, wall=clock)
    published = []
    for number in range(40):
        if number % REPORT_EVERY == 0:
            await quota.report("a", "q", [Usage({"tenant": "t"}, 400 * REPORT_EVERY, 0)])
        if number == 22:  # a reload, met by a report at the same rate (2 s since the last)
            chosen[0] = configs[1]
            await quota.report("a", "q", [Usage({"tenant": "t"}, 400 * 2, 0)])
        clock.now += 1.0
        before = len(store.publishes)
        await quota.tick()
        if any("tenant" in key for keys in store.publishes[before:] for key in keys):
            published.append(number)
    assert 22 in published  # the new limit goes at once, whatever the counter's turn
    assert _gaps([r for r in published if 12 <= r < 22]) == {STRETCH}


async def test_with_the_store_away_every_round_until_it_answers() -> None:
    published = await _rounds([250.0] * 40, {"tenant": "t"}, down=range(20, 30))
    failed = min(r for r in published if r >= 20)  # the first publish the store missed
    assert failed < 20 + STRETCH
    assert set(range(failed, 31)) <= set(published)  # then every round, and the first answered
    assert _gaps([r for r in published if r >= 30]) == {STRETCH}


@contextlib.asynccontextmanager
async def two_replicas(url: str) -> AsyncIterator[tuple[QuotaCoordinator, QuotaCoordinator, Clock]]:
    """Two replicas on one Redis, each its own store, on one clock (publishes that wait on)."""
    config = load_config([ConfigFile("q.yaml", RULES)])
    clock = Clock()
    stores = [RedisStore(url), RedisStore(url)]
    one, two = (QuotaCoordinator(lambda: config, Stats(), s, clock=clock) for s in stores)
    try:
        yield one, two, clock
    finally:
        for store in stores:
            await store.close()


def part(quota: QuotaCoordinator) -> float:
    """A replica's part of the counter (0 before its instances' first report)."""
    return sum(v.part or 0.0 for v in quota.view() if v is not None)


@pytest.mark.parametrize("phase", range(STRETCH))
async def test_a_step_beside_a_waiting_replica_is_divided_at_its_next_publish(
    redis_server, phase: int
) -> None:
    """Replica one's instance offers 250/s steadily (its counter waits); replica two's
    steps from 50/s to 500/s. Two publishes at once and takes what one leaves (one's part
    holds the rest); it then publishes every round while held short of its fair part,
    and takes that part in the round one next publishes (within STRETCH rounds). The
    parts never add up to more than the limit. ``phase`` shifts one's turns against the
    step (one's instance reports that many rounds earlier than two's)."""
    bucket = {"tenant": "t"}

    async def second(number: int, two_rate: float) -> bool:
        """One round; whether replica one published in it."""
        if (number + phase) % REPORT_EVERY == 0:
            await one.report("a", "q", [Usage(bucket, 250 * REPORT_EVERY, 0)])
        if number % REPORT_EVERY == 0:
            await two.report("b", "q", [Usage(bucket, round(two_rate * REPORT_EVERY), 0)])
        clock.now += 1.0
        before = one.bucket_updates
        await one.tick()
        await two.tick()
        assert part(one) + part(two) <= 100.0 + 0.01
        return one.bucket_updates > before

    async with two_replicas(redis_server.url) as (one, two, clock):
        waiting = 0
        for number in range(-REPORT_EVERY, 30):
            waiting += await second(number, 50.0)
            if number == 19:
                waiting = 0
        assert waiting <= 10 // STRETCH + 1  # one waits
        assert part(one) == pytest.approx(100 * 250 / 300, abs=0.01)
        fair, republished = None, None
        for number in range(30, 30 + 2 * REPORT_EVERY):
            published = await second(number, 500.0)  # the step, reported at round 30
            if republished is None and published and number > 30:  # one ticks first
                republished = number
            if fair is None and part(two) == pytest.approx(100 * 500 / 750, abs=0.01):
                fair = number
        assert republished is not None and republished - 30 <= STRETCH
        assert fair == republished
        assert part(one) == pytest.approx(100 * 250 / 750, abs=0.01)


async def _one_waiting(one: QuotaCoordinator, clock: Clock) -> None:
    """Replica one's three instances offer 250/s of tenant t steadily, until one has
    just published its counter: its next STRETCH - 1 rounds would wait."""
    for number in range(20):
        if number % REPORT_EVERY == 0:
            for name in ("a", "b", "c"):
                await one.report(name, "q", [Usage({"tenant": "t"}, 250 * REPORT_EVERY // 3, 0)])
        clock.now += 1.0
        await one.tick()
    assert part(one) == pytest.approx(100.0, abs=0.01)
    for _ in range(STRETCH):
        sent = one.bucket_updates
        clock.now += 1.0
        await one.tick()
        if one.bucket_updates > sent:
            return


async def _round(one: QuotaCoordinator, two: QuotaCoordinator, clock: Clock) -> int:
    """One round on both replicas; the counters one published."""
    sent = one.bucket_updates
    clock.now += 1.0
    await one.tick()
    await two.tick()
    return one.bucket_updates - sent


async def test_a_replica_new_to_the_counter_holds_its_even_share_for_two_rounds(
    redis_server,
) -> None:
    """Replica one's counter waits; replica two's one instance appears. Two gets its
    even share by instances at once (a quarter of the limit) and adds to the store's
    count of joins in its next round (Store.joins); one reads that in the round after and
    publishes, waiting or not: the parts add up to at most the even share over the limit,
    and to at most the limit again within two rounds."""
    async with two_replicas(redis_server.url) as (one, two, clock):
        await _one_waiting(one, clock)
        await two.report("d", "q", [Usage({"tenant": "t"}, 1, 0)])  # published at once
        assert part(two) == pytest.approx(100 / 4, abs=0.01)  # one instance of four
        assert part(one) + part(two) - 100.0 <= 100 / 4 + 0.01
        sent = [await _round(one, two, clock), await _round(one, two, clock)]
        assert sent == [0, 1]  # one waited, then published in the round after the join
        assert part(one) + part(two) <= 100.0 + 0.01
        assert part(one) < 99.0 and part(two) > 1.0  # one gave up two's part


async def test_a_counter_new_in_another_slot_leaves_the_wait(redis_server) -> None:
    """Replica one's counter of tenant t waits; replica two's instance appears on a
    tenant whose slot of the count of joins is another (a new counter elsewhere, as a
    key per client makes them all the time): one's counter keeps waiting."""
    other = next(
        f"u{n}" for n in range(100) if join_slot(f"q\x1ftenant\x1eu{n}\x1f1") != join_slot(KEY_T)
    )
    async with two_replicas(redis_server.url) as (one, two, clock):
        await _one_waiting(one, clock)
        await two.report("d", "q", [Usage({"tenant": other}, 1, 0)])
        sent = [await _round(one, two, clock) for _ in range(STRETCH - 1)]
        assert sent == [0] * (STRETCH - 1)
        assert two._joins is not None and sum(two._joins) >= 1  # two's join was counted


async def test_a_join_made_while_the_counts_are_read_is_added_next_round() -> None:
    """A counter's first publish lands while the round's call to the store's counts of
    joins is out (a report meanwhile): its slot is added in the next round's call, not
    dropped with the slots that call added."""
    config = load_config([ConfigFile("q.yaml", RULES)])
    clock = Clock()
    gate = asyncio.Event()
    added: list[list[int]] = []

    class GatedStore(CountingStore):
        async def joins(self, add: Sequence[int]) -> list[int]:
            added.append(list(add))
            await gate.wait()
            return await super().joins(add)

    store = GatedStore(clock)
    quota = QuotaCoordinator(lambda: config, Stats(), store, clock=clock, wall=clock)
    await quota.report("a", "q", [Usage({"tenant": "t"}, 1, 0)])  # its first publish
    clock.now += 1.0
    ticking = asyncio.create_task(quota.tick())  # adds t's slot, reading the counts
    while not added:
        await asyncio.sleep(0)
    await quota.report("b", "q", [Usage({"tenant": "u"}, 1, 0)])  # u's first, meanwhile
    gate.set()
    await ticking
    clock.now += 1.0
    await quota.tick()
    slot_t, slot_u = join_slot(KEY_T), join_slot("q\x1ftenant\x1eu\x1f1")
    assert added == [[slot_t], [slot_u]]


async def test_a_round_whose_joins_read_fails_publishes_nothing_and_the_next_everything() -> None:
    """The call that reads the counts of joins fails (the store is away or hung): the
    round does not also wait for a publish to fail (parts kept); the next round, the
    store answering, publishes every counter, none waiting."""
    config = load_config([ConfigFile("q.yaml", RULES)])
    clock = Clock()
    down = [False]

    class JoinsDown(CountingStore):
        async def joins(self, add: Sequence[int]) -> list[int]:
            if down[0]:
                raise StoreUnavailable("hung")
            return await super().joins(add)

    store = JoinsDown(clock)
    quota = QuotaCoordinator(lambda: config, Stats(), store, clock=clock, wall=clock)
    for number in range(12):  # steady at 2.5x: the counter waits
        if number % REPORT_EVERY == 0:
            await quota.report("a", "q", [Usage({"tenant": "t"}, 250 * REPORT_EVERY, 0)])
        clock.now += 1.0
        await quota.tick()
    part_before = part(quota)
    down[0] = True
    rounds = len(store.publishes)
    clock.now += 1.0
    await quota.tick()
    assert len(store.publishes) == rounds and quota.store_errors == 1
    assert part(quota) == part_before  # kept
    down[0] = False
    clock.now += 1.0
    await quota.tick()
    assert store.publishes[-1] == [KEY_T]  # the next round: published, waiting or not
