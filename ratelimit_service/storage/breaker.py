"""A circuit breaker with jittered exponential backoff and health hysteresis.

When the store fails several times in a row, callers fail fast (no connection
attempt) until the backoff expires; then one trial call goes through. So a fleet does not hammer a
recovering Redis, and the request path never waits on a store known to be down.
Health changes only after several results in a row, so it does not flap.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(
        self,
        *,
        base_backoff: float = 0.05,
        max_backoff: float = 1.0,
        flip_after: int = 3,
        open_after: int = 3,
        clock: Callable[[], float] = time.monotonic,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.base_backoff = base_backoff
        self.max_backoff = max_backoff
        self.flip_after = flip_after
        self.open_after = open_after
        self._clock = clock
        self._draw = draw
        self._backoff = 0.0
        self._open_until = 0.0
        self._trial_running = False
        self.failures_in_row = 0
        self.successes_in_row = 0
        self.healthy = True
        self.total_failures = 0

    def allow(self) -> bool:
        """Whether a call may go to the store now."""
        if self._backoff == 0.0:
            return True
        if self._trial_running or self._clock() < self._open_until:
            return False
        self._trial_running = True
        return True

    def success(self) -> None:
        self._backoff = 0.0
        self._trial_running = False
        self.failures_in_row = 0
        self.successes_in_row += 1
        if not self.healthy and self.successes_in_row >= self.flip_after:
            self.healthy = True

    def failure(self) -> None:
        self.total_failures += 1
        self._trial_running = False
        self.successes_in_row = 0
        self.failures_in_row += 1
        if self.failures_in_row >= self.flip_after:
            self.healthy = False
        if self.failures_in_row < self.open_after and self._backoff == 0.0:
            return  # a stray timeout does not stop traffic to a store that works
        self._backoff = min(self.max_backoff, max(self.base_backoff, self._backoff * 2))
        jitter = 0.5 + self._draw()  # 0.5x .. 1.5x
        self._open_until = self._clock() + self._backoff * jitter

    @property
    def open(self) -> bool:
        return self._backoff > 0.0
