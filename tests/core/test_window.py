"""SlidingWindow: counting, expiry, and the no-burst guarantee, with explicit times."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from ratelimit_service.core.window import SlidingWindow

Arrivals = list[tuple[float, int]]


def _internal_ok(window: SlidingWindow) -> None:
    """Invariants of the private slice list: sorted indices, positive counts, total = sum."""
    slices = list(window._slices)
    indices = [index for index, _ in slices]
    assert indices == sorted(set(indices))
    assert all(count > 0 for _, count in slices)
    assert window.total == sum(count for _, count in slices)
    assert len(window) <= window.slice_count + 1


# --------------------------------------------------------------------------- basics


def test_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        SlidingWindow(0)
    with pytest.raises(ValueError):
        SlidingWindow(1, 0)
    with pytest.raises(ValueError):
        SlidingWindow(-1, 10)


def test_counts_and_expiry_on_slice_boundaries() -> None:
    window = SlidingWindow(60, 60)  # one-second slices
    assert window.width == 1.0
    assert window.count(0.0) == 0
    window.add(0.5, 3)
    window.add(10.2, 2)
    assert window.count(10.2) == 5
    # slice 0 is part of the window until slice 61 starts
    assert window.count(60.0) == 5
    assert window.count(60.999) == 5
    assert window.count(61.0) == 2
    assert window.count(70.999) == 2
    assert window.count(71.0) == 0
    assert len(window) == 0
    _internal_ok(window)


def test_add_ignores_non_positive_hits() -> None:
    window = SlidingWindow(10, 10)
    window.add(1.0, 0)
    window.add(1.0, -5)
    assert window.count(1.0) == 0
    assert len(window) == 0


def test_same_slice_hits_are_merged() -> None:
    window = SlidingWindow(10, 10)
    window.add(3.1, 1)
    window.add(3.5, 2)
    window.add(3.99, 4)
    assert len(window) == 1
    assert window.count(4.0) == 7


def test_next_drop() -> None:
    window = SlidingWindow(60, 60)
    assert window.next_drop(5.0) == 0.0
    window.add(0.5, 3)
    window.add(10.2, 2)
    assert window.next_drop(30.0) == pytest.approx(31.0)
    assert window.next_drop(61.0) == pytest.approx(10.0)
    assert window.next_drop(71.0) == 0.0


def test_wait_for_room() -> None:
    window = SlidingWindow(60, 60)
    window.add(0.5, 3)
    window.add(10.2, 2)
    assert window.wait_for_room(30.0, 0, 5) == 0.0
    assert window.wait_for_room(30.0, 1, 6) == 0.0
    # one hit needs the oldest slice gone
    assert window.wait_for_room(30.0, 1, 5) == pytest.approx(31.0)
    assert window.wait_for_room(30.0, 3, 5) == pytest.approx(31.0)
    # four hits need both slices gone
    assert window.wait_for_room(30.0, 4, 5) == pytest.approx(41.0)
    # more than the limit never fits: time until the window is empty
    assert window.wait_for_room(30.0, 6, 5) == pytest.approx(41.0)
    empty = SlidingWindow(60, 60)
    assert empty.wait_for_room(0.0, 10, 5) == 0.0


def test_wait_for_room_is_when_hits_fit() -> None:
    rng = random.Random(7)
    for _ in range(200):
        window = SlidingWindow(10, 10)
        now = 0.0
        for _ in range(rng.randint(1, 20)):
            now += rng.uniform(0, 1.5)
            window.add(now, rng.randint(1, 3))
        limit = rng.randint(1, 20)
        hits = rng.randint(1, limit)
        wait = window.wait_for_room(now, hits, limit)
        if wait == 0.0:
            assert window.count(now) + hits <= limit
        else:
            # ask about the earlier instant first: count() expires as it goes
            assert window.count(now + wait - 1e-6) + hits > limit
            assert window.count(now + wait + 1e-9) + hits <= limit


# --------------------------------------------------------------------------- clock


def test_clock_going_backwards_keeps_totals_consistent() -> None:
    window = SlidingWindow(60, 60)
    window.add(10.0, 1)
    window.add(5.0, 1)  # into the newest slice, never reordered
    assert window.count(5.0) == 2
    assert len(window) == 1
    _internal_ok(window)
    assert window.count(70.999) == 2
    assert window.count(71.0) == 0
    window.add(100.0, 1)
    assert window.count(0.0) == 1  # asking in the past expires nothing
    window.add(0.0, 1)
    assert window.count(0.0) == 2
    _internal_ok(window)
    assert window.count(160.999) == 2
    assert window.count(161.0) == 0
    assert window.total == 0


def test_random_clock_jumps_never_corrupt_totals() -> None:
    rng = random.Random(3)
    window = SlidingWindow(5, 10)
    now = 100.0
    added = 0
    for _ in range(3000):
        now += rng.choice([-3.0, -0.3, 0.0, 0.05, 0.2, 1.0, 7.0]) * rng.random()
        hits = rng.randint(0, 3)
        window.add(now, hits)
        added += max(hits, 0)
        count = window.count(now)
        assert 0 <= count <= added
        _internal_ok(window)
    assert window.count(now + 1000.0) == 0
    assert window.total == 0


# --------------------------------------------------------------------------- memory


@pytest.mark.parametrize(("seconds", "slices"), [(1, 8), (60, 60), (3600, 12)])
def test_memory_bounded_by_slices(seconds: int, slices: int) -> None:
    rng = random.Random(seconds)
    window = SlidingWindow(seconds, slices)
    now = 0.0
    for _ in range(20_000):
        now += rng.expovariate(2000.0 / seconds)
        window.add(now, rng.randint(1, 1000))
        assert len(window) <= slices + 1
    _internal_ok(window)


# --------------------------------------------------------------------------- no burst


def admit_sliding(arrivals: Arrivals, limit: int, seconds: float, slices: int) -> Arrivals:
    window = SlidingWindow(seconds, slices)
    admitted: Arrivals = []
    for now, hits in arrivals:
        if window.count(now) + hits <= limit:
            window.add(now, hits)
            admitted.append((now, hits))
    return admitted


def admit_fixed(arrivals: Arrivals, limit: int, seconds: float) -> Arrivals:
    counts: dict[int, int] = {}
    admitted: Arrivals = []
    for now, hits in arrivals:
        index = math.floor(now / seconds)
        if counts.get(index, 0) + hits <= limit:
            counts[index] = counts.get(index, 0) + hits
            admitted.append((now, hits))
    return admitted


def max_in_any_interval(admitted: Arrivals, seconds: float) -> int:
    """The most hits in any half-open interval [a, a + seconds), by brute force over starts."""
    best = 0
    for start, _ in admitted:
        total = sum(hits for time, hits in admitted if start <= time < start + seconds)
        best = max(best, total)
    return best


def uniform_arrivals(rng: random.Random, seconds: float) -> Arrivals:
    times = sorted(rng.uniform(0, 5 * seconds) for _ in range(300))
    return [(t, rng.randint(1, 3)) for t in times]


def edge_bursts(rng: random.Random, seconds: float) -> Arrivals:
    """Bursts just before and at multiples of the window, and at slice edges."""
    arrivals: Arrivals = []
    for k in range(1, 5):
        edge = k * seconds
        for offset in (-1e-9, -seconds / 1000, 0.0, 1e-9, seconds / 1000):
            arrivals.extend((edge + offset, 1) for _ in range(rng.randint(1, 15)))
    return sorted(arrivals)


def slice_edge_bursts(rng: random.Random, seconds: float) -> Arrivals:
    width = seconds / 10
    arrivals: Arrivals = []
    for k in range(60):
        edge = k * width
        arrivals.extend((edge - 1e-7, rng.randint(1, 2)) for _ in range(rng.randint(0, 4)))
        arrivals.extend((edge, rng.randint(1, 2)) for _ in range(rng.randint(0, 4)))
    return sorted(arrivals)


def clustered(rng: random.Random, seconds: float) -> Arrivals:
    arrivals: Arrivals = []
    now = rng.uniform(0, seconds)
    for _ in range(40):
        now += rng.expovariate(3.0 / seconds)
        arrivals.extend((now + rng.uniform(0, seconds / 50), 1) for _ in range(rng.randint(1, 10)))
    return sorted(arrivals)


GENERATORS: dict[str, Callable[[random.Random, float], Arrivals]] = {
    "uniform": uniform_arrivals,
    "edge_bursts": edge_bursts,
    "slice_edge_bursts": slice_edge_bursts,
    "clustered": clustered,
}


@pytest.mark.parametrize("generator", sorted(GENERATORS))
@pytest.mark.parametrize(
    ("seconds", "slices", "limit"),
    [(1.0, 8, 10), (1.0, 10, 7), (60.0, 60, 25), (0.3, 7, 5), (10.0, 3, 12)],
)
def test_no_interval_of_length_t_exceeds_limit(
    generator: str, seconds: float, slices: int, limit: int
) -> None:
    for seed in range(6):
        rng = random.Random(f"{generator}-{seed}-{seconds}")
        arrivals = GENERATORS[generator](rng, seconds)
        admitted = admit_sliding(arrivals, limit, seconds, slices)
        assert admitted, "the scenario must admit something"
        assert max_in_any_interval(admitted, seconds) <= limit


def test_fixed_window_allows_double_but_sliding_does_not() -> None:
    limit, seconds = 10, 1.0
    arrivals: Arrivals = [(0.999, 1)] * 10 + [(1.0, 1)] * 10
    fixed = admit_fixed(arrivals, limit, seconds)
    sliding = admit_sliding(arrivals, limit, seconds, 8)
    assert sum(hits for _, hits in fixed) == 2 * limit
    assert max_in_any_interval(fixed, seconds) == 2 * limit
    assert sum(hits for _, hits in sliding) == limit
    assert max_in_any_interval(sliding, seconds) == limit


# --------------------------------------------------------------------------- conservativeness


@pytest.mark.parametrize(("seconds", "slices"), [(1.0, 8), (60.0, 60), (1.0, 60), (7.0, 5)])
def test_effective_window_between_t_and_t_plus_one_slice(seconds: float, slices: int) -> None:
    rng = random.Random(int(seconds * slices))
    width = seconds / slices
    for _ in range(300):
        start = rng.uniform(0, 100 * seconds)
        window = SlidingWindow(seconds, slices)
        window.add(start, 1)
        leave = start + window.next_drop(start)
        assert seconds - 1e-9 <= leave - start <= seconds + width + 1e-9
        assert window.count(leave - 1e-7 * seconds) == 1
        # next_drop is float arithmetic: allow rounding at the slice edge
        assert window.count(leave + 1e-9) == 0


def test_long_run_rate_is_between_limit_over_t_plus_w_and_limit_over_t() -> None:
    seconds, slices, limit = 1.0, 10, 20
    window = SlidingWindow(seconds, slices)
    admitted = 0
    steps = 100_000
    for step in range(steps):
        now = step * 0.0002  # 5000 offered per second for 20 s
        if window.count(now) + 1 <= limit:
            window.add(now, 1)
            admitted += 1
    duration = steps * 0.0002
    rate = admitted / duration
    assert limit / (seconds + seconds / slices) - 1 <= rate <= limit / seconds


def test_count_matches_slice_model() -> None:
    """With a monotone clock, count(now) is the hits whose slice is within S of now's slice."""
    rng = random.Random(11)
    seconds, slices = 2.0, 8
    width = seconds / slices
    window = SlidingWindow(seconds, slices)
    log: list[tuple[int, int]] = []
    now = 0.0
    for _ in range(2000):
        now += rng.expovariate(4.0)
        hits = rng.randint(1, 4)
        window.add(now, hits)
        log.append((math.floor(now / width), hits))
        current = math.floor(now / width)
        expected = sum(h for index, h in log if current - slices <= index <= current)
        assert window.count(now) == expected
