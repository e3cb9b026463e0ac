"""CPU per ShouldRateLimit call inside the process, without gRPC: what our Python costs.

    python bench/request_path_cost.py

Calls the servicer's ShouldRateLimit handler on the bytes of a request (one and five
descriptors, the throughput benchmark's config) from 16 concurrent callers on uvloop,
for each mode on the embedded store and for exact mode on a redis-server started on a
free port, and RedisStore.hit alone for scale. Prints the best of 3 passes of 40,000
calls each, in process CPU µs per call (all threads, Redis excluded). The rest of a
request's cost under h2load is grpc.aio's, which the null server pays too.

These are warm-cache figures: in the serving process grpc's own work between two
requests evicts the interpreter's caches, and the same handler costs about three
times as much CPU per request (docs/benchmarks.md, seventh session). Use this script
to compare versions of the code, and bench/ab_revisions.py --pin to see what a change
is worth in the server.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable

from exact_call_cost import run_against_redis
from grpc_body import framed
from throughput import CONFIG

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.config_model import Mode
from ratelimit_service.core.exact import ExactHit
from ratelimit_service.grpc_servicer import RateLimitServicer
from ratelimit_service.limiter import RateLimiter
from ratelimit_service.storage.base import Store
from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore

CALLS = 40_000
CALLERS = 16


async def cpu_per_call(call: Callable[[], Awaitable[object]]) -> float:
    per_caller = CALLS // CALLERS

    async def caller() -> None:
        for _ in range(per_caller):
            await call()

    await asyncio.gather(*(caller() for _ in range(CALLERS)))  # warm-up
    best = float("inf")
    for _ in range(3):
        started = time.process_time()
        await asyncio.gather(*(caller() for _ in range(CALLERS)))
        best = min(best, (time.process_time() - started) / (per_caller * CALLERS) * 1e6)
    return best


async def main(redis_url: str) -> None:
    redis_store = RedisStore(redis_url, request_timeout=1.0)
    await redis_store.warm()
    print("| descriptors | mode | store | CPU µs per call |")
    print("|---|---|---|---|")
    cases: list[tuple[Mode, str, Store]] = [
        (Mode.PROBABILISTIC, "embedded", EmbeddedStore()),
        (Mode.EXACT, "embedded", EmbeddedStore()),
        (Mode.EXACT, "Redis", redis_store),
    ]
    for count in (1, 5):
        raw = framed("bench", [f"k=v{i}" for i in range(1, count + 1)])[5:]  # no gRPC frame
        for mode, store_name, store in cases:
            config = load_config([ConfigFile("bench.yaml", CONFIG)], default_mode=mode)
            handler = RateLimitServicer(RateLimiter(config, store)).should_rate_limit
            cost = await cpu_per_call(functools.partial(handler, raw, None))  # type: ignore[arg-type]
            print(f"| {count} | {mode.value} | {store_name} | {cost:.1f} |", flush=True)
    hit = [ExactHit("bench", 10**9, 1, 1)]
    cost = await cpu_per_call(lambda: redis_store.hit(hit, True))
    print(f"| 1 | RedisStore.hit alone | Redis | {cost:.1f} |")
    await redis_store.close()


if __name__ == "__main__":
    run_against_redis(main)
