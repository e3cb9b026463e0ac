"""The Redis store: exact sliding windows in one Lua call per request (concurrent
requests share calls: exact_batcher; on a single server over the request path's own
pipelined connection: redis_pipe), and the fleet totals of probabilistic mode in one
round trip per sync (redis-py).

Time is Redis's (``TIME`` inside the scripts), so service clocks need not agree.
Every call is bounded (on the request path by the caller's deadline, at most
``request_timeout``; ``sync_timeout`` for the reconciler) and goes through a circuit
breaker; a failure surfaces as :class:`StoreUnavailable`, which callers turn into
their failure policy.

The breaker opens on evidence that Redis is down, never on a slow reply: errors,
refused or reset connections, or no byte at all from Redis for ``silence`` seconds
while calls are outstanding. A call given up at its deadline is only counted
(``timeouts``): on a busy machine most late replies are late because this process
was not running, and any reply proves Redis alive. The time each reply took, as this
process saw it, goes to the ``reply_time`` histogram.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

from redis.asyncio.cluster import ClusterNode
from redis.cluster import PRIMARY, REPLICA, get_node_name
from redis.crc import key_slot
from redis.exceptions import (
    AskError,
    MaxConnectionsError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import TimeoutError as RedisTimeoutError

from ratelimit_service.core.drop_ratio import SyncResult, capacity
from ratelimit_service.core.exact import (
    CHECK,
    DECIDE,
    DENIED,
    ExactHit,
    ExactResult,
    request_denied,
)
from ratelimit_service.core.histogram import Histogram
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.tiers import EXPIRE_PER_CALL, MILLI, Fenced, TierReport, TierTotals
from ratelimit_service.core.window import DEFAULT_SLICES
from ratelimit_service.core.zones import ZoneKeys
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.breaker import CircuitBreaker
from ratelimit_service.storage.exact_batcher import (
    MAX_PENDING,
    ExactBatcher,
    encode,
    hit_args,
)
from ratelimit_service.storage.redis_connect import connect
from ratelimit_service.storage.redis_pipe import RedisPipe, supports
from ratelimit_service.storage.script_replies import exact_reply, sync_reply, tier_reply

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")

CALL_CHUNK = 256
"""Items per script call of a batched store call: the store itself splits every batch
(a sync's buckets, a publish's counters, a zone's write-back) into calls of at most
this many, so each Lua call is short and Redis stays responsive."""
PREFIX = "rl:"
"""What every key starts with, by default (--redis-key-prefix)."""


def sync_args(
    reports: Sequence[BucketReport], node: str, node_ttl_us: int, zoned: bool
) -> list[Any]:
    """fleet_sync.lua's ARGV: ``node`` ('' for no heartbeat), then each bucket's report
    (see the script's header)."""
    args: list[Any] = [node, node_ttl_us, "1" if zoned else ""]
    for report in reports:
        args += (
            report.window_seconds * 1_000_000,
            report.limit,
            int(capacity(report.limit, report.burst)),
            report.admitted,
            report.offered,
            report.key if zoned else "",
        )
    return args


def tier_args(
    reports: Sequence[TierReport], forget_us: int, token: int | None, zoned: bool
) -> list[Any]:
    """quota_tier.lua's ARGV for one member's ``reports`` (see the script's header)."""
    member = reports[0].member
    args: list[Any] = [member, forget_us, "" if token is None else token, EXPIRE_PER_CALL]
    for report in reports:
        args += (
            round(report.demand * MILLI),
            report.instances,
            report.allowed,
            report.window_seconds * 1_000_000,
            round(report.limit * MILLI),
            report.key if zoned else "",
        )
    return args


@dataclass(slots=True)
class _Group:
    """Keys that one script call may touch together (one slot in a cluster)."""

    indexes: list[int]
    keys: list[str]
    hits: list[Any]


def _reorder(groups: Sequence[_Group], results: Sequence[Sequence[_R]], size: int) -> list[_R]:
    """Per-group results back in the order of the original items."""
    ordered: list[_R | None] = [None] * size
    for group, group_results in zip(groups, results, strict=True):
        for index, result in zip(group.indexes, group_results, strict=True):
            ordered[index] = result
    return [item for item in ordered if item is not None]


def _forget(task: asyncio.Future[Any]) -> None:
    """Collect the outcome of a command nobody waits for any more."""
    if not task.cancelled():
        task.exception()


LATE_TURNS = 3
"""Loop turns (each polls the sockets, without waiting) that a redis-py call past its
deadline gets to finish before it is given up: a reply that came while the loop was
busy elsewhere needs a poll to be read and a turn or two for redis-py's task to parse
it (redis-py's sockets are not ours to read directly, as the request path's pipe is).
Turns, not milliseconds: the answer must still reach the caller within its deadline."""
REQUEST_TIMEOUT = 1.0
"""Seconds an exact decision waits for Redis at most, by default: the bound for a
caller that sets no deadline (Envoy's filter sets one: 20 ms by default)."""
SILENCE = 1.0
"""Seconds with calls outstanding and no byte from Redis, by default, after which
Redis counts as down (the connection is dropped and the breaker opens)."""


async def _answered_late(command: asyncio.Future[Any]) -> bool:
    """Whether a call whose deadline has just passed had in fact been answered."""
    for _ in range(LATE_TURNS):
        await asyncio.sleep(0)
        if command.done():
            return True
    return False


def _outcome(done: asyncio.Future[Any]) -> Any:
    """A finished call's reply, or the exception it ended with."""
    if done.cancelled():  # only at shutdown
        return StoreUnavailable("redis: call cancelled")
    return done.exception() or done.result()


MAX_REASON = 200
"""Characters of an error kept for a log line or a status message."""


def describe(exc: BaseException) -> str:
    """An error in one short line: redis-py appends the repr of its client (a kilobyte
    of connection pools) to some messages, such as Sentinel's "No master found"."""
    text = " ".join((str(exc) or type(exc).__name__).split())
    text = text.split(" : <redis.", 1)[0]
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


RECONNECT_ON = ("READONLY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "MOVED", "ASK", "TRYAGAIN")
"""Error replies that say the connection reaches a server that cannot take the call: a
replica (a failover moved the master elsewhere), one loading its data, a cluster node
that no longer owns the slot. A fresh connection may reach the right one."""


MAX_NODE_GATES = 1000
"""Cluster nodes with a breaker of their own, at most (cleared when full)."""
FOLLOW_EVERY = 0.1
"""Seconds between two looks at a Cluster's slot ranges while a node fails (see
RedisStore._follow_topology): a promotion is seen within this much of the node that
answers knowing it."""
WARM_CONNECTIONS = 4
"""Connections opened to a promoted master before it gets its slots."""
FOLLOW_FOR = 2.0
"""Seconds the slot ranges are still looked at after the last failed call on a Cluster
(an error reply such as CLUSTERDOWN says the topology is changing)."""
REDIAL_EVERY = 0.25
"""Seconds between two drops of redis-py's pool (and log lines) at most."""


def wrong_server(exc: BaseException) -> bool:
    """Whether ``exc`` is an error reply of RECONNECT_ON, or a connection reset."""
    if isinstance(exc, ConnectionResetError):
        return True
    if not isinstance(exc, ResponseError):
        return False
    return str(exc).split(" ", 1)[0].upper() in RECONNECT_ON


def _display(url: str) -> str:
    """A URL fit for a log line: without its password."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


def _script(name: str) -> str:
    return resources.files("ratelimit_service.resources").joinpath(name).read_text()


_Prepared = tuple[Sequence[ExactHit], tuple[str, ...], tuple[Any, ...]]
"""Hits, their Redis keys, their ARGV part (see RedisStore._prepare)."""
MAX_PREPARED = 10_000
"""Hits kept prepared at most (cleared when full), as many as the servicer keeps requests."""


class RedisStore:
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        request_timeout: float = REQUEST_TIMEOUT,
        silence: float = SILENCE,
        sync_timeout: float = 1.0,
        connect_timeout: float = 0.5,
        prefix: str = PREFIX,
        slices: int = DEFAULT_SLICES,
        node_ttl: float = 5.0,
        max_connections: int = 64,
        batch_hold: float = 0.001,
        max_pending: int = MAX_PENDING,
        zone_keys: ZoneKeys | None = None,
    ) -> None:
        self.url = url
        self.request_timeout = request_timeout
        self.silence = silence
        self.connect_timeout = connect_timeout
        self.sync_timeout = sync_timeout
        self.prefix = prefix
        self.slices = slices
        self.node_ttl = node_ttl
        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._client, self.cluster = connect(
            url,
            socket_timeout=max(sync_timeout, request_timeout),
            connect_timeout=connect_timeout,
            max_connections=max_connections,
        )
        self._exact = self._client.register_script(_script("exact_window.lua"))
        self._sync = self._client.register_script(_script("fleet_sync.lua"))
        self._tier = self._client.register_script(_script("quota_tier.lua"))
        self.zone_keys = zone_keys
        """In a zone (a zone's store): the indexes fleet_sync.lua and quota_tier.lua
        keep for the zone's aggregator, and the count of zones; None: no zone."""
        self.breaker = CircuitBreaker(name=f"redis at {_display(url)}")
        self._initialized = not self.cluster
        self._node_gates: dict[str, CircuitBreaker] = {}
        """A Cluster's nodes by name, each with its own breaker (see _node_gate)."""
        self.node_failures = 0
        """Calls to a Cluster node that failed while other nodes worked (see
        _node_failed); the store's breaker counts the others."""
        self._follower: asyncio.Future[None] | None = None
        self._follow_until = 0.0
        self._follows = 0
        self._init_lock = asyncio.Lock()
        self.calls = 0
        self.timeouts = 0
        self.dropped_connections = 0
        """Times the connections were dropped for an error reply naming the wrong server
        (see wrong_server)."""
        self._redialed_at = -REDIAL_EVERY
        self._redial_said = False
        self.silences = 0
        """Times Redis was found silent (see SILENCE)."""
        self.reply_time = Histogram()
        """Seconds from writing a call to reading its reply, as this process saw them."""
        self._last_reply = 0.0
        """The loop's time of the last reply of any kind (redis-py calls)."""
        # Held batches count against the timeout: keep the gap well inside it.
        self.batch_hold = min(batch_hold, request_timeout / 4)
        self._batcher = ExactBatcher(
            self, slices, request_timeout, max_pending, gap=0.0 if self.cluster else self.batch_hold
        )
        self._prepared: dict[int, _Prepared] = {}
        # The request path's own connection (single server only): see redis_pipe.
        self._pipe = (
            RedisPipe(url, connect_timeout=connect_timeout, observe=self.reply_time.observe)
            if supports(url)
            else None
        )

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
        groups = self._by_slot([self._exact_key(hit.key, hit.window_seconds) for hit in hits], hits)
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
        costly = [g for g in groups if any(hit.cost for hit in g.hits)]
        if costly:
            await asyncio.gather(*(self._hit_group(g, DENIED, timeout) for g in costly))
        return results

    async def _hit_group(self, group: _Group, commit: int, timeout: float) -> list[ExactResult]:
        args: list[Any] = [self.slices, 1]
        encode(group.hits, commit, args)
        raw = await self._call(self._exact, group.keys, args, timeout)
        return exact_reply(raw, 0, len(group.hits))

    # The batcher's channel (see exact_batcher.Channel): callbacks, no coroutines, on
    # the pipelined connection when there is one.

    def send(self, keys: list[str], args: list[Any], deliver: Callable[[Any], None]) -> None:
        if not self.breaker.allow():
            deliver(StoreUnavailable("redis: circuit open after recent failures"))
            return
        self.calls += 1
        pipe, script = self._pipe, self._exact
        if pipe is not None and pipe.evalsha_now(script.sha, script.script, keys, args, deliver):
            return
        if pipe is None:  # Sentinel: redis-py, left to finish even past the deadline
            call = asyncio.ensure_future(self._run_timed(script, keys, args))
        else:  # not connected yet: connect first
            call = asyncio.ensure_future(pipe.evalsha(script.sha, script.script, keys, args))
        call.add_done_callback(lambda done: deliver(_outcome(done)))

    def settle(self, reply: Any) -> Any:
        if not isinstance(reply, BaseException):
            self._replied()
            return reply
        if isinstance(reply, StoreUnavailable):  # the circuit was open: nothing was sent
            raise reply
        if isinstance(reply, Exception):  # redis-py's own troubles in a failover too
            raise self._failed(reply) from reply
        raise reply

    def ready(self) -> bool:
        return not self.breaker.open

    def silent_longer_than(self, seconds: float) -> bool:
        pipe = self._pipe
        if pipe is None or pipe.silent_for() < seconds:  # the common case: one look
            return False
        self.poll()  # a reply may be waiting while this process was busy; or the
        # silence is long enough to drop the connection (and open the breaker)
        return pipe.silent_for() >= seconds

    def poll(self) -> None:
        """Read the replies already on the socket; drop a connection that has been
        silent too long (every call on it fails, and the breaker opens)."""
        pipe = self._pipe
        if pipe is None:
            return
        pipe.poll()
        silent = pipe.silent_for()
        if silent >= self.silence:
            reason = f"no byte from redis for {silent:.1f} s with calls outstanding"
            self._silent(reason)
            pipe.drop(reason)

    def timed_out(self, requests: int) -> None:
        self.timeouts += requests

    # -- reconciler --------------------------------------------------------------

    async def sync(self, reports: Sequence[BucketReport], interval: float) -> SyncResult:
        keys = [self._fleet_key(r.key, r.window_seconds) for r in reports]
        if self.cluster:
            # The node registry lives in its own slot: a heartbeat call of its own, and
            # one call per slot for the buckets, all concurrently.
            groups = self._by_slot(keys, reports)
            calls = [self._sync_call([], [], heartbeat=True)]
            calls += [self._sync_call(g.keys, g.hits, heartbeat=False) for g in groups]
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
            nodes=max(r.nodes for r in results),
            views=[view for r in results for view in r.views],
        )

    async def _sync_call(
        self, keys: list[str], reports: Sequence[BucketReport], heartbeat: bool
    ) -> SyncResult:
        zone = self.zone_keys
        zoned = zone is not None
        node = self.node_id if heartbeat else ""
        args = sync_args(reports, node, int(self.node_ttl * 1_000_000), zoned)
        call_keys = [self.prefix + "nodes", *keys] if heartbeat else list(keys)
        if zone is not None:
            call_keys += (zone.buckets, zone.zones)
        raw = await self._call(self._sync, call_keys, args, self.sync_timeout)
        return sync_reply(raw)

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
        """:meth:`publish` for a member that writes with a fencing token (a zone's
        aggregator), by ``deadline`` (the event loop's time): each call (of at most
        CALL_CHUNK counters) is refused whole when the store has seen a higher token
        from the member on any of its counters; the first refusal ends it."""
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
            chunk = reports[start : start + CALL_CHUNK]
            got = await self._publish(chunk, forget_after, token, self.time_left(deadline))
            if isinstance(got, Fenced):
                return got
            answers += got
        return answers

    async def _publish(
        self,
        reports: Sequence[TierReport],
        forget_after: float,
        token: int | None,
        timeout: float,
    ) -> list[TierTotals] | Fenced:
        keys = [self._tier_key(report.key) for report in reports]
        groups = self._by_slot(keys, reports)  # one group on a single server
        answers = await asyncio.gather(
            *(self._publish_call(g.keys, g.hits, forget_after, token, timeout) for g in groups)
        )
        refused = [a.highest for a in answers if isinstance(a, Fenced)]
        if refused:
            return Fenced(max(refused))
        return _reorder(groups, [a for a in answers if not isinstance(a, Fenced)], len(reports))

    def _tier_key(self, counter: str) -> str:
        """A counter's hash; its sorted set is the same name with ``:m``. Both carry a
        hash tag made from the counter (whose own text may hold braces), so a Cluster
        keeps them in one slot."""
        digest = hashlib.blake2b(counter.encode(), digest_size=8).hexdigest()
        return f"{self.prefix}qt{{{digest}}}"

    async def _publish_call(
        self,
        keys: list[str],
        reports: Sequence[TierReport],
        forget_after: float,
        token: int | None,
        timeout: float,
    ) -> list[TierTotals] | Fenced:
        index = self.zone_keys.counters if self.zone_keys is not None else None
        call_keys: list[str] = []
        for key in keys:
            call_keys += (key, key + ":m")
        if index is not None:
            call_keys.append(index)
        args = tier_args(reports, int(forget_after * 1_000_000), token, index is not None)
        raw = await self._call(self._tier, call_keys, args, timeout)
        return tier_reply(raw)

    def _by_slot(self, keys: list[str], items: Sequence[_T]) -> list[_Group]:
        """One group per cluster slot (everything in one group on a single server)."""
        if not self.cluster:
            return [_Group(list(range(len(keys))), keys, list(items))]
        groups: dict[int, _Group] = {}
        for index, (key, item) in enumerate(zip(keys, items, strict=True)):
            group = groups.setdefault(key_slot(key.encode()), _Group([], [], []))
            group.indexes.append(index)
            group.keys.append(key)
            group.hits.append(item)
        return list(groups.values())

    # -- plumbing ----------------------------------------------------------------

    async def _call(self, script: Any, keys: list[str], args: list[Any], timeout: float) -> Any:
        node = self._node_for(keys) if self.cluster else None
        gate = self._node_gate(node.name) if node is not None else None
        if gate is None:
            if not self.breaker.allow():
                raise StoreUnavailable("redis: circuit open after recent failures")
        elif not gate.allow():  # a Cluster node: its own breaker, and no other
            raise StoreUnavailable(f"redis: {gate.name} failing: circuit open")
        self.calls += 1
        # The command runs as its own task and is shielded from our deadline: when the
        # deadline passes we answer without it, but the command finishes in the
        # background and its connection goes back to the pool intact. Cancelling it
        # instead would drop the connection, and the next call would pay a new
        # connection's handshake (several round trips) inside its own deadline: under a
        # slow Redis that spirals into every call timing out.
        command = asyncio.ensure_future(
            self._run_timed(script, keys, args)
            if node is None
            else self._run_on_node(node, script, keys, args)
        )
        # Its outcome is collected even if our caller is cancelled meanwhile (gRPC
        # cancels a call past its deadline) and nobody awaits it any more.
        command.add_done_callback(_forget)
        try:
            try:
                async with asyncio.timeout(timeout):
                    raw = await asyncio.shield(command)
            except TimeoutError:
                if not await _answered_late(command):
                    if gate is not None:
                        self._watch_silence(command, gate)
                    raise self._timed_out(timeout) from None
                raw = command.result()
        except StoreUnavailable:  # no answer in time: no verdict on Redis (see _timed_out)
            raise
        except Exception as exc:  # RedisError, OSError, and redis-py's own troubles in a
            # failover (a RuntimeError on a transport it closed): the call failed
            if node is not None and gate is not None:
                raise self._node_failed(node, gate, exc) from exc
            raise self._failed(exc) from exc
        if gate is not None:
            gate.success()
        self._replied()
        return raw

    def _node_for(self, keys: list[str]) -> Any:
        """The Cluster node that serves ``keys`` in the slot map now, or None (no key,
        the map not loaded yet, the slot not covered): redis-py's client then routes
        the call itself."""
        if not keys or not self._initialized:
            return None
        try:
            return self._client.get_node_from_key(keys[0])
        except Exception:  # slots not loaded, or not covered: no node to call
            return None

    async def _run_on_node(self, node: Any, script: Any, keys: list[str], args: list[Any]) -> Any:
        """A script call on one Cluster node's own connections, its reply time observed.

        Not through redis-py's RedisCluster.execute_command: on CLUSTERDOWN (every
        node's answer, by default, while a master is flagged failed and not yet
        replaced) that sleeps 0.25 s and then rebuilds the whole slot map (16,384
        slots, about 4 ms of this loop in one piece) before it raises, so every call
        to a live master waits for its deadline; on a refused connection it asks for a
        rebuild that the next command to any node runs. Here a failure is this node's
        alone (see _node_failed), and the slot map is followed off the request path
        (see _follow_topology). A redirect (MOVED, ASK: slots migrating) is left to
        redis-py, which follows it."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            reply = await node.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:  # a node restarted or promoted without the script: load it
            reply = await node.execute_command("EVAL", script.script, len(keys), *keys, *args)
        except AskError:  # MOVED too
            return await self._run_timed(script, keys, args)
        self.reply_time.observe(loop.time() - started)
        return reply

    def _watch_silence(self, command: asyncio.Future[Any], gate: CircuitBreaker) -> None:
        """A Cluster call given up at its deadline: if it still has no reply ``silence``
        seconds on, its node counts as down (a hung or cut-off node; SILENCE), so the
        calls to its slots fail fast on its breaker instead of each waiting for its
        deadline. One timer per call given up, only then."""

        def check() -> None:
            if not command.done():
                self.silences += 1
                gate.down(f"no reply for {self.silence:.1f} s")
                self._follow_topology_soon()

        asyncio.get_running_loop().call_later(self.silence, check)

    def _node_gate(self, name: str) -> CircuitBreaker:
        """A Cluster node's own breaker: calls to a node that just failed fail at once
        for a backoff, then one goes through, while the other nodes are called as
        usual. Without it a master that is away until its replica is promoted costs
        every call to its slots a connection attempt."""
        gate = self._node_gates.get(name)
        if gate is None:
            if len(self._node_gates) >= MAX_NODE_GATES:
                self._node_gates.clear()
            gate = self._node_gates[name] = CircuitBreaker(
                flip_after=1, open_after=1, max_backoff=0.5, name=f"redis node {name}"
            )
        return gate

    def _node_failed(self, node: Any, gate: CircuitBreaker, exc: BaseException) -> StoreUnavailable:
        """A call to a Cluster node failed. An error reply (CLUSTERDOWN, TRYAGAIN...)
        came from a node that is there and answers at once: the call is answered by
        failure_mode, and the node stays open to calls (it serves again the moment
        the cluster does). A failed connection is the node's alone: its breaker opens,
        its idle connections are dialled again on their next use. Either way the slot
        ranges are followed for a while (a promotion moves them), and the store as a
        whole counts a failure only when no node it calls works."""
        reason = describe(exc)
        self._follow_until = asyncio.get_running_loop().time() + FOLLOW_FOR
        self._follow_topology_soon()
        if isinstance(exc, MaxConnectionsError):  # this process's own pool: no verdict
            return StoreUnavailable(f"redis: {reason}")
        if not isinstance(exc, ResponseError):
            gate.failure(reason, evidence=True)
            redial = getattr(node, "_mark_free_connections_for_reconnect_on_error", None)
            if redial is not None:  # redis-py 8: idle connections dialled on next use
                redial(exc)
        if isinstance(exc, ResponseError) or all(
            not each.healthy for each in self._node_gates.values()
        ):
            self.breaker.failure(reason, evidence=True)
        else:
            self.node_failures += 1  # counted here, not by the store's breaker
        return StoreUnavailable(f"redis: {node.name}: {reason}")

    def _follow_topology_soon(self) -> None:
        """Start following the slot ranges, unless that is under way already."""
        if self._follower is None or self._follower.done():
            self._follower = asyncio.ensure_future(self._follow_topology())
            self._follower.add_done_callback(_forget)

    async def _follow_topology(self) -> None:
        """While a node fails (or FOLLOW_FOR after an error reply), every FOLLOW_EVERY:
        the slot ranges as a node that answers sees them (CLUSTER SLOTS, a few
        hundred bytes), and the slot map changed only when they name another master
        than the map does: a promoted replica takes its ranges in place (see
        _promote), anything else rebuilds the map. One look at a time, each within
        ``sync_timeout``, off the request path; a look that fails is tried again with
        the next node."""
        loop = asyncio.get_running_loop()
        while loop.time() < self._follow_until or any(
            not gate.healthy for gate in self._node_gates.values()
        ):
            await asyncio.sleep(FOLLOW_EVERY)
            try:
                async with asyncio.timeout(self.sync_timeout):
                    moved = await self._moved_ranges()
                    if moved is None or (moved and not await self._promote(moved)):
                        await self._client.nodes_manager.initialize()
                    if moved is None or moved:
                        self._forget_gone_nodes()
            except Exception:  # no answer from that node, or no node: next time
                continue

    async def _moved_ranges(self) -> list[tuple[int, int, str, int]] | None:
        """The slot ranges (first, last, the master's host and port as announced) for
        which a node that answers names another master than the slot map does; None
        when no node is known to answer (the map is then rebuilt from the seeds)."""
        nodes = self._client.nodes_manager
        failing = {name for name, gate in self._node_gates.items() if not gate.healthy}
        asked = [node for node in self._client.get_nodes() if node.name not in failing]
        if not asked:
            return None
        self._follows += 1
        node = asked[self._follows % len(asked)]
        moved = []
        for start, end, primary, *_ in await node.execute_command("CLUSTER SLOTS"):
            host = primary[0].decode() if isinstance(primary[0], bytes) else primary[0]
            host, port = host or node.host, int(primary[1])
            name = get_node_name(*nodes.remap_host_port(host, port))
            for slot in (start, end):
                owners = nodes.slots_cache.get(slot)
                if not owners or owners[0].name != name:
                    moved.append((start, end, host, port))
                    break
        return moved

    async def _promote(self, moved: list[tuple[int, int, str, int]]) -> bool:
        """The ranges in ``moved`` given to their new masters in place, when each is a
        failover: the new master serves no other slot (a promoted replica, known to
        the map or not). Each new master is readied first (see _ready_master); then
        its slots get a new node list, the new master first and the old one as a
        replica, each slot assigned (5,461 of them for a third of the slots: a
        fraction of a millisecond). The whole map's rebuild instead holds this loop
        about 4 ms (16,384 slots, twice over), one more stall for every call in
        flight. False, with nothing changed, when a range is no failover (slots
        migrated to another master): the map is then rebuilt."""
        nodes = self._client.nodes_manager
        slots = nodes.slots_cache
        targets = []
        for start, end, host, port in moved:
            owners = slots.get(start)
            node = nodes.get_node(*nodes.remap_host_port(host, port))
            if owners is None or slots.get(end) is not owners:
                return False
            if node is not None and node.server_type == PRIMARY:
                return False  # a master already: slots migrated
            if node is None:
                node = ClusterNode(host, port, REPLICA, **nodes.connection_kwargs)
                nodes.set_nodes(nodes.nodes_cache, {node.name: node})
            targets.append((start, end, owners, node))
        masters = {node.name: node for *_, node in targets}
        await asyncio.gather(*(self._ready_master(node) for node in masters.values()))
        for start, end, owners, node in targets:
            old = owners[0]
            old.server_type, node.server_type = REPLICA, PRIMARY
            serving = [node, *(n for n in owners[1:] if n is not node), old]
            for slot in range(start, end + 1):
                slots[slot] = serving
            if nodes.default_node is old:
                nodes.default_node = node
        return True

    async def _ready_master(self, node: Any) -> None:
        """A promoted master readied before it gets its slots: WARM_CONNECTIONS
        connections opened, and the scripts loaded (a replica never ran them, and
        SCRIPT LOAD is not replicated). Otherwise the calls in flight when its slots
        arrive each dial a connection of their own and are refused NOSCRIPT, inside
        their deadlines."""
        await asyncio.gather(*(node.execute_command("PING") for _ in range(WARM_CONNECTIONS)))
        for script in (self._exact, self._sync, self._tier):
            await node.execute_command("SCRIPT", "LOAD", script.script)

    def _forget_gone_nodes(self) -> None:
        """After the slot map changed: the breakers of nodes that serve no slot any
        more (a dead master whose replica was promoted) are dropped, so the store no
        longer counts them unavailable."""
        masters = {node.name for node in self._client.get_primaries()}
        for name in [name for name in self._node_gates if name not in masters]:
            del self._node_gates[name]

    def _failed(self, exc: BaseException) -> StoreUnavailable:
        """A call failed: a breaker event, and a connection that answered that it is
        the wrong server (or not ready) is dropped, so the next call dials again."""
        reason = describe(exc)
        self.breaker.failure(reason)
        if wrong_server(exc):
            self._redial(reason)
        return StoreUnavailable(f"redis: {reason}")

    def _redial(self, reason: str) -> None:
        """Drop the connections that gave ``reason``: the request path's pipe at once
        (its outstanding calls fail with it, so no later reply of that connection drops
        the next one), redis-py's pool at most every REDIAL_EVERY seconds (every call
        on it answers the same). After a failover that moved an address, a new
        connection reaches the new master; the old ones would reach the demoted one for
        ever."""
        now = asyncio.get_running_loop().time()
        if self._pipe is not None:
            self._pipe.drop(f"redis connection dropped: {reason}")
        if now - self._redialed_at < REDIAL_EVERY:
            return
        self._redialed_at = now
        self.dropped_connections += 1
        if not self._redial_said:  # once until Redis answers again
            self._redial_said = True
            log.warning("redis at %s: %s; reconnecting", _display(self.url), reason)
        pool = getattr(self._client, "connection_pool", None)
        if pool is not None and not self.cluster:  # a Cluster client follows slots itself
            task = asyncio.ensure_future(pool.disconnect())
            task.add_done_callback(_forget)

    def time_left(self, deadline: float | None) -> float:
        """A call's timeout: ``sync_timeout``, or less to end by ``deadline`` (the event
        loop's time; None: no deadline). Raises StoreUnavailable when none is left."""
        if deadline is None:
            return self.sync_timeout
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            self.timeouts += 1
            raise StoreUnavailable("redis: no time left for the call")
        return min(self.sync_timeout, left)

    def _replied(self) -> None:
        """A reply came: Redis is alive."""
        self._last_reply = asyncio.get_running_loop().time()
        self._redial_said = False
        self.breaker.success()

    def _timed_out(self, timeout: float) -> StoreUnavailable:
        """A redis-py call got no reply within ``timeout``: counted; evidence that
        Redis is down only if no call at all has been answered for ``silence``."""
        self.timeouts += 1
        reason = f"no answer within {timeout * 1000:.0f} ms"
        if asyncio.get_running_loop().time() - self._last_reply >= self.silence:
            self._silent(f"{reason}, and none to any call for {self.silence:.1f} s")
        return StoreUnavailable(f"redis: {reason}")

    def _silent(self, reason: str) -> None:
        self.silences += 1
        self.breaker.down(reason)

    async def _run_timed(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """A redis-py script call, its reply time observed."""
        if not self._initialized:
            await self._initialize()
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await script(keys=keys, args=args)
        self.reply_time.observe(loop.time() - started)
        return reply

    async def start(self, connections: int = 4) -> None:
        """Open a few connections and load the scripts before traffic, outside any
        request deadline. A Redis that refuses or errs is marked down (the breaker says
        so once) and tried again by the calls that follow; one that is only slow to
        answer is no evidence of an outage: said once, and left to the request path."""
        try:
            async with asyncio.timeout(self.sync_timeout * 2):
                if not self._initialized:
                    await self._initialize()
                calls = [self._client.ping() for _ in range(connections)]
                calls += [self._client.script_load(s.script) for s in (self._exact, self._sync)]
                if self._pipe is not None:
                    calls.append(self._pipe.connected())
                await asyncio.gather(*calls)
        except (TimeoutError, RedisTimeoutError):
            log.warning(
                "redis at %s slow to answer at start-up (more than %.1f s): serving, and"
                " counting on it",
                _display(self.url),
                self.sync_timeout * 2,
            )
        except (RedisError, RedisClusterException, OSError) as exc:
            reason = describe(exc)
            # The breaker says it once; calls go on trying, and the first reply closes it.
            self.breaker.down(f"not reachable at start-up: {reason}; tried until it answers")

    async def _initialize(self) -> None:
        """Discover the cluster once, before concurrent use: redis-py's lazy discovery
        races when several first commands start together (seen with redis-py 8.1)."""
        async with self._init_lock:
            if not self._initialized:
                await self._client.initialize()
                self._initialized = True

    def _exact_key(self, bucket_key: str, window_seconds: int) -> str:
        return f"{self.prefix}e:{window_seconds}:{bucket_key}"

    def _fleet_key(self, bucket_key: str, window_seconds: int) -> str:
        return f"{self.prefix}p:{window_seconds}:{bucket_key}"

    def healthy(self) -> bool:
        return self.breaker.healthy

    def sweep(self) -> Iterator[int]:
        """Redis expires every key itself."""
        return iter(())

    def histograms(self) -> dict[str, Histogram]:
        return {"reply": self.reply_time}

    def stats(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "errors": self.breaker.total_failures + self.node_failures,
            "timeouts": self.timeouts,
            "silences": self.silences,
            "dropped_connections": self.dropped_connections,
            "circuit_open": 1.0 if self.breaker.open else 0.0,
            "nodes_unavailable": sum(not gate.healthy for gate in self._node_gates.values()),
            "healthy": 1.0 if self.breaker.healthy else 0.0,
            "outages": self.breaker.outages,
            "recoveries": self.breaker.recoveries,
            "exact_given_up": self._batcher.given_up,
            "exact_hopeless": self._batcher.hopeless,
            "exact_late": self._batcher.late,
            "exact_prompt_seconds": self._batcher.prompt,
            "exact_batches": self._batcher.batches,
            "exact_batched_requests": self._batcher.requests,
            "exact_held_batches": self._batcher.held,
            "exact_pending": self._batcher.pending,
            "exact_overloaded": self._batcher.overloaded,
            "exact_owed_entries": len(self._batcher.owed),
            "exact_owed_sent": self._batcher.owed.sent,
            "exact_owed_dropped": self._batcher.owed.dropped,
            "exact_batch_gap_seconds": self._batcher.gap,
        }

    async def close(self) -> None:
        self._batcher.close()
        if self._follower is not None:
            self._follower.cancel()
        if self._pipe is not None:
            await self._pipe.close()
        await self._client.aclose()
