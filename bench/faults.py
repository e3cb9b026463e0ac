"""Store faults under load, the long run of tests/faults/ (docs/reliability.md).

    python bench/faults.py                 # ~2 min: every fault, 30 s outages
    python bench/faults.py --outage 300    # partitions and hangs of 5 minutes
    python bench/faults.py --only cluster,sentinel --rounds 3

Each fault runs as testing/fault_scenarios.py stages it: a service process on real
redis-servers, a grpc.aio probe at 200 calls a second on 100 keys of an exact rule
(``failure_mode: open``) with Envoy's 20 ms deadline, 2 s of control load before the
fault. Printed per run, as a Markdown table: calls, the share of calls that missed
their deadline before the fault (the machine's own) and from the fault on, seconds
from the store being able to answer again to the service deciding by it, gRPC errors,
tracebacks in the service's log, and (partitions and hangs) the owed-hit entries kept
at the end of the outage.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from ratelimit_service.testing import fault_scenarios
from ratelimit_service.testing.fault_scenarios import FaultRun, store_metric

Scenario = Callable[[Path], Awaitable[FaultRun]]


def scenarios(outage: float) -> dict[str, Scenario]:
    return {
        "repoint": fault_scenarios.repointed_failover,
        "blackhole": lambda d: fault_scenarios.silent_store(d, "blackhole", outage),
        "sigstop": lambda d: fault_scenarios.silent_store(d, "sigstop", outage),
        "cluster": fault_scenarios.cluster_master_killed,
        "sentinel": fault_scenarios.sentinel_master_killed,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--outage", type=float, default=30.0, help="seconds of a partition/hang")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--only", default="", help="comma-separated: " + ",".join(scenarios(0)))
    options = parser.parse_args()
    chosen = scenarios(options.outage)
    names = options.only.split(",") if options.only else list(chosen)
    rows = []
    for _ in range(options.rounds):
        for name in names:
            with tempfile.TemporaryDirectory() as directory:
                run = await chosen[name](Path(directory))
            row = run.row()
            later = run.metrics.get("later")
            row["owed_entries"] = int(later[store_metric("exact_owed_entries")]) if later else "-"
            rows.append(row)
            print(row, flush=True)
    columns = list(rows[0])
    print("\n| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]) for c in columns) + " |")


if __name__ == "__main__":
    asyncio.run(main())
