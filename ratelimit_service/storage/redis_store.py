"""The Redis store: exact sliding windows in one Lua call per request (concurrent
requests share calls: exact_batcher), the fleet totals of probabilistic mode in one
round trip per sync, and RLQS tiers (quota_tier.lua).

Time is Redis's (``TIME`` inside the scripts), so service clocks need not agree. Every
call is bounded (by the caller's deadline, at most ``request_timeout``; ``sync_timeout``
for the reconciler) and goes through a circuit breaker (redis_calls); a failure surfaces
as :class:`StoreUnavailable`, which callers turn into their failure policy.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Sequence
from typing import Any, TypeVar

from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratelimit_service.core.drop_ratio import FleetView, SyncResult
from ratelimit_service.core.exact import (
    CHECK,
    DECIDE,
    DENIED,
    ExactHit,
    ExactResult,
    request_denied,
)
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.settings_table import default
from ratelimit_service.core.stretch import JOIN_SLOTS
from ratelimit_service.core.tiers import Fenced, TierReport, TierTotals
from ratelimit_service.core.window import DEFAULT_SLICES
from ratelimit_service.core.zones import ZoneKeys
from ratelimit_service.storage.base import StoreMetrics
from ratelimit_service.storage.exact_batcher import ExactBatcher
from ratelimit_service.storage.exact_channel import ExactChannel
from ratelimit_service.storage.redis_calls import Group, ScriptCalls, describe, display
from ratelimit_service.storage.script_calls import (
    add_exact_request,
    exact_batch_args,
    exact_reply,
    hit_args,
    joins_args,
    joins_reply,
    sync_args,
    sync_reply,
    tier_args,
    tier_keys,
    tier_reply,
)

log = logging.getLogger(__name__)

_R = TypeVar("_R")

CALL_CHUNK = 256
"""Items per script call at most when the store splits a batch (a sync's buckets, a
publish's counters, a zone's write-back): each Lua call is short, Redis responsive."""


def _reorder(groups: Sequence[Group], results: Sequence[Sequence[_R]], size: int) -> list[_R]:
    """Per-group results back in the order of the original items."""
    ordered: list[_R | None] = [None] * size
    for group, group_results in zip(groups, results, strict=True):
        for index, result in zip(group.indexes, group_results, strict=True):
            ordered[index] = result
    return [item for item in ordered if item is not None]


_Prepared = tuple[Sequence[ExactHit], tuple[str, ...], tuple[Any, ...]]
"""Hits, their Redis keys, their ARGV part (see RedisStore._prepare)."""
MAX_PREPARED = 10_000
"""Hits kept prepared at most (cleared when full), as many as the servicer keeps requests."""


class RedisStore:
    """The Store seam on Redis: exact hits, probabilistic syncs, RLQS publishes, each as
    script calls through :class:`ScriptCalls`."""

    def __init__(
        self,
        url: str,
        *,
        request_timeout: float = default("--redis-timeout"),
        silence: float = default("--redis-silence"),
        sync_timeout: float = 1.0,
        connect_timeout: float = 0.5,
        prefix: str = default("--redis-key-prefix"),
        slices: int = DEFAULT_SLICES,
        node_ttl: float = 5.0,
        max_connections: int = default("--redis-pool-size"),
        batch_hold: float = default("--exact-batch-hold"),
        max_pending: int = default("--exact-max-pending"),
        zone_keys: ZoneKeys | None = None,
    ) -> None:
        self.url = url
        self.request_timeout = request_timeout
        self.sync_timeout = sync_timeout
        self.prefix = prefix
        self.slices = slices
        self.node_ttl = node_ttl
        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.redis = ScriptCalls(
            url,
            request_timeout=request_timeout,
            silence=silence,
            sync_timeout=sync_timeout,
            connect_timeout=connect_timeout,
            max_connections=max_connections,
        )
        self.cluster = self.redis.cluster
        self._exact = self.redis.register("exact_window.lua")
        self._sync = self.redis.register("fleet_sync.lua")
        self._tier = self.redis.register("quota_tier.lua")
        self._joins = self.redis.register("joins.lua")
        self.zone_keys = zone_keys
        """In a zone (a zone's store): the indexes fleet_sync.lua and quota_tier.lua
        keep for the zone's aggregator, and the count of zones; None: no zone."""
        # Held batches count against the timeout: keep the gap well inside it.
        self.batch_hold = min(batch_hold, request_timeout / 4)
        self._batcher = ExactBatcher(
            ExactChannel(self.redis, self._exact),
            slices,
            request_timeout,
            max_pending,
            gap=0.0 if self.cluster else self.batch_hold,
        )
        self._prepared: dict[int, _Prepared] = {}

    # -- request path ------------------------------------------------------------

    def hit(
        self,
        hits: Sequence[ExactHit],
        commit: int,
        owe: bool = False,
        deadline: float | None = None,
    ) -> Awaitable[list[ExactResult]]:
        if not self.cluster:  # one server sees every key: batch with concurrent requests
            prepared = self._prepared.get(id(hits))
            if prepared is None or prepared[0] is not hits:
                prepared = self._prepare(hits)
            return self._batcher.submit(prepared[1], prepared[2], commit, owe, deadline)
        # A Cluster's keys live on several nodes: hits admitted while one is away are
        # not carried to it later (owed hits need the batcher's single connection).
        return self._hit_cluster(hits, commit, deadline)

    def _prepare(self, hits: Sequence[ExactHit]) -> _Prepared:
        """Keys and ARGV of a request's hits. The limiter passes the same tuple each
        time a request comes back under one config (its plan's), so tuples are kept,
        by id (the entry holds the tuple: its id cannot be reused meanwhile). Lists
        are hits made for one request: not kept."""
        keys = tuple([self._exact_key(hit.key, hit.window_seconds) for hit in hits])
        prepared = (hits, keys, hit_args(hits))
        if isinstance(hits, tuple):
            if len(self._prepared) >= MAX_PREPARED:
                self._prepared.clear()
            self._prepared[id(hits)] = prepared
        return prepared

    async def _hit_cluster(
        self, hits: Sequence[ExactHit], commit: int, deadline: float | None
    ) -> list[ExactResult]:
        timeout = self.request_timeout
        if deadline is not None:
            timeout = max(0.0, min(timeout, deadline - asyncio.get_running_loop().time()))
        keys = [self._exact_key(hit.key, hit.window_seconds) for hit in hits]
        groups = self.redis.by_slot(keys, hits)
        if len(groups) == 1:
            return await self._hit_group(groups[0], commit, timeout)
        # Redis Cluster, descriptors in several slots: one script cannot see them all.
        # Check everywhere first, then consume only if the whole request goes through;
        # the second pass re-checks each key, so a race can deny a hit, never overshoot.
        # A denied request's costs are still counted (core/exact.py counts): the groups
        # holding one are sent again, counting their costs only.
        checks = await asyncio.gather(*(self._hit_group(g, CHECK, timeout) for g in groups))
        results = _reorder(groups, checks, len(hits))
        if not commit:
            return results
        roles = [hit.role for hit in hits]
        if commit == DECIDE and not request_denied(roles, [r.admitted for r in results]):
            committed = await asyncio.gather(*(self._hit_group(g, DECIDE, timeout) for g in groups))
            return _reorder(groups, committed, len(hits))
        costly = [g for g in groups if any(hit.cost for hit in g.items)]
        if costly:
            await asyncio.gather(*(self._hit_group(g, DENIED, timeout) for g in costly))
        return results

    async def _hit_group(self, group: Group, commit: int, timeout: float) -> list[ExactResult]:
        args = exact_batch_args(self.slices)
        add_exact_request(args, commit, hit_args(group.items))
        raw = await self.redis.call(self._exact, group.keys, args, timeout)
        return exact_reply(raw, 0, len(group.items))

    # -- reconciler --------------------------------------------------------------

    async def sync(self, reports: Sequence[BucketReport]) -> SyncResult:
        keys = [self._fleet_key(r.key, r.window_seconds) for r in reports]
        if self.cluster:
            # The node registry lives in its own slot: a heartbeat call of its own, and
            # one call per slot for the buckets, all concurrently.
            groups = self.redis.by_slot(keys, reports)
            calls = [self._sync_call([], [], heartbeat=True)]
            calls += [self._sync_call(g.keys, g.items, heartbeat=False) for g in groups]
            results = await asyncio.gather(*calls)
            views = _reorder(groups, [r.views for r in results[1:]], len(reports))
            return SyncResult(nodes=results[0].nodes, views=views)
        # One server: each chunk carries the heartbeat; an empty sync still runs once.
        bounds = range(0, len(reports), CALL_CHUNK)
        chunks = [(keys[i : i + CALL_CHUNK], reports[i : i + CALL_CHUNK]) for i in bounds]
        results = await asyncio.gather(
            *(self._sync_call(k, r, heartbeat=True) for k, r in chunks or [([], [])])
        )
        return SyncResult(
            nodes=max(r.nodes for r in results), views=[view for r in results for view in r.views]
        )

    async def fold(self, reports: Sequence[BucketReport], deadline: float) -> list[FleetView]:
        """Fold ``reports`` into the fleet buckets with no heartbeat, by the event loop's
        ``deadline``: a zone's aggregator's calendar budgets in the global store, where
        the zones are the buckets' nodes (core/zones.py ZonePass.calendar_reports)."""
        keys = [self._fleet_key(r.key, r.window_seconds) for r in reports]
        groups = []
        for whole in self.redis.by_slot(keys, reports):  # calls of CALL_CHUNK buckets at most
            for start in range(0, len(whole.keys), CALL_CHUNK):
                part = slice(start, start + CALL_CHUNK)
                groups.append(Group(whole.indexes[part], whole.keys[part], whole.items[part]))
        timeout = self.redis.time_left(deadline)
        results = await asyncio.gather(
            *(self._sync_call(g.keys, g.items, heartbeat=False, timeout=timeout) for g in groups)
        )
        return _reorder(groups, [r.views for r in results], len(reports))

    async def _sync_call(
        self,
        keys: list[str],
        reports: Sequence[BucketReport],
        heartbeat: bool,
        timeout: float | None = None,
    ) -> SyncResult:
        zone = self.zone_keys
        node = self.node_id if heartbeat else ""
        args = sync_args(reports, node, int(self.node_ttl * 1_000_000), zone is not None)
        call_keys = [self.prefix + "nodes", *keys] if heartbeat else list(keys)
        if zone is not None:
            call_keys += (zone.buckets, zone.zones)
        wait = self.sync_timeout if timeout is None else timeout
        return sync_reply(await self.redis.call(self._sync, call_keys, args, wait))

    # -- RLQS --------------------------------------------------------------------

    async def publish(self, reports: Sequence[TierReport], forget_after: float) -> list[TierTotals]:
        """Each counter's totals in, the member's part out (quota_tier.lua), in calls of
        at most CALL_CHUNK counters, one after the other, each within ``sync_timeout``."""
        answers = await self._publish_chunks(reports, forget_after, None, None)
        assert not isinstance(answers, Fenced)  # no token, no fence
        return answers

    async def publish_fenced(
        self, reports: Sequence[TierReport], forget_after: float, token: int, deadline: float
    ) -> list[TierTotals] | Fenced:
        """:meth:`publish` with a fencing token (a zone's aggregator's), by ``deadline``
        (the event loop's time): each call is refused whole when the store has seen a
        higher token from the member on any of its counters; the first refusal ends it."""
        return await self._publish_chunks(reports, forget_after, token, deadline)

    async def _publish_chunks(
        self,
        reports: Sequence[TierReport],
        forget_after: float,
        token: int | None,
        deadline: float | None,
    ) -> list[TierTotals] | Fenced:
        answers: list[TierTotals] = []
        for start in range(0, len(reports), CALL_CHUNK):
            timeout = self.redis.time_left(deadline)
            chunk = reports[start : start + CALL_CHUNK]
            keys = [self._tier_key(report.key) for report in chunk]
            groups = self.redis.by_slot(keys, chunk)  # one group on a single server
            got = await asyncio.gather(
                *(self._publish_call(g, forget_after, token, timeout) for g in groups)
            )
            refused = [a.highest for a in got if isinstance(a, Fenced)]
            if refused:
                return Fenced(max(refused))
            answers += _reorder(groups, [a for a in got if not isinstance(a, Fenced)], len(chunk))
        return answers

    async def joins(self, add: Sequence[int], deadline: float | None = None) -> list[int]:
        """The store's counts of members new to a counter, per slot (joins.lua), one more
        in each slot of ``add``; by ``deadline`` (the event loop's time), within
        ``sync_timeout``."""
        keys, wait = [f"{self.prefix}joins:{JOIN_SLOTS}"], self.redis.time_left(deadline)
        args = joins_args(JOIN_SLOTS, add)
        return joins_reply(await self.redis.call(self._joins, keys, args, wait))

    def _tier_key(self, counter: str) -> str:
        """A counter's hash; its sorted set and its members' hash are the same name with
        ``:m`` and ``:e`` (:func:`tier_keys`). All carry a hash tag made from the counter
        (whose own text may hold braces), so a Cluster keeps them in one slot."""
        digest = hashlib.blake2b(counter.encode(), digest_size=8).hexdigest()
        return f"{self.prefix}qt{{{digest}}}"

    async def _publish_call(
        self, group: Group, forget_after: float, token: int | None, timeout: float
    ) -> list[TierTotals] | Fenced:
        index = self.zone_keys.counters if self.zone_keys is not None else None
        call_keys = [name for key in group.keys for name in tier_keys(key)]
        if index is not None:
            call_keys.append(index)
        args = tier_args(group.items, int(forget_after * 1_000_000), token, index is not None)
        return tier_reply(await self.redis.call(self._tier, call_keys, args, timeout))

    async def start(self, connections: int = 4) -> None:
        """Open a few connections and load the scripts before traffic, outside any
        request deadline. A Redis that refuses or errs is marked down (the breaker says
        so once) and tried again by the calls that follow; one only slow to answer is
        no evidence of an outage: said once, and left to the request path."""
        try:
            async with asyncio.timeout(self.sync_timeout * 2):
                await self.redis.initialize()
                client, pipe = self.redis.client, self.redis.pipe
                calls = [client.ping() for _ in range(connections)]
                calls += [client.script_load(s.script) for s in (self._exact, self._sync)]
                if pipe is not None:
                    calls.append(pipe.connected())
                await asyncio.gather(*calls)
        except (TimeoutError, RedisTimeoutError):
            log.warning(
                "redis at %s slow to answer at start-up (more than %.1f s): serving, and"
                " counting on it",
                display(self.url),
                self.sync_timeout * 2,
            )
        except (RedisError, RedisClusterException, OSError) as exc:
            reason = describe(exc)
            self.redis.breaker.down(f"not reachable at start-up: {reason}; tried until it answers")

    def _exact_key(self, bucket_key: str, window_seconds: int) -> str:
        return f"{self.prefix}e:{window_seconds}:{bucket_key}"

    def _fleet_key(self, bucket_key: str, window_seconds: int) -> str:
        return f"{self.prefix}p:{window_seconds}:{bucket_key}"

    def healthy(self) -> bool:
        return self.redis.breaker.healthy

    def metrics(self) -> StoreMetrics:
        batcher = self._batcher
        figures = {
            **self.redis.figures(),
            "exact_given_up": batcher.given_up,
            "exact_hopeless": batcher.hopeless,
            "exact_late": batcher.late,
            "exact_prompt_seconds": batcher.prompt,
            "exact_batches": batcher.batches,
            "exact_batched_requests": batcher.requests,
            "exact_held_batches": batcher.held,
            "exact_pending": batcher.pending,
            "exact_overloaded": batcher.overloaded,
            "exact_owed_entries": len(batcher.owed),
            "exact_owed_sent": batcher.owed.sent,
            "exact_owed_dropped": batcher.owed.dropped,
            "exact_batch_gap_seconds": batcher.gap,
        }
        reply = {"reply": self.redis.reply_time}
        return StoreMetrics("redis", figures, reply, (self.redis.breaker_state(),))

    async def close(self) -> None:
        self._batcher.close()
        await self.redis.close()
