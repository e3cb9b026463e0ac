"""RLQS at fleet scale, simulated: N Envoys (1,000 by default) enforce the token buckets
the real QuotaCoordinator (engine/quota.py, on the embedded store, fake clock) assigns
them, reporting every 5 s on their own timers (started at random moments) as Envoy 1.40
does, and at once for a bucket they have just created. Traffic is skewed
(Zipf-like over the Envoys), offered 0.5x the limit, then a step to 3x.

    python bench/rlqs_fleet.py                    # 1,000 Envoys, 10,000/s, ~1 min
    python bench/rlqs_fleet.py --envoys 10 --limit 100 --plot docs/img/rlqs_fleet.png
    python bench/rlqs_fleet.py --no-push          # only answers to reports, to compare

Prints admitted per second against the limit, the steady-state error after the step,
and the reaction time (until each second is within +-10 % of the limit). Envoy's side
is modelled on what 1.40 does: a token bucket starts full when its parameters change
and keeps its tokens when an identical one is re-sent; before the first assignment
a bucket allows everything.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
from dataclasses import dataclass

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.shares import TokenBucket
from ratelimit_service.engine.quota import REPORT_INTERVAL, Action, QuotaCoordinator, Usage
from ratelimit_service.engine.stats import Stats
from ratelimit_service.storage.embedded import EmbeddedStore

TICK = 0.05
BUCKET = {"tenant": "shared"}


@dataclass
class SimEnvoy:
    name: str
    weight: float
    phase: float
    bucket: TokenBucket | None = None
    tokens: float = 0.0
    allowed: int = 0
    denied: int = 0
    debt: float = 0.0

    def next_report(self, now: float) -> float:
        """Envoy's periodic report comes on its own timer (started with the Envoy, at
        ``phase``), not on the bucket's: only a bucket's first report is at once."""
        return self.phase + (math.floor((now - self.phase) / REPORT_INTERVAL) + 1) * REPORT_INTERVAL

    def assigned_rate(self) -> float:
        if self.bucket is None:
            return 0.0
        return self.bucket.tokens_per_fill / self.bucket.fill_seconds

    def assign(self, bucket: TokenBucket | None) -> None:
        if bucket != self.bucket:  # a new bucket starts full; an identical one is kept
            self.bucket, self.tokens = bucket, float(bucket.max_tokens) if bucket else 0.0

    def offer(self, requests: int, dt: float) -> int:
        bucket = self.bucket
        if bucket is None:
            self.allowed += requests
            return requests
        rate = bucket.tokens_per_fill / bucket.fill_seconds
        self.tokens = min(float(bucket.max_tokens), self.tokens + rate * dt)
        admitted = min(requests, int(self.tokens))
        self.tokens -= admitted
        self.allowed += admitted
        self.denied += requests - admitted
        return admitted


async def run(
    envoys: int,
    limit: int,
    seconds: float,
    step_at: float,
    seed: int,
    push: bool = True,
    shift_at: float | None = None,
    after: float = 3.0,
    replicas: int = 1,
    burst: int | None = None,
    before: float = 0.5,
) -> tuple[list[float], list[float]]:
    """Admitted per second. ``push``: buckets the coordinator pushes between an
    Envoy's reports reach it at once (as on a real stream); without, only the answers
    to its own reports (to compare the two side by side). ``shift_at``: from then on
    the skew is reversed (the busiest Envoy becomes the quietest), at the same total.
    ``replicas``: coordinators sharing one store, each with every replicas-th Envoy,
    each publishing every second. Also returns the fleet's assigned rate (the sum of
    every Envoy's tokens per second) at the end of each second."""
    rng = random.Random(seed)
    burst_text = "" if burst is None else f", burst: {burst}"
    config = load_config(
        [ConfigFile("q.yaml", f"domain: q\ndescriptors:\n  - key: tenant\n"
                    f"    rate_limit: {{unit: second, requests_per_unit: {limit}{burst_text}}}\n")]
    )  # fmt: skip
    clock = [0.0]
    store = EmbeddedStore(clock=lambda: clock[0])  # one store, every replica a member
    coordinators = [
        QuotaCoordinator(
            lambda: config,
            Stats(),
            store,
            member=f"replica-{n}",
            clock=lambda: clock[0],
            wall=lambda: clock[0],
        )
        for n in range(replicas)
    ]
    weights = [1.0 / (i + 1) ** 0.8 for i in range(envoys)]
    total = sum(weights)
    fleet = [
        SimEnvoy(f"e{i}", w / total, rng.uniform(0, REPORT_INTERVAL)) for i, w in enumerate(weights)
    ]
    replica_of = {e.name: coordinators[n % replicas] for n, e in enumerate(fleet)}
    if push:
        for envoy in fleet:
            replica_of[envoy.name].attach(envoy.name, lambda actions, e=envoy: deliver(e, actions))
    next_tick = [rng.uniform(0, 1.0) for _ in coordinators]
    per_second: list[float] = [0.0] * math.ceil(seconds)
    assigned: list[float] = [0.0] * math.ceil(seconds)
    next_report = {e.name: e.phase for e in fleet}
    first = {e.name: True for e in fleet}
    t = 0.0
    shifted = False
    while t < seconds:
        clock[0] = t
        if shift_at is not None and t >= shift_at and not shifted:
            shifted = True
            for envoy, weight in zip(fleet, reversed([e.weight for e in fleet]), strict=True):
                envoy.weight = weight
        offered = (before if t < step_at else after) * limit
        for envoy in fleet:
            envoy.debt += offered * envoy.weight * TICK
            requests = int(envoy.debt)
            envoy.debt -= requests
            if requests and first[envoy.name]:  # a new bucket: reported at once
                first[envoy.name] = False
                next_report[envoy.name] = t
            per_second[int(t)] += envoy.offer(requests, TICK)
            if not first[envoy.name] and t >= next_report[envoy.name]:
                usage = Usage(BUCKET, envoy.allowed, envoy.denied)
                envoy.allowed = envoy.denied = 0
                (action,) = await replica_of[envoy.name].report(envoy.name, "q", [usage])
                envoy.assign(action.token_bucket)
                next_report[envoy.name] = envoy.next_report(t)
        for n, coordinator in enumerate(coordinators):
            if t >= next_tick[n]:
                await coordinator.tick()
                next_tick[n] += coordinator.interval
        assigned[int(t)] = sum(e.assigned_rate() for e in fleet)
        t += TICK
    return per_second, assigned


