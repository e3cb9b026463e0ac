"""PNG plots for docs/benchmarks.md from the JSON files the benchmarks write.

    pip install -e ".[bench]"   # matplotlib
    python bench/plot.py        # reads bench/out/*.json, writes docs/img/*.png

Each plot is drawn only when its data file exists: throughput.json and
redis_delay.json (bench/throughput.py), cost_growth.json (bench/cost_growth.py),
tier_cost.json and tier_cost_buckets.json (bench/tier_cost.py), tier_simulation.json
(bench/tier_simulation.py), and the fleet scenario CSVs overload/under/step/exact/outage.csv
(bench/fleet_scenarios.py), drawn together as fleet_accuracy.png.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ["embedded probabilistic", "embedded exact", "redis probabilistic", "redis exact"]


def throughput(data: Any, out: Path) -> None:
    rows = [r for r in data["summary"] if r["load"] == "saturate" and r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.38
    for offset, count in ((-width / 2, 1), (width / 2, 5)):
        chosen = {r["target"]: r for r in rows if r["descriptors"] == count}
        ratios = [chosen[t]["ratio"] for t in TARGETS]
        low = [chosen[t]["ratio"] - chosen[t]["ratio_min"] for t in TARGETS]
        high = [chosen[t]["ratio_max"] - chosen[t]["ratio"] for t in TARGETS]
        xs = [i + offset for i in range(len(TARGETS))]
        bars = ax.bar(
            xs,
            ratios,
            width,
            yerr=[low, high],
            capsize=3,
            label=f"{count} descriptor{'s' if count > 1 else ''} per request",
        )
        for bar, row in zip(bars, (chosen[t] for t in TARGETS), strict=True):
            ax.annotate(
                f"{row['rps']:,.0f}/s",
                (bar.get_x() + bar.get_width() / 2, 0.02),
                ha="center",
                va="bottom",
                fontsize=7,
                rotation=90,
                color="white",
            )
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.text(-0.45, 1.01, "null server = 1.0", ha="left", va="bottom", fontsize=8)
    ax.set_xticks(range(len(TARGETS)), [t.replace(" ", "\n") for t in TARGETS])
    ax.set_ylabel("throughput / null server (same round)")
    ax.set_ylim(0, 1.15)
    ax.set_title("Saturated throughput, h2load -c 8 -m 8 -t 1 (median of rounds, bars: min-max)")
    ax.legend(loc="upper right", fontsize=8, bbox_to_anchor=(1.0, 0.93))
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def redis_delay(data: dict[str, Any], out: Path) -> None:
    rows = data["summary"]
    paths = list(data["ping_rtt"])
    services = ["probabilistic", "exact"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
    width = 0.36
    for index, service in enumerate(services):
        chosen = [next(r for r in rows if r["target"] == f"{service} {p}") for p in paths]
        xs = [i + (index - 0.5) * width for i in range(len(paths))]
        axes[0].bar(xs, [r["p50_ms"] for r in chosen], width, label=service)
        axes[0].bar(
            xs,
            [r["p99_ms"] - r["p50_ms"] for r in chosen],
            width,
            bottom=[r["p50_ms"] for r in chosen],
            alpha=0.35,
            color=f"C{index}",
        )
        shares = [100 * r["failure_mode_answers"] / r["served"] for r in chosen]
        axes[1].bar(xs, shares, width, label=service)
    for ax in axes:
        ax.set_xticks(
            range(len(paths)),
            [f"{p}\n(RTT {data['ping_rtt'][p]['p50_ms']:.1f} ms)" for p in paths],
            fontsize=8,
        )
        ax.set_xlabel("Redis path (bench/redis_delay_proxy.py)")
    axes[0].set_ylabel("latency ms: p50 (solid), p99 (light)")
    axes[0].set_title("Latency at 1,000 req/s, Envoy's 20 ms deadline")
    axes[0].legend(fontsize=8)
    axes[1].set_ylabel("% of answers given by failure_mode (open)")
    axes[1].set_title("Answers NOT decided by Redis")
    axes[1].set_ylim(0, 105)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def cost_growth(data: dict[str, Any], out: Path) -> None:
    cells = [c for c in data["cells"] if c["buckets"] > 0]
    intervals = sorted({c["interval"] for c in cells})
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for interval in intervals:
        chosen = sorted((c for c in cells if c["interval"] == interval), key=lambda c: c["buckets"])
        xs = [c["buckets"] for c in chosen]
        label = f"sync every {interval:g} s"
        axes[0].plot(
            xs, [c["bytes_in_per_s"] + c["bytes_out_per_s"] for c in chosen], "o-", label=label
        )
        axes[1].plot(xs, [c["redis_commands_per_s"] for c in chosen], "o-", label=label)
        axes[2].plot(xs, [c["reported_per_sync"] for c in chosen], "o-", label=label)
    axes[0].set_ylabel("Redis bytes/s (in + out) per process")
    axes[1].set_ylabel("Redis commands/s per process (incl. inside Lua)")
    axes[2].set_ylabel("buckets reported per sync")
    rate = cells[0]["rate"]
    for ax in axes:
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("active buckets (distinct descriptor values)")
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"Probabilistic mode, one process, {rate:g} req/s of up to "
        f"{max(c['per_request'] for c in cells)} descriptors "
        f"(traffic caps the buckets touched per sync)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


FLEET_SCENARIOS = ["overload", "under", "step", "exact", "outage"]


def fleet_accuracy(data_dir: Path, out: Path, limit: float) -> bool:
    """Admitted and offered per second (per 250 ms bucket) against the limit, one panel
    per fleet scenario. False when no scenario CSV exists."""
    import csv

    found = [(name, data_dir / f"{name}.csv") for name in FLEET_SCENARIOS]
    found = [(name, path) for name, path in found if path.exists()]
    if not found:
        return False
    fig, axes = plt.subplots(len(found), 1, figsize=(8, 2.2 * len(found)), sharex=True)
    axes = axes if len(found) > 1 else [axes]
    for ax, (name, path) in zip(axes, found, strict=True):
        with open(path, newline="") as handle:
            rows = [
                (float(r["t"]), int(r["offered"]), int(r["admitted"]))
                for r in csv.DictReader(handle)
            ]
        width = rows[1][0] - rows[0][0] if len(rows) > 1 else 0.25
        ts = [r[0] for r in rows]
        ax.plot(ts, [r[1] / width for r in rows], color="0.6", label="offered/s")
        ax.plot(ts, [r[2] / width for r in rows], color="tab:blue", label="admitted/s")
        ax.axhline(limit, color="tab:red", linestyle="--", linewidth=1, label="limit")
        ax.set_title(name, fontsize=9, loc="left")
        ax.set_ylabel("req/s")
    axes[0].legend(fontsize=8, loc="upper right")
    axes[-1].set_xlabel("seconds (per 250 ms bucket)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return True


def tier_cost(data: list[dict[str, Any]], out: Path) -> None:
    """Redis CPU and replica CPU per report against the Envoys, for each design (RLQS)."""
    rows = [r for r in data if r.get("mode", "rlqs") == "rlqs"]
    designs = sorted({r["design"] for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for design in designs:
        mine = sorted((r for r in rows if r["design"] == design), key=lambda r: r["envoys"])
        envoys = [r["envoys"] for r in mine]
        left.plot(envoys, [r["redis_cpu_pct"] for r in mine], marker="o", label=design)
        right.plot(envoys, [r["replica_cpu_ms_per_report"] for r in mine], marker="o",
                   label=design)  # fmt: skip
    sizes = sorted({r["envoys"] for r in rows})
    for ax, title in ((left, "Redis CPU, % of a core"), (right, "replica CPU per report, ms")):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel("simulated Envoys (4 replicas, one hot bucket)")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    left.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out)


def tier_cost_buckets(data: list[dict[str, Any]], out: Path) -> None:
    """Redis CPU and replica CPU per report against the fleet's hot buckets (RLQS, this
    tree): every replica touching them all (spread), and replica 0 kept on its 10
    (pinned) beside the others."""
    rows = [r for r in data if r.get("mode", "rlqs") == "rlqs" and r["design"] == "tiers"]
    if len({r["buckets"] for r in rows}) < 2:
        return
    envoys = min(r["envoys"] for r in rows)
    rows = [r for r in rows if r["envoys"] == envoys]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    lines: list[tuple[str, str, Any]] = [
        ("spread", "every replica (touches them all)", lambda r: r["replica_cpu_ms_per_report"]),
        ("pinned", "replica 0 (touches its 10)", lambda r: r["per_replica_cpu_ms_per_report"][0]),
        ("pinned", "replicas 1-3 (touch them all)",
         lambda r: sum(r["per_replica_cpu_ms_per_report"][1:]) / 3),
    ]  # fmt: skip
    for layout, label, value in lines:
        mine = sorted((r for r in rows if r["layout"] == layout), key=lambda r: r["buckets"])
        right.plot([r["buckets"] for r in mine], [value(r) for r in mine], marker="o", label=label)
    spread = sorted((r for r in rows if r["layout"] == "spread"), key=lambda r: r["buckets"])
    left.plot([r["buckets"] for r in spread], [r["redis_cpu_pct"] for r in spread], marker="o")
    sizes = sorted({r["buckets"] for r in rows})
    for ax, title in ((left, "Redis CPU, % of a core"), (right, "replica CPU per report, ms")):
        ax.set_xscale("log")
        ax.set_xticks(sizes, [f"{n:,}" for n in sizes])
        ax.minorticks_off()
        ax.set_xlabel(f"hot buckets in the fleet ({envoys:,} Envoys, 10 buckets each)")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    right.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(out)


def tier_simulation(data: list[dict[str, Any]], out: Path) -> None:
    """Each store's CPU at 100,000 Envoys / 1,000 replicas / 10 zones, by hot buckets."""
    hot = [c["hot"] for c in data]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.plot(hot, [c["zone_cpu"] for c in data], marker="o", label="each zone store")
    ax.plot(hot, [c["global_cpu"] for c in data], marker="o", label="the global store")
    flat = [c for c in data if c["flat_calls"]]  # --no-flat cells have none
    ax.plot([c["hot"] for c in flat], [min(c["flat_cpu"], 100) for c in flat], marker="o",
            linestyle="--", label="one store, no zones (capped at 100 %)")  # fmt: skip
    ax.set_xscale("log")
    ax.set_xticks(hot, [str(n) for n in hot])
    ax.minorticks_off()
    ax.set_xlabel("hot buckets")
    ax.set_ylabel("Redis CPU, % of a core")
    ax.set_title("100,000 Envoys, 1,000 replicas, 10 zones (real Lua, simulated rates)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "bench" / "out")
    parser.add_argument("--img", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument("--fleet-limit", type=float, default=400, help="as fleet_scenarios")
    args = parser.parse_args()
    args.img.mkdir(parents=True, exist_ok=True)
    for name, draw in (
        ("throughput", throughput),
        ("redis_delay", redis_delay),
        ("cost_growth", cost_growth),
        ("tier_cost", tier_cost),
        ("tier_cost_buckets", tier_cost_buckets),
        ("tier_simulation", tier_simulation),
    ):
        source = args.data / f"{name}.json"
        if source.exists():
            target = args.img / f"{name}.png"
            draw(json.loads(source.read_text()), target)
            print(f"wrote {target}")
    if fleet_accuracy(args.data, args.img / "fleet_accuracy.png", args.fleet_limit):
        print(f"wrote {args.img / 'fleet_accuracy.png'}")


if __name__ == "__main__":
    main()
