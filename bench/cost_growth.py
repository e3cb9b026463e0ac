"""What probabilistic mode costs in Redis traffic and memory, per service process, as the
number of active buckets and the sync interval grow.

    python bench/cost_growth.py            # about 3 minutes
    python bench/cost_growth.py --quick    # fewer cells, shorter windows

Live part: for every (active buckets N, --sync-interval I) cell, a fresh redis-server
and one fresh `ratelimit-service serve --mode probabilistic --redis-url ...` process;
a grpc.aio client in this script sends --rate requests per second, each with
min(N, --per-request) descriptors whose values cycle over N distinct values (so every
value is hit at the same rate). After a warm-up that touches every value and lets
syncs settle, it measures over --seconds:

- from Redis (``INFO stats commandstats cpu``, read on a raw socket whose own bytes are
  subtracted): script calls (EVALSHA) per second, commands per second (counting the
  commands the Lua scripts run), bytes per second in and out, Redis CPU;
- buckets reported per sync (the script runs one HINCRBY per reported bucket, so:
  HINCRBY calls / sync rounds);
- from the service: its CPU (all of it: serving the requests too), its mean sync
  duration, its RSS growth; from Redis: used_memory growth per key and
  ``MEMORY USAGE`` of one bucket key.

N = 0 is an idle service: the heartbeat sync alone.

In-process part: the real LocalBuckets and RedisStore in this process -- tracemalloc
bytes per bucket, and the CPU one sync costs the service per bucket (time.process_time
around Reconciler.sync_once, so Redis's own time is not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc
from throughput import (
    BENCH,
    Progress,
    cpu_seconds,
    lab,
    machine,
    metric_sum,
    scrape,
    start_redis,
    start_service,
)

from ratelimit_harness.redis import RedisServer
from ratelimit_service.cli.client import build_request
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.storage.redis_store import RedisStore

DOMAIN = "bench"
HUGE_LIMIT = 1_000_000_000
CONFIG = f"""domain: {DOMAIN}
descriptors:
  - key: k
    rate_limit: {{unit: minute, requests_per_unit: {HUGE_LIMIT}}}
"""
"""A minute window: a bucket hit once every few seconds is still active (idle buckets
are dropped after max(window, 10 intervals)); a limit never reached: every answer OK."""
OVER_LIMIT = 2
OWN_COMMANDS = {"cmdstat_info", "cmdstat_memory", "cmdstat_dbsize", "cmdstat_scan"}


# -- Redis, read on a raw socket so that our own bytes are known -------------------------


class RedisProbe:
    """INFO and a few other commands over one raw RESP2 connection, counting the bytes
    this connection sends and receives."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buffer = b""

    def close(self) -> None:
        self.sock.close()

    def command(self, *parts: str) -> tuple[object, int, int]:
        """(reply, bytes sent, bytes received)."""
        encoded = f"*{len(parts)}\r\n".encode() + b"".join(
            f"${len(p.encode())}\r\n".encode() + p.encode() + b"\r\n" for p in parts
        )
        self.sock.sendall(encoded)
        reply, size = self._read()
        return reply, len(encoded), size

    def _line(self) -> bytes:
        while b"\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("redis closed the connection")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\r\n")
        return line

    def _read(self) -> tuple[object, int]:
        line = self._line()
        size = len(line) + 2
        kind, rest = line[:1], line[1:]
        if kind == b"$":
            length = int(rest)
            if length < 0:
                return None, size
            while len(self.buffer) < length + 2:
                self.buffer += self.sock.recv(65536)
            data, self.buffer = self.buffer[:length], self.buffer[length + 2 :]
            return data.decode(), size + length + 2
        if kind == b"*":
            items = []
            for _ in range(int(rest)):
                item, item_size = self._read()
                items.append(item)
                size += item_size
            return items, size
        if kind == b":":
            return int(rest), size
        if kind == b"-":
            raise RuntimeError(rest.decode())
        return rest.decode(), size

    def info(self) -> tuple[dict[str, str], int, int]:
        reply, sent, received = self.command("INFO", "stats", "commandstats", "cpu", "memory")
        fields: dict[str, str] = {}
        for line in str(reply).splitlines():
            key, sep, value = line.partition(":")
            if sep:
                fields[key] = value
        return fields, sent, received


def command_calls(info: dict[str, str]) -> dict[str, int]:
    """cmdstat_<name> -> calls."""
    calls = {}
    for key, value in info.items():
        if key.startswith("cmdstat_"):
            parts = dict(part.split("=") for part in value.split(","))
            calls[key] = int(parts["calls"])
    return calls


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# -- load ----------------------------------------------------------------------------------


