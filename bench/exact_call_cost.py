"""CPU per exact-mode Redis call on the service side, by client path and concurrency.

    python bench/exact_call_cost.py

Starts a redis-server on a free port and, on uvloop (the service's loop), times:

- ``redis-py script``: the exact script through redis-py's asyncio client (what the
  request path used before it got its own connection), one call at a time;
- ``redis-py PING``: the cheapest redis-py command, for scale;
- ``store.hit, N concurrent``: RedisStore.hit as the request path calls it (pipelined
  connection, batcher), with N callers at once.

Reports process CPU (all threads) and wall time per call, and hits per script call.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop

from ratelimit_service.core.exact import ExactHit
from ratelimit_service.storage.redis_store import RedisStore
from ratelimit_service.testing.redis import RedisServer

CALLS = 20_000
HIT = [ExactHit("bench", 10**9, 1, 1)]


async def per_call(label: str, call: Callable[[], Awaitable[object]], callers: int = 1) -> None:
    per_caller = CALLS // callers

    async def caller() -> None:
        for _ in range(per_caller):
            await call()

    await asyncio.gather(*(caller() for _ in range(callers)))  # warm-up
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    calls = per_caller * callers
    cpu_us = (time.process_time() - cpu) / calls * 1e6
    wall_us = (time.perf_counter() - wall) / calls * 1e6
    print(f"| {label} | {cpu_us:.1f} | {wall_us:.1f} |", flush=True)


async def main(url: str) -> None:
    store = RedisStore(url, request_timeout=1.0)
    await store.warm()
    key = store._exact_key("bench", 1)
    args = [store.slices, 1, 1, 1, 10**9, 1_000_000, 1, 0]
    print("| path | CPU µs per call | wall µs per call |")
    print("|---|---|---|")
    await per_call("redis-py script", lambda: store._exact(keys=[key], args=args))
    await per_call("redis-py PING", lambda: store._client.ping())
    for callers in (1, 4, 16, 64):
        before = store.stats()
        await per_call(f"store.hit, {callers} concurrent", lambda: store.hit(HIT, True), callers)
        after = store.stats()
        batched = after["exact_batched_requests"] - before["exact_batched_requests"]
        calls = after["exact_batches"] - before["exact_batches"]
        print(f"|   (hits per script call: {batched / calls:.1f}) | | |", flush=True)
    await store.close()


def run_against_redis(main: Callable[[str], Awaitable[None]]) -> None:
    """Run ``main(url)`` on uvloop against a redis-server started on a free port."""
    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(Path(directory))
        server.start()
        try:
            uvloop.run(main(server.url))
        finally:
            server.stop()


if __name__ == "__main__":
    run_against_redis(main)
