"""Fleet accuracy harness: N service processes on one Redis, open-loop skewed traffic.

Starts redis-server and N `ratelimit-service serve` processes, sends requests at a
scheduled rate split across the processes by --skew, and records per time bucket
how many were offered and admitted.

    python bench/fleet.py --nodes 3 --limit 300 --rate 600 --seconds 10 --skew 0.6,0.3,0.1

Writes a CSV (--csv) with one row per --bucket seconds and prints a summary.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import shutil
import tempfile
from pathlib import Path

from ratelimit_service.testing.fleet import drive, redis_server, service_fleet, write_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--limit", type=int, default=300, help="requests per second")
    parser.add_argument("--rate", type=float, default=600, help="offered requests per second")
    parser.add_argument("--step-to", type=float, default=None, help="rate after --step-at")
    parser.add_argument("--step-at", type=float, default=5.0)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--skew", default="0.6,0.3,0.1")
    parser.add_argument("--mode", default="probabilistic")
    parser.add_argument("--sync-interval", default="0.25")
    parser.add_argument("--bucket", type=float, default=0.25)
    parser.add_argument("--csv", default=None)
    args = parser.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server is not installed")
    skew = [float(x) for x in args.skew.split(",")][: args.nodes]

    def rate_at(t: float) -> float:
        if args.step_to is not None and t >= args.step_at:
            return float(args.step_to)
        return float(args.rate)

    with tempfile.TemporaryDirectory() as tmp, redis_server(Path(tmp)) as redis:
        config = write_config(Path(tmp), args.limit, "second", args.mode)
        with service_fleet(
            args.nodes, config, redis.url, ["--sync-interval", args.sync_interval]
        ) as nodes:
            timeline = asyncio.run(
                drive(
                    [n.grpc_port for n in nodes],
                    skew,
                    rate_at,
                    args.seconds,
                    "fleet",
                    "k=v",
                    args.bucket,
                )
            )
    rows = timeline.rows()
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["t", "offered", "admitted"])
            writer.writerows(rows)
    steady = rows[int(2 / args.bucket) :]
    offered = sum(r[1] for r in steady)
    admitted = sum(r[2] for r in steady)
    span = len(steady) * args.bucket
    print(
        f"errors={timeline.errors} steady offered/s={offered / span:.1f} "
        f"admitted/s={admitted / span:.1f} limit={args.limit} "
        f"ratio={admitted / span / args.limit:.3f}"
    )
    lat = sorted(timeline.latencies)
    if lat:
        p50, p99 = lat[len(lat) // 2] * 1000, lat[int(len(lat) * 0.99)] * 1000
        print(f"latency p50={p50:.2f} ms p99={p99:.2f} ms")
    for t, o, a in rows:
        print(f"{t:6.2f} offered={o:5d} admitted={a:5d}")


if __name__ == "__main__":
    main()
