"""What --tracing costs: the service with tracing off, at 1 % and at 100 % sampling,
side by side in one run, straight at its gRPC port (h2load, as bench/throughput.py).

    python bench/tracing_cost.py               # 2 rounds, about 2 minutes
    python bench/tracing_cost.py --quick       # 1 round of short runs, to try it out
    python bench/tracing_cost.py --micro       # a decision's span alone, in a loop: µs per call

Two set-ups, each served three times (off, ``--tracing-sampling-rate 0.01``, 1.0), all
six at once, exporting over OTLP/gRPC to a receiver in this process (which keeps every
span: its CPU is not the service's): embedded probabilistic (a decision is one span)
and Redis exact (a decision and its Redis call: two spans). Each round runs every
target in turn (rotation: machine noise falls on all alike) under two loads, saturate
(``h2load -c 8 -m 8``: throughput, CPU per request) and one-by-one (``-c 1 -m 1``:
latency without queueing). The calls carry no trace context, so each is a root span
sampled by its own random trace id. The service's CPU (every thread: the exporter's
too) per request is read from /proc. After every run the spans received must match
the rate: once the services have stopped (stopping sends the spans still queued), the
share of each service's calls that reached the receiver as spans is printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import throughput as tp

from ratelimit_harness.otlp import GrpcReceiver
from ratelimit_service.engine.tracing import RLS_SPAN, Tracing

RATES = {"off": None, "1 %": "0.01", "100 %": "1.0"}
SETUPS = {  # grpcio serves them, as when these figures were taken
    "embedded probabilistic": [*tp.GRPCIO],
    "redis exact": ["--mode", "exact", *tp.GRPCIO],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--quick", action="store_true", help="1 round of 2 s runs")
    parser.add_argument("--micro", action="store_true", help="the span alone, per rate")
    args = parser.parse_args()
    if args.micro:
        micro()
        return
    if args.quick:
        args.rounds, args.seconds = 1, 2.0
    progress = tp.Progress()
    receiver = GrpcReceiver().start()
    results: dict[tuple[str, str, str], list[tp.Run]] = {}
    try:
        with tp.lab() as (directory, processes, redis_servers):
            redis_server = tp.start_redis(directory, redis_servers)
            config = directory / "config"
            config.mkdir()
            (config / "bench.yaml").write_text(tp.CONFIG)
            body = tp.write_bodies(directory, [1])[1]
            servers = {}
            for setup, flags in SETUPS.items():
                store = ["--redis-url", redis_server.url] if setup.startswith("redis") else []
                for rate, value in RATES.items():
                    name = f"{setup}, tracing {rate}"
                    tracing = [] if value is None else [
                        "--tracing", "--tracing-protocol", "grpc", "--tracing-service-name", name,
                        "--tracing-endpoint", receiver.endpoint, "--tracing-sampling-rate", value,
                    ]  # fmt: skip
                    servers[(setup, rate)] = tp.start_service(
                        processes, name, config, [*flags, *store, *tracing]
                    )
            tp.warm_up(list(servers.values()), {1: body}, directory / "warm.log")
            for round_ in range(args.rounds):
                for load in ("saturate", "one-by-one"):
                    for (setup, rate), server in servers.items():
                        progress(f"round {round_ + 1}, {load}, {server.name}")
                        run = tp.measure(
                            "tracing", server, 1, load, round_, body, args.seconds,
                            directory / "h2load.log", redis_server,
                        )  # fmt: skip
                        results.setdefault((setup, rate, load), []).append(run)
            calls = {
                server.name: tp.metric_sum(tp.scrape(server.admin_port or 0), CALLS)
                for server in servers.values()
            }
            progress("stopping the services (each sends the spans it still holds)")
    finally:
        receiver.stop()  # after the lab: the services have stopped, their spans are in
    traced = Counter(span.service for span in receiver.spans() if span.name == RLS_SPAN)
    print(table(results, {name: traced[name] / calls[name] for name in calls}))
    problems = [p for runs in results.values() for run in runs for p in run.problems]
    if problems:
        sys.exit("\n".join(problems))


CALLS = "ratelimit_server_should_rate_limit_total_requests_total"


def micro(calls: int = 50_000) -> None:
    """What Tracing.decision costs a call with no trace context, per rate (the span
    entered, two attributes set when it records, ended), exporting to a receiver."""
    receiver = GrpcReceiver().start()
    try:
        for rate in (0.0, 0.01, 1.0):
            tracing = Tracing(protocol="grpc", endpoint=receiver.endpoint, sampling_rate=rate)
            metadata = (("user-agent", "grpc-c"),)
            started = time.perf_counter()
            for _ in range(calls):
                span = tracing.decision(metadata)
                if span is not None:
                    with span as current:
                        current.set_attributes({"ratelimit.overall_code": "OK", "n": 1})
            elapsed = time.perf_counter() - started
            tracing.shutdown()
            print(f"rate {rate:g}: {elapsed / calls * 1e6:.1f} µs per call", flush=True)
    finally:
        receiver.stop()


def table(results: dict[tuple[str, str, str], list[tp.Run]], traced: dict[str, float]) -> str:
    """Medians over the rounds, each against tracing off in the same set-up and load;
    ``traced``: the share of each service's calls whose span reached the receiver."""
    lines = [
        "| set-up | load | tracing | req/s | p50 µs | p99 µs | service CPU µs/req | vs off |"
        " calls traced |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (setup, rate, load), runs in results.items():
        rps = statistics.median(run.h2.rps for run in runs)
        p50 = statistics.median(run.h2.p50_us for run in runs)
        p99 = statistics.median(run.h2.p99_us for run in runs)
        cpu = statistics.median(run.server_cpu_s / max(1, run.h2.done) * 1e6 for run in runs)
        off = results[(setup, "off", load)]
        off_cpu = statistics.median(r.server_cpu_s / max(1, r.h2.done) * 1e6 for r in off)
        off_p50 = statistics.median(r.h2.p50_us for r in off)
        versus = (
            f"CPU {cpu / off_cpu - 1:+.0%}"
            if load == "saturate"
            else f"p50 {p50 - off_p50:+.0f} µs"
        )
        lines.append(
            f"| {setup} | {load} | {rate} | {rps:,.0f} | {p50:.0f} | {p99:.0f} | {cpu:.0f} |"
            f" {'' if rate == 'off' else versus} | {traced[f'{setup}, tracing {rate}']:.1%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
