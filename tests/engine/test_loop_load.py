"""The event loop's saturation signal: hysteresis on measured demand, the kernel's
per-thread figures, and the service turning exact batching on and off with it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.config_model import Mode
from ratelimit_service.engine.loop_lag import STALL_AFTER, LoopLag
from ratelimit_service.storage.loop_load import LoopLoad, Saturation, read_schedstat

pytestmark = pytest.mark.serial  # timing: run alone, after the parallel part


def test_saturation_needs_high_demand_to_start_and_low_demand_to_stop() -> None:
    saturation = Saturation(busy_above=0.85, idle_below=0.6)
    readings = [
        (0.0, 0.0, False),  # the first reading only sets the baseline
        (1.0, 0.5, False),  # 0.5 CPU
        (2.0, 1.34, False),  # 0.84: not yet
        (3.0, 2.3, True),  # 0.96
        (4.0, 3.0, True),  # 0.70: batching lowered it, still saturated
        (5.0, 3.61, True),  # 0.61
        (6.0, 4.1, False),  # 0.49: idle
        (7.0, 4.8, False),  # 0.70: not enough to start again
    ]
    for wall, busy_seconds, expected in readings:
        assert saturation.update(wall, busy_seconds) is expected, (wall, busy_seconds)
    assert saturation.demand == pytest.approx(0.7)


def test_a_reading_without_elapsed_time_changes_nothing() -> None:
    saturation = Saturation()
    saturation.update(1.0, 0.0)
    assert saturation.update(2.0, 1.0) is True
    assert saturation.update(2.0, 1.0) is True  # same instant: no new demand figure
    assert saturation.update(1.5, 1.0) is True  # a clock that stepped back: ignored
    assert saturation.demand == 1.0


def test_thresholds_must_be_ordered() -> None:
    with pytest.raises(ValueError):
        Saturation(busy_above=0.5, idle_below=0.7)
    with pytest.raises(ValueError):
        Saturation(busy_above=0.5, idle_below=0.0)


def test_schedstat_is_read_as_seconds_run_plus_waited(tmp_path: Path) -> None:
    stat = tmp_path / "schedstat"
    stat.write_text("1500000000 250000000 42\n")
    assert read_schedstat(str(stat)) == 1.75
    stat.write_text("garbage\n")
    assert read_schedstat(str(stat)) is None
    assert read_schedstat(str(tmp_path / "missing")) is None


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.mark.skipif(
    read_schedstat() is None, reason="no per-thread scheduler statistics: CPU time only"
)
def test_loop_load_reports_a_busy_thread_and_then_an_idle_one() -> None:
    reports: list[bool] = []
    load = LoopLoad(reports.append)
    load.sample()
    _spin(0.3)  # this thread wants a whole CPU
    load.sample()
    _spin(0.3)
    load.sample()
    assert reports == [False, True, True]  # every sample is reported
    assert load.saturation.demand > 0.85
    time.sleep(0.3)  # and now none: an idle stretch, measured by the kernel, is the subject
    load.sample()
    assert reports == [False, True, True, False]
    assert load.saturation.demand < 0.6
    assert load.changes == 2


async def test_service_holds_exact_calls_while_its_loop_is_saturated(
    start_service, write_config, redis_server
) -> None:
    config = write_config(
        """
        domain: d
        descriptors:
          - key: k
            rate_limit: {unit: minute, requests_per_unit: 100}
        """
    )
    running = await start_service(
        config, redis_url=redis_server.url, mode=Mode.EXACT, exact_batch_hold=0.002
    )
    store = running.service.store
    assert store.metrics().figures["exact_batch_hold_seconds"] == 0
    # Keep the loop's thread busy for a second, a few milliseconds at a time, so the
    # service's own sampling task (every 0.25 s) runs in between and sees it.
    loop = asyncio.get_running_loop()
    saturated_at = None
    end = loop.time() + 1.5
    while loop.time() < end and saturated_at is None:
        _spin(0.005)
        await asyncio.sleep(0)
        if store.metrics().figures["exact_batch_hold_seconds"] == 0.002:
            saturated_at = loop.time()
    assert saturated_at is not None, "the saturated loop was not noticed"
    batches = store.metrics().figures["exact_batches"]
    loop_started = loop.time()
    response = await running.call("d", [("k", "v")])
    assert response.overall_code == 1  # OK
    assert store.metrics().figures["exact_batches"] == batches + 1
    assert loop.time() - loop_started >= 0.002  # its call was held
    await eventually_async(  # idle: the hold goes away
        lambda: store.metrics().figures["exact_batch_hold_seconds"] == 0, timeout=5, what="hold off"
    )


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
