"""A long run at a steady rate over many keys: what a caller with Envoy's 20 ms deadline
sees, and whether the service's memory and pauses stay flat.

    python bench/soak.py                  # 30 minutes, embedded store
    python bench/soak.py --minutes 5 --redis --busy

One real service process (`serve`, the embedded store or a fresh redis-server with
--redis) and, in this script, a grpc.aio client sending --rate calls a second open loop
(each at its time whatever the answers), the descriptor ``client=v<i>`` cycling over
--keys values, each call with a --deadline (Envoy's 20 ms). The rule is probabilistic
with detailed_metric, so every value is a bucket and a stats key: per-key state up to
the caps. /metrics is scraped every --scrape-every seconds, as Prometheus would.
--busy runs a busy-loop process beside it, as on a busy node.

Reported: the client's p50, p99 and max latency and the calls past the deadline; the
service's RSS at the start, once every key has been seen, and at the end; from its
metrics, the garbage collector's pauses (``ratelimit_gc_pause_seconds``), its tenures,
the longest event-loop lag, and its own latency histogram's calls past 20 ms; each
scrape's duration and size. Writes ``bench/out/soak.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ratelimit_harness.fleet import (
    KeyedLoad,
    cpu_hog,
    keyed_load,
    redis_server,
    rss_bytes,
    scrape,
    service_fleet,
)

BENCH = Path(__file__).resolve().parent
RULES = """\
domain: soak
descriptors:
  - key: client
    mode: probabilistic
    detailed_metric: true
    rate_limit: {unit: second, requests_per_unit: 50}
"""


def over(samples: dict[str, float], histogram: str, bound: str) -> float | None:
    """Observations of a histogram above ``bound`` (one of its le labels); None where
    the service has no such histogram or bound (an older revision)."""
    bucket = samples.get(f'{histogram}_bucket{{le="{bound}"}}')
    return None if bucket is None else samples[f"{histogram}_count"] - bucket


def grown(before: float | None, after: float | None) -> float | None:
    return None if before is None or after is None else after - before


def top_bucket(samples: dict[str, float], histogram: str) -> str | None:
    """The lowest bound at or below which every observation lies."""
    count = samples.get(f"{histogram}_count")
    if count is None:
        return None
    bounds = [
        (float(name.split('le="')[1].rstrip('"}')), value)
        for name, value in samples.items()
        if name.startswith(f"{histogram}_bucket{{")
    ]
    return f"{min(bound for bound, value in bounds if value >= count):g}"


@dataclass
class Watched:
    rss: list[tuple[float, int]] = field(default_factory=list)
    """(seconds since the start, bytes)"""
    scrapes: list[tuple[float, int]] = field(default_factory=list)
    """(seconds the scrape took, bytes)"""


async def watch(
    pid: int, admin_port: int, every: float, scrape_every: float, watched: Watched
) -> None:
    """RSS every ``every`` seconds and a timed scrape every ``scrape_every`` (0: none).
    The scrape is curl's, in a process of its own: reading 8 MB here would hold this
    process, and the client's own pause would pass for the service's."""
    start = time.monotonic()
    next_scrape = start + scrape_every if scrape_every else float("inf")
    while True:
        now = time.monotonic()
        watched.rss.append((round(now - start, 1), rss_bytes(pid)))
        if now >= next_scrape:
            began = time.monotonic()
            size = await _fetch(admin_port)
            watched.scrapes.append((round(time.monotonic() - began, 3), size))
            next_scrape += scrape_every
        await asyncio.sleep(every)


async def _fetch(admin_port: int) -> int:
    curl = await asyncio.create_subprocess_exec(
        "curl", "-sf", "-o", "/dev/null", "-w", "%{size_download}",
        f"http://127.0.0.1:{admin_port}/metrics",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await curl.communicate()
    return int(out or 0)


@contextlib.contextmanager
def store(use_redis: bool, directory: Path) -> Iterator[str | None]:
    if not use_redis:
        yield None
        return
    with redis_server(directory) as server:
        yield server.url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=500.0, help="calls per second")
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--deadline", type=float, default=0.020, help="seconds per call")
    parser.add_argument("--scrape-every", type=float, default=15.0, help="seconds (0: none)")
    parser.add_argument("--redis", action="store_true", help="a redis-server as the store")
    parser.add_argument("--busy", action="store_true", help="a busy-loop process beside")
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    args = parser.parse_args()
    seconds = args.minutes * 60
    with tempfile.TemporaryDirectory() as tmp:
        rules = Path(tmp) / "rules.yaml"
        rules.write_text(RULES)
        hog = cpu_hog(seconds + 60) if args.busy else contextlib.nullcontext()
        with store(args.redis, Path(tmp)) as url, service_fleet(1, rules, url) as (node,), hog:
            watched = Watched()
            before = scrape(node.admin_port)

            async def run() -> KeyedLoad:
                watcher = asyncio.ensure_future(
                    watch(node.process.pid, node.admin_port, 10.0, args.scrape_every, watched)
                )
                try:
                    return await keyed_load(
                        node.grpc_port, "soak", "client", args.keys, args.rate, seconds,
                        args.deadline,
                    )  # fmt: skip
                finally:
                    watcher.cancel()

            load = asyncio.run(run())
            after = scrape(node.admin_port)
    report(args, load, before, after, watched)


def report(
    args: argparse.Namespace,
    load: KeyedLoad,
    before: dict[str, float],
    after: dict[str, float],
    watched: Watched,
) -> None:
    rss = watched.rss
    cycle = args.keys / args.rate
    seen_all = next((size for at, size in rss if at >= cycle), rss[-1][1])
    gc = "ratelimit_gc_pause_seconds"
    latency = "ratelimit_server_should_rate_limit_response_time_seconds"
    scrapes = [duration for duration, _ in watched.scrapes]
    result = {
        "minutes": args.minutes,
        "rate": args.rate,
        "keys": args.keys,
        "store": "redis" if args.redis else "embedded",
        "busy": args.busy,
        "calls": len(load.latencies),
        "p50_ms": round(load.quantile(0.5) * 1e3, 2),
        "p99_ms": round(load.quantile(0.99) * 1e3, 2),
        "max_ms": round(max(load.latencies) * 1e3, 1),
        "over_deadline": load.over(args.deadline),
        "failures": dict(load.failures),
        "rss_mb_start": round(rss[0][1] / 2**20, 1),
        "rss_mb_all_keys_seen": round(seen_all / 2**20, 1),
        "rss_mb_end": round(rss[-1][1] / 2**20, 1),
        "gc_pauses": grown(before.get(f"{gc}_count"), after.get(f"{gc}_count")),
        "gc_pauses_over_5ms": grown(over(before, gc, "0.005"), over(after, gc, "0.005")),
        "gc_pause_top_bucket_s": top_bucket(after, gc),
        "tenures": after.get("ratelimit_gc_tenures_total"),
        "tenure_rounds_skipped": after.get("ratelimit_gc_tenures_skipped_total"),
        "loop_lag_top_bucket_s": top_bucket(after, "ratelimit_event_loop_lag_seconds"),
        "histogram_over_20ms": grown(over(before, latency, "0.02"), over(after, latency, "0.02")),
        "scrapes": len(scrapes),
        "scrape_max_s": max(scrapes, default=0.0),
        "scrape_mb": round(max((size for _, size in watched.scrapes), default=0) / 2**20, 2),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(json.dumps({**result, "rss": rss}, indent=1) + "\n")
    print("| figure | value |\n|---|---|")
    for name, value in result.items():
        print(f"| {name} | {value} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
