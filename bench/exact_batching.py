"""How exact requests on Redis share script calls, by load and --exact-batch-hold.

    python bench/exact_batching.py                       # about 1 minute
    python bench/exact_batching.py --holds 0,0.001,0.002 --loads saturate --seconds 8
    python bench/exact_batching.py --loads 4000/s,5200/s,6000/s   # open loop, 8 clients

Starts a redis-server and, per hold value, one service in exact mode on it (the
config of bench/throughput.py: limits never reached), then drives it with h2load
under each load (bench/throughput.py's loads, or ``N/s``: ``h2load -c 8 -m 8
--rps N/8``, an open-loop rate in bursts) and five descriptors per request
(``--descriptors``). For every run it prints req/s, p99, the requests per script
call (the store's own counters), the CPU per request of the service (all threads)
and of redis-server, the script's time per request (Redis's commandstats), and the
demand of the service's event-loop thread: CPU run plus CPU waited for, from
``/proc/<pid>/task/<tid>/schedstat`` (what loop_load.py samples), and the share of
script calls that were held (``exact_held_batches``).

Runs one after the other, not rotated: a quick look at mechanisms, not a
comparison between code versions.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import redis
import throughput as tp


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as file:
        fields = file.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def loop_thread_demand(pid: int) -> float:
    """Seconds the process's first thread (the event loop's) has run or waited to run."""
    run_ns, wait_ns, _ = Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()
    return (int(run_ns) + int(wait_ns)) / 1e9


def store_stat(samples: dict[str, float], name: str) -> float:
    return tp.metric_sum(samples, "ratelimit_store", name=name)


def measure(
    directory: Path, server: tp.Server, redis_pid: int, client: redis.Redis, body: Path,
    load: str, seconds: float,
) -> str:  # fmt: skip
    before = tp.scrape(server.admin_port or 0)
    cpu0, redis0 = cpu_seconds(server.pid), cpu_seconds(redis_pid)
    demand0, wall0 = loop_thread_demand(server.pid), time.monotonic()
    script0 = client.info("commandstats").get("cmdstat_evalsha", {})
    h2 = tp.run_h2load(server.port, body, load, seconds, directory / "h2load.log")
    demand = (loop_thread_demand(server.pid) - demand0) / (time.monotonic() - wall0)
    after = tp.scrape(server.admin_port or 0)
    script1 = client.info("commandstats").get("cmdstat_evalsha", {})
    done = max(h2.done, 1)
    calls = store_stat(after, "exact_batches") - store_stat(before, "exact_batches")
    requests = store_stat(after, "exact_batched_requests") - store_stat(
        before, "exact_batched_requests"
    )
    script_us = script1.get("usec", 0) - script0.get("usec", 0)
    held = store_stat(after, "exact_held_batches") - store_stat(before, "exact_held_batches")
    return (
        f"| {load} | {h2.rps:,.0f} | {h2.p50_us / 1000:.2f} | {h2.p99_us / 1000:.2f} | "
        f"{requests / max(calls, 1):.2f} | {held / max(calls, 1):.0%} | "
        f"{1e6 * (cpu_seconds(server.pid) - cpu0) / done:.0f} | "
        f"{1e6 * (cpu_seconds(redis_pid) - redis0) / done:.0f} | {script_us / done:.1f} | "
        f"{demand:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--holds", default="0,0.001", help="--exact-batch-hold values")
    parser.add_argument("--loads", default="saturate,one-by-one,1000/s")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--descriptors", type=int, default=5)
    args = parser.parse_args()
    for load in args.loads.split(","):
        if load not in tp.LOADS:
            rate = int(load.removesuffix("/s"))
            tp.LOADS[load] = ["-c", "8", "-m", "8", "-t", "1", "--rps", str(max(1, rate // 8))]
    progress = tp.Progress()
    with tp.lab() as (directory, processes, redis_servers):
        redis_server = tp.start_redis(directory, redis_servers)
        assert redis_server.process is not None
        client = redis.Redis(port=redis_server.port)
        config = directory / "config"
        config.mkdir()
        (config / "bench.yaml").write_text(tp.CONFIG)
        body = directory / "body"
        body.write_bytes(tp.framed("bench", [f"k=v{i}" for i in range(1, args.descriptors + 1)]))
        print(
            "| load | req/s | p50 ms | p99 ms | requests per call | calls held | "
            "service CPU µs/req | Redis CPU µs/req | script µs/req | loop thread demand (CPU) |"
        )
        for hold in args.holds.split(","):
            server = tp.start_service(
                processes, f"exact-hold-{hold}", config,
                ["--mode", "exact", "--redis-url", redis_server.url, "--exact-batch-hold", hold],
            )  # fmt: skip
            tp.run_h2load(server.port, body, "saturate", 1, directory / "warm.log")
            print(f"| **--exact-batch-hold {hold}** | | | | | | | | | |", flush=True)
            for load in args.loads.split(","):
                progress(f"hold {hold}, {load}, {args.seconds:g} s")
                row = measure(
                    directory, server, redis_server.process.pid, client, body, load, args.seconds
                )
                print(row, flush=True)
                time.sleep(0.6)  # let the service see the load go (its sampling: 0.25 s)


if __name__ == "__main__":
    main()
