"""What one hot RLQS bucket costs the store and the replicas as the fleet of Envoys grows,
with replicas that aggregate (this tree) and, side by side in the same run, the design
before tiers (every report through the store: ``--baseline``, a git revision).

    python bench/tier_cost.py                       # 400 and 4,000 Envoys, both designs
    python bench/tier_cost.py --envoys 400 --seconds 20 --baseline none

Per cell: a fresh redis-server and 4 fresh ``ratelimit-service serve --redis-url``
replicas; N simulated Envoys, each a real gRPC stream (node id ``e<n>``) to one replica
(round robin), opened by --clients processes. Every Envoy reports the one hot bucket
every 5 s, at its own phase, as Envoy 1.40 does: what it allowed and denied since its
last report, from its offered rate (a Zipf-like skew over the Envoys, 2x the limit in
all) against the token bucket the service last assigned it (a new bucket starts full,
as in Envoy). After a warm-up of three report intervals the script measures
--seconds: Redis CPU from ``INFO cpu`` (user + sys) per second, the replicas' CPU
from /proc per report, the reports sent and answered, and at the end the fleet's
assigned rate (the sum of every Envoy's tokens per second) against the limit.

The limit is 50,000 per second: at 4,000 Envoys a share is about 12 tokens per second,
well above the one token a share rounds up to.

    python bench/tier_cost.py --buckets 1000 --baseline 8108439 \
        --baseline-name "before cheaper scripts"
    python bench/tier_cost.py --envoys 400 --buckets 10 100 1000 --layout spread pinned \
        --modes rlqs --baseline none

With --buckets N (N > 1) the fleet has N hot buckets, each its own rule (``tenant:
b<n>``, 50,000/s for the first falling Zipf-like to 500/s for the 1,000th): each Envoy
carries --per-envoy of them (10) and reports them all in one message every 5 s, as
Envoy does; every bucket is carried by as many Envoys on each replica (many_fleet) and
offered 2x its limit. Per cell, beside the figures above: the replicas' CPU per report
and per bucket in a report, each replica's own, and the fleet's assigned rate over
each bucket's limit (median, min, max over the buckets). ``--layout pinned`` keeps
replica 0's Envoys on the same buckets while the fleet's grow: what a replica pays
for buckets it does not touch. Probabilistic: N keys of 1,000 / N per second each, 2x
offered, from gRPC client processes (h2load sends one body per run), with the load
generator's own CPU and each key's admitted hits (answers OK) over its limit. Results
go to tier_cost_buckets.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import redis
from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc
from throughput import (
    BENCH,
    REPO,
    ROUTE,
    Processes,
    Progress,
    Server,
    cpu_seconds,
    framed,
    lab,
    metric_sum,
    scrape,
    start_redis,
    start_service,
)

from ratelimit_harness.redis import RedisServer
from ratelimit_harness.rlqs_sim import SimEnvoy, usage_report
from ratelimit_service.cli.client import build_request

REPLICAS = 4
LIMIT = 50_000
REPORT_EVERY = 5.0
DOMAIN = "quota"
BUCKET = {"tenant": "hot"}
CONFIG = f"""domain: {DOMAIN}
descriptors:
  - key: tenant
    rate_limit: {{unit: second, requests_per_unit: {LIMIT}}}
"""


@dataclass
class Tally:
    """One client process's counts over the measured window."""

    sent: int = 0
    answered: int = 0
    """Reports sent in the window whose answer came."""
    responses: int = 0
    """Every response in the window (answers and pushed assignments)."""
    errors: int = 0
    assigned_rate: float = 0.0
    """At the window's end: the sum of its Envoys' tokens per second."""
    unassigned: int = 0
    """Envoys with no assignment at the window's end."""


def report(allowed: int, denied: int) -> rlqs_pb2.RateLimitQuotaUsageReports:
    return usage_report(DOMAIN, BUCKET, allowed, denied, int(REPORT_EVERY))


def page(admin_port: int) -> dict[str, float]:
    """A replica's /metrics; empty when it cannot answer in time (a saturated replica
    of the design before tiers)."""
    try:
        return scrape(admin_port)
    except OSError:
        return {}


LAST_ANSWERS = 10.0
"""Seconds each simulated Envoy waits, after the window, for the answers to its
reports sent in it."""


def weights(count: int) -> list[float]:
    """A Zipf-like skew (1/(n+10)), normalized to 1."""
    raw = [1.0 / (n + 10) for n in range(count)]
    total = sum(raw)
    return [w / total for w in raw]


