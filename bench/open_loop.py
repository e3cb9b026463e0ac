"""Latency under open-loop arrivals: exact and probabilistic on Redis, one process and
``--workers 2``, beside the null server, swept over offered rates.

    python bench/open_loop.py                        # about 6 minutes
    python bench/open_loop.py --rates 1000,0.8x --seconds 5 --only "exact,exact x2"
    python bench/open_loop.py --tree /tmp/before     # also exact from another checkout

Calls arrive on their own schedule in production: a service that answers N calls a
second when a client keeps 128 in flight (closed loop) may still miss deadlines at a
fraction of N when the same calls come at a fixed rate. So, per target:

1. **Closed loop** (``h2load -c 8 -m 16``: 128 calls in flight, no deadline): the
   target's capacity, its req/s.
2. **Open loop** at each ``--rates`` value (``R`` req/s, or ``0.8x``: 0.8 times the
   target's own capacity from step 1), ``h2load -c 8 -m 256 --rps R/8``: 8
   connections, each sending at a fixed rate whatever the answers (256 streams per
   connection: the client never waits for an answer to send the next call). Every
   call carries Envoy's deadline (``grpc-timeout: 20m``), as the ratelimit filter
   sends it. Latency is per call from h2load's log: p50, p99, and the calls over
   20 ms (which Envoy would have given up on).

Targets: the null server (``bench/null_server.py --uvloop``: a grpc.aio servicer that
answers OK at once, the ceiling of a Python process), and services in exact and in
probabilistic mode on one ``redis-server`` (one rule, never reached), each as one
process and as ``--workers 2``. Each rate runs every target in turn, one target
further on per rate, so machine noise falls on all alike. After each run the
services' ``/metrics`` tell how many calls were answered without Redis's word:
refused as overload (``RESOURCE_EXHAUSTED``, or denied by a ``failure_mode: closed``
rule) and answered by ``failure_mode`` (Redis or the deadline failed them); h2load
counts gRPC errors as HTTP 200.

The service, h2load and redis-server share the machine's cores; with ``--pin`` the
targets run on CPU 0 and h2load, redis-server (before h2load: nice -10) and this
script on CPU 1 (only one-process targets then: two workers on one core say
nothing), as in production a service has its cores and its clients and Redis other
hosts.
Before each round, bench/cpu_steadiness.py probes every CPU for ``--steadiness``
seconds while the targets idle: the share of 50 ms windows in which a fixed piece of
work ran 1.3x slower or more than the machine's fast state. A virtual CPU's speed
can change from one moment to the next; the 0.7x and 0.8x rows are read beside it.
Results: ``--out``/open_loop.json, and a Markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import cpu_steadiness
import throughput as tp

from ratelimit_harness.fleet import wait_port
from ratelimit_harness.redis import free_port

CLOSED = "closed"
CLOSED_LOAD = ["-c", "8", "-m", "16", "-t", "1"]
MAX_FOREIGN = 0.1
"""CPUs other processes may use during a run before it is taken again (up to TRIES)."""
TRIES = 4
OVER_MS = 20.0
"""Envoy's ratelimit filter gives up after 20 ms by default."""
DEFAULT_RATES = "500,1000,1500,2000,2500,3000,0.8x"
TARGETS = (
    "null", "exact", "probabilistic", "exact x2", "probabilistic x2",
    "null native", "exact native", "probabilistic native", "exact native x2",
)  # fmt: skip
SERVER_CPUS: frozenset[int] | None = None
"""--pin: the targets' CPUs (h2load and Redis run on LOAD_CPUS)."""
LOAD_CPUS: frozenset[int] | None = None
REDIS_NICE = -10
STEADINESS: list[dict[str, Any]] = []
"""Per round, bench/cpu_steadiness.py's figures per CPU, taken before the round."""
GRPCIO = ("--grpc-engine", "grpcio")
"""The targets without "native" in their name: grpcio serves their whole port."""


