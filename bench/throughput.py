"""Throughput and latency of the service beside a null gRPC server, measured with h2load.

    python bench/throughput.py                      # suite "throughput", about 4 minutes
    python bench/throughput.py --suite redis-delay  # exact vs probabilistic behind a slow Redis
    python bench/throughput.py --quick              # one round of short runs, to try it out
    python bench/throughput.py --pin                # servers on CPU 0, h2load and Redis on CPU 1
    python bench/throughput.py --tree ../other      # also serve another checkout, side by side

Suite "throughput": starts the null server (bench/null_server.py, the ceiling) and one
fresh service per target -- embedded probabilistic, embedded exact, Redis probabilistic,
Redis exact -- on a config whose limits are never reached, so every answer is OK and
each target takes the same path every time. Each round runs every target in turn
(rotation, so machine noise falls on all of them alike), with 1 and with 5
descriptors per request, under two loads:

- saturate: ``h2load -c 8 -m 8 -t 1`` (64 requests in flight): throughput. Latency
  here is mostly queueing (in flight / throughput).
- one-by-one: ``h2load -c 1 -m 1 -t 1``: one request at a time, latency without
  queueing.

Suite "redis-delay": one redis-server, bench/redis_delay_proxy.py in front of it
with each --delays value (ms; plus the direct connection), and per path two
services, exact and probabilistic, each driven at a fixed 1,000 requests/s
(``h2load -c 4 -m 8 --rps 250``), every call with Envoy's 20 ms deadline. It also
times the first command on a new connection of the service's own Redis client on
each path, and counts the connections Redis accepts during each run.

With --pin (throughput suite, 2 CPUs or more) every server under test, the null
server included, runs on CPU 0 and h2load and redis-server on CPU 1: each server has a
core to itself, as where Redis runs on other machines, instead of sharing both cores
with the load generator and Redis. Its results go to throughput_pinned.json.

Percentiles come from h2load's --log-file (per-request latency). After every run the
service's /metrics must have counted between h2load's "done" and "started" requests,
no invalid request and no OVER_LIMIT (gRPC errors reach h2load as HTTP 200). Results go
to --out (JSON) and a Markdown summary is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import redis
from redis_delay_proxy import ping_rtts

from ratelimit_harness.fleet import wait_healthy, wait_port
from ratelimit_harness.redis import RedisServer, free_port
from ratelimit_service.cli.client import build_request
from ratelimit_service.storage.redis_connect import connect

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
ROUTE = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"
LOADS: dict[str, list[str]] = {
    "saturate": ["-c", "8", "-m", "8", "-t", "1"],
    "one-by-one": ["-c", "1", "-m", "1", "-t", "1"],
    "1000/s": ["-c", "4", "-m", "8", "-t", "1", "--rps", "250"],
}
DELAY_MODES: list[tuple[str, str, list[str]]] = [
    ("exact", "exact", []),
    ("probabilistic", "probabilistic", []),
]
"""redis-delay suite: (--mode, label, extra flags) of the services on each path."""
ENVOY_DEADLINE = "20m"
"""The redis-delay suite's calls carry Envoy's default deadline (the ratelimit filter's
20 ms timeout), as gRPC's grpc-timeout header: exact decisions wait for Redis until
2 ms before it."""
HUGE_LIMIT = 1_000_000_000
GRPCIO = ("--grpc-engine", "grpcio")
"""The services measured against the grpcio null server are served by grpcio too."""
CONFIG = f"""domain: bench
descriptors:
  - key: k
    rate_limit: {{unit: second, requests_per_unit: {HUGE_LIMIT}}}
"""


class Progress:
    """Prints what is running, with the time elapsed since the script started."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:6.1f}s] {message}", flush=True)


