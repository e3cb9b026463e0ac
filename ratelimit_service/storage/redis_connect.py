"""Turn ``--redis-url`` into a redis-py asyncio client: single node, Sentinel or Cluster
(the URL forms: core/redis_url.py).

Retries are off everywhere (``Retry(NoBackoff(), 0)``): the circuit breaker decides
when to try again, and a client-side retry would blow the request-path time bound.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff

from ratelimit_service.core.redis_url import Topology, parse_target


def connect(
    url: str, *, socket_timeout: float, connect_timeout: float, max_connections: int
) -> tuple[Any, bool]:
    """A client for ``url`` and whether it is a cluster client."""
    target = parse_target(url)
    common: dict[str, Any] = {
        "socket_timeout": socket_timeout,
        "socket_connect_timeout": connect_timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    if target.kind is Topology.CLUSTER:
        nodes = [ClusterNode(host, port) for host, port in target.hosts]
        client: Any = RedisCluster(
            startup_nodes=nodes,
            username=target.username,
            password=target.password,
            max_connections=max_connections,
            **common,
        )
        return client, True
    if target.kind is Topology.SENTINEL:
        sentinel_kwargs = dict(common)
        if target.sentinel_password:
            sentinel_kwargs["password"] = target.sentinel_password
        sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs, **common)
        client = sentinel.master_for(
            target.master,
            db=target.db,
            username=target.username,
            password=target.password,
            max_connections=max_connections,
        )
        return client, False
    # A blocking pool: a burst beyond max_connections waits for a free connection
    # (bounded by the caller's deadline) instead of failing at once.
    pool = aioredis.BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=None, health_check_interval=0, **common
    )
    return aioredis.Redis.from_pool(pool), False
