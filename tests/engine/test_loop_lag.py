"""The event loop's lag, and what a call waited for the loop before its handler started."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from ratelimit_service.core.histogram import Histogram
from ratelimit_service.engine.loop_lag import STALL_AFTER, LoopLag

pytestmark = pytest.mark.serial  # timing: run alone, after the parallel part


def test_calls_behind_a_pause_are_given_their_share_of_it() -> None:
    """A handler starting past the lag timer's due time sees a pause first; the calls
    starting during the catch-up are spread evenly over the pause, at the rate before
    it: the first waited almost all of it; the ones after arrived since, at that rate,
    until one would have arrived after it started: calm again."""
    lag = LoopLag(interval=0.01)
    lag.rate = 100.0  # calls per second before the pause
    lag._due, lag.calm_until = 10.0, 10.0 + STALL_AFTER  # the timer is due at 10.0
    starts = [10.2 + 0.0001 * n for n in range(20)]  # a pause of 0.2 s: 20 calls behind it
    outside = [not lag.calm_from <= at <= lag.calm_until for at in starts]
    waits = [lag.held(at) for at in starts]
    assert outside[0]
    assert waits[0] == pytest.approx(0.2 - 0.005, abs=1e-6)  # arrived half a slot in
    assert waits[-1] == pytest.approx(0.2 - 0.195 + 0.0019, abs=1e-6)
    assert waits == sorted(waits, reverse=True)
    assert lag.held(10.215) == pytest.approx(0.005)  # arrived since, at 10.21 ...
    assert lag.held(10.2155) == 0.0  # ... the next at 10.22, after it started: caught up
    assert lag.calm_from == 0.0
    assert lag.held(10.0) == 0.0  # under way when the pause ended


def test_a_pause_seen_by_the_timer_first_and_then_no_call_for_long() -> None:
    lag = LoopLag(interval=0.01)
    lag.rate = 10.0
    lag._due = 5.0
    lag._saw_pause(5.5)  # the timer ran half a second late
    assert lag.held(5.5005) == pytest.approx(0.5005 - 0.05, abs=1e-6)  # 1st of 5 expected
    assert lag.held(7.0) == 0.0  # long after the catch-up: not behind the pause
    assert lag.calm_from == 0.0


async def _lag_beside(hold: Callable[[], None]) -> LoopLag:
    """A LoopLag measuring while ``hold`` holds the loop once, 50 ms into the run."""
    lag = LoopLag(interval=0.01)
    task = asyncio.ensure_future(lag.run())
    await asyncio.sleep(0.05)
    hold()
    await asyncio.sleep(0.05)
    task.cancel()
    return lag


def _over(histogram: Histogram, bound: float) -> int:
    return histogram.count - dict(histogram.cumulative())[bound]


async def test_lag_from_own_work_is_told_from_a_wait_for_the_cpu() -> None:
    """The loop held 100 ms by a callback that runs (its own work) counts in ``blocked``;
    held as long by a thread that is off the CPU (as a descheduled process is) counts in
    the lag only."""

    def spin() -> None:
        end = time.perf_counter() + 0.1
        while time.perf_counter() < end:
            pass

    own = await _lag_beside(spin)
    starved = await _lag_beside(lambda: time.sleep(0.1))
    assert _over(own.histogram, 0.05) == 1 and _over(own.blocked, 0.05) == 1
    assert _over(starved.histogram, 0.05) == 1 and _over(starved.blocked, 0.01) == 0
