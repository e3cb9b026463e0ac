"""How late the event loop runs a timer that is due, and what a call waited for the loop
before its handler ran (the latency histogram adds it)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from ratelimit_service.core.histogram import Histogram

LAG_INTERVAL = 0.01
"""Seconds between two measurements of the event loop's lag: every longer pause is seen."""
STALL_AFTER = 0.002
"""Lag from which the loop counts as having been held (below: timer resolution)."""
RATE_MEMORY = 0.25
"""Seconds over which the call rate before a stall is averaged."""


class LoopLag:
    """How late the event loop runs a due timer: the wait of any ready callback (the loop
    busy, or the process not on a CPU). Beside the store's reply time: replies slow and lag
    low is a slow store; both high is this process starved.

    :meth:`held` tells the latency histogram what a call waited before its handler ran: a
    call arriving while the loop is held waits in gRPC's queue, unseen from its handler.
    A pause is seen by the lag timer (late) or a handler starting past the timer's due
    time, whichever comes first. The calls then starting are taken to have arrived at the
    rate seen before the pause, evenly over it (arrivals are unknown); the catch-up ends
    with the first call that would have arrived after its start, or twice the pause after."""

    def __init__(self, interval: float = LAG_INTERVAL, calls: Callable[[], int] = int) -> None:
        self.interval = interval
        self.histogram = Histogram()
        self.blocked = Histogram()
        """Of each lag, the part this thread was running (at most its CPU time over the
        measurement): the process's own work held the loop (a long callback, a collection).
        The rest of the lag the thread waited for a CPU (a busy node, a CPU limit). The
        catch-up on calls that queued while it waited is its own work too."""
        self._calls = calls
        """Calls started so far (for the rate)."""
        self.rate = 0.0
        """Calls per second, smoothed over RATE_MEMORY (updated outside pauses)."""
        self.calm_from = 0.0
        self.calm_until = float("inf")
        """A handler starting within [calm_from, calm_until] (perf_counter) has no pause in
        view. Before calm_from: a catch-up is under way; after calm_until: a pause."""
        self._due = 0.0
        self._pause_start = self._pause_end = self._catch_up_end = 0.0
        self._expected = 1
        self._caught = 0

    async def run(self) -> None:
        clock, cpu = time.perf_counter, time.thread_time
        last_calls, last_at = self._calls(), clock()
        while True:
            self._due = clock() + self.interval
            self.calm_until = self._due + STALL_AFTER
            ran = cpu()
            await asyncio.sleep(self.interval)
            now = clock()
            lag = max(0.0, now - self._due)
            self.histogram.observe(lag)
            self.blocked.observe(min(lag, cpu() - ran))
            calls = self._calls()
            if lag > STALL_AFTER:
                self._saw_pause(now)
            else:
                weight = min(1.0, (now - last_at) / RATE_MEMORY)
                measured = (calls - last_calls) / max(now - last_at, 1e-6)
                self.rate += weight * (measured - self.rate)
            last_calls, last_at = calls, now

    def _saw_pause(self, now: float) -> None:
        """A pause from the timer's due time to ``now``, seen once."""
        if self._pause_start == self._due:
            return
        self._pause_start, self._pause_end = self._due, now
        pause = now - self._due
        self._catch_up_end = now + 2 * pause + self.interval
        self._expected = max(1, round(self.rate * pause))
        self._caught = 0
        self.calm_from = float("inf")  # every handler start is looked at until caught up

    def waited(self, started: float) -> float:
        """:meth:`held` for a call whose handler starts at ``started``: 0 in calm times
        (once per call: it counts the calls of a catch-up)."""
        if self.calm_from <= started <= self.calm_until:
            return 0.0
        return self.held(started)

    def held(self, started: float) -> float:
        """Seconds a call whose handler started at ``started`` (perf_counter, outside the
        calm range) waited for the loop."""
        if started > self.calm_until:
            self._saw_pause(started)
        if started < self._pause_end:
            return 0.0  # under way when the pause ended: its own time includes it
        self._caught += 1
        if self._caught <= self._expected:  # arrived during the pause
            pause = self._pause_end - self._pause_start
            arrived = self._pause_start + pause * (self._caught - 0.5) / self._expected
        elif self.rate > 0:  # arrived since, queued behind those
            arrived = self._pause_end + (self._caught - self._expected) / self.rate
        else:
            arrived = started
        if arrived >= started or started > self._catch_up_end:  # caught up
            self.calm_from, self.calm_until = 0.0, self._due + STALL_AFTER
            return 0.0
        return started - arrived
