"""The call plumbing of a Redis store: every script call bounded by its timeout and kept
out of the way of the next (shielded, collected), a circuit breaker over the store and
one per Cluster node, connections dropped when they reach the wrong server, and a
Cluster's slot map followed off the request path after a failover.

The breaker opens on evidence that Redis is down, never on a slow reply: errors, refused
or reset connections, or no byte from Redis for ``silence`` seconds while calls are
outstanding. A call given up at its deadline is only counted (``timeouts``): on a busy
machine most late replies are late because this process was not running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, TypeVar

from redis.asyncio.cluster import ClusterNode
from redis.cluster import PRIMARY, REPLICA, get_node_name
from redis.crc import key_slot
from redis.exceptions import AskError, MaxConnectionsError, NoScriptError, ResponseError

from ratelimit_service.core.histogram import Histogram
from ratelimit_service.storage.base import BreakerState, StoreUnavailable
from ratelimit_service.storage.breaker import CircuitBreaker
from ratelimit_service.storage.redis_connect import connect
from ratelimit_service.storage.redis_pipe import RedisPipe, forget, supports

log = logging.getLogger(__name__)

_T = TypeVar("_T")


LATE_TURNS = 3
"""Loop turns (not ms: the answer must still come in time) a late redis-py call gets to finish."""


async def _answered_late(command: asyncio.Future[Any]) -> bool:
    """Whether a call whose deadline has just passed had in fact been answered."""
    for _ in range(LATE_TURNS):
        await asyncio.sleep(0)
        if command.done():
            return True
    return False


def outcome(done: asyncio.Future[Any]) -> Any:
    """A finished call's reply, or the exception it ended with."""
    if done.cancelled():  # only at shutdown
        return StoreUnavailable("redis: call cancelled")
    return done.exception() or done.result()


MAX_REASON = 200
"""Characters of an error kept for a log line or a status message."""


def describe(exc: BaseException) -> str:
    """An error in one short line: redis-py appends a kilobyte of its client's repr to some."""
    text = " ".join((str(exc) or type(exc).__name__).split()).split(" : <redis.", 1)[0]
    return text if len(text) <= MAX_REASON else text[: MAX_REASON - 3] + "..."


RECONNECT_ON = ("READONLY", "LOADING", "MASTERDOWN", "CLUSTERDOWN", "MOVED", "ASK", "TRYAGAIN")
"""Error replies of a server that cannot take the call (a replica, loading, not the slot's)."""


MAX_NODE_GATES = 1000
"""Cluster nodes with a breaker of their own, at most (cleared when full)."""
FOLLOW_EVERY = 0.1
"""Seconds between two looks at a Cluster's slot ranges while a node fails."""
WARM_CONNECTIONS = 4
"""Connections opened to a promoted master before it gets its slots."""
FOLLOW_FOR = 2.0
"""Seconds the slot ranges are still followed after a Cluster call's error reply."""
REDIAL_EVERY = 0.25
"""Seconds between two drops of redis-py's pool (and log lines) at most."""


def wrong_server(exc: BaseException) -> bool:
    """Whether ``exc`` is an error reply of RECONNECT_ON, or a connection reset."""
    return isinstance(exc, ConnectionResetError) or (
        isinstance(exc, ResponseError) and str(exc).split(" ", 1)[0].upper() in RECONNECT_ON
    )