async def run_envoy(
    envoy: SimEnvoy, channel: grpc.aio.Channel, phase: float,
    window: tuple[float, float], tally: Tally,
) -> None:  # fmt: skip
    """Report every REPORT_EVERY seconds until the window ends (wall clock)."""
    stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
    call = stub.StreamRateLimitQuotas(metadata=(("x-envoy-node-id", envoy.name),))
    start, end = window
    pending: list[float] = []

    async def read() -> None:
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                return
            now = time.time()
            envoy.assign(response)
            if start <= now < end:
                tally.responses += 1
            if pending:  # the answer to the oldest report (pushes come between reports)
                sent_at = pending.pop(0)
                if start <= sent_at < end:
                    tally.answered += 1

    reader = asyncio.ensure_future(read())
    try:
        await asyncio.sleep(phase)
        await call.write(report(1, 0))  # Envoy's first report of a new bucket, at once
        pending.append(time.time())
        next_at = time.monotonic() + REPORT_EVERY
        while time.time() < end:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += REPORT_EVERY
            allowed, denied = envoy.usage(time.monotonic())
            sent_at = time.time()
            await call.write(report(allowed, denied))
            pending.append(sent_at)
            if start <= sent_at < end:
                tally.sent += 1
        # The last answers: on a busy machine a replica, or this process, may take a
        # while to get to them.
        deadline = time.monotonic() + LAST_ANSWERS
        while any(start <= t < end for t in pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        # The stream ended (the design before tiers gives up streams when saturated).
        tally.errors += 1
    finally:
        reader.cancel()
        call.cancel()


async def client_main(
    envoys: list[tuple[str, float, int]], ports: list[int], window: tuple[float, float]
) -> Tally:
    tally = Tally()
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in ports]
    sims = [SimEnvoy(name, rate) for name, rate, _ in envoys]
    tasks = [
        run_envoy(sim, channels[replica], REPORT_EVERY * n / len(envoys), window, tally)
        for n, (sim, (_, _, replica)) in enumerate(zip(sims, envoys, strict=True))
    ]

    async def at_the_end() -> None:
        """The fleet's assignments when the window ends (as the Envoys stop, the
        replicas hand the room they leave to the others)."""
        await asyncio.sleep(max(0.0, window[1] - time.time()))
        tally.assigned_rate = sum(s.assigned_rate() for s in sims)
        tally.unassigned = sum(1 for s in sims if s.bucket is None)

    await asyncio.gather(at_the_end(), *tasks)
    for channel in channels:
        await channel.close()
    return tally


def client_process(
    envoys: list[tuple[str, float, int]], ports: list[int], window: tuple[float, float],
    out: multiprocessing.Queue[dict[str, Any]],
) -> None:  # fmt: skip
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asdict(asyncio.run(client_main(envoys, ports, window))))


def redis_cpu(port: int) -> float:
    client = redis.Redis(port=port)
    try:
        info = client.info("cpu")
    finally:
        client.close()
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def start_fleet(
    directory: Path, processes: Processes, redis_servers: list[RedisServer], design: str,
    tree: Path | None, rules_text: str,
) -> tuple[RedisServer, list[Server]]:  # fmt: skip
    """A fresh redis-server and REPLICAS replicas on it, serving ``rules_text``."""
    rules = directory / "rules"
    rules.mkdir()
    (rules / "q.yaml").write_text(rules_text)
    store = start_redis(directory, redis_servers)
    replicas = [
        start_service(processes, f"{design}-{n}", rules,
                      ["--redis-url", store.url, "--log-level", "WARNING"], tree=tree)
        for n in range(REPLICAS)
    ]  # fmt: skip
    return store, replicas


def cell(
    design: str, tree: Path | None, envoys: int, seconds: float, clients: int,
    progress: Progress,
) -> dict[str, Any]:  # fmt: skip
    with lab() as (directory, processes, redis_servers):
        store, replicas = start_fleet(directory, processes, redis_servers, design, tree, CONFIG)
        shares = weights(envoys)
        fleet = [(f"e{n}", 2 * LIMIT * shares[n], n % REPLICAS) for n in range(envoys)]
        warm = 3 * REPORT_EVERY + REPORT_EVERY
        start = time.time() + warm
        window = (start, start + seconds)
        out: multiprocessing.Queue[dict[str, Any]] = multiprocessing.Queue()
        workers = [
            multiprocessing.Process(
                target=client_process,
                args=(fleet[n::clients], [r.port for r in replicas], window, out),
            )
            for n in range(clients)
        ]
        for worker in workers:
            worker.start()
        progress(f"{design}: {envoys} Envoys, warming up {warm:.0f} s")
        time.sleep(max(0.0, start - time.time()))
        redis_before = redis_cpu(store.port)
        cpu_before = [cpu_seconds(r.pid) for r in replicas]
        time.sleep(max(0.0, window[1] - time.time()))
        redis_after = redis_cpu(store.port)
        cpu_after = [cpu_seconds(r.pid) for r in replicas]
        pages = [page(r.admin_port or 0) for r in replicas]
        progress("measured; the Envoys stop")
        tallies = [Tally(**out.get(timeout=120)) for _ in workers]
        for worker in workers:
            worker.join(timeout=30)
        sent = sum(t.sent for t in tallies)
        replica_cpu = sum(a - b for a, b in zip(cpu_after, cpu_before, strict=True))
        return {
            "design": design,
            "envoys": envoys,
            "seconds": seconds,
            "reports_per_s": sent / seconds,
            "redis_cpu_pct": 100 * (redis_after - redis_before) / seconds,
            "replica_cpu_ms_per_report": 1000 * replica_cpu / sent if sent else None,
            "replicas_cpu_pct": 100 * replica_cpu / seconds,
            "sent": sent,
            "answered": sum(t.answered for t in tallies),
            "errors": sum(t.errors for t in tallies),
            "assigned_over_limit": sum(t.assigned_rate for t in tallies) / LIMIT,
            "unassigned": sum(t.unassigned for t in tallies),
            "parts_over_limit": sum(metric_sum(p, "ratelimit_rlqs_part") for p in pages) / LIMIT,
            "shares_over_limit": sum(metric_sum(p, "ratelimit_rlqs_instance_share") for p in pages)
            / LIMIT,
        }


PROB_LIMIT = 1_000
PROB_RATE = 2 * PROB_LIMIT
PROB_CONFIG = f"""domain: {DOMAIN}
descriptors:
  - key: tenant
    mode: probabilistic
    rate_limit: {{unit: second, requests_per_unit: {PROB_LIMIT}}}
"""