class Driver:
    """Open-loop load in a thread of its own: ``rate`` requests per second, each carrying
    ``per_request`` descriptors, values cycling over ``buckets`` distinct values."""

    def __init__(self, port: int, buckets: int, per_request: int, rate: float) -> None:
        self.port = port
        self.rate = rate
        values = [f"k=v{i}" for i in range(buckets)]
        self.requests = [
            build_request(DOMAIN, values[i : i + per_request], 0)
            for i in range(0, buckets, per_request)
        ]
        self.sent = 0
        self.answered = 0
        self.errors = 0
        self.over_limit = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    async def _run(self) -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            tasks: set[asyncio.Task[None]] = set()
            loop = asyncio.get_running_loop()
            start = loop.time()
            tick = 0.01

            async def one(request: object) -> None:
                try:
                    response = await stub.ShouldRateLimit(request, timeout=5)
                except grpc.aio.AioRpcError:
                    self.errors += 1
                    return
                self.answered += 1
                if response.overall_code == OVER_LIMIT:
                    self.over_limit += 1

            while not self._stop.is_set():
                due = int((loop.time() - start) * self.rate)
                while self.sent < due:
                    request = self.requests[self.sent % len(self.requests)]
                    self.sent += 1
                    task = asyncio.create_task(one(request))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.sleep(tick)
            if tasks:
                await asyncio.gather(*tasks)


# -- one cell ------------------------------------------------------------------------------


@dataclass
class Cell:
    buckets: int
    interval: float
    per_request: int
    rate: float
    seconds: float = 0.0
    syncs_per_s: float = 0.0
    reported_per_sync: float = 0.0
    table_buckets: int = 0
    evalsha_per_s: float = 0.0
    redis_commands_per_s: float = 0.0
    bytes_in_per_s: float = 0.0
    bytes_out_per_s: float = 0.0
    redis_cpu_pct: float = 0.0
    service_cpu_pct: float = 0.0
    sync_ms_mean: float = 0.0
    redis_keys: int = 0
    redis_memory_delta: int = 0
    redis_key_memory_usage: int | None = None
    service_rss_delta: int = 0
    requests_sent: int = 0
    errors: int = 0
    over_limit: int = 0
    commands: dict[str, float] = field(default_factory=dict)


def run_cell(args: argparse.Namespace, buckets: int, interval: float) -> Cell:
    per_request = max(1, min(buckets, args.per_request))
    cell = Cell(buckets, interval, per_request, args.rate if buckets else 0.0)
    with lab() as (directory, processes, redis_servers):
        config = directory / "bench.yaml"
        config.write_text(CONFIG)
        redis = start_redis(directory, redis_servers)
        probe = RedisProbe(redis.port)
        try:
            memory_before = int(probe.info()[0]["used_memory"])
            service = start_service(processes, "service", config, [
                "--mode", "probabilistic", "--redis-url", redis.url,
                "--sync-interval", f"{interval:g}"])  # fmt: skip
            assert service.admin_port is not None
            time.sleep(0.5)
            rss_before = rss_bytes(service.pid)
            driver = None
            if buckets:
                driver = Driver(service.port, buckets, per_request, args.rate)
                driver.start()
            # Touch every value once, then let a few syncs settle.
            cycle = len(driver.requests) / args.rate if driver else 0.0
            time.sleep(cycle + max(args.settle, 2 * interval))
            info0, _, reply0 = probe.info()
            metrics0, cpu0 = scrape(service.admin_port), cpu_seconds(service.pid)
            started = time.monotonic()
            time.sleep(args.seconds)
            info1, sent1, _ = probe.info()
            metrics1, cpu1 = scrape(service.admin_port), cpu_seconds(service.pid)
            cell.seconds = elapsed = time.monotonic() - started
            if driver:
                driver.stop()
                cell.requests_sent, cell.errors = driver.sent, driver.errors
                cell.over_limit = driver.over_limit
            fill_cell(cell, elapsed, info0, info1, reply0, sent1, metrics0, metrics1)
            cell.service_cpu_pct = 100 * (cpu1 - cpu0) / elapsed
            cell.service_rss_delta = rss_bytes(service.pid) - rss_before
            cell.redis_memory_delta = int(probe.info()[0]["used_memory"]) - memory_before
            cell.redis_keys = int(str(probe.command("DBSIZE")[0]))
            scan = probe.command("SCAN", "0", "MATCH", "rl:p:*", "COUNT", "1000")[0]
            keys = scan[1] if isinstance(scan, list) else []
            if keys:
                cell.redis_key_memory_usage = int(str(probe.command("MEMORY", "USAGE", keys[0])[0]))
        finally:
            probe.close()
    return cell


