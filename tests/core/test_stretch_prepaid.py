"""Waits over the limit, paid in advance (core/stretch.py prepaid_wait): the arithmetic of
a wait's length, its payment, and what the fleet's waits hold unspent."""

from __future__ import annotations

from ratelimit_service.core.stretch import moved, prepaid_unspent, prepaid_wait

STRETCH = 4


def test_a_wait_ends_on_the_buckets_turn_and_pays_for_the_intervals_after_the_first() -> None:
    """Places 0..3 of four turns: a wait runs to the next turn (4, 3, 2, 1 intervals) and
    pays a pace (10 hits) for each interval after its first; a wait of one pays nothing."""
    waits = [prepaid_wait(place, 9, 10.0, 100, 100.0, 1.0, STRETCH) for place in range(4)]
    assert waits == [(4, 30), (3, 20), (2, 10), (1, 0)]
    # Every wait ends on a turn: the next report's place is a multiple of STRETCH.
    assert all((place + n) % STRETCH == 0 for place, (n, _) in enumerate(waits[:3]))


def test_waits_grow_by_one_interval_a_report() -> None:
    """The ramp bounds the wait: 2, 3, then STRETCH intervals, whatever the turn."""
    assert [prepaid_wait(0, ramp, 10.0, 100, 100.0, 1.0, STRETCH)[0] for ramp in (2, 3, 4, 9)] == [
        2,
        3,
        4,
        4,
    ]


def test_a_rate_that_moved_or_a_pace_under_a_hit_does_not_wait() -> None:
    assert prepaid_wait(0, 9, 10.0, 250, 100.0, 1.0, STRETCH) == (1, 0)  # 2.5x the rate
    assert prepaid_wait(0, 9, 10.0, 40, 100.0, 1.0, STRETCH) == (1, 0)  # 0.4x
    assert prepaid_wait(0, 9, 10.0, 190, 100.0, 1.0, STRETCH) == (4, 30)  # within 2x
    assert prepaid_wait(0, 9, 0.3, 100, 100.0, 1.0, STRETCH) == (1, 0)  # 0.9 hit: none
    assert prepaid_wait(0, 9, 0.5, 100, 100.0, 1.0, STRETCH) == (4, 1)


def test_moved_is_a_factor_of_two_either_way_and_no_rate_has_moved() -> None:
    assert not moved(20, 10.0, 1.0) and not moved(5, 10.0, 1.0)
    assert moved(21, 10.0, 1.0) and moved(4, 10.0, 1.0)
    assert moved(3, 0.0, 1.0)


def test_the_fleets_unspent_payments_follow_the_ramp_one_report_behind() -> None:
    """Half of what the waits of a report before paid: nothing at the first wait (the
    others have paid nothing yet), then half an interval more each report, up to half
    of STRETCH - 1 intervals."""
    assert [prepaid_unspent(ramp, STRETCH) for ramp in range(2, 8)] == [0, 0.5, 1.0, 1.5, 1.5, 1.5]
    assert prepaid_unspent(9, 1) == 0
