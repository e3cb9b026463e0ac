"""Probabilistic mode: the controller's math, the local buckets, and a closed-loop simulation."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from ratelimit_service.core.drop_ratio import FleetView, control, initial_credit, smoothed_rate
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.storage.embedded import EmbeddedStore

# --------------------------------------------------------------------------- control()


@pytest.mark.parametrize(
    ("limit", "window", "interval", "offered_rate"),
    [
        (100, 1, 0.25, 200.0),
        (100, 1, 0.25, 150.0),
        (100, 1, 0.25, 1000.0),
        (600, 60, 0.5, 30.0),
        (6000, 60, 0.25, 250.0),
    ],
)
def test_steady_state_ratio_is_seed_formula(
    limit: int, window: int, interval: float, offered_rate: float
) -> None:
    """Offered r over a full window: admitted = limit, expiring = limit * interval / T."""
    expiring = limit * interval / window
    assert expiring == int(expiring)
    view = FleetView(admitted_in_window=limit, expiring=int(expiring), offered_total=10_000)
    result = control(
        limit=limit,
        view=view,
        fleet_rate=offered_rate,
        local_rate=offered_rate,
        interval=interval,
    )
    seed = (offered_rate - limit / window) / offered_rate
    assert result.ratio == pytest.approx(seed)
    assert result.credit == pytest.approx(limit * interval / window)


def test_below_limit_ratio_is_zero() -> None:
    # 0.7x of 100/s over a full 1 s window, synced every 0.25 s
    view = FleetView(admitted_in_window=70, expiring=17, offered_total=1000)
    result = control(limit=100, view=view, fleet_rate=70.0, local_rate=70.0, interval=0.25)
    assert result.ratio == 0.0
    assert result.credit == pytest.approx(47.0)


def test_empty_window_budget_is_whole_limit() -> None:
    view = FleetView(admitted_in_window=0, expiring=0, offered_total=0)
    result = control(limit=100, view=view, fleet_rate=0.0, local_rate=0.0, interval=0.25)
    assert result.ratio == 0.0
    assert result.credit == pytest.approx(100.0)
    # a rate that would use more than the whole limit in one interval is cut
    result = control(limit=100, view=view, fleet_rate=800.0, local_rate=800.0, interval=0.25)
    assert result.ratio == pytest.approx(0.5)
    assert result.credit == pytest.approx(100.0)


@pytest.mark.parametrize(
    ("fleet_rate", "local_rate", "nodes", "share"),
    [
        (400.0, 100.0, 4, 0.25),
        (400.0, 300.0, 2, 0.75),
        (400.0, 400.0, 3, 1.0),
        (100.0, 400.0, 3, 1.0),  # local above fleet (stale fleet view): capped at 1
        (0.0, 0.0, 4, 0.25),  # nothing offered yet: equal share
        (0.0, 0.0, 1, 1.0),
        (0.0, 0.0, 0, 1.0),
    ],
)
def test_credit_split_by_local_share(
    fleet_rate: float, local_rate: float, nodes: int, share: float
) -> None:
    view = FleetView(admitted_in_window=60, expiring=20, offered_total=0, nodes=nodes)
    result = control(
        limit=100, view=view, fleet_rate=fleet_rate, local_rate=local_rate, interval=0.25
    )
    assert result.credit == pytest.approx(60.0 * share)


def test_window_over_limit_gives_no_budget() -> None:
    view = FleetView(admitted_in_window=150, expiring=10, offered_total=0)
    result = control(limit=100, view=view, fleet_rate=50.0, local_rate=50.0, interval=0.25)
    assert result.ratio == 1.0
    assert result.credit == 0.0
    idle = control(limit=100, view=view, fleet_rate=0.0, local_rate=0.0, interval=0.25)
    assert idle.credit == 0.0


def test_initial_credit() -> None:
    assert initial_credit(100, 4) == 25.0
    assert initial_credit(100, 1) == 100.0
    assert initial_credit(100, 0) == 100.0


@pytest.mark.parametrize(
    ("previous", "measured", "decay", "expected"),
    [
        (None, 50.0, 0.5, 50.0),
        (10.0, 50.0, 0.5, 50.0),  # fast attack
        (50.0, 50.0, 0.5, 50.0),
        (100.0, 0.0, 0.5, 50.0),  # EWMA decay
        (100.0, 20.0, 0.25, 80.0),
        (100.0, 0.0, 1.0, 0.0),
        (100.0, 0.0, 0.0, 100.0),
    ],
)
def test_smoothed_rate(
    previous: float | None, measured: float, decay: float, expected: float
) -> None:
    assert smoothed_rate(previous, measured, decay) == pytest.approx(expected)


def test_smoothed_rate_decays_geometrically() -> None:
    rate: float | None = 128.0
    seen = []
    for _ in range(4):
        rate = smoothed_rate(rate, 0.0, 0.5)
        seen.append(rate)
    assert seen == [64.0, 32.0, 16.0, 8.0]
    assert smoothed_rate(rate, 1000.0, 0.5) == 1000.0


# --------------------------------------------------------------------------- LocalBuckets


def test_new_bucket_starts_open_with_initial_credit() -> None:
    local = LocalBuckets()
    bucket = local.get("k", 100, 60, now=5.0)
    assert bucket.ratio == 0.0
    assert bucket.credit == 100.0
    assert bucket.remaining() == 100
    assert local.get("k", 100, 60, now=6.0) is bucket
    assert bucket.last_used == 6.0
    local.nodes = 4
    assert local.get("other", 100, 60, now=6.0).credit == 25.0


def test_decide_uses_the_injected_draw() -> None:
    local = LocalBuckets()
    bucket = local.get("k", 100, 60, now=0.0)
    bucket.ratio = 0.5
    assert LocalBuckets.decide(bucket, 1, 0.4) is False
    assert LocalBuckets.decide(bucket, 1, 0.6) is True
    assert LocalBuckets.decide(bucket, 1, 0.5) is True  # draw < ratio drops
    assert bucket.offered == 3
    assert bucket.admitted == 2
    assert bucket.credit == 98.0


def test_credit_caps_admissions() -> None:
    local = LocalBuckets()
    bucket = local.get("k", 100, 60, now=0.0)
    bucket.credit = 3.0
    results = [LocalBuckets.decide(bucket, 1, 0.99) for _ in range(5)]
    assert results == [True, True, True, False, False]
    assert bucket.admitted == 3
    assert bucket.offered == 5
    assert bucket.credit == 0.0
    bucket.credit = 1.5
    assert LocalBuckets.decide(bucket, 2, 0.99) is False
    assert LocalBuckets.decide(bucket, 1, 0.99) is True
    assert bucket.credit == pytest.approx(0.5)


def test_check_only_hits() -> None:
    local = LocalBuckets()
    bucket = local.get("k", 100, 60, now=0.0)
    bucket.credit = 1.0
    assert LocalBuckets.decide(bucket, 0, 0.99) is True
    assert (bucket.credit, bucket.admitted, bucket.offered) == (1.0, 0, 0)
    bucket.credit = 0.5
    assert LocalBuckets.decide(bucket, 0, 0.99) is False
    bucket.credit = 10.0
    bucket.ratio = 0.5
    assert LocalBuckets.decide(bucket, 0, 0.1) is False
    assert (bucket.credit, bucket.admitted, bucket.offered) == (10.0, 0, 0)


def test_take_reports_resets_deltas() -> None:
    local = LocalBuckets()
    bucket = local.get("k", 100, 60, now=0.0)
    bucket.ratio = 0.5
    for draw in (0.1, 0.9, 0.9, 0.2):
        LocalBuckets.decide(bucket, 1, draw)
    reports = local.take_reports(now=0.5, interval=0.25)
    assert len(reports) == 1
    report = reports[0]
    assert (report.key, report.limit, report.window_seconds) == ("k", 100, 60)
    assert (report.offered, report.admitted) == (4, 2)
    assert bucket.offered == 0
    assert bucket.admitted == 0
    assert bucket.local_rate == pytest.approx(8.0)
    assert bucket.last_report == 0.5
    assert local.take_reports(now=0.75, interval=0.25) == []


def test_take_reports_evicts_idle_buckets() -> None:
    local = LocalBuckets()
    local.get("short", 10, 1, now=0.0)  # idle after max(1, 10 * 0.25) = 2.5 s unused
    local.get("long", 10, 60, now=0.0)  # idle after 60 s unused
    busy = local.get("busy", 10, 1, now=0.0)
    assert local.take_reports(now=2.5, interval=0.25) == []
    assert len(local) == 3
    assert local.evicted_idle == 0
    local.get("busy", 10, 1, now=2.55)
    LocalBuckets.decide(busy, 1, 0.9)
    reports = local.take_reports(now=2.6, interval=0.25)
    assert [r.key for r in reports] == ["busy"]
    assert {b.key for b in local.buckets()} == {"long", "busy"}
    assert local.evicted_idle == 1
    # busy was last used at 2.55: idle once 2.5 s have passed with nothing to report
    local.take_reports(now=5.05, interval=0.25)
    assert len(local) == 2
    local.take_reports(now=5.06, interval=0.25)
    assert {b.key for b in local.buckets()} == {"long"}
    assert local.evicted_idle == 2
    local.take_reports(now=60.0, interval=0.25)
    assert len(local) == 1
    local.take_reports(now=60.01, interval=0.25)
    assert len(local) == 0
    assert local.evicted_idle == 3


def test_bucket_with_unreported_hits_is_not_evicted() -> None:
    local = LocalBuckets()
    bucket = local.get("k", 10, 1, now=0.0)
    LocalBuckets.decide(bucket, 1, 0.9)
    reports = local.take_reports(now=100.0, interval=0.25)
    assert [r.admitted for r in reports] == [1]
    assert len(local) == 1


def test_apply_sets_ratio_credit_and_view() -> None:
    local = LocalBuckets()
    bucket = local.get("k", 100, 1, now=0.0)
    for _ in range(50):
        LocalBuckets.decide(bucket, 1, 0.9)
    local.take_reports(now=0.25, interval=0.25)  # local rate 200/s
    view = FleetView(
        admitted_in_window=100, expiring=25, offered_total=50, nodes=1, reset_after=0.5
    )
    local.apply("k", view, now=0.25, interval=0.25)
    assert bucket.ratio == pytest.approx(0.5)
    assert bucket.credit == pytest.approx(25.0)
    assert bucket.window_count == 100
    assert bucket.remaining() == 0
    assert bucket.reset_estimate(0.35) == pytest.approx(0.4)
    assert bucket.reset_estimate(5.0) == 0.0
    # the next sync measures the fleet rate from offered_total
    for _ in range(25):
        LocalBuckets.decide(bucket, 1, 0.9)
    local.take_reports(now=0.5, interval=0.25)
    view = FleetView(admitted_in_window=100, expiring=25, offered_total=150, nodes=3)
    local.apply("k", view, now=0.5, interval=0.25)
    assert bucket.fleet_rate == pytest.approx(400.0)
    assert local.nodes == 3
    # fleet 400/s, local smoothed 150/s: the credit is this node's share of the budget
    assert bucket.local_rate == pytest.approx(150.0)
    assert bucket.credit == pytest.approx(25.0 * 150.0 / 400.0)


def test_apply_subtracts_hits_admitted_during_the_sync() -> None:
    local = LocalBuckets()
    bucket = local.get("k", 100, 1, now=0.0)
    LocalBuckets.decide(bucket, 1, 0.9)
    local.take_reports(now=0.25, interval=0.25)
    for _ in range(3):  # admitted after the report was taken, before the view came back
        LocalBuckets.decide(bucket, 1, 0.9)
    view = FleetView(admitted_in_window=90, expiring=0, offered_total=1)
    local.apply("k", view, now=0.26, interval=0.25)
    assert bucket.credit == pytest.approx(10.0 - 3.0)
    view = FleetView(admitted_in_window=99, expiring=0, offered_total=1)
    local.apply("k", view, now=0.27, interval=0.25)
    assert bucket.credit == 0.0  # never negative


def test_apply_unknown_key_is_ignored() -> None:
    local = LocalBuckets()
    local.apply("missing", FleetView(0, 0, 0, nodes=5), now=1.0, interval=0.25)
    assert len(local) == 0
    assert local.nodes == 1


def test_lru_overflow_eviction() -> None:
    local = LocalBuckets(max_buckets=3)
    for key in ("a", "b", "c"):
        local.get(key, 10, 60, now=0.0)
    local.get("a", 10, 60, now=1.0)  # a is now the most recent
    local.get("d", 10, 60, now=2.0)
    assert len(local) == 3
    assert local.evicted_overflow == 1
    assert {b.key for b in local.buckets()} == {"a", "c", "d"}
    for index in range(100):
        local.get(f"flood{index}", 10, 60, now=3.0)
        assert len(local) <= 3
    assert local.evicted_overflow == 101


def test_limit_change_on_reload_keeps_counts() -> None:
    local = LocalBuckets()
    bucket = local.get("k", 10, 60, now=0.0)
    for _ in range(4):
        LocalBuckets.decide(bucket, 1, 0.9)
    bucket.window_count = 3
    same = local.get("k", 20, 60, now=1.0)
    assert same is bucket
    assert bucket.limit == 20
    assert bucket.admitted == 4
    assert bucket.offered == 4
    assert bucket.credit == 6.0
    assert bucket.remaining() == 20 - 3 - 4
    report = local.take_reports(now=2.0, interval=0.25)[0]
    assert report.limit == 20


def test_unit_change_on_reload_updates_the_window() -> None:
    """The bucket is one counter identity "descriptor values + window": after a reload
    from 10/minute to 10/second, the bucket must report and be synced as a 1 s window."""
    local = LocalBuckets()
    bucket = local.get("k", 10, 60, now=0.0)
    LocalBuckets.decide(bucket, 1, 0.9)
    local.get("k", 10, 1, now=1.0)
    reports = local.take_reports(now=2.0, interval=0.25)
    assert [r.window_seconds for r in reports] == [1]


# --------------------------------------------------------------------------- closed loop

LIMIT = 100
INTERVAL = 0.25
RateFn = Callable[[float], float]


@dataclass
class Simulation:
    admitted: list[float] = field(default_factory=list)
    offered: int = 0


def arrival_times(rng: random.Random, rate: RateFn, end: float, pattern: str) -> list[float]:
    times: list[float] = []
    now = 0.0
    while True:
        if pattern == "poisson":
            now += rng.expovariate(rate(now))
        else:  # evenly spaced with a little jitter
            now += (1.0 / rate(now)) * rng.uniform(0.9, 1.1)
        if now >= end:
            return times
        times.append(now)


async def simulate(
    rate: RateFn,
    *,
    limit: int = LIMIT,
    window: int = 1,
    end: float,
    seed: int,
    pattern: str = "poisson",
    times: list[float] | None = None,
) -> Simulation:
    rng = random.Random(seed)
    clock = [0.0]
    store = EmbeddedStore(clock=lambda: clock[0])
    local = LocalBuckets()
    if times is None:
        times = arrival_times(rng, rate, end, pattern)
    result = Simulation(offered=len(times))
    next_sync = INTERVAL
    for now in times:
        while next_sync <= now:
            clock[0] = next_sync
            reports = local.take_reports(next_sync, INTERVAL)
            views = await store.sync(reports, INTERVAL)
            for report, view in zip(reports, views, strict=True):
                local.apply(report.key, view, next_sync, INTERVAL)
            next_sync += INTERVAL
        clock[0] = now
        bucket = local.get("k", limit, window, now)
        if LocalBuckets.decide(bucket, 1, rng.random()):
            result.admitted.append(now)
    return result


def max_in_any_window(times: list[float], seconds: float) -> int:
    """The most admissions in any half-open interval [t, t + seconds)."""
    best = 0
    start = 0
    for end, now in enumerate(times):
        while times[start] <= now - seconds:
            start += 1
        best = max(best, end - start + 1)
    return best


def count_between(times: list[float], start: float, end: float) -> int:
    return sum(1 for t in times if start <= t < end)


PATTERNS = ["poisson", "even"]
SEEDS = [1, 2, 3]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pattern", PATTERNS)
async def test_overload_never_exceeds_limit_in_any_window(pattern: str, seed: int) -> None:
    sim = await simulate(lambda _: 2.0 * LIMIT, end=20.0, seed=seed, pattern=pattern)
    assert sim.offered > 3500
    assert max_in_any_window(sim.admitted, 1.0) <= LIMIT * 1.05


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pattern", PATTERNS)
async def test_overload_long_run_rate_is_the_limit(pattern: str, seed: int) -> None:
    """Steady state must reduce to the seed formula: admitted rate = limit / T (+-5 %)."""
    sim = await simulate(lambda _: 2.0 * LIMIT, end=20.0, seed=seed, pattern=pattern)
    rate = count_between(sim.admitted, 2.0, 20.0) / 18.0
    assert LIMIT * 0.95 <= rate <= LIMIT * 1.05


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pattern", PATTERNS)
async def test_below_limit_admits_almost_everything(pattern: str, seed: int) -> None:
    sim = await simulate(lambda _: 0.7 * LIMIT, end=20.0, seed=seed, pattern=pattern)
    assert sim.offered > 1200
    assert len(sim.admitted) >= 0.995 * sim.offered


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("pattern", PATTERNS)
async def test_step_up_converges_within_one_second(pattern: str, seed: int) -> None:
    step = 10.0

    def rate(now: float) -> float:
        return 0.5 * LIMIT if now < step else 3.0 * LIMIT

    sim = await simulate(rate, end=16.0, seed=seed, pattern=pattern)
    before = count_between(sim.admitted, 5.0, step) / 5.0
    assert before == pytest.approx(0.5 * LIMIT, rel=0.15)  # nothing dropped at 0.5x
    assert max_in_any_window(sim.admitted, 1.0) <= LIMIT * 1.05
    # from one second after the step on, every whole second admits about the limit
    per_second = [count_between(sim.admitted, s, s + 1.0) for s in range(11, 16)]
    assert all(LIMIT * 0.85 <= n <= LIMIT * 1.05 for n in per_second), per_second


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("offered_per_second", [0.3, 1.0, 20.0])
async def test_low_rate_limit_is_a_sliding_window(offered_per_second: float, seed: int) -> None:
    sim = await simulate(lambda _: offered_per_second, limit=5, window=60, end=600.0, seed=seed)
    assert max_in_any_window(sim.admitted, 60.0) <= 5
    # and it is not starved: close to 5 per minute when offered enough
    if offered_per_second >= 1.0:
        assert len(sim.admitted) >= 45


async def test_low_rate_limit_bursts_right_before_syncs() -> None:
    """Adversarial arrivals: bursts just before and just after each sync instant."""
    times: list[float] = []
    for tick in range(1, 2400):
        edge = tick * INTERVAL
        times.extend([edge - 1e-6] * 3)
        times.extend([edge + 1e-6] * 3)
    sim = await simulate(lambda _: 1.0, limit=5, window=60, end=600.0, seed=9, times=times)
    assert max_in_any_window(sim.admitted, 60.0) <= 5
    assert len(sim.admitted) >= 45
