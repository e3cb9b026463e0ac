"""The Redis store: exact sliding windows in one Lua call per request, and the fleet
totals of probabilistic mode in one round trip per sync.

Time is Redis's (``TIME`` inside the scripts), so service clocks need not agree.
Every call is bounded (``request_timeout`` on the request path, ``sync_timeout``
for the reconciler) and goes through a circuit breaker; a failure surfaces as
:class:`StoreUnavailable`, which callers turn into their failure policy.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from collections.abc import Sequence
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from ratelimit_service.core.drop_ratio import FleetView, SyncResult
from ratelimit_service.core.exact import ExactHit, ExactResult
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.core.window import DEFAULT_SLICES
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.breaker import CircuitBreaker

SYNC_CHUNK = 256
"""Buckets per sync script call: keeps each Lua call short so Redis stays responsive."""


def _script(name: str) -> str:
    return resources.files("ratelimit_service.resources").joinpath(name).read_text()


class RedisStore:
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        request_timeout: float = 0.010,
        sync_timeout: float = 1.0,
        connect_timeout: float = 0.5,
        prefix: str = "rl:",
        slices: int = DEFAULT_SLICES,
        node_ttl: float = 5.0,
        max_connections: int = 64,
    ) -> None:
        self.url = url
        self.request_timeout = request_timeout
        self.sync_timeout = sync_timeout
        self.prefix = prefix
        self.slices = slices
        self.node_ttl = node_ttl
        self.node_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._client = aioredis.Redis.from_url(
            url,
            socket_timeout=max(sync_timeout, request_timeout),
            socket_connect_timeout=connect_timeout,
            retry=Retry(NoBackoff(), 0),
            max_connections=max_connections,
            health_check_interval=0,
        )
        self._exact = self._client.register_script(_script("exact_window.lua"))
        self._sync = self._client.register_script(_script("fleet_sync.lua"))
        self.breaker = CircuitBreaker()
        self.calls = 0
        self.timeouts = 0

    # -- request path ------------------------------------------------------------

    async def hit(self, hits: Sequence[ExactHit], commit: bool) -> list[ExactResult]:
        keys = [self._exact_key(hit.key, hit.window_seconds) for hit in hits]
        args: list[Any] = [1 if commit else 0, self.slices]
        for hit in hits:
            args += (hit.limit, hit.window_seconds * 1_000_000, hit.hits, int(hit.role))
        raw = await self._call(self._exact, keys, args, self.request_timeout)
        return [
            ExactResult(
                admitted=bool(raw[i]),
                before=int(raw[i + 1]),
                remaining=int(raw[i + 2]),
                reset_after=int(raw[i + 3]) / 1e6,
            )
            for i in range(0, len(raw), 4)
        ]

    # -- reconciler --------------------------------------------------------------

    async def sync(self, reports: Sequence[BucketReport], interval: float) -> SyncResult:
        # An empty report still runs once: it is this node's heartbeat and a liveness probe.
        chunks = [reports[i : i + SYNC_CHUNK] for i in range(0, len(reports), SYNC_CHUNK)] or [[]]
        results = await asyncio.gather(*(self._sync_chunk(c) for c in chunks))
        return SyncResult(
            nodes=max(nodes for nodes, _ in results),
            views=[view for _, views in results for view in views],
        )

    async def _sync_chunk(self, reports: Sequence[BucketReport]) -> tuple[int, list[FleetView]]:
        keys = [self.prefix + "nodes"]
        args: list[Any] = [self.node_id, int(self.node_ttl * 1_000_000)]
        for report in reports:
            keys.append(self._fleet_key(report.key, report.window_seconds))
            args += (
                report.window_seconds * 1_000_000,
                report.limit,
                report.admitted,
                report.offered,
            )
        raw = await self._call(self._sync, keys, args, self.sync_timeout)
        views = [
            FleetView(tokens=int(raw[i]) / 1000, offered_total=int(raw[i + 1]))
            for i in range(1, len(raw), 2)
        ]
        return int(raw[0]), views

    # -- plumbing ----------------------------------------------------------------

    async def _call(self, script: Any, keys: list[str], args: list[Any], timeout: float) -> Any:
        if not self.breaker.allow():
            raise StoreUnavailable("redis: circuit open after recent failures")
        self.calls += 1
        try:
            async with asyncio.timeout(timeout):
                raw = await script(keys=keys, args=args)
        except TimeoutError as exc:
            self.timeouts += 1
            self.breaker.failure()
            raise StoreUnavailable(f"redis: no answer within {timeout * 1000:.0f} ms") from exc
        except (RedisError, OSError) as exc:
            self.breaker.failure()
            raise StoreUnavailable(f"redis: {exc}") from exc
        self.breaker.success()
        return raw

    def _exact_key(self, bucket_key: str, window_seconds: int) -> str:
        return f"{self.prefix}e:{window_seconds}:{bucket_key}"

    def _fleet_key(self, bucket_key: str, window_seconds: int) -> str:
        return f"{self.prefix}p:{window_seconds}:{bucket_key}"

    def healthy(self) -> bool:
        return self.breaker.healthy

    def stats(self) -> dict[str, float]:
        return {
            "calls": self.calls,
            "errors": self.breaker.total_failures,
            "timeouts": self.timeouts,
            "circuit_open": 1.0 if self.breaker.open else 0.0,
        }

    async def ping(self) -> bool:
        try:
            async with asyncio.timeout(self.sync_timeout):
                return bool(await self._client.ping())
        except (TimeoutError, RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._client.aclose()
