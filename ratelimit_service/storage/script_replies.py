"""The Lua scripts' replies read by name: one typed decoder per script, the only place
that knows each reply's layout (the script's header says the same). Production reads
every reply through these, and the tests that hold a script equal to its twin use them
too.

Redis hands a Lua table back as a list of integers and byte strings (a Lua number is
truncated to an integer). A refused fenced write is the two numbers
``{-1, highest token}`` (:class:`~ratelimit_service.core.tiers.Fenced`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ratelimit_service.core.drop_ratio import FleetView, SyncResult
from ratelimit_service.core.exact import ExactResult
from ratelimit_service.core.tiers import MILLI, Fenced, TierTotals
from ratelimit_service.core.zones import (
    Lease,
    LeaseState,
    ZoneBucket,
    ZoneBuckets,
    ZoneTotals,
)

EXACT_STRIDE = 4
"""Numbers per descriptor in exact_window.lua's reply."""
REFUSED = -1
"""A fenced script's first number when it refused the write."""
TIER_STRIDE = 5
"""Numbers per counter in quota_tier.lua's reply."""
SYNC_STRIDE = 3
"""Numbers per bucket in fleet_sync.lua's reply, after the live nodes."""
ZONE_READ_STRIDE = 9
"""Fields per counter in zone_read.lua's reply."""
ZONE_READ_FLEET_STRIDE = 9
"""Fields per bucket in zone_read_fleet.lua's reply, after its time and replicas."""


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def exact_reply(raw: Sequence[Any], start: int, count: int) -> list[ExactResult]:
    """exact_window.lua: ``count`` descriptors' results, beginning at descriptor
    ``start`` of the batch: admitted, hits before, remaining, the reset (microseconds)."""
    results = []  # a loop, not a comprehension: one call fewer per reply (3.11)
    for i in range(EXACT_STRIDE * start, EXACT_STRIDE * (start + count), EXACT_STRIDE):
        results.append(
            ExactResult(bool(raw[i]), int(raw[i + 1]), int(raw[i + 2]), int(raw[i + 3]) / 1e6)
        )
    return results


def _fenced(raw: Any) -> Fenced | None:
    if isinstance(raw, list) and len(raw) == 2 and int(raw[0]) == REFUSED:
        return Fenced(int(raw[1]))
    return None


def tier_reply(raw: Sequence[Any]) -> list[TierTotals] | Fenced:
    """quota_tier.lua: per counter, the member's part, the fleet's demand (both in
    thousandths), instances, members and the window's allowed hits; or refused."""
    if (fenced := _fenced(raw)) is not None:
        return fenced
    return [
        TierTotals(
            part=int(raw[i]) / MILLI,
            demand=int(raw[i + 1]) / MILLI,
            instances=int(raw[i + 2]),
            members=int(raw[i + 3]),
            used=int(raw[i + 4]),
        )
        for i in range(0, len(raw), TIER_STRIDE)
    ]


def sync_reply(raw: Sequence[Any]) -> SyncResult:
    """fleet_sync.lua: the live nodes (-1 without a heartbeat), then per bucket its
    tokens, the offered total and the limit it refilled at (tokens and limit in
    thousandths)."""
    views = [
        FleetView(
            tokens=int(raw[i]) / MILLI,
            offered_total=int(raw[i + 1]),
            limit=int(raw[i + 2]) / MILLI,
        )
        for i in range(1, len(raw), SYNC_STRIDE)
    ]
    return SyncResult(nodes=int(raw[0]), views=views)


def zone_read_reply(raw: Sequence[Any]) -> list[ZoneTotals]:
    """zone_read.lua: every live counter of the zone with the zone's sums."""
    return [
        ZoneTotals(
            store_key=text(raw[i]),
            key=text(raw[i + 1]),
            demand=int(raw[i + 2]) / MILLI,
            instances=int(raw[i + 3]),
            limit=int(raw[i + 4]) / MILLI,
            window_seconds=int(raw[i + 5]) // 1_000_000,
            used=int(raw[i + 6]),
            forwarded=int(raw[i + 7]),
            window=int(raw[i + 8]),
        )
        for i in range(0, len(raw), ZONE_READ_STRIDE)
    ]


def zone_read_fleet_reply(raw: Sequence[Any]) -> ZoneBuckets:
    """zone_read_fleet.lua: the store's time, the zone's live replicas, every live
    probabilistic bucket."""
    buckets = [
        ZoneBucket(
            store_key=text(raw[i]),
            key=text(raw[i + 1]),
            offered=int(raw[i + 2]),
            admitted=int(raw[i + 3]),
            limit=int(raw[i + 4]),
            window_seconds=int(raw[i + 5]) // 1_000_000,
            forwarded=int(raw[i + 6]),
            created_us=int(raw[i + 7]),
            ends_us=int(raw[i + 8]) or None,
        )
        for i in range(2, len(raw), ZONE_READ_FLEET_STRIDE)
    ]
    return ZoneBuckets(now_us=int(raw[0]), replicas=int(raw[1]), buckets=buckets)


def zone_write_reply(raw: Any) -> int | Fenced:
    """zone_write.lua: how many counters were written; or refused."""
    if (fenced := _fenced(raw)) is not None:
        return fenced
    return int(raw)


def lease_reply(raw: Sequence[Any]) -> Lease:
    """lease.lua: the state (taken, renewed, held by another), the holder, its token."""
    state, holder, token = raw
    return Lease(LeaseState(int(state)), text(holder), int(token))
