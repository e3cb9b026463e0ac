"""Each Lua script's ARGV encoded and its reply decoded, one section per script: the only
place that knows those layouts (the script's header says the same), used by production
and by the tests that hold a script equal to its twin.

Redis hands a Lua table back as a list of integers and byte strings (a Lua number is
truncated to an integer). A refused fenced write is the two numbers
``{-1, highest token}`` (:class:`~ratelimit_service.core.tiers.Fenced`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any, NamedTuple

from ratelimit_service.core.drop_ratio import FleetView, SyncResult, capacity
from ratelimit_service.core.exact import ExactHit, ExactResult, HitRole
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.tiers import EXPIRE_PER_CALL, MILLI, Fenced, TierReport, TierTotals
from ratelimit_service.core.zones import (
    Lease,
    LeaseState,
    ZoneBucket,
    ZoneBuckets,
    ZoneShare,
    ZoneTotals,
)

EXACT_STRIDE = 4
"""Numbers per descriptor in exact_window.lua's reply."""
REFUSED = -1
"""A fenced script's first number when it refused the write."""
TIER_STRIDE = 6
"""Numbers per counter in quota_tier.lua's reply."""
SYNC_STRIDE = 3
"""Numbers per bucket in fleet_sync.lua's reply, after the live nodes."""
ZONE_READ_STRIDE = 9
"""Fields per counter in zone_read.lua's reply."""
ZONE_READ_FLEET_STRIDE = 9
"""Fields per bucket in zone_read_fleet.lua's reply, after its time and replicas."""


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fenced(raw: Any) -> Fenced | None:
    if isinstance(raw, list) and len(raw) == 2 and int(raw[0]) == REFUSED:
        return Fenced(int(raw[1]))
    return None


# exact_window.lua


COST_FLAG = 4
"""Added to a hit's role in ARGV when the hit is a cost (exact_window.lua COST)."""
HIT_STRIDE = 4
"""ARGV entries per descriptor of a request: limit, window, hits, role."""


def exact_batch_args(slices: int) -> list[Any]:
    """The head of exact_window.lua's ARGV: the window's slices and the count of the
    batch's requests, which :func:`add_exact_request` raises as it adds each one."""
    return [slices, 0]