def display(url: str) -> str:
    """A URL fit for a log line: without its password."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


def script_text(name: str) -> str:
    return resources.files("ratelimit_service.resources").joinpath(name).read_text()


@dataclass(slots=True)
class Group:
    """Keys one script call may touch together (one Cluster slot), their items and indexes."""

    indexes: list[int]
    keys: list[str]
    items: list[Any]


class ScriptCalls:
    """Script calls to one Redis (server, Sentinel or Cluster), each bounded and accounted."""

    def __init__(
        self,
        url: str,
        *,
        request_timeout: float,
        silence: float,
        sync_timeout: float,
        connect_timeout: float,
        max_connections: int,
    ) -> None:
        self.url = url
        self.silence = silence
        self.sync_timeout = sync_timeout
        self.client, self.cluster = connect(
            url,
            socket_timeout=max(sync_timeout, request_timeout),
            connect_timeout=connect_timeout,
            max_connections=max_connections,
        )
        self.scripts: list[Any] = []
        """Every script registered (see :meth:`register`): loaded on a promoted master."""
        self.breaker = CircuitBreaker(name=f"redis at {display(url)}")
        self._initialized = not self.cluster
        self._node_gates: dict[str, CircuitBreaker] = {}
        """A Cluster's nodes by name, each with its own breaker (see _node_gate)."""
        self.node_failures = 0
        """Failed calls to a Cluster node while other nodes worked (see _node_failed)."""
        self._follower: asyncio.Future[None] | None = None
        self._follow_until = 0.0
        self._follows = 0
        self._init_lock = asyncio.Lock()
        self.calls = 0
        self.timeouts = 0
        self.dropped_connections = 0
        """Times the connections were dropped for reaching the wrong server."""
        self._redialed_at = -REDIAL_EVERY
        self._redial_said = False
        self.silences = 0
        """Times Redis was found silent (see --redis-silence)."""
        self.reply_time = Histogram()
        """Seconds from writing a call to reading its reply, as this process saw them."""
        self._last_reply = 0.0
        """The loop's time of the last reply of any kind (redis-py calls)."""
        # The request path's own connection (single server only): see redis_pipe.
        self.pipe = (
            RedisPipe(url, connect_timeout=connect_timeout, observe=self.reply_time.observe)
            if supports(url)
            else None
        )

    def register(self, name: str) -> Any:
        """The script ``name`` of resources/, registered with the client."""
        script = self.client.register_script(script_text(name))
        self.scripts.append(script)
        return script

    def by_slot(self, keys: list[str], items: Sequence[_T]) -> list[Group]:
        """One group per cluster slot (everything in one group on a single server)."""
        if not self.cluster:
            return [Group(list(range(len(keys))), keys, list(items))]
        groups: dict[int, Group] = {}
        for index, (key, item) in enumerate(zip(keys, items, strict=True)):
            group = groups.setdefault(key_slot(key.encode()), Group([], [], []))
            group.indexes.append(index)
            group.keys.append(key)
            group.items.append(item)
        return list(groups.values())

    async def call(self, script: Any, keys: list[str], args: list[Any], timeout: float) -> Any:
        node = self._node_for(keys) if self.cluster else None
        gate = self._node_gate(node.name) if node is not None else None
        if gate is None:
            if not self.breaker.allow():
                raise StoreUnavailable("redis: circuit open after recent failures")
        elif not gate.allow():  # a Cluster node: its own breaker, and no other
            raise StoreUnavailable(f"redis: {gate.name} failing: circuit open")
        self.calls += 1
        # Its own task, shielded from our deadline: it finishes in the background with its
        # connection intact, where cancelling it would make the next call pay a handshake
        # inside its deadline (under a slow Redis, every call would time out).
        command = asyncio.ensure_future(
            self.run_timed(script, keys, args)
            if node is None
            else self._run_on_node(node, script, keys, args)
        )
        command.add_done_callback(forget)  # even if gRPC cancels our caller meanwhile
        try:
            try:
                async with asyncio.timeout(timeout):
                    raw = await asyncio.shield(command)
            except TimeoutError:
                if not await _answered_late(command):
                    if gate is not None:
                        self._watch_silence(command, gate)
                    raise self.timed_out(timeout) from None
                raw = command.result()
        except StoreUnavailable:  # no answer in time: no verdict on Redis (see _timed_out)
            raise
        except Exception as exc:  # RedisError, OSError, redis-py's RuntimeError in a failover
            if node is not None and gate is not None:
                raise self._node_failed(node, gate, exc) from exc
            raise self.failed(exc) from exc
        if gate is not None:
            gate.success()
        self.replied()
        return raw

    def _node_for(self, keys: list[str]) -> Any:
        """The node serving ``keys`` in the slot map now, or None: redis-py then routes the call."""
        if not keys or not self._initialized:
            return None
        try:
            return self.client.get_node_from_key(keys[0])
        except Exception:  # slots not loaded, or not covered: no node to call
            return None

    async def _run_on_node(self, node: Any, script: Any, keys: list[str], args: list[Any]) -> Any:
        """A script call on one Cluster node's own connections, its reply time observed: not
        RedisCluster.execute_command, which on CLUSTERDOWN sleeps 0.25 s and rebuilds the whole slot
        map before it raises. Redirects (MOVED, ASK) are left to redis-py."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            reply = await node.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:  # a node restarted or promoted without the script: load it
            reply = await node.execute_command("EVAL", script.script, len(keys), *keys, *args)
        except AskError:  # MOVED too
            return await self.run_timed(script, keys, args)
        self.reply_time.observe(loop.time() - started)
        return reply

    def _watch_silence(self, command: asyncio.Future[Any], gate: CircuitBreaker) -> None:
        """A Cluster call given up at its deadline: with no reply ``silence`` seconds on, its node
        counts as down, so calls to its slots fail fast instead of waiting for their deadline."""

        def check() -> None:
            if not command.done():
                self.silences += 1
                gate.down(f"no reply for {self.silence:.1f} s")
                self._follow_topology_soon()

        asyncio.get_running_loop().call_later(self.silence, check)

    def _node_gate(self, name: str) -> CircuitBreaker:
        """A Cluster node's own breaker: calls to a node that just failed fail at once for a
        backoff, instead of each costing a connection attempt; other nodes are called as usual."""
        gate = self._node_gates.get(name)
        if gate is None:
            if len(self._node_gates) >= MAX_NODE_GATES:
                self._node_gates.clear()
            gate = self._node_gates[name] = CircuitBreaker(
                flip_after=1, open_after=1, max_backoff=0.5, name=f"redis node {name}"
            )
        return gate

    def _node_failed(self, node: Any, gate: CircuitBreaker, exc: BaseException) -> StoreUnavailable:
        """A Cluster node's call failed: a failed connection (not an error reply) opens its breaker;
        the ranges are followed; the store fails only when no node works."""
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
            self._follower.add_done_callback(forget)

    async def _follow_topology(self) -> None:
        """While a node fails (or FOLLOW_FOR after an error reply), every FOLLOW_EVERY: the slot
        ranges as a node that answers sees them, the map changed where they differ."""
        loop = asyncio.get_running_loop()
        while loop.time() < self._follow_until or any(
            not gate.healthy for gate in self._node_gates.values()
        ):
            await asyncio.sleep(FOLLOW_EVERY)
            try:
                async with asyncio.timeout(self.sync_timeout):
                    moved = await self._moved_ranges()
                    if moved is None or (moved and not await self._promote(moved)):
                        await self.client.nodes_manager.initialize()
                    if moved is None or moved:
                        self._forget_gone_nodes()
            except Exception:  # no answer from that node, or no node: next time
                continue

    async def _moved_ranges(self) -> list[tuple[int, int, str, int]] | None:
        """The slot ranges (first, last, announced host and port) a node that answers gives another
        master than the map does; None when no node is known to answer (the map is then rebuilt)."""
        nodes = self.client.nodes_manager
        failing = {name for name, gate in self._node_gates.items() if not gate.healthy}
        asked = [node for node in self.client.get_nodes() if node.name not in failing]
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
        """The ranges in ``moved`` given in place to their readied new masters when each is a
        failover (far cheaper than a rebuild); False, nothing changed, when slots migrated."""
        nodes = self.client.nodes_manager
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
        """A promoted master readied before it gets its slots (WARM_CONNECTIONS, the scripts
        loaded), lest calls in flight each dial and be refused NOSCRIPT."""
        await asyncio.gather(*(node.execute_command("PING") for _ in range(WARM_CONNECTIONS)))
        for script in self.scripts:
            await node.execute_command("SCRIPT", "LOAD", script.script)

    def _forget_gone_nodes(self) -> None:
        """Drop the breakers of nodes that serve no slot any more (dead masters, replaced)."""
        masters = {node.name for node in self.client.get_primaries()}
        for name in [name for name in self._node_gates if name not in masters]:
            del self._node_gates[name]

    def failed(self, exc: BaseException) -> StoreUnavailable:
        """A call failed: a breaker event, and connections to the wrong server dropped."""
        reason = describe(exc)
        self.breaker.failure(reason)
        if wrong_server(exc):
            self._redial(reason)
        return StoreUnavailable(f"redis: {reason}")

    def _redial(self, reason: str) -> None:
        """Drop the connections that gave ``reason``, so a new one reaches the new master: the pipe
        at once (its calls fail with it), redis-py's pool at most every REDIAL_EVERY seconds."""
        now = asyncio.get_running_loop().time()
        if self.pipe is not None:
            self.pipe.drop(f"redis connection dropped: {reason}")
        if now - self._redialed_at < REDIAL_EVERY:
            return
        self._redialed_at = now
        self.dropped_connections += 1
        if not self._redial_said:  # once until Redis answers again
            self._redial_said = True
            log.warning("redis at %s: %s; reconnecting", display(self.url), reason)
        pool = getattr(self.client, "connection_pool", None)
        if pool is not None and not self.cluster:  # a Cluster client follows slots itself
            task = asyncio.ensure_future(pool.disconnect())
            task.add_done_callback(forget)

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

    def replied(self) -> None:
        """A reply came: Redis is alive."""
        self._last_reply = asyncio.get_running_loop().time()
        self._redial_said = False
        self.breaker.success()

    def timed_out(self, timeout: float) -> StoreUnavailable:
        """A redis-py call got no reply within ``timeout``: counted; evidence that
        Redis is down only if no call at all has been answered for ``silence``."""
        self.timeouts += 1
        reason = f"no answer within {timeout * 1000:.0f} ms"
        if asyncio.get_running_loop().time() - self._last_reply >= self.silence:
            self.silent(f"{reason}, and none to any call for {self.silence:.1f} s")
        return StoreUnavailable(f"redis: {reason}")

    def silent(self, reason: str) -> None:
        self.silences += 1
        self.breaker.down(reason)

    async def run_timed(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        """A redis-py script call, its reply time observed."""
        if not self._initialized:
            await self.initialize()
        loop = asyncio.get_running_loop()
        started = loop.time()
        reply = await script(keys=keys, args=args)
        self.reply_time.observe(loop.time() - started)
        return reply

    async def initialize(self) -> None:
        """Discover the cluster once, before concurrent use (redis-py's lazy discovery races)."""
        async with self._init_lock:
            if not self._initialized:
                await self.client.initialize()
                self._initialized = True

    def breaker_state(self) -> BreakerState:
        """The store's breaker as the status page shows it."""
        b = self.breaker
        errors = float(b.total_failures + self.node_failures)
        return BreakerState(
            "store", b.open, b.healthy, errors, float(b.outages), float(b.recoveries)
        )

    def figures(self) -> dict[str, float]:
        """The calls' counters and the breakers' state, for the metrics page."""
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
        }

    async def close(self) -> None:
        """Stop following the slot map; close the pipe and the client's connections."""
        if self._follower is not None:
            self._follower.cancel()
        if self.pipe is not None:
            await self.pipe.close()
        await self.client.aclose()
