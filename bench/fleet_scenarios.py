"""The fleet accuracy scenarios behind docs/benchmarks.md (issue targets in brackets).

    python bench/fleet_scenarios.py --out bench/out

Each scenario starts a fresh redis-server and N service processes, drives skewed
open-loop traffic (skew 0.4/0.3/0.2/0.1) and writes <out>/<scenario>.csv (t,
offered, admitted per 250 ms). The summary table is printed as Markdown. --burst N
gives the rule rate_limit.burst N (default: none, the fleet bucket holds the limit).

- overload: offered 2x the limit [fleet admitted within +-5% of the limit]
- under:    offered 0.7x the limit [>= 99.5% admitted]
- step:     0.5x, then 3x [back within +-10% of the limit in <= 1.5 s; goal 1 s]
- exact:    exact mode, 2x the limit [never over the limit in any window]
- outage:   probabilistic, Redis SIGSTOPped for 3 s mid-run [0 errors, no latency spike]

--zones Z puts the nodes in Z zones (node n in zone n % Z, a redis-server each) under
the scenario's redis-server as the global store (``serve --zone``). Traffic starts once
every zone has counted the Z zones (its aggregator's passes), so a scenario's bucket is
one new to a running deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis
from simulate import reaction_time as rows_reaction_time

from ratelimit_harness.fleet import (
    Timeline,
    drive,
    redis_server,
    service_fleet,
    write_config,
)
from ratelimit_harness.redis import RedisServer
from ratelimit_harness.waiting import eventually

SKEW = [0.4, 0.3, 0.2, 0.1]
SCENARIOS = ("overload", "under", "step", "exact", "outage")


def run(
    name: str,
    mode: str,
    limit: int,
    rate: Callable[[float], float],
    seconds: float,
    nodes: int,
    out: Path,
    during: Callable[[RedisServer], Awaitable[None]] | None = None,
    burst: int | None = None,
    zones: int = 0,
) -> Timeline:
    print(f"{name} ...", flush=True)
    with (
        tempfile.TemporaryDirectory() as tmp,
        redis_server(Path(tmp)) as redis,
        contextlib.ExitStack() as stack,
    ):
        zone_stores = [stack.enter_context(redis_server(Path(tmp))) for _ in range(zones)]
        config = write_config(Path(tmp), limit, "second", mode)
        if burst is not None:
            config.write_text(
                f"domain: fleet\ndescriptors:\n  - key: k\n    mode: {mode}\n"
                f"    rate_limit: {{unit: second, requests_per_unit: {limit}, burst: {burst}}}\n"
            )
        extra = ["--redis-timeout", "0.05"] if mode == "exact" else []
        # With zones, node n is in zone n % zones, on that zone's Redis; the scenario's
        # Redis is the global store above them.
        each = [
            ["--zone", f"z{n % zones}", "--redis-url", zone_stores[n % zones].url,
             "--global-redis-url", redis.url]
            for n in range(nodes if zones else 0)
        ]  # fmt: skip
        with service_fleet(nodes, config, None if zones else redis.url, extra, each) as fleet:
            ports = [n.grpc_port for n in fleet]
            for z, store in enumerate(zone_stores):
                eventually(lambda z=z, s=store: counted(s, f"z{z}", zones), what="zones counted")

            async def scenario() -> Timeline:
                task = asyncio.create_task(
                    drive(ports, SKEW[:nodes], rate, seconds, "fleet", "k=v")
                )
                if during is not None:
                    await during(redis)
                return await task

            timeline = asyncio.run(scenario())
    with open(out / f"{name}.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["t", "offered", "admitted"])
        writer.writerows(timeline.rows())
    return timeline


def counted(store: RedisServer, zone: str, zones: int) -> bool:
    """Whether ``zone``'s store holds the count of ``zones`` its aggregator writes."""
    client = redis.Redis(port=store.port)
    try:
        return client.get(f"rl:zone:{zone}:zones") == str(zones).encode()
    finally:
        client.close()


def window_rate(timeline: Timeline, start: float, end: float) -> tuple[float, float]:
    rows = [r for r in timeline.rows() if start <= r[0] < end]
    span = len(rows) * timeline.bucket
    return sum(r[1] for r in rows) / span, sum(r[2] for r in rows) / span