@dataclass
class Point:
    target: str
    load: str
    """``closed``, or the offered rate (req/s)."""
    offered: float
    rps: float
    done: int
    started: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    over_20ms: int
    refused: int = 0
    """Calls refused as overload (RESOURCE_EXHAUSTED, or denied by a closed rule)."""
    by_failure_mode: int = 0
    """Calls answered by failure_mode: Redis failed them, or their deadline came first."""
    unseen: int = 0
    """Calls answered without reaching the service's handler: refused by gRPC itself
    (its bound on calls waiting to be started) or past their deadline while waiting."""
    foreign_cpu: float = 0.0
    """CPUs used meanwhile by processes other than the target, its Redis, h2load and this
    script: other jobs on the machine (a run that met more than MAX_FOREIGN is run again)."""
    late: int = 0
    """Of those, answered at once: too little time left to ask Redis (exact_late)."""
    round: int = 0
    server_cpu_us: float = 0.0
    redis_cpu_us: float = 0.0
    requests_per_call: float = 0.0
    problems: list[str] = field(default_factory=list)


def rate_load(rate: int) -> str:
    """An open-loop h2load load for ``rate`` req/s over 8 connections (registered in
    throughput.LOADS)."""
    name = f"{rate}/s"
    tp.LOADS[name] = ["-c", "8", "-m", "256", "-t", "1", "--rps", str(max(1, round(rate / 8)))]
    return name


