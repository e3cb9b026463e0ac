"""Whether the event loop's thread is saturated: the signal that turns exact batching on.

grpc.aio starts about one RPC per turn of the event loop, and Redis answers a script
call before the next RPC starts, so on its own the exact batcher sends one request per
call even at full load; each call then costs the process a write, a wake-up and a read
and costs Redis a command and a script start. Holding calls for a millisecond packs
several requests into one and lowers the CPU per request by a fifth to a quarter (see
docs/benchmarks.md), but a millisecond added to every request is a poor trade while
the process has CPU to spare. So the hold is on only while the loop's thread wants a
whole CPU: then requests queue anyway, and batching shortens the queue.

Demand is read from the kernel's per-thread scheduler statistics (time run plus time
waiting to run, ``/proc/thread-self/schedstat``): a thread that competes for a core
with other processes is still saturated though it runs only part of the time. Where
that file is missing, CPU time alone (``time.thread_time``) stands in.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

SCHEDSTAT = "/proc/thread-self/schedstat"
BUSY_ABOVE = 0.85
"""Demand (CPUs wanted by the loop's thread) from which the loop counts as saturated."""
IDLE_BELOW = 0.6
"""Demand under which it no longer does. Batching lowers the demand it was turned on
for (by about a fifth at the same traffic): the gap keeps it from switching off again
at once."""
INTERVAL = 0.25
"""Seconds between samples: a load change is followed within half a second."""


def read_schedstat(path: str = SCHEDSTAT) -> float | None:
    """Seconds the calling thread has run or waited to run; None where not available
    (no file, or zeros: a kernel that keeps no such accounting)."""
    try:
        with open(path, "rb") as file:
            run_ns, wait_ns, _ = file.read().split()
        seconds = (int(run_ns) + int(wait_ns)) / 1e9
    except (OSError, ValueError):
        return None
    return seconds or None


def _busy_clock() -> Callable[[], float]:
    """The calling thread's busy seconds: scheduler statistics where the kernel keeps
    them, CPU time otherwise. Chosen once: the two cannot be mixed in one difference."""
    if read_schedstat() is None:
        return time.thread_time

    def schedstat() -> float:
        return read_schedstat() or 0.0

    return schedstat


class Saturation:
    """Turns readings of a thread's busy seconds into on/off, with hysteresis."""

    def __init__(self, busy_above: float = BUSY_ABOVE, idle_below: float = IDLE_BELOW) -> None:
        if not 0 < idle_below <= busy_above:
            raise ValueError("need 0 < idle_below <= busy_above")
        self.busy_above = busy_above
        self.idle_below = idle_below
        self.busy = False
        self.demand = 0.0
        self._last: tuple[float, float] | None = None

    def update(self, wall: float, busy_seconds: float) -> bool:
        """Feed one reading (wall-clock seconds, the thread's busy seconds so far);
        returns whether the thread is saturated now."""
        last, self._last = self._last, (wall, busy_seconds)
        if last is None or wall <= last[0]:
            return self.busy
        self.demand = (busy_seconds - last[1]) / (wall - last[0])
        if self.busy:
            self.busy = self.demand >= self.idle_below
        else:
            self.busy = self.demand >= self.busy_above
        return self.busy


class LoopLoad:
    """Samples the loop thread's demand every ``interval`` and reports the state to
    ``report`` (True: saturated) after every sample, not only on changes: the batcher
    may drop its hold on its own (exact_batcher.LONE_BATCHES) and gets it back from the
    next report. Runs as a task on the loop it measures: the sample is taken on that
    loop's own thread."""

    def __init__(
        self,
        report: Callable[[bool], None],
        interval: float = INTERVAL,
        saturation: Saturation | None = None,
    ) -> None:
        self.report = report
        self.interval = interval
        self.saturation = saturation or Saturation()
        self.changes = 0
        self._busy_seconds = _busy_clock()

    def sample(self) -> None:
        was = self.saturation.busy
        now = self.saturation.update(time.monotonic(), self._busy_seconds())
        if now != was:
            self.changes += 1
            log.debug(  # may change every sample under a load near the threshold
                "event loop %s (demand %.2f CPU): exact batching %s",
                "saturated" if now else "no longer saturated",
                self.saturation.demand,
                "holds calls" if now else "sends at once",
            )
        self.report(now)

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)