def add_exact_request(args: list[Any], commit: int, hit_part: Sequence[Any]) -> None:
    """Add one request to a batch's ARGV: its commit, descriptor count and :func:`hit_args`."""
    args[1] += 1
    args += (int(commit), len(hit_part) // HIT_STRIDE)
    args += hit_part


def hit_args(hits: Sequence[ExactHit]) -> tuple[Any, ...]:
    """A request's per-descriptor ARGV: the same for the same hits, so callers may keep it."""
    args: list[Any] = []
    for hit in hits:
        role = int(hit.role) + COST_FLAG if hit.cost else int(hit.role)
        args += (hit.limit, hit.window_seconds * 1_000_000, hit.hits, role)
    return tuple(args)


def hit_roles(hit_part: Sequence[Any]) -> list[HitRole]:
    """The roles of a request's descriptors, read back from its :func:`hit_args`."""
    return [HitRole(role % COST_FLAG) for role in hit_part[3::HIT_STRIDE]]


def without_costs(hit_part: Sequence[Any]) -> list[Any]:
    """A request's :func:`hit_args` with its costs' hits set to 0: what is still owed
    of a request whose costs Redis counted already."""
    owed = list(hit_part)
    for role_at in range(3, len(owed), HIT_STRIDE):
        if owed[role_at] >= COST_FLAG:
            owed[role_at - 1] = 0
    return owed


def exact_reply(raw: Sequence[Any], start: int, count: int) -> list[ExactResult]:
    """exact_window.lua: ``count`` descriptors' results, beginning at descriptor
    ``start`` of the batch: admitted, hits before, remaining, the reset (microseconds)."""
    results = []  # a loop, not a comprehension: one call fewer per reply (3.11)
    for i in range(EXACT_STRIDE * start, EXACT_STRIDE * (start + count), EXACT_STRIDE):
        results.append(
            ExactResult(bool(raw[i]), int(raw[i + 1]), int(raw[i + 2]), int(raw[i + 3]) / 1e6)
        )
    return results


# fleet_sync.lua


SYNC_REPORT = struct.Struct("<dddddd")
"""A bucket's report in fleet_sync.lua's ARGV[4] (its header: REPORT)."""


def sync_args(
    reports: Sequence[BucketReport], node: str, node_ttl_us: int, zoned: bool
) -> list[Any]:
    """fleet_sync.lua's ARGV: ``node`` ('' for no heartbeat), the buckets' reports packed
    in one string, then in a zone their keys."""
    packed = b"".join(
        SYNC_REPORT.pack(
            report.window_seconds * 1_000_000,
            report.limit,
            int(capacity(report.limit, report.burst)),
            report.admitted,
            report.offered,
            -1 if report.ends_in is None else round(report.ends_in * 1_000_000),
        )
        for report in reports
    )
    args: list[Any] = [node, node_ttl_us, "1" if zoned else "", packed]
    if zoned:
        args += [report.key for report in reports]
    return args


FLEET_STATE = "<dddddddd"
"""The struct layout of a fleet bucket's packed state, its hash's field 'v' (fleet_sync.lua
packs it with Lua's struct library; zone_read_fleet.lua reads it)."""


class FleetState(NamedTuple):
    """A fleet bucket's packed state as fleet_sync.lua keeps it (times in microseconds;
    0: none yet)."""

    tokens: float
    stamp: float
    offered: float
    admitted: float
    indexed_at: float
    expires_at: float
    limit: float
    window_us: float


def fleet_state(packed: bytes | None) -> FleetState | None:
    """A fleet bucket hash's field 'v' decoded; None for a bucket with none."""
    return None if packed is None else FleetState(*struct.unpack(FLEET_STATE, packed))


def sync_reply(raw: Sequence[Any]) -> SyncResult:
    """fleet_sync.lua: the live nodes (-1 without a heartbeat), then per bucket its
    tokens, the offered total and the limit it refilled at (tokens and limit in
    thousandths)."""
    views = [
        FleetView(
            tokens=int(raw[i]) / MILLI, offered_total=int(raw[i + 1]), limit=int(raw[i + 2]) / MILLI
        )
        for i in range(1, len(raw), SYNC_STRIDE)
    ]
    return SyncResult(nodes=int(raw[0]), views=views)


# quota_tier.lua


COUNTER_STATE = "<ddddddddd"
"""The struct layout of an RLQS counter's packed state, its hash's field 'v'
(quota_tier.lua packs it; zone_read.lua reads it)."""


class CounterState(NamedTuple):
    """An RLQS counter's packed state as quota_tier.lua keeps it (rates in thousandths of
    a hit per second, times in microseconds; 0: none yet)."""

    demand: float
    instances: float
    parts: float
    window_index: float
    used: float
    indexed_at: float
    expires_at: float
    limit: float
    window_us: float


def counter_state(packed: bytes | None) -> CounterState | None:
    """An RLQS counter hash's field 'v' decoded; None for a counter with none."""
    return None if packed is None else CounterState(*struct.unpack(COUNTER_STATE, packed))


MEMBER_ENTRY = "<Bddd"
"""The struct layout of a member's entry in an RLQS counter's members' hash: a 0 byte,
then its demand (thousandths of a hit per second), instances and part (thousandths)."""


def member_entry(packed: bytes) -> tuple[float, float, float]:
    """A member's entry decoded: (demand, instances, part)."""
    _, demand, instances, part = struct.unpack(MEMBER_ENTRY, packed)
    return demand, instances, part


def tier_keys(hash_key: str) -> tuple[str, str, str]:
    """quota_tier.lua's KEYS for one counter: its hash, its members' sorted set and hash."""
    return hash_key, hash_key + ":m", hash_key + ":e"


TIER_REPORT = struct.Struct("<ddddd")
"""A counter's report in quota_tier.lua's ARGV[5] (its header: REPORT)."""


def tier_args(
    reports: Sequence[TierReport], forget_us: int, token: int | None, zoned: bool
) -> list[Any]:
    """quota_tier.lua's ARGV for one member's ``reports`` (see the script's header)."""
    member = reports[0].member
    packed = b"".join(
        TIER_REPORT.pack(
            round(report.demand * MILLI),
            report.instances,
            report.allowed,
            report.window_seconds * 1_000_000,
            round(report.limit * MILLI),
        )
        for report in reports
    )
    args: list[Any] = [member, forget_us, "" if token is None else token, EXPIRE_PER_CALL, packed]
    if zoned:
        args += [report.key for report in reports]
    return args


def tier_reply(raw: Sequence[Any]) -> list[TierTotals] | Fenced:
    """quota_tier.lua: per counter, the member's part, the fleet's demand (both in
    thousandths), instances, members, the window's allowed hits and the limit the parts
    divide (thousandths); or refused."""
    if (fenced := _fenced(raw)) is not None:
        return fenced
    return [
        TierTotals(
            part=int(raw[i]) / MILLI,
            demand=int(raw[i + 1]) / MILLI,
            instances=int(raw[i + 2]),
            members=int(raw[i + 3]),
            used=int(raw[i + 4]),
            limit=int(raw[i + 5]) / MILLI,
        )
        for i in range(0, len(raw), TIER_STRIDE)
    ]


# zone_read.lua and zone_read_fleet.lua


def zone_read_args(forget_us: int, most: int) -> list[Any]:
    """zone_read.lua's and zone_read_fleet.lua's ARGV: how long a silent member still
    counts, and how many entries one read returns at most."""
    return [forget_us, most]


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
    """zone_read_fleet.lua: the store's time, the zone's live replicas and probabilistic buckets."""
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


# zone_write.lua


def write_args(
    shares: Sequence[ZoneShare], zones: int | None, keep_ms: int, token: int
) -> list[Any]:
    """zone_write.lua's ARGV: the count of ``zones`` (None: left as it is), how long it
    lives, the writer's token, then each hash's share (see the script's header)."""
    args: list[Any] = ["" if zones is None else zones, keep_ms, token]
    for share in shares:
        allot = "" if share.allot is None else share.allot
        args += (share.part, share.global_used, share.window, share.forwarded, allot)
    return args


def zone_write_reply(raw: Any) -> int | Fenced:
    """zone_write.lua: how many counters were written; or refused."""
    if (fenced := _fenced(raw)) is not None:
        return fenced
    return int(raw)


# joins.lua


def joins_args(slots: int, add: Sequence[int]) -> list[Any]:
    """joins.lua's ARGV: the number of slots, then the slots to add one to first."""
    return [slots, *add]


def joins_reply(raw: Sequence[Any]) -> list[int]:
    """joins.lua: every slot's count of members new to a counter there."""
    return [int(count) for count in raw]


# lease.lua


def lease_args(holder: str, ttl_us: int, floor: int | None) -> list[Any]:
    """lease.lua's ARGV: who asks, for how long, and a token a write of theirs was
    refused against (None: none)."""
    return [holder, ttl_us, "" if floor is None else floor]


def lease_reply(raw: Sequence[Any]) -> Lease:
    """lease.lua: the state (taken, renewed, held by another), the holder, its token."""
    state, holder, token = raw
    return Lease(LeaseState(int(state)), text(holder), int(token))