def fill_cell(
    cell: Cell, elapsed: float, info0: dict[str, str], info1: dict[str, str],
    reply0: int, sent1: int, metrics0: dict[str, float], metrics1: dict[str, float],
) -> None:  # fmt: skip
    calls0, calls1 = command_calls(info0), command_calls(info1)
    deltas = {name: calls1[name] - calls0.get(name, 0) for name in calls1}
    service_deltas = {k: v for k, v in deltas.items() if k not in OWN_COMMANDS and v}
    cell.commands = {k.removeprefix("cmdstat_"): v / elapsed for k, v in service_deltas.items()}
    cell.evalsha_per_s = deltas.get("cmdstat_evalsha", 0) / elapsed
    cell.redis_commands_per_s = sum(service_deltas.values()) / elapsed
    # Our first INFO's reply left after its counters were read, and our last INFO's
    # request arrived before them: take both out.
    bytes_in = int(info1["total_net_input_bytes"]) - int(info0["total_net_input_bytes"]) - sent1
    bytes_out = int(info1["total_net_output_bytes"]) - int(info0["total_net_output_bytes"]) - reply0
    cell.bytes_in_per_s = bytes_in / elapsed
    cell.bytes_out_per_s = bytes_out / elapsed

    def cpu(info: dict[str, str]) -> float:
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])

    cell.redis_cpu_pct = 100 * (cpu(info1) - cpu(info0)) / elapsed

    def delta(metric: str) -> float:
        return metric_sum(metrics1, metric) - metric_sum(metrics0, metric)

    syncs = delta("ratelimit_sync_rounds_total")
    cell.syncs_per_s = syncs / elapsed
    cell.reported_per_sync = deltas.get("cmdstat_hincrby", 0) / syncs if syncs else 0.0
    count = delta("ratelimit_sync_duration_seconds_count")
    if count:
        cell.sync_ms_mean = 1000 * delta("ratelimit_sync_duration_seconds_sum") / count
    cell.table_buckets = int(metric_sum(metrics1, "ratelimit_probabilistic_buckets"))


# -- in-process ------------------------------------------------------------------------------


def bucket_keys(count: int) -> list[str]:
    """Keys as the matcher builds them for domain ``bench``, key ``k``, a minute window."""
    return [f"{DOMAIN}\x1fk\x1ev{i}\x1f60" for i in range(count)]


def local_bucket_bytes(count: int) -> float:
    """tracemalloc bytes per bucket held in a real LocalBuckets table."""
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    table = LocalBuckets()
    now = time.time()
    for key in bucket_keys(count):  # the key strings count: the table keeps them
        table.get(key, HUGE_LIMIT, 60, now, rule="bench.k")
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    grown = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    del table
    return grown / count


async def sync_cpu(redis_url: str, count: int, rounds: int) -> tuple[float, float]:
    """Service CPU (process time) and wall time of one sync of ``count`` active buckets,
    with the real LocalBuckets, Reconciler and RedisStore; medians over ``rounds``."""
    store = RedisStore(redis_url)
    table = LocalBuckets()
    reconciler = Reconciler(table, store, interval=0.25)
    keys = bucket_keys(count)
    cpu: list[float] = []
    wall: list[float] = []
    try:
        for round_ in range(rounds + 1):
            now = time.time()
            for key in keys:
                LocalBuckets.decide(table.get(key, HUGE_LIMIT, 60, now, "bench.k"), 1, 0.5)
            cpu0, wall0 = time.process_time(), time.perf_counter()
            synced = await reconciler.sync_once()
            cpu1, wall1 = time.process_time(), time.perf_counter()
            if synced != count:
                raise RuntimeError(f"synced {synced} buckets, expected {count}")
            if round_:  # the first round loads the script and creates the keys
                cpu.append(cpu1 - cpu0)
                wall.append(wall1 - wall0)
    finally:
        await store.close()
    return statistics.median(cpu), statistics.median(wall)


def in_process(counts: Sequence[int], progress: Progress) -> list[dict[str, float]]:
    rows = []
    with lab() as (directory, _, redis_servers):
        redis: RedisServer = start_redis(directory, redis_servers)
        for count in counts:
            progress(f"in-process: {count} buckets (tracemalloc, then sync CPU)")
            per_bucket = local_bucket_bytes(count)
            cpu, wall = asyncio.run(sync_cpu(redis.url, count, rounds=9))
            rows.append({
                "buckets": count, "local_bytes_per_bucket": per_bucket,
                "sync_cpu_ms": cpu * 1000, "sync_wall_ms": wall * 1000,
                "sync_cpu_us_per_bucket": cpu * 1e6 / count,
            })  # fmt: skip
    return rows


# -- output ----------------------------------------------------------------------------------


