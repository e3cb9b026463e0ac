"""The circuit breaker on an injected clock: backoff, trial calls, health hysteresis."""

from __future__ import annotations

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