def prob_cell(
    design: str, tree: Path | None, clients: int, seconds: float, progress: Progress
) -> dict[str, Any]:
    """Probabilistic mode: ``clients`` Envoys as clients // 10 HTTP/2 connections
    (spread over the 4 replicas; h2load, --rps each so that together they offer 2x the
    limit) send RLS requests for the one hot bucket; Redis CPU per second, the
    replicas' CPU per request, requests answered, admitted against the limit. Not one
    connection per Envoy: h2load's connections fire in step, and 4,000 connections at
    half a request a second arrive as one burst of 1,000 per replica every 2 s, which
    is no fleet's traffic (the local credit, renewed every sync, then admits about
    0.65x the limit)."""
    with lab() as (directory, processes, redis_servers):
        fleet = start_fleet(directory, processes, redis_servers, design, tree, PROB_CONFIG)
        store, replicas = fleet
        body = directory / "body.bin"
        body.write_bytes(framed(DOMAIN, ["tenant=hot"]))
        warm = 5.0
        connections = max(REPLICAS, clients // 10)
        rate = f"{PROB_RATE / connections:g}"
        command = [
            "h2load", "-c", str(connections // REPLICAS), "-m", "1", "-t", "1", "--rps", rate,
            "-D", f"{warm + seconds + 1:g}", "-H", "content-type: application/grpc",
            "-H", "te: trailers", "-d", str(body),
        ]  # fmt: skip
        loads = [
            subprocess.Popen(
                [*command, f"http://127.0.0.1:{replica.port}{ROUTE}"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for replica in replicas
        ]
        progress(f"{design}: probabilistic, {connections} connections, warming up {warm:.0f} s")
        time.sleep(warm)
        redis_before, pages_before = (
            redis_cpu(store.port),
            [scrape(r.admin_port or 0) for r in replicas],
        )
        cpu_before = [cpu_seconds(r.pid) for r in replicas]
        time.sleep(seconds)
        redis_after, pages_after = (
            redis_cpu(store.port),
            [scrape(r.admin_port or 0) for r in replicas],
        )
        cpu_after = [cpu_seconds(r.pid) for r in replicas]
        outputs = [load.communicate(timeout=seconds + 120)[0] for load in loads]

        def delta(metric: str) -> float:
            return sum(
                metric_sum(after, metric) - metric_sum(before, metric)
                for before, after in zip(pages_before, pages_after, strict=True)
            )

        hits = delta("ratelimit_service_rate_limit_total_hits_total")
        over = delta("ratelimit_service_rate_limit_over_limit_total")
        replica_cpu = sum(a - b for a, b in zip(cpu_after, cpu_before, strict=True))
        done = sum(_h2load_count(out, "done") for out in outputs)
        succeeded = sum(_h2load_count(out, "succeeded") for out in outputs)
        return {
            "design": design,
            "mode": "probabilistic",
            "envoys": clients,
            "seconds": seconds,
            "requests_per_s": hits / seconds,
            "redis_cpu_pct": 100 * (redis_after - redis_before) / seconds,
            "replica_cpu_ms_per_request": 1000 * replica_cpu / hits if hits else None,
            "replicas_cpu_pct": 100 * replica_cpu / seconds,
            "answered": succeeded,
            "sent": done,
            "admitted_over_limit": (hits - over) / seconds / PROB_LIMIT,
        }


# -- many hot buckets (--buckets N, N > 1) --------------------------------------------


def bucket_limits(buckets: int) -> list[int]:
    """Each bucket's limit per second: LIMIT for the first, a Zipf-like fall after it
    (LIMIT * 10 / (b + 10): 500/s for the 1,000th)."""
    return [max(1, LIMIT * 10 // (b + 10)) for b in range(buckets)]


def many_config(limits: list[int], mode: str = "") -> str:
    """A limit per bucket: one descriptor value (``tenant: b<n>``) per bucket."""
    extra = f"\n    mode: {mode}" if mode else ""
    entries = "".join(
        f"""  - key: tenant
    value: b{b}{extra}
    rate_limit: {{unit: second, requests_per_unit: {limit}}}
"""
        for b, limit in enumerate(limits)
    )
    return f"domain: {DOMAIN}\ndescriptors:\n{entries}"


Carried = list[tuple[str, float]]
"""One Envoy's buckets: (the bucket's tenant value, the Envoy's offered rate in it)."""


def many_fleet(
    envoys: int, buckets: int, per_envoy: int, layout: str
) -> list[tuple[str, int, Carried]]:
    """(node id, replica, its buckets) per Envoy. Envoy n talks to replica n % 4, and each
    4 in a row (one per replica) carry the same ``per_envoy`` consecutive buckets, the
    next 4 the next ones (wrapping around N): every bucket is carried by the same number
    of Envoys, as many on each replica. ``layout`` "pinned": replica 0's Envoys all carry
    buckets 0 .. per_envoy - 1 instead, whatever N, so replica 0 touches the same
    buckets while the fleet's grow. A bucket's offered rate, 2x its limit, is divided
    among its Envoys with the same Zipf-like skew as the Envoys of the one hot bucket."""
    k = min(per_envoy, buckets)
    carried: list[list[int]] = []
    for n in range(envoys):
        first = 0 if layout == "pinned" and n % REPLICAS == 0 else (n // REPLICAS) * k
        carried.append([(first + i) % buckets for i in range(k)])
    carriers: dict[int, list[int]] = {}
    for n, mine in enumerate(carried):
        for b in mine:
            carriers.setdefault(b, []).append(n)
    limits = bucket_limits(buckets)
    rate: dict[tuple[int, int], float] = {}
    for b, ns in carriers.items():
        for n, share in zip(ns, weights(len(ns)), strict=True):
            rate[n, b] = 2 * limits[b] * share
    return [
        (f"e{n}", n % REPLICAS, [(f"b{b}", rate[n, b]) for b in mine])
        for n, mine in enumerate(carried)
    ]


@dataclass
class ManyTally:
    """One client process's counts over the measured window (many buckets)."""

    sent: list[int]
    """Reports sent in the window, per replica."""
    answered: int = 0
    pushes: list[int] | None = None
    """Assignments pushed between reports in the window, per replica."""
    errors: int = 0
    assigned: dict[str, float] | None = None
    """At the window's end: per bucket, the sum of its Envoys' tokens per second."""
    unassigned: int = 0
    """(Envoy, bucket) pairs with no assignment at the window's end."""


def many_report(sims: dict[str, SimEnvoy], first: bool) -> rlqs_pb2.RateLimitQuotaUsageReports:
    """One report with all the Envoy's buckets, as Envoy sends it."""
    now = time.monotonic()
    usages = []
    for value, sim in sims.items():
        allowed, denied = (1, 0) if first else sim.usage(now)
        one = usage_report(DOMAIN, {"tenant": value}, allowed, denied, int(REPORT_EVERY))
        usages.extend(one.bucket_quota_usages)
    return rlqs_pb2.RateLimitQuotaUsageReports(domain=DOMAIN, bucket_quota_usages=usages)


async def run_many_envoy(
    sims: dict[str, SimEnvoy], name: str, replica: int, channel: grpc.aio.Channel,
    phase: float, window: tuple[float, float], tally: ManyTally,
) -> None:  # fmt: skip
    """run_envoy with several buckets: each report carries them all; an answer is the
    response that names them all (a push names one)."""
    stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel)
    call = stub.StreamRateLimitQuotas(metadata=(("x-envoy-node-id", name),))
    start, end = window
    pending: list[float] = []

    async def read() -> None:
        while True:
            response = await call.read()
            if response is grpc.aio.EOF:
                return
            now = time.time()
            for action in response.bucket_action:
                sim = sims.get(action.bucket_id.bucket.get("tenant", ""))
                if sim is not None:
                    sim.assign(rlqs_pb2.RateLimitQuotaResponse(bucket_action=[action]))
            answer = len(response.bucket_action) == len(sims) if len(sims) > 1 else pending
            if answer and pending:
                sent_at = pending.pop(0)
                if start <= sent_at < end:
                    tally.answered += 1
            elif start <= now < end and tally.pushes is not None:
                tally.pushes[replica] += 1

    reader = asyncio.ensure_future(read())
    try:
        await asyncio.sleep(phase)
        await call.write(many_report(sims, first=True))
        pending.append(time.time())
        for sim in sims.values():
            sim.last = time.monotonic()
        next_at = time.monotonic() + REPORT_EVERY
        while time.time() < end:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            next_at += REPORT_EVERY
            message = many_report(sims, first=False)
            sent_at = time.time()
            await call.write(message)
            pending.append(sent_at)
            if start <= sent_at < end:
                tally.sent[replica] += 1
        deadline = time.monotonic() + LAST_ANSWERS
        while any(start <= t < end for t in pending) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        tally.errors += 1
    finally:
        reader.cancel()
        call.cancel()


async def many_client_main(
    envoys: list[tuple[str, int, Carried]], phases: list[float], ports: list[int],
    window: tuple[float, float],
) -> ManyTally:  # fmt: skip
    tally = ManyTally(sent=[0] * REPLICAS, pushes=[0] * REPLICAS)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for port in ports]
    sims = [{value: SimEnvoy(name, rate) for value, rate in carried} for name, _, carried in envoys]
    tasks = [
        run_many_envoy(mine, name, replica, channels[replica], phase, window, tally)
        for mine, (name, replica, _), phase in zip(sims, envoys, phases, strict=True)
    ]

    async def at_the_end() -> None:
        await asyncio.sleep(max(0.0, window[1] - time.time()))
        assigned: dict[str, float] = {}
        for mine in sims:
            for value, sim in mine.items():
                assigned[value] = assigned.get(value, 0.0) + sim.assigned_rate()
                tally.unassigned += sim.bucket is None
        tally.assigned = assigned

    await asyncio.gather(at_the_end(), *tasks)
    for channel in channels:
        await channel.close()
    return tally


def many_client_process(
    envoys: list[tuple[str, int, Carried]], phases: list[float], ports: list[int],
    window: tuple[float, float], out: multiprocessing.Queue[dict[str, Any]],
) -> None:  # fmt: skip
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asdict(asyncio.run(many_client_main(envoys, phases, ports, window))))


def spread(ratios: list[float]) -> dict[str, float | None]:
    """Median, min and max of ``ratios`` (None when empty)."""
    if not ratios:
        return {"median": None, "min": None, "max": None}
    ordered = sorted(ratios)
    return {"median": statistics.median(ordered), "min": ordered[0], "max": ordered[-1]}


def many_cell(
    design: str, tree: Path | None, envoys: int, buckets: int, per_envoy: int, layout: str,
    seconds: float, clients: int, progress: Progress,
) -> dict[str, Any]:  # fmt: skip
    """cell() with ``buckets`` hot buckets carried by the Envoys (many_fleet)."""
    limits = bucket_limits(buckets)
    config = many_config(limits)
    with lab() as (directory, processes, redis_servers):
        store, replicas = start_fleet(directory, processes, redis_servers, design, tree, config)
        fleet = many_fleet(envoys, buckets, per_envoy, layout)
        phases = [REPORT_EVERY * n / envoys for n in range(envoys)]
        warm = 3 * REPORT_EVERY + REPORT_EVERY
        start = time.time() + warm
        window = (start, start + seconds)
        out: multiprocessing.Queue[dict[str, Any]] = multiprocessing.Queue()
        ports = [r.port for r in replicas]
        workers = [
            multiprocessing.Process(
                target=many_client_process,
                args=(fleet[n::clients], phases[n::clients], ports, window, out),
            )
            for n in range(clients)
        ]
        for worker in workers:
            worker.start()
        progress(
            f"{design}: {envoys} Envoys, {buckets} buckets ({layout}), warming up {warm:.0f} s"
        )
        time.sleep(max(0.0, start - time.time()))
        redis_before = redis_cpu(store.port)
        cpu_before = [cpu_seconds(r.pid) for r in replicas]
        time.sleep(max(0.0, window[1] - time.time()))
        redis_after = redis_cpu(store.port)
        cpu_after = [cpu_seconds(r.pid) for r in replicas]
        progress("measured; the Envoys stop")
        tallies = [ManyTally(**out.get(timeout=120)) for _ in workers]
        for worker in workers:
            worker.join(timeout=30)
    sent = [sum(t.sent[r] for t in tallies) for r in range(REPLICAS)]
    cpu = [a - b for a, b in zip(cpu_after, cpu_before, strict=True)]
    assigned: dict[str, float] = {}
    for t in tallies:
        for value, rate in (t.assigned or {}).items():
            assigned[value] = assigned.get(value, 0.0) + rate
    ratios = [assigned[f"b{b}"] / limit for b, limit in enumerate(limits) if f"b{b}" in assigned]
    k = min(per_envoy, buckets)
    return {
        "design": design,
        "envoys": envoys,
        "buckets": buckets,
        "per_envoy": k,
        "layout": layout,
        "seconds": seconds,
        "reports_per_s": sum(sent) / seconds,
        "redis_cpu_pct": 100 * (redis_after - redis_before) / seconds,
        "replica_cpu_ms_per_report": 1000 * sum(cpu) / sum(sent) if sum(sent) else None,
        "replica_cpu_us_per_bucket_report": 1e6 * sum(cpu) / sum(sent) / k if sum(sent) else None,
        "per_replica_cpu_ms_per_report": [
            1000 * c / s if s else None for c, s in zip(cpu, sent, strict=True)
        ],
        "replicas_cpu_pct": 100 * sum(cpu) / seconds,
        "sent": sum(sent),
        "answered": sum(t.answered for t in tallies),
        "per_replica_sent": sent,
        "per_replica_pushes": [
            sum((t.pushes or [0] * REPLICAS)[r] for t in tallies) for r in range(REPLICAS)
        ],
        "errors": sum(t.errors for t in tallies),
        "unassigned": sum(t.unassigned for t in tallies),
        "buckets_with_demand": len(ratios),
        "assigned_over_limit": spread(ratios),
    }


@dataclass
class LoadTally:
    """One load process's RLS calls sent in the measured window."""

    sent: int = 0
    answered: int = 0
    admitted: dict[str, int] | None = None
    """Per key: answers OK."""
    errors: int = 0
    cpu_seconds: float = 0.0
    """This process's own CPU over the window."""


OK_ANSWER = b"\x08\x01"
"""A RateLimitResponse whose first field is overall_code OK."""


async def load_main(
    keys: list[str], rate: float, ports: list[int], connections: int,
    window: tuple[float, float],
) -> LoadTally:  # fmt: skip
    """RLS calls for ``keys`` in turn at ``rate`` per second, open loop, from now until
    the window ends: a key's successive calls go to successive replicas, each over one
    of ``connections`` HTTP/2 connections (spread over the replicas)."""
    tally = LoadTally(admitted=dict.fromkeys(keys, 0))
    admitted = tally.admitted
    assert admitted is not None
    options = [("grpc.use_local_subchannel_pool", 1)]
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{ports[n % REPLICAS]}", options=options)
        for n in range(max(REPLICAS, connections))
    ]
    by_replica = [channels[r::REPLICAS] for r in range(REPLICAS)]
    calls = [[c.unary_unary(ROUTE) for c in mine] for mine in by_replica]
    bodies = [
        build_request(DOMAIN, [f"tenant={key}"], 0).SerializeToString() for key in keys
    ]  # fmt: skip
    start, end = window
    flying: set[asyncio.Task[None]] = set()

    async def one(key: int, call: Any) -> None:
        sent_at = time.time()
        counted = start <= sent_at < end
        tally.sent += counted
        try:
            answer = await call(bodies[key], timeout=5.0)
        except grpc.aio.AioRpcError:
            tally.errors += counted
            return
        if counted:
            tally.answered += 1
            if answer[:2] == OK_ANSWER:
                admitted[keys[key]] += 1

    began, issued = time.monotonic(), 0
    cpu_at_start: float | None = None
    while time.time() < end:
        if cpu_at_start is None and time.time() >= start:
            cpu_at_start = time.process_time()
        due = int((time.monotonic() - began) * rate)
        for i in range(issued, due):
            key, turn = i % len(keys), i // len(keys)
            replica = (key + turn) % REPLICAS
            mine = calls[replica]
            task = asyncio.ensure_future(one(key, mine[(turn // REPLICAS + key) % len(mine)]))
            flying.add(task)
            task.add_done_callback(flying.discard)
        issued = max(issued, due)
        await asyncio.sleep(0.005)
    tally.cpu_seconds = time.process_time() - (cpu_at_start or time.process_time())
    if flying:
        await asyncio.wait(flying, timeout=LAST_ANSWERS)
    for channel in channels:
        await channel.close()
    return tally


def load_process(
    keys: list[str], rate: float, ports: list[int], connections: int,
    window: tuple[float, float], out: multiprocessing.Queue[dict[str, Any]],
) -> None:  # fmt: skip
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    out.put(asdict(asyncio.run(load_main(keys, rate, ports, connections, window))))


def many_prob_cell(
    design: str, tree: Path | None, envoys: int, buckets: int, seconds: float, clients: int,
    progress: Progress, offered: float = 2.0, key_limit: int | None = None,
) -> dict[str, Any]:  # fmt: skip
    """prob_cell over ``buckets`` probabilistic keys, each of PROB_LIMIT / N per second
    (at least 1; or ``key_limit``), at ``offered`` times it each (2x: the same 2,000
    requests per second as one hot bucket). h2load sends one body per run, so the load
    comes from ``clients`` gRPC client processes instead (the keys divided among them),
    over Envoys / 10 connections."""
    limit = key_limit or max(1, PROB_LIMIT // buckets)
    rate = offered * limit
    keys = [f"b{b}" for b in range(buckets)]
    config = many_config([limit] * buckets, mode="probabilistic")
    with lab() as (directory, processes, redis_servers):
        store, replicas = start_fleet(directory, processes, redis_servers, design, tree, config)
        warm = 5.0
        start = time.time() + warm
        window = (start, start + seconds)
        connections = max(REPLICAS, envoys // 10)
        per = max(REPLICAS, connections // clients)
        out: multiprocessing.Queue[dict[str, Any]] = multiprocessing.Queue()
        ports = [r.port for r in replicas]
        workers = [
            multiprocessing.Process(
                target=load_process,
                args=(keys[n::clients], rate * len(keys[n::clients]), ports, per, window, out),
            )
            for n in range(clients)
        ]
        for worker in workers:
            worker.start()
        progress(f"{design}: probabilistic, {buckets} keys, warming up {warm:.0f} s")
        time.sleep(max(0.0, start - time.time()))
        redis_before, pages_before = (
            redis_cpu(store.port),
            [scrape(r.admin_port or 0) for r in replicas],
        )
        cpu_before = [cpu_seconds(r.pid) for r in replicas]
        time.sleep(max(0.0, window[1] - time.time()))
        redis_after, pages_after = (
            redis_cpu(store.port),
            [scrape(r.admin_port or 0) for r in replicas],
        )
        cpu_after = [cpu_seconds(r.pid) for r in replicas]
        tallies = [LoadTally(**out.get(timeout=120)) for _ in workers]
        for worker in workers:
            worker.join(timeout=30)
    hits = sum(
        metric_sum(after, "ratelimit_service_rate_limit_total_hits_total")
        - metric_sum(before, "ratelimit_service_rate_limit_total_hits_total")
        for before, after in zip(pages_before, pages_after, strict=True)
    )
    replica_cpu = sum(a - b for a, b in zip(cpu_after, cpu_before, strict=True))
    admitted: dict[str, int] = {}
    for t in tallies:
        admitted.update(t.admitted or {})
    return {
        "design": design,
        "mode": "probabilistic",
        "envoys": envoys,
        "buckets": buckets,
        "offered": offered,
        "seconds": seconds,
        "requests_per_s": hits / seconds,
        "bucket_updates_per_s": sum(
            metric_sum(after, "ratelimit_sync_bucket_updates_total")
            - metric_sum(before, "ratelimit_sync_bucket_updates_total")
            for before, after in zip(pages_before, pages_after, strict=True)
        )
        / seconds,
        "redis_cpu_pct": 100 * (redis_after - redis_before) / seconds,
        "replica_cpu_ms_per_request": 1000 * replica_cpu / hits if hits else None,
        "replicas_cpu_pct": 100 * replica_cpu / seconds,
        "load_cpu_pct": 100 * sum(t.cpu_seconds for t in tallies) / seconds,
        "answered": sum(t.answered for t in tallies),
        "sent": sum(t.sent for t in tallies),
        "errors": sum(t.errors for t in tallies),
        "admitted_over_limit": spread([n / seconds / limit for n in admitted.values()]),
        "fleet_admitted_over_limit": sum(admitted.values()) / seconds / (limit * buckets),
    }


def in_process(buckets: int, per_envoy: int, rounds: int = 20) -> dict[str, Any]:
    """A replica's own work without processes, sockets or Redis: one QuotaCoordinator on
    the embedded store and an injected clock, holding ``buckets`` counters (reported by
    enough other Envoys, ``per_envoy`` buckets each, to touch them all), times the
    reports of 100 Envoys that each carry buckets 0 .. per_envoy - 1 (the same at any
    N), and the publish rounds, ``rounds`` report intervals long."""
    from ratelimit_service.core.config_loader import ConfigFile, load_config
    from ratelimit_service.engine.quota import QuotaCoordinator, Usage
    from ratelimit_service.engine.stats import Stats
    from ratelimit_service.storage.embedded import EmbeddedStore

    k = min(per_envoy, buckets)
    config = load_config([ConfigFile("q.yaml", many_config(bucket_limits(buckets)))])
    now = [1000.0]
    clock = lambda: now[0]  # noqa: E731
    store = EmbeddedStore(clock=clock)
    quota = QuotaCoordinator(lambda: config, Stats(), store, clock=clock, wall=clock)
    others = [
        (f"o{n}", [Usage({"tenant": f"b{(n * k + i) % buckets}"}, 100, 100) for i in range(k)])
        for n in range(-(-buckets // k))
    ]
    watched = [
        (f"w{n}", [Usage({"tenant": f"b{i}"}, 100, 100) for i in range(k)]) for n in range(100)
    ]
    timed = {"report": 0.0, "tick": 0.0}

    async def rounds_of(count: int, timing: bool) -> None:
        for _ in range(count):
            for name, usages in others:
                await quota.report(name, DOMAIN, usages)
            began = time.perf_counter()
            for name, usages in watched:
                await quota.report(name, DOMAIN, usages)
            reported = time.perf_counter()
            now[0] += REPORT_EVERY
            await quota.tick()
            if timing:
                timed["report"] += reported - began
                timed["tick"] += time.perf_counter() - reported

    asyncio.run(rounds_of(3, False))  # every counter published, every demand measured
    asyncio.run(rounds_of(rounds, True))
    return {
        "buckets": buckets,
        "per_envoy": k,
        "counters": len(quota._counters),
        "us_per_report": 1e6 * timed["report"] / (rounds * len(watched)),
        "ms_per_publish_round": 1e3 * timed["tick"] / rounds,
        "us_per_counter_published": 1e6 * timed["tick"] / rounds / max(1, len(quota._counters)),
    }


def markdown_in_process(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"| hot buckets the replica holds | a report of {rows[0]['per_envoy']} buckets"
        " (the same at every N) | a publish round | per counter published |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['counters']:,} | {r['us_per_report']:.0f} µs"
            f" | {r['ms_per_publish_round']:.2f} ms | {r['us_per_counter_published']:.1f} µs |"
        )
    return "\n".join(lines)


def _h2load_count(output: str, name: str) -> int:
    found = re.search(rf"(\d+) {name}", output)
    return int(found.group(1)) if found else 0


def baseline_tree(revision: str) -> Path:
    """A checkout of ``revision`` (a git worktree, outside this tree so that no tool
    here meets its files) whose package the baseline serves."""
    tree = Path(tempfile.gettempdir()) / f"ratelimit-baseline-{revision}"
    if not tree.exists():
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(tree), revision],
            cwd=REPO, check=True, capture_output=True,
        )  # fmt: skip
    return tree


Row = dict[str, Any]


def _table(columns: list[tuple[str, Callable[[Row], str]]], rows: list[Row]) -> str:
    """A markdown table: a header and a cell formatter per column, a line per row."""
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|---" * len(columns) + "|"]
    lines += ["| " + " | ".join(cell(r) for _, cell in columns) + " |" for r in rows]
    return "\n".join(lines)


def _design(r: Row) -> str:
    return str(r["design"])


def _envoys(r: Row) -> str:
    return f"{r['envoys']:,}"


def _redis(r: Row) -> str:
    return f"{r['redis_cpu_pct']:.1f} %"


def _replicas(r: Row) -> str:
    return f"{r['replicas_cpu_pct']:.0f} %"


def _answered(r: Row) -> str:
    return f"{r['answered']:,} / {r['sent']:,}"


def markdown(rows: list[Row]) -> str:
    return _table([
        ("design", _design), ("Envoys", _envoys),
        ("reports/s", lambda r: f"{r['reports_per_s']:.0f}"), ("Redis CPU", _redis),
        ("replica CPU per report", lambda r: f"{r['replica_cpu_ms_per_report']:.2f} ms"),
        ("replicas' CPU", _replicas), ("answered / sent", _answered),
        ("stream errors", lambda r: str(r["errors"])),
        ("assigned rate / limit", lambda r: f"{r['assigned_over_limit']:.2f}"),
    ], rows)  # fmt: skip


def markdown_prob(rows: list[Row]) -> str:
    return _table([
        ("design", _design), ("Envoys", _envoys),
        ("requests/s", lambda r: f"{r['requests_per_s']:.0f}"), ("Redis CPU", _redis),
        ("replica CPU per request", lambda r: f"{r['replica_cpu_ms_per_request']:.2f} ms"),
        ("replicas' CPU", _replicas), ("answered / sent", _answered),
        ("admitted / limit", lambda r: f"{r['admitted_over_limit']:.2f}"),
    ], rows)  # fmt: skip


def markdown_many(rows: list[Row]) -> str:
    return _table([
        ("design", _design), ("Envoys", _envoys),
        ("buckets (per Envoy, layout)",
         lambda r: f"{r['buckets']:,} ({r['per_envoy']}, {r['layout']})"),
        ("reports/s", lambda r: f"{r['reports_per_s']:.0f}"), ("Redis CPU", _redis),
        ("replica CPU per report", lambda r: f"{r['replica_cpu_ms_per_report']:.2f} ms"),
        ("per bucket in a report",
         lambda r: f"{r['replica_cpu_us_per_bucket_report']:.0f} µs"),
        ("replica 0 per report", lambda r: f"{r['per_replica_cpu_ms_per_report'][0]:.2f} ms"),
        ("replicas' CPU", _replicas), ("answered / sent", _answered),
        ("stream errors", lambda r: str(r["errors"])),
        ("assigned rate / limit, median (min-max)", lambda r: _spread(r["assigned_over_limit"])),
    ], rows)  # fmt: skip


def markdown_many_prob(rows: list[Row]) -> str:
    return _table([
        ("design", _design), ("Envoys", _envoys), ("keys", lambda r: f"{r['buckets']:,}"),
        ("offered / limit", lambda r: f"{r['offered']:g}"),
        ("requests/s", lambda r: f"{r['requests_per_s']:,.0f}"),
        ("bucket updates/s", lambda r: f"{r['bucket_updates_per_s']:,.0f}"),
        ("Redis CPU", _redis),
        ("replica CPU per request", lambda r: f"{r['replica_cpu_ms_per_request']:.2f} ms"),
        ("replicas' CPU", _replicas),
        ("load generator CPU", lambda r: f"{r['load_cpu_pct']:.0f} %"),
        ("answered / sent", _answered),
        ("admitted / limit per key, median (min-max)",
         lambda r: _spread(r["admitted_over_limit"])),
        ("fleet's admitted / limit", lambda r: f"{r['fleet_admitted_over_limit']:.2f}"),
    ], rows)  # fmt: skip


def _spread(ratio: dict[str, float | None]) -> str:
    if ratio["median"] is None:
        return "-"
    return f"{ratio['median']:.2f} ({ratio['min']:.2f}-{ratio['max']:.2f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envoys", type=int, nargs="+", default=[400, 4000])
    parser.add_argument("--seconds", type=float, default=30.0, help="measured window")
    parser.add_argument("--clients", type=int, default=2, help="client processes (RLQS)")
    parser.add_argument(
        "--modes", nargs="+", default=["rlqs", "probabilistic"],
        choices=["rlqs", "probabilistic"],
    )  # fmt: skip
    parser.add_argument(
        "--baseline", default="d0a2a69",
        help="git revision of the design before tiers ('none': this tree only)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline-name", default="before tiers",
        help="what the baseline's rows call it (beside its revision)",
    )  # fmt: skip
    parser.add_argument(
        "--buckets", type=int, nargs="+", default=[1],
        help="hot buckets (RLQS) and keys (probabilistic) in the fleet; each value a cell",
    )  # fmt: skip
    parser.add_argument(
        "--per-envoy", type=int, default=10, help="buckets each Envoy reports (--buckets > 1)"
    )
    parser.add_argument(
        "--layout", nargs="+", default=["spread"], choices=["spread", "pinned"],
        help="spread: each bucket on every replica; pinned: replica 0's Envoys carry "
        "buckets 0 .. per-envoy - 1 whatever the fleet's (--buckets > 1)",
    )  # fmt: skip
    parser.add_argument(
        "--in-process", action="store_true",
        help="time the replica's report and publish code in this process instead (--buckets)",
    )  # fmt: skip
    parser.add_argument(
        "--offered", type=float, default=2.0,
        help="probabilistic keys (--buckets > 1): offered times each key's limit",
    )  # fmt: skip
    parser.add_argument(
        "--key-limit", type=int, default=None,
        help=f"probabilistic keys (--buckets > 1): each key's limit per second (default:"
        f" {PROB_LIMIT:,} over the keys)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    args = parser.parse_args()
    if args.in_process:
        rows = [in_process(n, args.per_envoy) for n in args.buckets]
        print(json.dumps(rows, indent=1))
        print(markdown_in_process(rows))
        return
    progress = Progress()
    args.out.mkdir(parents=True, exist_ok=True)
    designs: list[tuple[str, Path | None]] = [("tiers", None)]
    if args.baseline != "none":
        tree = baseline_tree(args.baseline)
        designs.append((f"{args.baseline_name} ({args.baseline})", tree))
    if args.buckets != [1]:
        many(args, designs, progress)
        return
    rows, prob_rows = [], []
    for envoys in args.envoys:
        for design, tree in designs:
            if "rlqs" in args.modes:
                row = cell(design, tree, envoys, args.seconds, args.clients, progress)
                progress(json.dumps(row))
                rows.append(row)
            if "probabilistic" in args.modes:
                row = prob_cell(design, tree, envoys, args.seconds, progress)
                progress(json.dumps(row))
                prob_rows.append(row)
    (args.out / "tier_cost.json").write_text(json.dumps(rows + prob_rows, indent=1))
    if rows:
        print(f"\nRLQS, one hot bucket of {LIMIT:,}/s, 2x offered\n")
        print(markdown(rows))
    if prob_rows:
        print(f"\nProbabilistic, one hot bucket of {PROB_LIMIT:,}/s, 2x offered\n")
        print(markdown_prob(prob_rows))


def many(
    args: argparse.Namespace, designs: list[tuple[str, Path | None]], progress: Progress
) -> None:
    """The cells of --buckets N (N > 1): results to tier_cost_buckets.json."""
    rows, prob_rows = [], []
    for envoys in args.envoys:
        for buckets in args.buckets:
            for design, tree in designs:
                for layout in args.layout if "rlqs" in args.modes else ():
                    row = many_cell(
                        design, tree, envoys, buckets, args.per_envoy, layout, args.seconds,
                        args.clients, progress,
                    )  # fmt: skip
                    progress(json.dumps(row))
                    rows.append(row)
                if "probabilistic" in args.modes:
                    row = many_prob_cell(
                        design, tree, envoys, buckets, args.seconds, args.clients, progress,
                        args.offered, args.key_limit,
                    )  # fmt: skip
                    progress(json.dumps(row))
                    prob_rows.append(row)
    (args.out / "tier_cost_buckets.json").write_text(json.dumps(rows + prob_rows, indent=1))
    if rows:
        print("\nRLQS, hot buckets of 50,000/s falling to 500/s (the 1,000th), 2x offered\n")
        print(markdown_many(rows))
    if prob_rows:
        print(f"\nProbabilistic, {PROB_LIMIT:,}/s divided among the keys, 2x offered\n")
        print(markdown_many_prob(prob_rows))


if __name__ == "__main__":
    sys.exit(main())