class Processes:
    """Every process the benchmark starts; all are stopped on exit, errors included."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        name: str,
        command: Sequence[str],
        cpus: frozenset[int] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        """``cwd``: run there (with ``-m``, Python imports that directory's package)."""
        log = open(self.logs / f"{name}.log", "wb")  # noqa: SIM115 (kept open by the child)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PYTHONSAFEPATH", None)  # it would keep the working directory off sys.path
        process = subprocess.Popen(
            list(command), stdout=log, stderr=subprocess.STDOUT,
            env=env, preexec_fn=on_cpus(cpus), cwd=cwd,
        )  # fmt: skip
        log.close()
        self.running.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.running:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.running:
            try:
                process.wait(timeout=8)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.running = []


@contextlib.contextmanager
def lab(keep_logs: bool = False) -> Iterator[tuple[Path, Processes, list[RedisServer]]]:
    """A temporary directory, the processes started in it, the Redis servers started in it;
    SIGTERM becomes SystemExit so that everything is cleaned up on it too."""
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    directory = Path(tempfile.mkdtemp(prefix="rl-bench-"))
    processes = Processes(directory)
    redis_servers: list[RedisServer] = []
    try:
        yield directory, processes, redis_servers
    finally:
        processes.stop_all()
        for redis in redis_servers:
            redis.stop()
        signal.signal(signal.SIGTERM, previous)
        if keep_logs:
            print(f"logs kept in {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)


def on_cpus(cpus: frozenset[int] | None) -> Callable[[], None] | None:
    """For preexec_fn: the child (and every thread it starts) runs only on ``cpus``."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def start_redis(
    directory: Path, redis_servers: list[RedisServer], cpus: frozenset[int] | None = None
) -> RedisServer:
    redis = RedisServer(directory)
    redis_servers.append(redis)
    redis.start()
    if cpus is not None and redis.process is not None:
        for thread in os.listdir(f"/proc/{redis.process.pid}/task"):
            os.sched_setaffinity(int(thread), cpus)
    return redis


@dataclass
class Server:
    name: str
    port: int
    admin_port: int | None
    pid: int


def start_service(
    processes: Processes,
    name: str,
    config: Path,
    extra: Sequence[str] = (),
    cpus: frozenset[int] | None = None,
    tree: Path | None = None,
) -> Server:
    """``tree``: serve the package of that checkout instead of this one (one from before
    --grpc-engine serves everything with grpcio: the flag is left out for it)."""
    grpc_port, admin_port = free_port(), free_port()
    if tree is not None and not _knows_engines(tree):
        extra = _without_engine(extra)
    process = processes.start(
        name.replace(" ", "-").replace("/", "-").replace("@", "at-"),
        [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(config),
         "--grpc-addr", f"127.0.0.1:{grpc_port}", "--admin-addr", f"127.0.0.1:{admin_port}",
         *extra],
        cpus,
        cwd=tree if tree is not None else REPO,
    )  # fmt: skip
    wait_healthy(admin_port)
    return Server(name, grpc_port, admin_port, process.pid)


def _knows_engines(tree: Path) -> bool:
    table = tree / "ratelimit_service" / "core" / "settings_table.py"
    return table.exists() and '"--grpc-engine"' in table.read_text()


def _without_engine(flags: Sequence[str]) -> list[str]:
    out, skip = [], False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--grpc-engine":
            skip = True
        else:
            out.append(flag)
    return out


TREE_TARGETS = ("embedded probabilistic", "redis exact")
"""The targets --tree adds for the other checkout (one per mode, to keep the run short)."""


def check_tree(tree: Path) -> None:
    """Refuse a directory whose own package would not be the one served."""
    found = subprocess.run(
        [sys.executable, "-c", "import ratelimit_service; print(ratelimit_service.__file__)"],
        cwd=tree, capture_output=True, text=True, env={k: v for k, v in os.environ.items()
                                                       if k != "PYTHONSAFEPATH"},
    ).stdout.strip()  # fmt: skip
    if not found.startswith(str(tree.resolve())):
        raise SystemExit(f"--tree {tree}: python there imports {found or 'nothing'}")


def pinning(pin: bool) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """(CPUs of the servers under test, CPUs of h2load and Redis): CPU 0 and CPU 1 with
    --pin, anywhere without."""
    if not pin:
        return None, None
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("--pin needs two CPUs")
    return frozenset({0}), frozenset({1})


def start_null(processes: Processes, cpus: frozenset[int] | None = None) -> Server:
    port = free_port()
    process = processes.start(
        "null", [sys.executable, str(BENCH / "null_server.py"), "--port", str(port)], cpus
    )
    wait_port(port)
    return Server("null server", port, None, process.pid)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^}]*\})?) (\S+)$")


def scrape(admin_port: int) -> dict[str, float]:
    """The service's /metrics as {'name{labels}': value}."""
    url = f"http://127.0.0.1:{admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            samples[match.group(1)] = float(match.group(2))
    return samples


def metric_sum(samples: dict[str, float], metric: str, **labels: str) -> float:
    """Sum of the samples of ``metric`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == metric and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100 * len(sorted_values) + 0.5)))
    return sorted_values[rank - 1]


@dataclass
class H2load:
    rps: float
    done: int
    started: int
    succeeded: int
    failed: int
    errored: int
    p50_us: float
    p99_us: float
    mean_us: float
    max_us: float
    command: str


def run_h2load(
    port: int,
    body: Path,
    load: str,
    seconds: float,
    log: Path,
    cpus: frozenset[int] | None = None,
    deadline: str | None = None,
) -> H2load:
    """``deadline``: a grpc-timeout value (``20m``) every call carries, as Envoy's do."""
    log.unlink(missing_ok=True)  # h2load appends to its log file
    command = [
        "h2load", *LOADS[load], "-D", f"{seconds:g}", "--log-file", str(log),
        "-H", "content-type: application/grpc", "-H", "te: trailers",
        *(["-H", f"grpc-timeout: {deadline}"] if deadline else []),
        "-d", str(body), f"http://127.0.0.1:{port}{ROUTE}",
    ]  # fmt: skip
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=seconds + 60, preexec_fn=on_cpus(cpus)
    )
    out = result.stdout
    finished = re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", out)
    counts = re.search(
        r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
        r"(\d+) failed, (\d+) errored",
        out,
    )
    if result.returncode != 0 or finished is None or counts is None:
        raise RuntimeError(f"h2load failed ({result.returncode}):\n{out}\n{result.stderr}")
    latencies = sorted(
        int(cols[2])
        for cols in (line.split("\t") for line in log.read_text().splitlines())
        if len(cols) >= 3
    )
    return H2load(
        rps=float(finished.group(1)),
        started=int(counts.group(2)),
        done=int(counts.group(3)),
        succeeded=int(counts.group(4)),
        failed=int(counts.group(5)),
        errored=int(counts.group(6)),
        p50_us=percentile(latencies, 50),
        p99_us=percentile(latencies, 99),
        mean_us=statistics.fmean(latencies) if latencies else float("nan"),
        max_us=float(latencies[-1]) if latencies else float("nan"),
        command=" ".join(command[:-1]).replace(str(body), body.name).replace(str(log), "LOG")
        + f" http://127.0.0.1:PORT{ROUTE}",
    )


@dataclass
class Run:
    suite: str
    target: str
    descriptors: int
    load: str
    round: int
    h2: H2load
    served: int | None = None
    """Requests the service counted during the run (None for the null server)."""
    invalid: int = 0
    over_limit: int = 0
    store_timeouts: int = 0
    failure_mode_answers: int = 0
    new_redis_connections: int = 0
    """Connections Redis accepted during the run (its own counter; includes ours, one)."""
    server_cpu_s: float = 0.0
    """CPU seconds (user + system, all threads) the server under test used in the run."""
    redis_cpu_s: float = 0.0
    script_calls: int = 0
    """EVALSHA calls Redis ran during the run (all clients), and their total time."""
    script_usec: int = 0
    problems: list[str] = field(default_factory=list)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process has used (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class RedisSample:
    connections: int = 0
    script_calls: int = 0
    script_usec: int = 0
    cpu: float = 0.0

    @staticmethod
    def take(server: RedisServer | None) -> RedisSample:
        if server is None or server.process is None:
            return RedisSample()
        client = redis.Redis(port=server.port)
        try:
            stats = client.info("stats")
            script = client.info("commandstats").get("cmdstat_evalsha", {})
        finally:
            client.close()
        return RedisSample(
            connections=int(stats["total_connections_received"]),
            script_calls=int(script.get("calls", 0)),
            script_usec=int(script.get("usec", 0)),
            cpu=cpu_seconds(server.process.pid),
        )


def measure(
    suite: str, server: Server, descriptors: int, load: str, round_: int,
    body: Path, seconds: float, log: Path, redis_server: RedisServer | None = None,
    cpus: frozenset[int] | None = None, deadline: str | None = None,
) -> Run:  # fmt: skip
    before = scrape(server.admin_port) if server.admin_port else {}
    redis_before, cpu_before = RedisSample.take(redis_server), cpu_seconds(server.pid)
    h2 = run_h2load(server.port, body, load, seconds, log, cpus, deadline)
    cpu_after, redis_after = cpu_seconds(server.pid), RedisSample.take(redis_server)
    run = Run(suite, server.name, descriptors, load, round_, h2)
    run.new_redis_connections = redis_after.connections - redis_before.connections
    run.server_cpu_s = cpu_after - cpu_before
    run.redis_cpu_s = redis_after.cpu - redis_before.cpu
    run.script_calls = redis_after.script_calls - redis_before.script_calls
    run.script_usec = redis_after.script_usec - redis_before.script_usec
    if h2.failed or h2.errored or h2.succeeded != h2.done:
        run.problems.append(f"h2load: {h2.failed} failed, {h2.errored} errored")
    if server.admin_port is None:
        return run
    after = scrape(server.admin_port)

    def delta(metric: str, **labels: str) -> int:
        return round(metric_sum(after, metric, **labels) - metric_sum(before, metric, **labels))

    run.served = delta("ratelimit_server_should_rate_limit_total_requests_total")
    run.invalid = delta("ratelimit_service_call_should_rate_limit_service_error_total")
    run.over_limit = delta("ratelimit_service_rate_limit_over_limit_total")
    run.store_timeouts = delta("ratelimit_store", name="timeouts")
    run.failure_mode_answers = delta("ratelimit_service_call_should_rate_limit_store_error_total")
    if not h2.done <= run.served <= h2.started:
        run.problems.append(f"served {run.served} outside [done {h2.done}, started {h2.started}]")
    if run.invalid or run.over_limit:
        run.problems.append(f"{run.invalid} invalid, {run.over_limit} over limit")
    return run


def framed(domain: str, descriptors: list[str], hits_addend: int = 0) -> bytes:
    """A ShouldRateLimit request in gRPC's length-prefixed framing, for ``h2load -d``."""
    message = build_request(domain, descriptors, hits_addend).SerializeToString()
    return struct.pack(">BI", 0, len(message)) + message


def write_bodies(directory: Path, counts: Sequence[int]) -> dict[int, Path]:
    bodies: dict[int, Path] = {}
    for count in counts:
        path = directory / f"body-{count}.bin"
        path.write_bytes(framed("bench", [f"k=v{i}" for i in range(1, count + 1)]))
        bodies[count] = path
    return bodies


def warm_up(
    servers: Sequence[Server],
    bodies: dict[int, Path],
    log: Path,
    cpus: frozenset[int] | None = None,
) -> None:
    for server in servers:
        for body in bodies.values():
            run_h2load(server.port, body, "saturate", 1, log, cpus)


# -- suite: throughput -------------------------------------------------------------------


def suite_throughput(args: argparse.Namespace, progress: Progress) -> list[Run]:
    runs: list[Run] = []
    with lab(args.keep_logs) as (directory, processes, redis_servers):
        config = directory / "bench.yaml"
        config.write_text(CONFIG)
        bodies = write_bodies(directory, [1, 5])
        log = directory / "h2load.tsv"
        # --pin: the servers under test on CPU 0; h2load and Redis on CPU 1.
        mine, tools = pinning(args.pin)
        progress("starting redis-server, the null server and 4 services")
        server_redis = start_redis(directory, redis_servers, tools)
        url = server_redis.url
        targets = [
            ("embedded probabilistic", ["--mode", "probabilistic", *GRPCIO]),
            ("embedded exact", ["--mode", "exact", *GRPCIO]),
            ("redis probabilistic", ["--mode", "probabilistic", "--redis-url", url, *GRPCIO]),
            ("redis exact", ["--mode", "exact", "--redis-url", url, *GRPCIO]),
        ]
        servers = [start_null(processes, mine)]
        servers += [start_service(processes, n, config, x, mine) for n, x in targets]
        if args.tree is not None:  # the same targets from another checkout, side by side
            check_tree(args.tree)
            servers += [
                start_service(processes, f"{n} @{args.tree.name}", config, x, mine, args.tree)
                for n, x in targets
                if n in TREE_TARGETS
            ]
        progress("warming up (1 s per target and body, not measured)")
        warm_up(servers, bodies, log, tools)
        loads = ["saturate", "one-by-one"]
        total = args.rounds * len(bodies) * len(servers) * len(loads)
        for round_ in range(1, args.rounds + 1):
            # Each round starts one target further on, so no target always runs
            # right after the same one (or first, when the machine is coldest).
            shift = (round_ - 1) % len(servers)
            for count, body in bodies.items():
                for server in servers[shift:] + servers[:shift]:
                    for load in loads:
                        seconds = args.seconds if load == "saturate" else args.latency_seconds
                        progress(f"run {len(runs) + 1}/{total}: round {round_}, {server.name}, "
                                 f"{count} descriptor(s), {load}, {seconds:g} s")  # fmt: skip
                        run = measure("throughput", server, count, load, round_, body,
                                      seconds, log, server_redis, tools)  # fmt: skip
                        runs.append(run)
                        report(progress, run)
    return runs


# -- suite: redis-delay ------------------------------------------------------------------


async def fresh_connection_ms(port: int, tries: int = 5) -> tuple[float, float]:
    """Medians of the first PING on a new client (connection set-up included) and of a
    second PING on the same connection, with the client the service builds."""
    first: list[float] = []
    warm: list[float] = []
    for _ in range(tries):
        client, _ = connect(f"redis://127.0.0.1:{port}/0", socket_timeout=2.0,
                            connect_timeout=2.0, max_connections=1)  # fmt: skip
        try:
            for samples in (first, warm):
                started = time.perf_counter()
                await client.ping()
                samples.append((time.perf_counter() - started) * 1000)
        finally:
            await client.aclose()
    return statistics.median(first), statistics.median(warm)


def suite_redis_delay(
    args: argparse.Namespace, progress: Progress
) -> tuple[list[Run], dict[str, dict[str, float]]]:
    runs: list[Run] = []
    rtts: dict[str, dict[str, float]] = {}
    with lab(args.keep_logs) as (directory, processes, redis_servers):
        config = directory / "bench.yaml"
        config.write_text(CONFIG)
        bodies = write_bodies(directory, [1])
        log = directory / "h2load.tsv"
        server_redis = start_redis(directory, redis_servers)
        paths: list[tuple[str, int]] = [("direct", server_redis.port)]
        for delay in args.delays:
            port = free_port()
            processes.start(f"proxy-{delay:g}ms", [
                sys.executable, str(BENCH / "redis_delay_proxy.py"), "--listen-port", str(port),
                "--upstream-port", str(server_redis.port), "--delay-ms", f"{delay:g}"])  # fmt: skip
            wait_port(port)
            paths.append((f"+{delay:g} ms", port))
        progress("PING round trips through each path (300 sequential PINGs)")
        for name, port in paths:
            values = sorted(ping_rtts(port))
            rtts[name] = {"p50_ms": percentile(values, 50) * 1000,
                          "p99_ms": percentile(values, 99) * 1000}  # fmt: skip
            progress(f"  {name}: p50 {rtts[name]['p50_ms']:.3f} ms, "
                     f"p99 {rtts[name]['p99_ms']:.3f} ms")  # fmt: skip
        progress("first command on a fresh connection, with the service's own Redis client")
        for name, port in paths:
            first, warm = asyncio.run(fresh_connection_ms(port))
            rtts[name].update(first_command_ms=first, warm_command_ms=warm)
            progress(f"  {name}: first PING {first:.2f} ms, then {warm:.2f} ms")
        progress(f"starting {len(DELAY_MODES) * len(paths)} services "
                 f"({', '.join(label for _, label, _ in DELAY_MODES)} per path)")  # fmt: skip
        servers: list[Server] = []
        for name, port in paths:
            url = f"redis://127.0.0.1:{port}/0"
            for mode, label, extra in DELAY_MODES:
                flags = ["--mode", mode, "--redis-url", url, *GRPCIO, *extra]
                servers.append(start_service(processes, f"{label} {name}", config, flags))
        progress("warming up (1 s per service, not measured)")
        warm_up(servers, bodies, log)
        total = args.rounds * len(servers)
        for round_ in range(1, args.rounds + 1):
            for server in servers:
                progress(f"run {len(runs) + 1}/{total}: round {round_}, {server.name}, "
                         f"1000 req/s, {args.latency_seconds:g} s")  # fmt: skip
                run = measure("redis-delay", server, 1, "1000/s", round_, bodies[1],
                              args.latency_seconds, log, server_redis,
                              deadline=ENVOY_DEADLINE)  # fmt: skip
                runs.append(run)
                report(progress, run)
    return runs, rtts


# -- summaries ---------------------------------------------------------------------------


def report(progress: Progress, run: Run) -> None:
    h2 = run.h2
    line = (f"    {h2.rps:8.0f} req/s  p50 {h2.p50_us / 1000:6.2f} ms  "
            f"p99 {h2.p99_us / 1000:6.2f} ms")  # fmt: skip
    if run.served is not None:
        line += f"  served {run.served} (h2load done {h2.done})"
    if run.store_timeouts or run.failure_mode_answers:
        line += (f"  redis timeouts {run.store_timeouts}, "
                 f"failure-mode answers {run.failure_mode_answers}")  # fmt: skip
    for problem in run.problems:
        line += f"  PROBLEM: {problem}"
    progress(line)


def summarize(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per (target, descriptors, load): medians over rounds, spread, ratio to the null
    server of the same round (median of the per-round ratios)."""
    groups: dict[tuple[str, int, str], list[Run]] = {}
    for run in runs:
        groups.setdefault((run.target, run.descriptors, run.load), []).append(run)
    null = {(r.descriptors, r.load, r.round): r.h2.rps for r in runs if r.target == "null server"}
    rows = []
    for (target, descriptors, load), members in groups.items():
        rps = [m.h2.rps for m in members]
        ratios = [m.h2.rps / null[(descriptors, load, m.round)] for m in members
                  if (descriptors, load, m.round) in null]  # fmt: skip
        rows.append({
            "target": target, "descriptors": descriptors, "load": load,
            "rounds": len(members),
            "rps": statistics.median(rps), "rps_min": min(rps), "rps_max": max(rps),
            "ratio": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
            "p50_ms": statistics.median(m.h2.p50_us for m in members) / 1000,
            "p99_ms": statistics.median(m.h2.p99_us for m in members) / 1000,
            "p99_ms_max": max(m.h2.p99_us for m in members) / 1000,
            "mean_ms": statistics.median(m.h2.mean_us for m in members) / 1000,
            "store_timeouts": sum(m.store_timeouts for m in members),
            "failure_mode_answers": sum(m.failure_mode_answers for m in members),
            "served": sum(m.served or 0 for m in members),
            "new_redis_connections": sum(m.new_redis_connections for m in members),
            "server_cpu_us_per_request": statistics.median(
                1e6 * m.server_cpu_s / max(1, m.h2.done) for m in members),
            "redis_cpu_us_per_request": statistics.median(
                1e6 * m.redis_cpu_s / max(1, m.h2.done) for m in members),
            "redis_us_per_script_call": statistics.median(
                m.script_usec / m.script_calls if m.script_calls else 0.0 for m in members),
            "problems": [p for m in members for p in m.problems],
            "command": members[0].h2.command,
        })  # fmt: skip
    return rows


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| target | descriptors | load | req/s (median, min-max) | ratio to null | "
        "p50 ms | p99 ms | server CPU µs/req | Redis CPU µs/req | Redis timeouts | "
        "answered by failure_mode |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratio = "" if row["ratio"] is None else (
            f"{row['ratio']:.2f} ({row['ratio_min']:.2f}-{row['ratio_max']:.2f})")  # fmt: skip
        lines.append(
            f"| {row['target']} | {row['descriptors']} | {row['load']} | "
            f"{row['rps']:,.0f} ({row['rps_min']:,.0f}-{row['rps_max']:,.0f}) | {ratio} | "
            f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['server_cpu_us_per_request']:.0f} | "
            f"{row['redis_cpu_us_per_request']:.0f} | {row['store_timeouts']} | "
            f"{row['failure_mode_answers'] / row['served'] if row['served'] else 0:.1%} |"
        )
    return "\n".join(lines)


def markdown_delay(rows: Sequence[dict[str, Any]], rtts: dict[str, dict[str, float]]) -> str:
    lines = [
        "| Redis path | PING RTT p50 ms | first command on a new connection ms | service | "
        "p50 ms | p99 ms | answered by failure_mode | Redis timeouts | new Redis connections |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        label, _, path = row["target"].rpartition(" ")
        path = path if path == "direct" else label.rsplit(" ", 1)[-1] + " " + path
        label = row["target"][: -len(path)].strip()
        share = row["failure_mode_answers"] / row["served"] if row["served"] else 0.0
        lines.append(
            f"| {path} | {rtts[path]['p50_ms']:.2f} | "
            f"{rtts[path].get('first_command_ms', float('nan')):.2f} | {label} | "
            f"{row['p50_ms']:.2f} | "
            f"{row['p99_ms']:.2f} | {share:.1%} | {row['store_timeouts']} | "
            f"{row['new_redis_connections']} |"
        )
    return "\n".join(lines)


def machine() -> dict[str, str]:
    h2load_version = subprocess.run(["h2load", "--version"], capture_output=True, text=True)
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True)
    return {
        "date": datetime.date.today().isoformat(),
        "cpus": str(os.cpu_count()),
        "python": platform.python_version(),
        "h2load": h2load_version.stdout.strip(),
        "redis": redis_version.stdout.split(" sha=")[0].strip(),
        "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "commit": commit(),
    }


def commit() -> str:
    """The commit the services ran, with "+changes" when the working tree differs."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=BENCH, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("+changes" if git("status", "--porcelain", "--", "../ratelimit_service") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["throughput", "redis-delay"], default="throughput")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0, help="length of a saturate run")
    parser.add_argument("--latency-seconds", type=float, default=3.0,
                        help="length of a one-by-one or fixed-rate run")  # fmt: skip
    parser.add_argument("--delays", default="0,1,5,15",
                        help="redis-delay suite: proxy delays in ms")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="1 round, 2 s runs")
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--pin", action="store_true", help="servers on CPU 0, h2load and redis-server on CPU 1"
    )
    parser.add_argument(
        "--tree", type=Path, default=None,
        help="also serve embedded probabilistic and redis exact from this checkout (e.g. a"
        " `git worktree` of another revision), side by side in the same rounds",
    )  # fmt: skip
    args = parser.parse_args()
    args.delays = [float(x) for x in args.delays.split(",") if x]
    if args.quick:
        args.rounds, args.seconds, args.latency_seconds = 1, 2.0, 2.0
    if args.pin and (args.suite != "throughput" or len(os.sched_getaffinity(0)) < 2):
        raise SystemExit("--pin needs the throughput suite and two CPUs")
    for tool in ("h2load", "redis-server"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed")
    progress = Progress()
    info = machine()
    progress(f"suite {args.suite}: {args.rounds} round(s); machine {info}")
    extra: dict[str, Any] = {}
    if args.suite == "throughput":
        runs = suite_throughput(args, progress)
    else:
        runs, rtts = suite_redis_delay(args, progress)
        extra["ping_rtt"] = rtts
    rows = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / f"{args.suite.replace('-', '_')}{'_pinned' if args.pin else ''}.json"
    out.write_text(json.dumps({
        "machine": info, "argv": sys.argv[1:], "summary": rows,
        "runs": [asdict(run) for run in runs], **extra,
    }, indent=1) + "\n")  # fmt: skip
    progress(f"done; wrote {out}")
    print()
    print(markdown(rows) if args.suite == "throughput" else markdown_delay(rows, extra["ping_rtt"]))
    problems = [p for row in rows for p in row["problems"]]
    if problems:
        print(f"\n{len(problems)} run(s) with problems: {problems[:5]}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
