"""The garbage collector's policy for a serving process (:class:`Tenuring`, installed
by server/app.py at start): collections that hold the event loop briefly, whatever the
number of keys.

CPython's oldest-generation pass scans every tracked object, and a limiter keeps some per
key: over many keys that pass frees almost nothing and holds the loop past Envoy's 20 ms
deadline (docs/benchmarks.md, "Soak"). ``gc.freeze()`` at start-up misses the per-key
state that comes later, ``gc.set_threshold`` changes how often the pass runs, not how
long, and CPython 3.11 cannot run a full pass in steps.

So the process *tenures*: every second, at a moment when every running task has been
running since the round before (no call or scrape half-done), it collects what is not
yet tenured (a short pass) and freezes what survived, only objects alive at a quiet
moment: per-key state, which holds no cycles and is freed by reference counting, and
long-lived service objects. A cycle formed later among them is not collected; memory
stays flat over the soak.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import weakref
from collections.abc import Iterator, Sized
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric

from ratelimit_service.core.histogram import Histogram
from ratelimit_service.engine.background import BackgroundTask
from ratelimit_service.engine.stats import histogram_family

log = logging.getLogger(__name__)

TENURE_INTERVAL = 1.0
QUIET_TRIES = 100
"""Looks for a quiet moment per tenure, QUIET_WAIT apart, before the round is skipped."""
QUIET_WAIT = 0.001
LIST_EVERY = 10
"""Tries between two listings of the tasks when their count says nothing is quiet."""


class Tenuring:
    """See the module docstring. :meth:`install` once, in the process that serves."""

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
        """Collect what is not tenured yet, then tenure (and count) what survived."""
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
            for attempt in range(QUIET_TRIES):
                # More tasks than the settled ones and this one: not quiet, told without
                # listing them (thousands in flight under load: a list each try would cost
                # the loop most when it has least to spare). The count takes in every
                # loop's tasks: every LIST_EVERY tries they are listed all the same.
                if _task_count() <= len(settled) + 1 or attempt % LIST_EVERY == 0:
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
            self.tenures,
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


_REGISTERED: Sized | None = getattr(asyncio.tasks, "_all_tasks", None)
"""CPython 3.11's set of every task alive (a later Python may keep none such)."""


def _task_count() -> int:
    """An upper bound on ``len(asyncio.all_tasks())`` in constant time: the tasks alive
    (done ones not yet collected too); 0 where Python keeps no such set (then the tasks
    are listed each try)."""
    return 0 if _REGISTERED is None else len(_REGISTERED)