def markdown(cells: Sequence[Cell], local: Sequence[dict[str, float]]) -> str:
    lines = [
        "| active buckets | sync interval s | buckets per sync | script calls/s | "
        "Redis commands/s | bytes in/s | bytes out/s | Redis CPU % | service CPU % | "
        "sync ms (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        lines.append(
            f"| {c.buckets:,} | {c.interval:g} | {c.reported_per_sync:,.0f} | "
            f"{c.evalsha_per_s:,.1f} | {c.redis_commands_per_s:,.0f} | "
            f"{c.bytes_in_per_s:,.0f} | {c.bytes_out_per_s:,.0f} | {c.redis_cpu_pct:.1f} | "
            f"{c.service_cpu_pct:.1f} | {c.sync_ms_mean:.2f} |"
        )
    lines += ["", "| active buckets | Redis keys | Redis used_memory growth per key | "
              "MEMORY USAGE of one key | service RSS growth per bucket |",
              "|---|---|---|---|---|"]  # fmt: skip
    seen = set()
    for c in cells:
        if c.buckets in seen or not c.buckets:
            continue
        seen.add(c.buckets)
        per_key = c.redis_memory_delta / c.redis_keys if c.redis_keys else 0
        lines.append(
            f"| {c.buckets:,} | {c.redis_keys:,} | {per_key:,.0f} B | "
            f"{c.redis_key_memory_usage} B | {c.service_rss_delta / c.buckets:,.0f} B |"
        )
    first: dict[int, Cell] = {}
    for c in cells:
        if c.buckets:
            first.setdefault(c.buckets, c)
    largest = sorted(first.values(), key=lambda c: c.buckets)
    if len(largest) >= 2:
        small, big = largest[-2], largest[-1]
        grown = big.buckets - small.buckets
        lines.append(
            f"| marginal, {small.buckets:,} -> {big.buckets:,} | | "
            f"{(big.redis_memory_delta - small.redis_memory_delta) / grown:,.0f} B | | "
            f"{(big.service_rss_delta - small.service_rss_delta) / grown:,.0f} B |"
        )
    lines += ["", "| buckets | LocalBuckets bytes per bucket (tracemalloc) | service CPU per sync "
              "| per bucket | wall time per sync |", "|---|---|---|---|---|"]  # fmt: skip
    for row in local:
        lines.append(
            f"| {row['buckets']:,} | {row['local_bytes_per_bucket']:,.0f} | "
            f"{row['sync_cpu_ms']:.2f} ms | {row['sync_cpu_us_per_bucket']:.1f} µs | "
            f"{row['sync_wall_ms']:.2f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--buckets", default="0,1,100,1000,10000")
    parser.add_argument("--intervals", default="0.1,0.25,1")
    parser.add_argument("--rate", type=float, default=400.0, help="requests per second")
    parser.add_argument("--per-request", type=int, default=25,
                        help="descriptors per request (at most)")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=6.0, help="measured window per cell")
    parser.add_argument("--settle", type=float, default=2.0, help="seconds before measuring")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    args = parser.parse_args()
    if args.quick:
        args.buckets, args.intervals, args.seconds, args.settle = "0,100,10000", "0.25,1", 3, 1
    bucket_counts = [int(x) for x in args.buckets.split(",")]
    intervals = [float(x) for x in args.intervals.split(",")]
    progress = Progress()
    info = machine()
    progress(f"cost growth: buckets {bucket_counts} x intervals {intervals}, {args.rate:g} "
             f"req/s of up to {args.per_request} descriptors; machine {info}")  # fmt: skip
    cells: list[Cell] = []
    total = len(bucket_counts) * len(intervals)
    for interval in intervals:
        for buckets in bucket_counts:
            progress(f"cell {len(cells) + 1}/{total}: {buckets} active buckets, "
                     f"sync interval {interval:g} s")  # fmt: skip
            cell = run_cell(args, buckets, interval)
            cells.append(cell)
            progress(f"    {cell.reported_per_sync:,.0f} buckets/sync, "
                     f"{cell.evalsha_per_s:.1f} script calls/s, "
                     f"{cell.redis_commands_per_s:,.0f} Redis commands/s, "
                     f"in {cell.bytes_in_per_s:,.0f} B/s, out {cell.bytes_out_per_s:,.0f} B/s, "
                     f"Redis CPU {cell.redis_cpu_pct:.1f}%, service CPU "
                     f"{cell.service_cpu_pct:.1f}%, errors {cell.errors}")  # fmt: skip
    local = in_process([n for n in bucket_counts if n >= 100] or [1000], progress)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "cost_growth.json"
    out.write_text(json.dumps({
        "machine": info, "argv": sys.argv[1:], "cells": [asdict(c) for c in cells],
        "in_process": local,
    }, indent=1) + "\n")  # fmt: skip
    progress(f"done; wrote {out}")
    print()
    print(markdown(cells, local))
    bad = [c for c in cells if c.errors or c.over_limit]
    if bad:
        print(f"\n{len(bad)} cell(s) with errors or OVER_LIMIT answers")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
