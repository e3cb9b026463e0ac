"""Redis memory per key: our sliced window and fleet bucket vs a sorted-set log.

    python bench/redis_memory.py

Starts a throw-away redis-server, fills an exact-mode window key (1 and 61 slices), a
probabilistic fleet key, and sorted sets of 100 / 1,000 / 10,000 unique members (the
ZADD log of Uber's design), and prints MEMORY USAGE and the encoding of each.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import redis
import redis.asyncio as aioredis

from ratelimit_harness.fleet import redis_server
from ratelimit_service.core.exact import ExactHit
from ratelimit_service.core.local_buckets import BucketReport
from ratelimit_service.storage.redis_store import RedisStore


async def fill(url: str) -> None:
    store = RedisStore(url, request_timeout=1)
    try:
        await store.hit([ExactHit("one-slice", 10, 60, 1)], True)
        for _ in range(70):  # a 1 s window has 60 slices of ~16.7 ms: touch each of them
            await store.hit([ExactHit("full", 10**6, 1, 1)], True)
            await asyncio.sleep(0.017)
        await store.sync([BucketReport("bucket", 100, 1, 5, 5)])
    finally:
        await store.close()
    client = aioredis.Redis.from_url(url)
    now = int(time.time() * 1000)
    for count in (100, 1000, 10_000):
        pipe = client.pipeline(transaction=False)
        for i in range(count):
            pipe.zadd(f"zset:{count}", {f"{now + i}-{i}": now + i})
        await pipe.execute()
    await client.aclose()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as server:
        asyncio.run(fill(server.url))
        client = redis.Redis.from_url(server.url)
        print("| key | fields/members | MEMORY USAGE (bytes) | encoding |")
        print("|---|---|---|---|")
        for key in sorted(client.keys("*")):
            kind = client.type(key).decode()
            size = client.hlen(key) if kind == "hash" else client.zcard(key)
            usage = client.memory_usage(key)
            encoding = client.object("encoding", key).decode()
            print(f"| `{key.decode(errors='replace')}` | {size} | {usage} | {encoding} |")
        client.close()


if __name__ == "__main__":
    main()
