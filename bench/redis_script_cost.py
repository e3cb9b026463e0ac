"""Redis's CPU per exact-mode script call: what one decision costs the shared Redis.

    python bench/redis_script_cost.py                       # the working tree's script
    python bench/redis_script_cost.py --rev cc32094 --rev WORKTREE

In exact mode every decision runs exact_window.lua on Redis, and one Redis serves the
whole fleet, so the script's cost bounds the fleet's exact decisions per second.
For each script version (a git revision, or WORKTREE for the file on disk) this
starts a fresh redis-server, sends script calls one at a time on a hot key set
(arguments built by the service's own encoder), and reads from Redis itself:
the script's time per call (INFO commandstats, `usec_per_call` of EVALSHA: Lua and
the commands it runs) and the server's CPU per call (INFO cpu, user + system: also
reading the command and writing the reply). Cases: 1 and 5 descriptors per request,
and batches of 8 one-descriptor requests (what a loaded service sends; the script
reads each key once per batch). Versions run in rotated rounds; medians of 3.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path

import redis

from ratelimit_service.core.exact import ExactHit
from ratelimit_service.storage.exact_batcher import encode
from ratelimit_service.testing.redis import RedisServer

REPO = Path(__file__).resolve().parent.parent
SCRIPT = "ratelimit_service/resources/exact_window.lua"
CASES = [(1, 1), (5, 1), (1, 8)]
"""(descriptors per request, requests per call)"""


def script_text(rev: str) -> str:
    if rev == "WORKTREE":
        return (REPO / SCRIPT).read_text()
    return subprocess.run(
        ["git", "show", f"{rev}:{SCRIPT}"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout


def call_arguments(descriptors: int, requests: int) -> tuple[list[str], list[object]]:
    """Keys and ARGV of one call, as the service would send them (limit never reached)."""
    keys: list[str] = []
    args: list[object] = [60, requests]
    for _ in range(requests):
        hits = [ExactHit(f"k_v{i}", 10**9, 1, 1) for i in range(1, descriptors + 1)]
        keys += [f"rl:e:1:bench_{hit.key}" for hit in hits]
        encode(hits, True, args)
    return keys, args


def measure(script: str, descriptors: int, requests: int, calls: int) -> tuple[float, float]:
    """(script µs per call, server CPU µs per call) on a fresh redis-server."""
    with tempfile.TemporaryDirectory() as directory:
        server = RedisServer(Path(directory))
        server.start()
        try:
            client = redis.Redis(port=server.port)
            sha = client.script_load(script)
            keys, args = call_arguments(descriptors, requests)
            for _ in range(2000):  # fill the keys' slices and bookkeeping
                client.evalsha(sha, len(keys), *keys, *args)
            client.config_resetstat()
            cpu = client.info("cpu")
            before = cpu["used_cpu_user"] + cpu["used_cpu_sys"]
            for _ in range(calls):
                client.evalsha(sha, len(keys), *keys, *args)
            cpu = client.info("cpu")
            spent = cpu["used_cpu_user"] + cpu["used_cpu_sys"] - before
            script_us = client.info("commandstats")["cmdstat_evalsha"]["usec_per_call"]
            client.close()
            return float(script_us), spent / calls * 1e6
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", help="git revision, or WORKTREE (default)")
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    revs = args.rev or ["WORKTREE"]
    scripts = {rev: script_text(rev) for rev in revs}
    results: dict[tuple[str, int, int], list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        for descriptors, requests in CASES:
            order = revs[round_ % len(revs) :] + revs[: round_ % len(revs)]
            for rev in order:
                print(f"round {round_ + 1}/{args.rounds}: {rev}, {descriptors} descriptor(s), "
                      f"{requests} request(s) per call", flush=True)  # fmt: skip
                sample = measure(scripts[rev], descriptors, requests, args.calls)
                results.setdefault((rev, descriptors, requests), []).append(sample)
    print("\n| script | descriptors | requests per call | script µs per call | "
          "Redis CPU µs per call | Redis CPU µs per request |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for descriptors, requests in CASES:
        for rev in revs:
            samples = results[(rev, descriptors, requests)]
            script_us = statistics.median(s[0] for s in samples)
            cpu_us = statistics.median(s[1] for s in samples)
            print(f"| {rev} | {descriptors} | {requests} | {script_us:.1f} | {cpu_us:.1f} | "
                  f"{cpu_us / requests:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