def process_tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its children (a supervisor and its workers)."""
    total = tp.cpu_seconds(pid)
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return total
    return total + sum(process_tree_cpu(int(child)) for child in children)


def machine_busy() -> float:
    """CPU seconds the whole machine has spent busy (every core; /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    ticks = [int(value) for value in fields]
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu() -> float:
    """CPU seconds of this script and the children it waited for (h2load)."""
    mine = os.times()
    return mine.user + mine.system + mine.children_user + mine.children_system


def latencies_ms(log: Path) -> list[float]:
    return sorted(
        int(cols[2]) / 1000
        for cols in (line.split("\t") for line in log.read_text().splitlines())
        if len(cols) >= 3
    )


def measure(
    server: tp.Server, body: Path, load: str, offered: float, seconds: float,
    log: Path, redis_server: Any, deadline: str | None,
) -> Point:  # fmt: skip
    before = tp.scrape(server.admin_port) if server.admin_port else {}
    cpu0, redis0 = process_tree_cpu(server.pid), tp.RedisSample.take(redis_server)
    busy0, ours0, wall0 = machine_busy(), own_cpu(), time.monotonic()
    h2 = tp.run_h2load(server.port, body, load, seconds, log, LOAD_CPUS, deadline)
    busy1, ours1, wall1 = machine_busy(), own_cpu(), time.monotonic()
    cpu1, redis1 = process_tree_cpu(server.pid), tp.RedisSample.take(redis_server)
    values = latencies_ms(log)
    point = Point(
        server.name, CLOSED if load == "closed" else f"{offered:.0f}/s", offered, h2.rps,
        h2.done, h2.started, h2.p50_us / 1000, h2.p99_us / 1000, h2.max_us / 1000,
        sum(1 for v in values if v > OVER_MS),
    )  # fmt: skip
    done = max(1, h2.done)
    point.server_cpu_us = 1e6 * (cpu1 - cpu0) / done
    ours = (cpu1 - cpu0) + (redis1.cpu - redis0.cpu) + (ours1 - ours0)
    point.foreign_cpu = max(0.0, (busy1 - busy0) - ours) / (wall1 - wall0)
    if server.admin_port:
        point.redis_cpu_us = 1e6 * (redis1.cpu - redis0.cpu) / done
        after = tp.scrape(server.admin_port)

        def delta(metric: str, **labels: str) -> int:
            return round(tp.metric_sum(after, metric, **labels)
                         - tp.metric_sum(before, metric, **labels))  # fmt: skip

        point.unseen = max(
            0, h2.done - delta("ratelimit_server_should_rate_limit_total_requests_total")
        )
        point.refused = delta("ratelimit_service_call_should_rate_limit_store_overloaded_total")
        point.by_failure_mode = delta("ratelimit_service_call_should_rate_limit_store_error_total")
        point.late = delta("ratelimit_store", name="exact_late")
        calls = delta("ratelimit_store", name="exact_batches")
        if calls:
            batched = delta("ratelimit_store", name="exact_batched_requests")
            point.requests_per_call = batched / calls
        if delta("ratelimit_service_rate_limit_over_limit_total"):
            point.problems.append("OVER_LIMIT answers: the rule was reached")
    if h2.failed or h2.errored:
        point.problems.append(f"h2load: {h2.failed} failed, {h2.errored} errored")
    return point


def measure_alone(
    server: tp.Server, body: Path, load: str, offered: float, seconds: float,
    log: Path, redis_server: Any, deadline: str | None, progress: tp.Progress,
) -> Point:  # fmt: skip
    """:func:`measure`, again while other jobs took more than MAX_FOREIGN of the CPUs
    (at most TRIES times; the last is kept, its foreign_cpu says so)."""
    for attempt in range(1, TRIES + 1):
        point = measure(server, body, load, offered, seconds, log, redis_server, deadline)
        if point.foreign_cpu <= MAX_FOREIGN or attempt == TRIES:
            return point
        progress(f"    other jobs used {point.foreign_cpu:.2f} CPU meanwhile: again")
        time.sleep(2.0)
    raise AssertionError("unreachable")


def first_on_its_cpu(redis_server: Any, progress: tp.Progress) -> None:
    """--pin: Redis before h2load on the CPU they share (nice -10), as a Redis on a host
    of its own answers whatever the clients do; this script runs there too, so that the
    targets' CPU runs the targets alone."""
    os.sched_setaffinity(0, LOAD_CPUS or set())
    try:
        for thread in os.listdir(f"/proc/{redis_server.process.pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(thread), REDIS_NICE)
    except PermissionError:
        progress("    (not allowed to raise Redis's priority: it shares CPU 1 with h2load as is)")


def start_targets(
    args: argparse.Namespace, processes: tp.Processes, directory: Path, redis_url: str
) -> list[tp.Server]:
    config = directory / "config"
    config.mkdir()
    (config / "bench.yaml").write_text(tp.CONFIG)
    flags = {
        "exact": ["--mode", "exact", *GRPCIO],
        "probabilistic": ["--mode", "probabilistic", *GRPCIO],
        "exact x2": ["--mode", "exact", "--workers", "2", *GRPCIO],
        "probabilistic x2": ["--mode", "probabilistic", "--workers", "2", *GRPCIO],
        "exact native": ["--mode", "exact", "--grpc-engine", "native"],
        "probabilistic native": ["--mode", "probabilistic", "--grpc-engine", "native"],
        "exact native x2": ["--mode", "exact", "--grpc-engine", "native", "--workers", "2"],
    }
    servers: list[tp.Server] = []
    for name in args.only:
        if name in ("null", "null native"):
            port = free_port()
            native = ["--native"] if name == "null native" else []
            null = processes.start(
                name.replace(" ", "-"), [sys.executable, str(tp.BENCH / "null_server.py"),
                                         "--port", str(port), "--uvloop", *native], SERVER_CPUS,
            )  # fmt: skip
            wait_port(port)
            servers.append(tp.Server(name, port, None, null.pid))
        else:
            extra = [*flags[name], "--redis-url", redis_url, *args.service_flags]
            servers.append(tp.start_service(processes, name, config, extra, SERVER_CPUS))
    for tree in args.tree:
        tp.check_tree(tree)
        for name in args.tree_targets:
            extra = [*flags[name], "--redis-url", redis_url, *args.service_flags]
            label = f"{name} @{tree.name}"
            servers.append(
                tp.start_service(processes, label, config, extra, SERVER_CPUS, tree=tree)
            )
    return servers


def sweep(
    args: argparse.Namespace, servers: list[tp.Server], body: Path, log: Path,
    redis_server: Any, rates: list[str], round_: int, progress: tp.Progress,
) -> list[Point]:  # fmt: skip
    """One round: every target's capacity (closed loop), then each rate on every target
    in turn, one target further on per rate and round."""
    points: list[Point] = []
    if args.steadiness > 0:
        steady = cpu_steadiness.measure(args.steadiness)
        STEADINESS.append({"round": round_, "cpus": [asdict(s) for s in steady]})
        for line in map(cpu_steadiness.line, steady):
            progress(f"round {round_}, {line}")
    capacity: dict[str, float] = {}
    shift = round_ - 1
    for server in servers[shift % len(servers) :] + servers[: shift % len(servers)]:
        progress(f"round {round_}, {server.name}: closed loop, {args.seconds:g} s")
        point = measure_alone(
            server, body, CLOSED, 0, args.seconds, log, redis_server, None, progress
        )
        point.round = round_
        capacity[server.name] = point.rps
        points.append(point)
        progress(f"    {point.rps:,.0f} req/s, p99 {point.p99_ms:.2f} ms")
    for index, rate in enumerate(rates):
        at = (shift + index + 1) % len(servers)
        for server in servers[at:] + servers[:at]:
            offered = (
                float(rate[:-1]) * capacity[server.name] if rate.endswith("x") else float(rate)
            )
            load = rate_load(round(offered))
            progress(f"round {round_}, {server.name}: {rate} = {offered:,.0f} req/s")
            point = measure_alone(server, body, load, offered, args.seconds, log,
                                  redis_server, tp.ENVOY_DEADLINE, progress)  # fmt: skip
            point.load, point.round = rate if rate.endswith("x") else point.load, round_
            points.append(point)
            if args.keep_logs:  # each run's calls (start µs, status, latency µs), to read later
                name = f"{server.name}-{point.load}-round{round_}".replace(" ", "_")
                shutil.copy(log, log.with_name(name.replace("/", "per") + ".tsv"))
            progress(
                f"    {point.rps:,.0f} req/s, p50 {point.p50_ms:.2f} ms, p99 {point.p99_ms:.2f}"
                f" ms, over 20 ms {point.over_20ms}, refused {point.refused}, failure_mode"
                f" {point.by_failure_mode} (late {point.late}), not started {point.unseen},"
                f" other jobs {point.foreign_cpu:.2f} CPU"
            )
            time.sleep(0.5)  # a pause between runs
    return points


def summarize(points: list[Point]) -> list[dict[str, Any]]:
    """Per target and load: medians over the rounds, with the spread of p99 and of the
    share over 20 ms."""
    groups: dict[tuple[str, str], list[Point]] = {}
    for point in points:
        groups.setdefault((point.target, point.load), []).append(point)
    rows = []
    for (target, load), members in groups.items():

        def median(name: str, members: list[Point] = members) -> float:
            return float(statistics.median(getattr(m, name) for m in members))

        shares = [m.over_20ms / max(1, m.done) for m in members]
        rows.append({
            "target": target, "load": load, "rounds": len(members),
            "offered": median("offered"), "rps": median("rps"),
            "p50_ms": median("p50_ms"), "p99_ms": median("p99_ms"),
            "p99_min": min(m.p99_ms for m in members), "p99_max": max(m.p99_ms for m in members),
            "over_share": statistics.median(shares), "over_min": min(shares),
            "over_max": max(shares),
            "refused_share": statistics.median(m.refused / max(1, m.done) for m in members),
            "unseen_share": statistics.median(m.unseen / max(1, m.done) for m in members),
            "failure_mode_share": statistics.median(
                m.by_failure_mode / max(1, m.done) for m in members),
            "requests_per_call": median("requests_per_call"),
            "server_cpu_us": median("server_cpu_us"), "redis_cpu_us": median("redis_cpu_us"),
            "late_share": statistics.median(m.late / max(1, m.done) for m in members),
            "foreign_cpu_max": max(m.foreign_cpu for m in members),
        })  # fmt: skip
    rows.sort(key=lambda r: (r["target"], r["load"] != CLOSED, r["offered"]))
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| target | load | req/s | p50 ms | p99 ms (min-max) | over 20 ms (min-max) | "
        "by failure_mode | refused | not started | requests per call | service CPU µs/req | "
        "Redis CPU µs/req |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        load = r["load"] if not r["load"].endswith("x") else f"{r['load']} ({r['offered']:,.0f}/s)"
        lines.append(
            f"| {r['target']} | {load} | {r['rps']:,.0f} | {r['p50_ms']:.2f} | "
            f"{r['p99_ms']:.2f} ({r['p99_min']:.1f}-{r['p99_max']:.1f}) | "
            f"{r['over_share']:.2%} ({r['over_min']:.2%}-{r['over_max']:.2%}) | "
            f"{r['failure_mode_share']:.2%} | {r['refused_share']:.2%} | {r['unseen_share']:.2%} | "
            f"{r['requests_per_call']:.2f} | {r['server_cpu_us']:.0f} | {r['redis_cpu_us']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rates",
        default=DEFAULT_RATES,
        help="offered rates: req/s, or Nx for N times the target's capacity",
    )
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--descriptors", type=int, default=1)
    parser.add_argument(
        "--only", default=",".join(TARGETS), help=f"targets, from: {', '.join(TARGETS)}"
    )
    parser.add_argument("--service-flags", default="", help="more flags for every service")
    parser.add_argument(
        "--tree",
        type=Path,
        action="append",
        default=[],
        help="also serve --tree-targets from this checkout, side by side (repeatable)",
    )
    parser.add_argument("--tree-targets", default="exact,exact x2")
    parser.add_argument("--out", type=Path, default=tp.BENCH / "out")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument("--steadiness", type=float, default=2.0,
                        help="seconds of CPU probes before each round (0: none)")  # fmt: skip
    parser.add_argument("--pin", action="store_true",
                        help="targets on CPU 0; h2load and redis-server on CPU 1")  # fmt: skip
    args = parser.parse_args()  # fmt: skip
    args.only = [t.strip() for t in args.only.split(",") if t.strip()]
    args.tree_targets = [t.strip() for t in args.tree_targets.split(",") if t.strip()]
    args.service_flags = args.service_flags.split()
    unknown = [t for t in args.only + args.tree_targets if t not in TARGETS]
    if unknown:
        raise SystemExit(f"unknown target(s) {unknown}: choose from {', '.join(TARGETS)}")
    if args.pin and any(t.endswith("x2") for t in args.only + args.tree_targets * bool(args.tree)):
        raise SystemExit("--pin: one-process targets only (two workers on one CPU say nothing)")
    global SERVER_CPUS, LOAD_CPUS
    SERVER_CPUS, LOAD_CPUS = tp.pinning(args.pin)
    for tool in ("h2load", "redis-server"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed")
    progress = tp.Progress()
    info = tp.machine()
    progress(f"machine {info}")
    points: list[Point] = []
    with tp.lab(args.keep_logs) as (directory, processes, redis_servers):
        redis_server = tp.start_redis(directory, redis_servers, LOAD_CPUS)
        if args.pin:
            first_on_its_cpu(redis_server, progress)
        servers = start_targets(args, processes, directory, redis_server.url)
        body = directory / "body"
        body.write_bytes(tp.framed("bench", [f"k=v{i}" for i in range(1, args.descriptors + 1)]))
        log = directory / "h2load.tsv"
        tp.LOADS[CLOSED] = CLOSED_LOAD
        progress("warming up (1 s each, not measured)")
        for server in servers:
            tp.run_h2load(server.port, body, CLOSED, 1, log, LOAD_CPUS)
        rates = [r.strip() for r in args.rates.split(",") if r.strip()]
        for round_ in range(1, args.rounds + 1):
            points += sweep(args, servers, body, log, redis_server, rates, round_, progress)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "open_loop.json"
    out.write_text(json.dumps(
        {"machine": info, "argv": sys.argv[1:], "loadavg_after": os.getloadavg(),
         "summary": summarize(points), "steadiness": STEADINESS,
         "points": [asdict(p) for p in points]},
        indent=1) + "\n")  # fmt: skip
    progress(f"done; wrote {out}")
    print()
    print(markdown(summarize(points)))
    for entry in STEADINESS:
        shares = " / ".join(f"{cpu['slowed_share']:.0%}" for cpu in entry["cpus"])
        print(f"\nround {entry['round']}: windows slowed 1.3x or more per CPU {shares}", end="")
    print()
    problems = [f"{p.target} {p.load}: {q}" for p in points for q in p.problems]
    if problems:
        print(f"\n{len(problems)} problem(s): {problems[:5]}")


if __name__ == "__main__":
    main()