def deliver(envoy: SimEnvoy, actions: list[Action]) -> bool:
    for action in actions:
        envoy.assign(action.token_bucket)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--envoys", type=int, default=1000)
    parser.add_argument("--limit", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--step-at", type=float, default=25.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--plot", default=None, help="write a PNG of admitted per second")
    parser.add_argument(
        "--no-push", action="store_true", help="only answers to reports, no pushed buckets"
    )
    parser.add_argument(
        "--shift-at", type=float, default=None, help="reverse the skew at this second"
    )
    parser.add_argument("--after", type=float, default=3.0, help="offered x limit after the step")
    parser.add_argument("--replicas", type=int, default=1, help="replicas sharing one store")
    parser.add_argument("--burst", type=int, default=None, help="the rule's rate_limit.burst")
    parser.add_argument("--before", type=float, default=0.5, help="offered x limit before it")
    args = parser.parse_args()
    rows, assigned = asyncio.run(
        run(args.envoys, args.limit, args.seconds, args.step_at, args.seed, not args.no_push,
            args.shift_at, args.after, args.replicas, args.burst, args.before)
    )  # fmt: skip
    limit = args.limit
    step = int(args.step_at)
    within = next(
        (s for s in range(step, len(rows)) if all(abs(r / limit - 1) <= 0.1 for r in rows[s:])),
        None,
    )
    steady = rows[step + 15 :] or rows[-5:]
    error = sum(steady) / len(steady) / limit - 1
    shift = "" if args.shift_at is None else f", skew reversed at t={args.shift_at:g}s"
    print(f"{args.envoys} Envoys on {args.replicas} replica(s), limit {limit}/s,"
          f" {args.before:g}x then {args.after:g}x at t={step}s{shift}")  # fmt: skip
    print("second  admitted/limit  assigned/limit")
    for second, (admitted, rate) in enumerate(zip(rows, assigned, strict=True)):
        print(f"{second:6d}  {admitted / limit:14.2f}  {rate / limit:14.2f}")
    reaction = "never" if within is None else f"{within - step} s"
    print(f"reaction (every later second within +-10 %): {reaction}")
    print(f"steady state after the step: {error:+.1%} of the limit")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 3.5))
        ax.plot(range(len(rows)), [r / limit for r in rows], label="admitted / limit")
        ax.axhline(1.0, color="grey", linestyle="--", label="limit")
        ax.axvline(args.step_at, color="red", linestyle=":", label="step 0.5x -> 3x")
        ax.set_xlabel("second")
        ax.set_ylabel("admitted / limit")
        ax.set_title(f"RLQS, {args.envoys} simulated Envoys (reports every 5 s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)


if __name__ == "__main__":
    main()
