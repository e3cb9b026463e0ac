"""Usage budgets in the pure core: a cost (an explicit per-descriptor hits_addend of 1
or more) is counted whatever the answer; a check (an explicit 0) is admitted while one
more would fit; a plain admission of a denied request consumes nothing."""

from __future__ import annotations

import math

import pytest

from ratelimit_service.core.exact import (
    CHECK,
    DECIDE,
    DENIED,
    ExactHit,
    HitRole,
    counts,
    evaluate,
    is_cost,
)
from ratelimit_service.core.local_buckets import LocalBuckets, ProbabilisticBucket
from ratelimit_service.core.window import SlidingWindow

NOW = 1000.0


def test_what_is_a_cost() -> None:
    assert is_cost(700, count_denied_costs=True)
    assert is_cost(1, count_denied_costs=True)
    assert not is_cost(0, count_denied_costs=True)  # a check
    assert not is_cost(None, count_denied_costs=True)  # a plain admission
    assert not is_cost(700, count_denied_costs=False)  # STOP_CACHE_KEY_INCREMENT...=true


def test_the_counting_rule() -> None:
    assert counts(admitted=True, cost=False)
    assert counts(admitted=True, cost=True)
    assert counts(admitted=False, cost=True)
    assert not counts(admitted=False, cost=False)


def two_phase(budget: int, cost: int, requests: int, count_denied_costs: bool = True) -> int:
    """Sequential requests, each a check (hits 0) then its report (``cost``, once the
    response is done) on one window: how many checks were admitted."""
    window = SlidingWindow(60, 60)
    admitted = 0
    for _ in range(requests):
        (check,) = evaluate([ExactHit("k", budget, 60, 0)], [window], NOW, DECIDE)
        if not check.admitted:
            continue
        admitted += 1
        report = ExactHit("k", budget, 60, cost, cost=is_cost(cost, count_denied_costs))
        evaluate([report], [window], NOW, DECIDE)
    return admitted


@pytest.mark.parametrize(("budget", "cost"), [(6000, 700), (6000, 600), (10, 3), (5, 7)])
def test_a_budget_admits_until_it_is_spent(budget: int, cost: int) -> None:
    """⌈B/c⌉ when c does not divide B (the last report takes the window over), B/c
    when it does (the budget is held exactly)."""
    assert two_phase(budget, cost, 20) == math.ceil(budget / cost)


def test_without_counting_denied_costs_the_over_report_is_lost() -> None:
    """The Go service's STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true: the 9th report
    (700 with 400 left) is denied and not counted, so every later check passes."""
    assert two_phase(6000, 700, 20, count_denied_costs=False) == 20


def test_a_denied_cost_is_counted_and_reported_over() -> None:
    window = SlidingWindow(60, 60)
    window.add(NOW, 5600)
    (result,) = evaluate([ExactHit("k", 6000, 60, 700, cost=True)], [window], NOW, DECIDE)
    assert not result.admitted and result.before == 5600 and result.remaining == 0
    assert window.count(NOW) == 6300
    assert result.reset_after > 0  # until 700 would fit again


def test_a_cost_counts_whatever_the_other_descriptors_decided() -> None:
    """An enforcing descriptor over denies the request: its admission consumes nothing,
    its cost counts."""
    full, plain, budget = SlidingWindow(60, 60), SlidingWindow(60, 60), SlidingWindow(60, 60)
    full.add(NOW, 1)
    hits = [
        ExactHit("full", 1, 60, 1),
        ExactHit("plain", 10, 60, 1),
        ExactHit("budget", 6000, 60, 700, cost=True),
    ]
    results = evaluate(hits, [full, plain, budget], NOW, DECIDE)
    assert [r.admitted for r in results] == [False, True, True]
    assert (full.count(NOW), plain.count(NOW), budget.count(NOW)) == (1, 0, 700)


