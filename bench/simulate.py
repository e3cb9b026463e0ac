"""Fleet simulator: the real decision core for many virtual nodes, in virtual time.

    python bench/simulate.py --nodes 4 --limit 400 --rate 200 --step-to 1200 --step-at 10 \
        --seconds 16 --interval 0.25 --skew 0.4,0.3,0.2,0.1

Each virtual node is a real LocalBuckets; they share one EmbeddedStore (standing in
for Redis: same token-bucket arithmetic, and the fleet's size in each answer, as
Redis's registry of live nodes gives it) and sync at staggered phases every
--interval. Arrivals are Poisson per node, following a step at once. Prints admitted
hits per --bucket seconds and a summary; deterministic for a given --seed. --burst N
sets the rule's rate_limit.burst (the fleet bucket's capacity: drop_ratio.capacity).
No network, no sleeping: it explores sync intervals, skew and fleet sizes (e.g.
--nodes 1000) this machine cannot run.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import random
import statistics

from ratelimit_service.core.drop_ratio import SyncResult, capacity
from ratelimit_service.core.exact import fits
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.core.stretch import STRETCH
from ratelimit_service.core.window import SlidingWindow
from ratelimit_service.storage.embedded import EmbeddedStore


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def simulate(args: argparse.Namespace) -> list[tuple[float, int, int]]:
    clock = Clock()
    store = EmbeddedStore(clock=clock)
    rng = random.Random(args.seed)
    weights = [float(w) for w in args.skew.split(",")] if args.skew else [1.0]
    weights = (weights * args.nodes)[: args.nodes]
    total = sum(weights)
    shares = [w / total for w in weights]
    nodes = [LocalBuckets(turn=rng.randrange(1 << 16)) for _ in range(args.nodes)]
    window = SlidingWindow(1.0)  # --exact: the fleet's one window, as a store keeps it
    args.updates = 0  # bucket reports sent to the store

    def rate_at(t: float) -> float:
        return args.step_to if args.step_to is not None and t >= args.step_at else args.rate

    # Arrivals by thinning: candidates at the highest rate, each kept with probability
    # rate(t) / highest, so a node's arrivals follow the step at once (an arrival drawn
    # at the old rate would otherwise delay a slow node's first one after the step).
    top = max(args.rate, args.step_to or 0.0)

    events: list[tuple[float, int, int]] = []  # (time, kind 0=sync 1=arrival, node)
    for i in range(args.nodes):
        heapq.heappush(events, (args.interval * (i + 1) / args.nodes, 0, i))
        heapq.heappush(events, (rng.expovariate(max(top * shares[i], 1e-9)), 1, i))
    rows: dict[int, list[int]] = {}
    while events:
        at, kind, i = heapq.heappop(events)
        if at >= args.seconds:
            continue
        clock.now = at
        node = nodes[i]
        if kind == 0:
            reports = node.take_reports(at, args.interval, args.stretch)
            args.updates += len(reports)
            result = await store.sync(reports)
            # Redis counts the live nodes in its registry; the embedded store is one process.
            result = SyncResult(nodes=args.nodes, views=result.views)
            node.apply_all(reports, result, at, args.interval)
            heapq.heappush(events, (at + args.interval, 0, i))
            continue
        heapq.heappush(events, (at + rng.expovariate(max(top * shares[i], 1e-9)), 1, i))
        if rng.random() * top >= rate_at(at):
            continue
        row = rows.setdefault(int(at / args.bucket), [0, 0])
        row[0] += 1
        if args.exact:
            if fits(window.count(at), 1, args.limit):
                window.add(at, 1)
                row[1] += 1
            continue
        bucket = node.get("k", args.limit, 1, at, burst=args.burst)
        draw = bucket.next_draw() if args.draw == "sequence" else rng.random()
        row[1] += node.decide(bucket, 1, draw)
    # Every bucket of the run, those without arrivals too: a rate is per second of the run.
    count = int(args.seconds / args.bucket + 0.5)
    return [(k * args.bucket, *rows.get(k, (0, 0))) for k in range(count)]


def reaction_time(
    rows: list[tuple[float, int, int]],
    bucket: float,
    step_at: float,
    limit: float,
    tolerance: float,
    hold: float = 2.0,
) -> float:
    """Seconds after the step until the admitted rate (0.5 s moving average) is within
    +-tolerance of the limit and stays there for ``hold`` seconds. ``rows`` are
    (start, offered, admitted) per ``bucket`` seconds."""
    per_second = [r[2] / bucket for r in rows]
    moving = [(per_second[i] + per_second[i - 1]) / 2 for i in range(1, len(rows))]
    ends = [rows[i][0] + bucket for i in range(1, len(rows))]
    points = [(t, v) for t, v in zip(ends, moving, strict=True) if t > step_at]
    for start, (t0, _) in enumerate(points):
        window = [v for t, v in points[start:] if t < t0 + hold]
        if all(abs(v - limit) <= tolerance * limit for v in window):
            return t0 - step_at
    return float("inf")


def sweep(args: argparse.Namespace) -> None:
    """--seeds N: the same run for seeds 1..N; the spread of the step reaction and of
    the admitted count per bucket once steady."""
    reactions, scatter, updates, levels = [], [], [], []
    for seed in range(1, args.seeds + 1):
        run = argparse.Namespace(**{**vars(args), "seed": seed})
        rows = asyncio.run(simulate(run))
        updates.append(run.updates / args.nodes / args.seconds)
        settle = args.step_at + 2 if args.step_to is not None else 3.0
        steady = [r[2] for r in rows if r[0] >= settle]
        per_bucket = args.limit * args.bucket
        scatter.append(statistics.pstdev(steady) / per_bucket)
        levels.append(statistics.mean(steady) / per_bucket)
        if args.step_to is not None:
            reactions.append(reaction_time(rows, args.bucket, args.step_at, args.limit, 0.10))
    print(f"fleet bucket capacity {capacity(args.limit, args.burst):g} (limit {args.limit})")
    print(f"seeds 1..{args.seeds}: admitted per {args.bucket:g} s once steady scatters by "
          f"{statistics.mean(scatter):.3f}x of the limit (sd, mean over seeds)")  # fmt: skip
    print(f"admitted once steady: {statistics.mean(levels):.3f}x of the limit (mean over "
          f"seeds; {min(levels):.3f}-{max(levels):.3f}x)")  # fmt: skip
    print(f"bucket reports per node per second: {statistics.mean(updates):.2f} (one sync "
          f"every {args.interval:g} s: {1 / args.interval:g})")  # fmt: skip
    if reactions:
        reactions.sort()
        within = sum(r <= 1.0 for r in reactions)
        within_15 = sum(r <= 1.5 for r in reactions)
        print(f"step reaction (+-10 %): median {statistics.median(reactions):.2f} s, "
              f"90th percentile {reactions[int(0.9 * len(reactions))]:.2f} s, "
              f"max {reactions[-1]:.2f} s; <= 1 s in {within}, <= 1.5 s in {within_15} "
              f"of {len(reactions)} seeds")  # fmt: skip


def plot(rows: list[tuple[float, int, int]], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.2))
    ts = [r[0] for r in rows]
    ax.plot(ts, [r[1] / args.bucket for r in rows], color="0.6", label="offered/s")
    ax.plot(ts, [r[2] / args.bucket for r in rows], color="tab:blue", label="admitted/s")
    ax.axhline(args.limit, color="tab:red", linestyle="--", linewidth=1, label="limit")
    ax.set_title(
        f"simulated fleet: {args.nodes} nodes, sync {args.interval} s (seed {args.seed})",
        fontsize=9,
        loc="left",
    )
    ax.set_xlabel("virtual seconds")
    ax.set_ylabel("req/s")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    plt.close(fig)
    print(f"wrote {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--limit", type=int, default=400, help="per second")
    parser.add_argument("--rate", type=float, default=800, help="offered per second")
    parser.add_argument("--step-to", type=float, default=None)
    parser.add_argument("--step-at", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--interval", type=float, default=0.25)
    parser.add_argument("--skew", default="0.4,0.3,0.2,0.1")
    parser.add_argument("--bucket", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument(
        "--burst",
        type=int,
        default=None,
        help="the rule's rate_limit.burst: what the fleet bucket holds when full "
        "(default: the limit)",
    )
    parser.add_argument(
        "--draw",
        choices=["sequence", "random"],
        default="sequence",
        help="numbers compared with the drop ratio: each bucket's golden-ratio sequence "
        "(what the service does) or independent random numbers (Uber's design)",
    )
    parser.add_argument(
        "--exact",
        action="store_true",
        help="decide every arrival by the exact sliding window (core/window.py) instead",
    )
    parser.add_argument(
        "--stretch",
        type=int,
        default=STRETCH,
        help="intervals a bucket far below its limit, or steady well over it (paid in "
        "advance), may wait between two reports (the service's: %(default)s; 1: every "
        "interval)",
    )
    parser.add_argument("--plot", default=None, help="write a PNG here (needs matplotlib)")
    parser.add_argument("--seeds", type=int, default=0, help="sweep seeds 1..N (summary only)")
    args = parser.parse_args()
    if args.seeds:
        sweep(args)
        return
    rows = asyncio.run(simulate(args))
    print(f"fleet bucket capacity {capacity(args.limit, args.burst):g} (limit {args.limit})")
    for t, offered, admitted in rows:
        print(f"{t:7.2f} offered={offered:6d} admitted={admitted:6d}")
    if args.plot:
        plot(rows, args)
    steady = [r for r in rows if r[0] >= 3 and (args.step_to is None or r[0] >= args.step_at + 3)]
    if steady:
        span = len(steady) * args.bucket
        admitted = sum(r[2] for r in steady) / span
        offered = sum(r[1] for r in steady) / span
        print(f"steady admitted/s={admitted:.1f} = {admitted / args.limit:.3f}x the limit, "
              f"{admitted / offered:.1%} of offered")  # fmt: skip
    print(f"bucket reports per node per second: {args.updates / args.nodes / args.seconds:.2f}")


if __name__ == "__main__":
    main()
