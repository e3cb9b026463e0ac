"""How steady this machine's CPUs are: the same piece of work, timed again and again on
each CPU, nothing else asked of the machine.

    python bench/cpu_steadiness.py                  # 10 s, every CPU at once
    python bench/cpu_steadiness.py --seconds 30 --cpus 0

A latency target at a share of a process's capacity (the open-loop 0.7x and 0.8x rows
of docs/benchmarks.md) assumes the capacity holds from one moment to the next. On a
virtual machine it need not: the host may run other guests on the same cores. Each
probe (one process pinned per CPU, real-time priority when allowed) runs a fixed loop
of integer arithmetic every 2 ms and records the CPU time it took (``thread_time``:
time on the CPU, whatever else the guest runs). Per 50 ms window, the median duration
against the machine's fast state (the 10th percentile of the windows' medians):

- **slowed**: the share of windows whose median is 1.3x the fast state or more (a
  service at 80 % of its capacity is then past 100 % for that window);
- **worst**: the slowest window's ratio to the fast state.

Results: ``--out``/cpu_steadiness.json, and one line per CPU on stdout.
:func:`measure` is what bench/open_loop.py calls before each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

WORK = 3000
"""Loop iterations per probe: about 0.1 ms on a 2020s server core."""
EVERY = 0.002
WINDOW = 0.05
SLOWED = 1.3
FAST_QUANTILE = 0.1
REALTIME_PRIORITY = 40


@dataclass
class Steadiness:
    """One CPU's probes, summarised (see the module docstring)."""

    cpu: int
    fast_us: float
    median_us: float
    slowed_share: float
    worst: float
    windows: int
    realtime: bool


def work() -> int:
    total = 0
    for i in range(WORK):
        total += i * i
    return total


def probe(cpu: int, seconds: float) -> dict[str, object]:
    """Runs in the probe's own process: pinned to ``cpu``; (wall time, CPU seconds)
    of every piece of work."""
    os.sched_setaffinity(0, {cpu})
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(REALTIME_PRIORITY))
        realtime = True
    except (PermissionError, OSError):
        realtime = False
    samples = []
    end = time.monotonic() + seconds
    while (now := time.monotonic()) < end:
        before = time.thread_time()
        work()
        samples.append((now, time.thread_time() - before))
        time.sleep(EVERY)
    return {"cpu": cpu, "realtime": realtime, "samples": samples}


def summarise(cpu: int, samples: list[tuple[float, float]], realtime: bool) -> Steadiness:
    windows: dict[int, list[float]] = {}
    for at, took in samples:
        windows.setdefault(int(at / WINDOW), []).append(took * 1e6)
    medians = sorted(statistics.median(durations) for durations in windows.values())
    fast = medians[int(FAST_QUANTILE * (len(medians) - 1))]
    return Steadiness(
        cpu=cpu,
        fast_us=fast,
        median_us=statistics.median(medians),
        slowed_share=sum(m >= SLOWED * fast for m in medians) / len(medians),
        worst=medians[-1] / fast,
        windows=len(medians),
        realtime=realtime,
    )


def measure(seconds: float, cpus: list[int] | None = None) -> list[Steadiness]:
    """Probes every CPU in ``cpus`` (default: all this process may use) at once, each
    in a process of its own, for ``seconds``."""
    chosen = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    probes = [
        subprocess.Popen(
            [sys.executable, __file__, "--probe", str(cpu), "--seconds", str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for cpu in chosen
    ]
    results = []
    for process in probes:
        out, _ = process.communicate(timeout=seconds + 30)
        if process.returncode != 0:
            raise RuntimeError(f"probe exited {process.returncode}")
        found = json.loads(out)
        samples = [(float(a), float(b)) for a, b in found["samples"]]
        results.append(summarise(int(found["cpu"]), samples, bool(found["realtime"])))
    return results


def line(result: Steadiness) -> str:
    return (
        f"CPU {result.cpu}: {result.slowed_share:.0%} of {result.windows} windows slowed"
        f" {SLOWED:g}x or more, worst {result.worst:.2f}x (fast {result.fast_us:.0f} us,"
        f" median {result.median_us:.0f} us{', real-time' if result.realtime else ''})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--cpus", help="comma-separated CPUs (default: all)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out")
    parser.add_argument("--probe", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe is not None:
        json.dump(probe(args.probe, args.seconds), sys.stdout)
        return
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    results = measure(args.seconds, cpus)
    for result in results:
        print(line(result))
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "cpu_steadiness.json"
    out.write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")


if __name__ == "__main__":
    main()
