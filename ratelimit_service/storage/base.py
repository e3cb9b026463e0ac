"""The storage seam: everything the request path and the reconciler need from a store.

Three operations, each batched so a Redis store can answer it in one round trip:
``hit`` decides a request's exact-mode descriptors atomically; ``sync`` folds one
process's probabilistic counts into the fleet totals and returns them; ``publish``
records one replica's RLQS totals and returns the fleet's.
"""

from __future__ import annotations

from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ratelimit_service.core.drop_ratio import SyncResult
from ratelimit_service.core.exact import ExactHit, ExactResult
from ratelimit_service.core.histogram import Histogram
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.tiers import TierReport, TierTotals


class StoreUnavailable(Exception):
    """The store did not answer in time or at all; callers apply the failure policy."""


class StoreOverloaded(Exception):
    """Too many exact requests wait: nothing sent, no failure policy (see the limiter)."""


@dataclass(frozen=True)
class BreakerState:
    """One circuit breaker of a store, as the status page shows it."""

    name: str
    open: bool
    healthy: bool
    errors: float
    outages: float
    recoveries: float


@dataclass(frozen=True)
class StoreMetrics:
    """What a store shows the metrics and status pages: name, figures, histograms and breakers."""

    name: str
    figures: dict[str, float]
    histograms: dict[str, Histogram] = field(default_factory=dict)
    breakers: tuple[BreakerState, ...] = ()


class Store(Protocol):
    """Eight members, each a reason in every backend; what one backend needs it does itself."""

    def hit(
        self,
        hits: Sequence[ExactHit],
        commit: int,
        owe: bool = False,
        deadline: float | None = None,
    ) -> Awaitable[list[ExactResult]]:
        """Decide ``hits`` (index-aligned results) and count them as ``commit`` says (core/exact.py:
        CHECK, DECIDE, DENIED). ``owe``: the caller admits the request if the store fails, so a
        store that can should count its hits later (see owed_hits). ``deadline``: the loop's time
        after which the answer is of no use (None: the store's own bound). Raises StoreUnavailable
        when the store fails or must wait past it, StoreOverloaded when too many requests wait. Any
        awaitable will do: no coroutine layer needed on the request path."""

    async def sync(self, reports: Sequence[BucketReport]) -> SyncResult:
        """Add ``reports`` to the fleet totals; return the live node count and each
        bucket's fleet view. Runs even with no reports: it is the node's heartbeat."""

    async def publish(self, reports: Sequence[TierReport], forget_after: float) -> list[TierTotals]:
        """RLQS tiers: record one member's totals per counter and return the sums over every member
        heard from within ``forget_after`` seconds, at a cost that does not grow with them."""

    async def joins(self, add: Sequence[int]) -> list[int]:
        """RLQS tiers: how many times a member has been new to a counter here, per slot of
        counters (core/stretch.py join_slot), after adding one to each slot of ``add``. A
        newcomer gets its even share at once, which the others' parts leave only at their next
        publish: a member whose publishes wait reads this each round, and publishes the
        counters of the slots that moved."""

    async def start(self) -> None:
        """Connect and start the store's work before traffic; never raises (unhealthy until up)."""

    def healthy(self) -> bool:
        """Whether the store answers (the health check and the status page)."""

    def metrics(self) -> StoreMetrics:
        """The store's name, figures, histograms and breakers, read now."""

    async def close(self) -> None:
        """Stop what :meth:`start` started and close connections."""
