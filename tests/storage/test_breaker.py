"""The circuit breaker on an injected clock: backoff, trial calls, health hysteresis."""

from __future__ import annotations

import logging

from ratelimit_service.storage.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def breaker(clock: Clock) -> CircuitBreaker:
    # draw 0.5: jitter factor exactly 1.0, so the backoff is the wait
    return CircuitBreaker(base_backoff=0.05, max_backoff=0.2, clock=clock, draw=lambda: 0.5)


def test_a_stray_failure_does_not_stop_calls() -> None:
    clock = Clock()
    b = breaker(clock)
    assert b.allow() and b.healthy
    b.failure()
    assert b.allow() and b.healthy and b.failures_in_row == 1  # one failure: calls go on
    b.success()
    assert b.failures_in_row == 0 and not b.open


def test_opens_after_failures_in_a_row_then_lets_one_trial_through() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.failure()
    assert b.open and not b.healthy
    assert not b.allow()  # within the backoff
    clock.now += 0.06
    assert b.allow()  # the trial
    assert not b.allow()  # only one at a time
    b.failure()  # the trial failed: a longer backoff
    clock.now += 0.06
    assert not b.allow()
    clock.now += 0.05
    assert b.allow()


def test_health_comes_back_only_after_successes_in_a_row() -> None:
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.failure()
    clock.now += 1.0
    assert b.allow()
    b.success()
    assert not b.open and b.allow()  # calls flow again at once
    assert not b.healthy  # health flips after 3 successes in a row
    b.success()
    assert not b.healthy
    b.success()
    assert b.healthy


def test_an_outage_is_logged_once_then_summarised_then_its_end(caplog) -> None:
    clock = [0.0]
    breaker = CircuitBreaker(clock=lambda: clock[0], draw=lambda: 0.5, name="redis at x")
    with caplog.at_level(logging.INFO, logger="ratelimit_service.storage.breaker"):
        for _ in range(200):  # 40 s of a call every 0.2 s, every one failing
            clock[0] += 0.2
            breaker.failure("connection refused")
        for _ in range(3):
            breaker.success()
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert [level for level, _ in lines] == [logging.WARNING, logging.WARNING, logging.INFO]
    assert "redis at x unavailable after 3 failed calls in a row (connection" in lines[0][1]
    assert "still unavailable after 30 s" in lines[1][1]
    assert "answering again after 39.4 s unavailable (200 failed calls)" in lines[2][1]
    assert breaker.outages == 1


def test_a_stray_failure_is_not_logged(caplog) -> None:
    breaker = CircuitBreaker()
    with caplog.at_level(logging.INFO, logger="ratelimit_service.storage.breaker"):
        breaker.failure("timeout")
        breaker.success()
    assert caplog.records == []
    assert breaker.outages == 0


def test_a_trial_without_a_verdict_ends_after_its_timeout() -> None:
    """A trial call given up with no verdict on the store (no success, no failure told)
    must not keep the circuit open for ever: another trial goes after trial_timeout."""
    clock = Clock()
    b = breaker(clock)
    for _ in range(3):
        b.failure()
    clock.now += 0.06
    assert b.allow()  # the trial, whose outcome is never told
    clock.now += b.trial_timeout - 0.01
    assert not b.allow()
    clock.now += 0.02
    assert b.allow()


def test_flapping_is_summarised_not_logged_per_transition(caplog) -> None:
    """Down and up again and again (a Cluster with one master away): every transition
    counted, one line at the first outage and then one summary per summary_every."""
    clock = Clock()
    b = breaker(clock)
    with caplog.at_level(logging.INFO, logger="ratelimit_service.storage.breaker"):
        for _ in range(30):
            for _ in range(3):
                b.failure("node away")
            clock.now += 1.0
            for _ in range(3):
                b.success()
            clock.now += 0.5
    assert (b.outages, b.recoveries) == (30, 30)
    lines = [r.getMessage() for r in caplog.records]
    # 30 rounds of 1.5 s: the first outage and its recovery, then a summary at the
    # first flap and one 30 s later.
    assert len(lines) == 4, lines
    assert "flapping" in lines[2] and "flapping" in lines[3]
