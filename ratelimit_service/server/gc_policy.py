"""The garbage collector's policy for a serving process (:class:`Tenuring`, installed
by server/app.py at start): collections that hold the event loop for a millisecond or
two, whatever the number of keys, where CPython's defaults would hold it for tens.

Why: CPython's oldest-generation pass scans every tracked object, and a limiter keeps
tracked objects per key: probabilistic buckets, stats keys, cached requests and their
plans, the store's entries. Over 50,000 keys at 500 calls a second that pass took 15-90
ms (190 ms on a busy machine) every 10 s and freed almost nothing; it holds the event
loop, so calls in flight missed Envoy's 20 ms deadline. At the caps (100,000 buckets,
10,000 stats keys and cached requests) one pass takes 60 ms on an idle core. The
options, measured:

- ``gc.freeze()`` after start-up alone keeps modules and config out of the scans, but
  the per-key state arrives later: the pass still grows with the keys.
- ``gc.set_threshold`` changes how often the pass runs, not how long it holds the loop.
- Per-key state made cheap to scan (numbers in arrays, atomic tuples): the state lives
  in several layers (buckets, stats, request cache, each store's own tables), and even
  100,000 entries whose values hold no references (arrays) cost a 6 ms pass.
- CPython 3.11 cannot run a full pass in steps.

So the process *tenures*: every second, at a moment when every task running has been
running since the round before at least (background loops, RLQS streams, kept-alive
connections; no call or scrape is half-done), it collects everything not yet tenured
(what was made since: a pass of a millisecond or two) and freezes what survived. Full
passes then scan only what is newer than the last tenure, whatever the number of keys.
Garbage is never frozen (the collection comes first), only objects that were alive at a
quiet moment: per-key state, which holds no cycles and is freed by reference counting
when evicted, and long-lived service objects. The cost: a cycle formed later among
tenured objects is not collected. The process's memory stays flat over a 30-minute soak
(docs/benchmarks.md), and the tenured objects still alive follow the live state: between
104,000 and 149,000 over 7 minutes of 500 calls a second over 50,000 keys, with 20
refused calls a second and a scrape every 15 s beside them, and 84,000 half a minute
after the load stopped. ``ratelimit_gc_pause_seconds`` times every collection;
``ratelimit_gc_tenured_objects_total`` counts the objects tenured (counting those still
alive, ``gc.get_freeze_count()``, walks them all: a pause of its own)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import weakref
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from ratelimit_service.core.histogram import Histogram
from ratelimit_service.engine.background import BackgroundTask
from ratelimit_service.engine.stats import histogram_family

log = logging.getLogger(__name__)

TENURE_INTERVAL = 1.0
"""Seconds between two tenures (see the module docstring)."""
QUIET_TRIES = 100
"""Looks for a quiet moment per tenure, QUIET_WAIT apart, before the round is skipped."""
QUIET_WAIT = 0.001


class Tenuring:
    """The collector's policy for a serving process (see the module docstring): times
    every collection, and tenures the survivors every ``interval`` at a quiet moment.
    Process-wide: :meth:`install` once, in the process that serves."""

    def __init__(self, interval: float = TENURE_INTERVAL) -> None:
        self.interval = interval
        self.pauses = Histogram()
        """Every collection's duration, any generation (the event loop waits for it)."""
        self.tenures = 0
        self.tenured_objects = 0
        self.skipped = 0
        """Rounds without a quiet moment (calls always in flight): nothing tenured."""
        self._started = 0.0
        self._background = BackgroundTask("gc-tenure", self._run)

    def install(self) -> None:
        gc.collect()
        gc.freeze()  # modules, config, listeners: alive as long as the process
        gc.callbacks.append(self._timed)
        self._background.start()
        log.debug("objects tenured at start: %d", gc.get_freeze_count())

    async def uninstall(self) -> None:
        await self._background.stop()
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)

    def _timed(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses.observe(time.perf_counter() - self._started)

    def tenure(self) -> None:
        """Collect what is not tenured yet, then tenure what survived (counted: the
        survivors are few, where counting every tenured object would take a pause of
        its own)."""
        gc.collect()
        self.tenured_objects += len(gc.get_objects(generation=2))
        gc.freeze()
        self.tenures += 1

    async def _run(self) -> None:
        current = asyncio.current_task()
        seen: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        settled: weakref.WeakSet[asyncio.Task[Any]] = weakref.WeakSet()
        while True:
            await asyncio.sleep(self.interval)
            for _ in range(QUIET_TRIES):
                tasks = asyncio.all_tasks()
                if all(task in settled or task is current for task in tasks):
                    self.tenure()
                    break
                del tasks
                await asyncio.sleep(QUIET_WAIT)
            else:
                self.skipped += 1
                tasks = asyncio.all_tasks()
            # A task alive at two rounds lives long (a stream, a kept-alive connection, a
            # background loop): it no longer stands in the way of a quiet moment.
            settled = weakref.WeakSet(task for task in tasks if task in seen)
            seen = weakref.WeakSet(tasks)
            del tasks

    def metrics(self) -> Iterator[Metric | None]:
        yield histogram_family(
            "ratelimit_gc_pause_seconds",
            "Garbage collections' durations, any generation (the event loop waits for them)",
            self.pauses,
        )
        yield CounterMetricFamily(
            "ratelimit_gc_tenures",
            "Tenures: survivors frozen out of later collections",
            value=self.tenures,
        )
        yield CounterMetricFamily(
            "ratelimit_gc_tenures_skipped",
            "Tenure rounds skipped: no moment without a call in flight",
            value=self.skipped,
        )
        yield CounterMetricFamily(
            "ratelimit_gc_tenured_objects",
            "Objects tenured (frozen) so far: out of the collector's scans from then on",
            value=self.tenured_objects,
        )