def reaction_time(
    timeline: Timeline, step_at: float, limit: float, tolerance: float, hold: float = 2.0
) -> float:
    """See simulate.reaction_time (the simulator measures the same way)."""
    return rows_reaction_time(timeline.rows(), timeline.bucket, step_at, limit, tolerance, hold)


def max_in_any_window(timeline: Timeline, window: float = 1.0) -> int:
    sends = sorted(timeline.admitted_at)
    best, j = 0, 0
    for i, t in enumerate(sends):
        while sends[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[int(len(ordered) * 0.99)] if ordered else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--burst", type=int, default=None, help="the rule's rate_limit.burst")
    parser.add_argument(
        "--zones", type=int, default=0,
        help="nodes in this many zones (a Redis each) under the scenario's Redis",
    )  # fmt: skip
    parser.add_argument(
        "--only", default=",".join(SCENARIOS), help="comma-separated scenarios to run"
    )
    args = parser.parse_args()
    wanted = set(args.only.split(","))
    unknown = wanted - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; known: {SCENARIOS}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    limit, seconds, nodes, burst, zones = (
        args.limit, args.seconds, args.nodes, args.burst, args.zones
    )  # fmt: skip
    lines = ["| scenario | target | measured |", "|---|---|---|"]

    if "overload" in wanted:
        t = run(
            "overload",
            "probabilistic",
            limit,
            lambda _: 2 * limit,
            seconds,
            nodes,
            out,
            None,
            burst,
            zones,
        )
        offered, admitted = window_rate(t, 3, seconds)
        per_bucket = [r[2] / t.bucket / limit for r in t.rows() if r[0] >= 3]
        lines.append(
            f"| overload 2x, {nodes} nodes, skewed | admitted within +-5% of {limit}/s | "
            f"{admitted:.1f}/s = {admitted / limit:.3f}x (offered {offered:.0f}/s; per 250 ms: "
            f"sd {statistics.pstdev(per_bucket):.3f}x), errors {t.errors} |"
        )

    if "under" in wanted:
        t = run(
            "under", "probabilistic", limit, lambda _: 0.7 * limit, seconds, nodes, out, None,
            burst, zones,
        )  # fmt: skip
        offered, admitted = window_rate(t, 0, seconds)
        lines.append(
            f"| 0.7x the limit | >= 99.5% admitted | {100 * admitted / offered:.2f}% admitted |"
        )

    if "step" in wanted:
        step_at = seconds / 2
        t = run(
            "step",
            "probabilistic",
            limit,
            lambda s: 0.5 * limit if s < step_at else 3 * limit,
            seconds,
            nodes,
            out,
            None,
            burst,
            zones,
        )
        reaction = reaction_time(t, step_at, limit, 0.10)
        _, after = window_rate(t, step_at + 2, seconds)
        first = [r[2] for r in t.rows() if step_at <= r[0] < step_at + 1.5]
        lines.append(
            f"| step 0.5x -> 3x | within +-10% in <= 1.5 s (goal 1 s) | {reaction:.2f} s "
            f"(then {after / limit:.3f}x; admitted per 250 ms after the step: "
            f"{', '.join(map(str, first))}) |"
        )

    if "exact" in wanted:
        t = run("exact", "exact", limit, lambda _: 2 * limit, seconds, nodes, out, zones=zones)
        _, admitted = window_rate(t, 2, seconds)
        lines.append(
            f"| exact, 2x the limit | never over the limit in any 1 s window | max in any 1 s "
            f"window: {max_in_any_window(t)} (limit {limit}); mean {admitted:.1f}/s; "
            f"p99 latency {p99(t.latencies) * 1000:.2f} ms |"
        )

    if "outage" in wanted:

        async def freeze(redis: RedisServer) -> None:
            await asyncio.sleep(seconds / 3)
            redis.pause()
            await asyncio.sleep(3)
            redis.resume()

        started = time.monotonic()
        t = run(
            "outage",
            "probabilistic",
            limit,
            lambda _: 2 * limit,
            seconds,
            nodes,
            out,
            freeze,
            burst,
            zones,
        )
        lines.append(
            f"| Redis SIGSTOPped 3 s, probabilistic | 0 errors, no latency spike | errors "
            f"{t.errors}, p99 latency {p99(t.latencies) * 1000:.2f} ms over the run "
            f"({time.monotonic() - started:.0f} s) |"
        )

    print("\n".join(lines))


if __name__ == "__main__":
    main()
