"""Store faults under load, the long run of tests/faults/ (docs/reliability.md).

    python bench/faults.py                 # ~2 min: every fault, 30 s outages
    python bench/faults.py --outage 300    # partitions and hangs of 5 minutes
    python bench/faults.py --only cluster,cluster-nocover --rounds 5 --busy

Each fault runs as ratelimit_harness/fault_scenarios.py stages it: a service process on real
redis-servers, a grpc.aio probe at 200 calls a second on 100 keys of an exact rule
(``failure_mode: open``) with Envoy's 20 ms deadline, 2 s of control load before the
fault. Printed per run, as a Markdown table: calls, the share of calls that missed
their deadline before the fault (the machine's own) and from the fault on, seconds
from the store being able to answer again to the service deciding by it, gRPC errors,
tracebacks in the service's log, (partitions and hangs) the owed-hit entries kept
at the end of the outage, and (Cluster) seconds from the kill to the promotion and to
the service deciding on every node, and the checks of the live masters' slots that
the store did not decide (of all, every 0.1 s from the kill on). ``cluster`` runs
with Redis's default cluster-require-full-coverage yes, ``cluster-nocover`` with no.
``--busy``: a busy-loop process beside, all along.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from ratelimit_harness import fault_scenarios
from ratelimit_harness.fault_scenarios import FaultRun, store_metric
from ratelimit_harness.fleet import cpu_hog

Scenario = Callable[[Path], Awaitable[FaultRun]]


def scenarios(outage: float) -> dict[str, Scenario]:
    return {
        "repoint": fault_scenarios.repointed_failover,
        "blackhole": lambda d: fault_scenarios.silent_store(d, "blackhole", outage),
        "sigstop": lambda d: fault_scenarios.silent_store(d, "sigstop", outage),
        "cluster": fault_scenarios.cluster_master_killed,
        "cluster-nocover": lambda d: fault_scenarios.cluster_master_killed(d, False),
        "sentinel": fault_scenarios.sentinel_master_killed,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outage", type=float, default=30.0, help="seconds of a partition/hang")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated: " + ",".join(scenarios(0)))
    parser.add_argument("--busy", action="store_true", help="a busy-loop process beside")
    options = parser.parse_args()
    with cpu_hog() if options.busy else contextlib.nullcontext():
        rows = await _runs(options)
    columns = list(dict.fromkeys(column for row in rows for column in row))
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row.get(c, "-")) for c in columns) + " |")


async def _runs(options: argparse.Namespace) -> list[dict[str, object]]:
    """Each chosen fault, ``rounds`` times: a row each, printed as it comes."""
    chosen = scenarios(options.outage)
    names = options.only.split(",") if options.only else list(chosen)
    rows: list[dict[str, object]] = []
    for _ in range(options.rounds):
        for name in names:
            with tempfile.TemporaryDirectory() as directory:
                run = await chosen[name](Path(directory))
            row = run.row()
            later = run.metrics.get("later")
            row["owed_entries"] = int(later[store_metric("exact_owed_entries")]) if later else "-"
            if run.live_checks:
                row["promoted_s"] = round(run.able_at, 2)
                row["decided_s"] = round(run.decided_at, 2)
                undecided = sum(not decided for _, decided in run.live_checks)
                row["live_undecided"] = f"{undecided}/{len(run.live_checks)}"
            rows.append(row)
            print(row, flush=True)
    return rows


if __name__ == "__main__":
    asyncio.run(main())
