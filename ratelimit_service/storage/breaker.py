"""A circuit breaker with jittered exponential backoff and health hysteresis.

When the store fails several times in a row, callers fail fast until the backoff
expires; then one trial call goes through: a fleet does not hammer a recovering Redis,
and the request path never waits on a store known to be down. Health changes only after
several results in a row, and each change is logged once: a WARNING when the store
becomes unavailable, a summary at most every ``summary_every`` seconds while it stays
so, an INFO line when it answers again (a line per failed call would flood the log).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


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
        name: str = "store",
        summary_every: float = 30.0,
        trial_timeout: float = 1.0,
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
        self._trial_started = 0.0
        self.trial_timeout = trial_timeout
        self.failures_in_row = 0
        self.successes_in_row = 0
        self.healthy = True
        self.total_failures = 0
        self.outages = 0
        """Times the store became unavailable (several failures in a row)."""
        self.recoveries = 0
        """Times it became available again."""
        self.name = name
        self.summary_every = summary_every
        self._down_since = 0.0
        self._up_since = -summary_every
        """When it last became available again (the start counts as long ago)."""
        self._flaps = 0
        """Outages that began within ``summary_every`` of a recovery, in a row."""
        self._failures_at_down = 0
        self._summary_at = 0.0

    def allow(self) -> bool:
        """Whether a call may go to the store now. While open, one trial call at a time once the
        backoff has passed, a trial never told of over after ``trial_timeout``."""
        if self._backoff == 0.0:
            return True
        now = self._clock()
        if now < self._open_until:
            return False
        if self._trial_running and now - self._trial_started < self.trial_timeout:
            return False
        self._trial_running = True
        self._trial_started = now
        return True

    def success(self) -> None:
        self._backoff = 0.0
        self._trial_running = False
        self.failures_in_row = 0
        self.successes_in_row += 1
        if not self.healthy and self.successes_in_row >= self.flip_after:
            self.healthy = True
            self.recoveries += 1
            now = self._clock()
            self._up_since = now
            if self._flaps:
                return  # the next outage or the flapping summary says it
            log.info(
                "%s answering again after %.1f s unavailable (%d failed calls)",
                self.name,
                now - self._down_since,
                self.total_failures - self._failures_at_down,
            )

    def failure(self, reason: str = "", evidence: bool = False) -> None:
        """A failed call. ``evidence`` (see down): the outage's first log line gives the reason."""
        self.total_failures += 1
        self._trial_running = False
        self.successes_in_row = 0
        self.failures_in_row += 1
        if self.failures_in_row >= self.flip_after:
            self._unhealthy(reason, evidence)
        if self.failures_in_row < self.open_after and self._backoff == 0.0:
            return  # a stray timeout does not stop traffic to a store that works
        self._backoff = min(self.max_backoff, max(self.base_backoff, self._backoff * 2))
        jitter = 0.5 + self._draw()  # 0.5x .. 1.5x
        self._open_until = self._clock() + self._backoff * jitter

    def down(self, reason: str) -> None:
        """Evidence that the store is gone, not merely slow: unhealthy and open at once."""
        self.failures_in_row = max(self.failures_in_row, self.flip_after, self.open_after) - 1
        self.failure(reason, evidence=True)

    def _unhealthy(self, reason: str, evidence: bool) -> None:
        now = self._clock()
        if self.healthy:
            self.healthy = False
            self.outages += 1
            self._failures_at_down = self.total_failures - self.failures_in_row
            if now - self._up_since < self.summary_every:
                self._flapping(now, reason)
                return
            self._flaps = 0
            self._down_since = self._summary_at = now
            count = f"after {self.failures_in_row} failed calls in a row "
            cause = f"({reason})" if evidence else f"{count}({reason or 'no reason given'})"
            log.warning(
                "%s unavailable %s: exact rules answer by their failure_mode,"
                " probabilistic rules keep their last drop ratios",
                self.name,
                cause,
            )
        elif now - self._summary_at >= self.summary_every:
            self._summary_at = now
            log.warning(
                "%s still unavailable after %.0f s (%d failed calls; last: %s)",
                self.name,
                now - self._down_since,
                self.total_failures - self._failures_at_down,
                reason or "no reason given",
            )

    def _flapping(self, now: float, reason: str) -> None:
        """Down again soon after a recovery (a Cluster with one node away): one summary
        line at most every ``summary_every``; the metrics count every transition."""
        self._flaps += 1
        self._down_since = now
        if self._flaps == 1 or now - self._summary_at >= self.summary_every:
            self._summary_at = now
            log.warning(
                "%s flapping: unavailable %d times within %.0f s of answering (last: %s)",
                self.name,
                self._flaps,
                self.summary_every,
                reason or "no reason given",
            )

    @property
    def open(self) -> bool:
        return self._backoff > 0.0