def test_a_request_denied_already_counts_its_costs_only() -> None:
    plain, budget = SlidingWindow(60, 60), SlidingWindow(60, 60)
    hits = [ExactHit("plain", 10, 60, 1), ExactHit("budget", 6000, 60, 700, cost=True)]
    evaluate(hits, [plain, budget], NOW, DENIED)
    assert (plain.count(NOW), budget.count(NOW)) == (0, 700)
    evaluate(hits, [plain, budget], NOW, CHECK)  # a look counts nothing, costs neither
    assert (plain.count(NOW), budget.count(NOW)) == (0, 700)


def test_a_shadow_or_quota_cost_counts_too() -> None:
    for role in (HitRole.SHADOW, HitRole.QUOTA):
        window = SlidingWindow(60, 60)
        window.add(NOW, 10)
        evaluate([ExactHit("k", 10, 60, 4, role, cost=True)], [window], NOW, DECIDE)
        assert window.count(NOW) == 14, role


def test_plain_admission_is_unchanged() -> None:
    """A client at twice the limit gets the limit in every window; a fresh key of N
    admits N; a limit of 0 denies; denied requests consume nothing."""
    window = SlidingWindow(60, 60)
    decided = [
        evaluate([ExactHit("k", 10, 60, 1)], [window], NOW + i, DECIDE)[0].admitted
        for i in range(20)
    ]
    assert decided == [True] * 10 + [False] * 10
    assert window.count(NOW + 19) == 10
    # The next window: the same share again (nothing denied was counted).
    later = [
        evaluate([ExactHit("k", 10, 60, 1)], [window], NOW + 61 + i, DECIDE)[0].admitted
        for i in range(20)
    ]
    assert sum(later) == 10
    zero = SlidingWindow(60, 60)
    (result,) = evaluate([ExactHit("z", 0, 60, 1)], [zero], NOW, DECIDE)
    assert not result.admitted and zero.count(NOW) == 0


def test_a_probabilistic_bucket_charges_a_denied_cost() -> None:
    """What take() did not admit, charge() counts: it reaches the fleet with the
    admitted hits at the next sync, and the credit goes below 0."""
    bucket = ProbabilisticBucket("k", 6000, 60, NOW, nodes=1)
    bucket.tokens = bucket.credit = 400.0  # the fleet's bucket holds 400, all granted here
    assert bucket.take(0, draw=0.5)  # a check: one more fits
    assert not bucket.take(700, draw=0.5)
    bucket.charge(700)
    assert bucket.admitted == 700 and bucket.credit == -300.0 and bucket.offered == 700
    assert not bucket.take(0, draw=0.5)  # the next check is denied


def test_a_probabilistic_check_reads_the_fleets_bucket_not_the_credit() -> None:
    """A process granted no share of a budget (it only checks it) admits checks while
    the fleet's bucket has room, and denies them once the fleet is in debt."""
    bucket = ProbabilisticBucket("k", 6000, 60, NOW, nodes=2)
    bucket.credit, bucket.tokens = 0.0, 2500.0
    assert bucket.take(0, draw=0.5)
    bucket.tokens = -300.0
    assert not bucket.take(0, draw=0.5)


def test_a_bucket_only_checked_is_reported_at_the_next_sync() -> None:
    """So that its view of the fleet's bucket stays fresh."""
    buckets = LocalBuckets()
    buckets.get("k", 6000, 60, NOW).take(0, draw=0.5)
    (report,) = buckets.take_reports(NOW + 0.25, 0.25)
    assert (report.key, report.offered, report.admitted) == ("k", 0, 0)


def test_a_charged_cost_is_reported_at_the_next_sync() -> None:
    """The fleet's total (and with --zone the zone's, which the same sync feeds) gets a
    denied cost with the admitted hits."""
    buckets = LocalBuckets()
    bucket = buckets.get("k", 6000, 60, NOW)
    bucket.credit = 400.0
    assert bucket.take(300, draw=0.5)
    assert not bucket.take(700, draw=0.5)
    bucket.charge(700)
    (report,) = buckets.take_reports(NOW + 0.25, 0.25)
    assert (report.offered, report.admitted) == (1000, 1000)
