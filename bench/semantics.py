"""What a rule of N per second does in each mode, on real processes (docs/benchmarks.md,
"Semantics per mode").

    python bench/semantics.py            # ~1.5-2 min; --limit 200 --seconds 6

For each mode (probabilistic and exact, on the embedded store and on one
redis-server) it starts real service processes with default flags (one process on
the embedded store, three on Redis) and measures, each on a key never hit before:

- burst:    2N requests sent at once to one process: how many are admitted (on Redis
            also 2N spread evenly over the processes at once)
- window:   N at once, then 2N/s for --seconds, spread 0.5/0.3/0.2 over the processes:
            the most admitted in any 1 s window (by send time, and by answer time:
            the service decides in between), the mean after 2 s,
            answers given by failure_mode (/metrics) meanwhile
- step:     0.5N/s for 4 s, then 3N/s for 5 s: reaction time, measured as
            simulate.reaction_time measures it (within +-10 %, held 2 s), and
            failure_mode answers meanwhile
- outage:   (Redis only) 2N/s for 9 s, redis-server SIGSTOPped for 3 s from t = 2 s:
            errors, p99 latency during the freeze, admitted per second during it,
            answers given by failure_mode (/metrics)
- overload: one process with --exact-max-pending 16 and --redis-timeout 1 on a
            frozen redis-server: 100 requests at once on an exact failure_mode: open
            rule, then 100 on an exact closed rule and 100 on a probabilistic rule,
            how each is answered; and 2N at once on exact embedded with the same flags
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from envoy.service.ratelimit.v3 import rls_pb2_grpc
from fleet_scenarios import max_in_any_window, p99
from simulate import reaction_time

from ratelimit_harness import fleet
from ratelimit_harness.fleet import Timeline, drive, redis_server, service_fleet
from ratelimit_harness.redis import RedisServer
from ratelimit_service.cli.client import build_request

DOMAIN = "sem"
OVER = 2
SKEW = [0.5, 0.3, 0.2]
MODES = (
    ("probabilistic", False),
    ("probabilistic", True),
    ("exact", False),
    ("exact", True),
)


@dataclass
class TimedTimeline(Timeline):
    """A Timeline that also keeps each answer's send time, beside its latency."""

    sent_at: list[float] = field(default_factory=list)
    admitted_answered_at: list[float] = field(default_factory=list)

    def record(self, at: float, admitted: bool, latency: float) -> None:
        super().record(at, admitted, latency)
        self.sent_at.append(at)
        if admitted:
            self.admitted_answered_at.append(at + latency)


fleet.Timeline = TimedTimeline  # type: ignore[misc]  # drive() builds its timeline by name


@contextlib.contextmanager
def services(
    count: int, config: Path, redis_url: str | None, extra: Sequence[str] = ()
) -> Iterator[list[tuple[int, int]]]:
    """``count`` service processes: (grpc port, admin port) each."""
    with service_fleet(count, config, redis_url, ["--log-level", "WARNING", *extra]) as nodes:
        yield [(node.grpc_port, node.admin_port) for node in nodes]


def metric_sum(admin_ports: Sequence[int], name: str) -> float:
    """Sum of every sample of ``name`` over the processes' /metrics."""
    total = 0.0
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", re.M)
    for port in admin_ports:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            text = response.read().decode()
        total += sum(float(v) for v in pattern.findall(text))
    return total


async def at_once(port: int, descriptor: str, count: int) -> dict[str, int]:
    """``count`` requests sent together on one channel: how they were answered."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        await channel.channel_ready()
        request = build_request(DOMAIN, [descriptor], 0)
        calls = [stub.ShouldRateLimit(request, timeout=5) for _ in range(count)]
        answers = await asyncio.gather(*calls, return_exceptions=True)
    tally = {"admitted": 0, "denied": 0}
    for answer in answers:
        if isinstance(answer, grpc.aio.AioRpcError):
            tally[answer.code().name] = tally.get(answer.code().name, 0) + 1
        else:
            tally["denied" if answer.overall_code == OVER else "admitted"] += 1
    return tally


def rate_between(timeline: Timeline, start: float, end: float) -> float:
    rows = [r for r in timeline.rows() if start <= r[0] < end]
    return sum(r[2] for r in rows) / (len(rows) * timeline.bucket) if rows else 0.0


def measure(mode: str, on_redis: bool, limit: int, seconds: float, tmp: Path) -> dict:
    config = tmp / f"{mode}.yaml"
    config.write_text(
        f"domain: {DOMAIN}\ndescriptors:\n  - key: k\n    mode: {mode}\n"
        f"    rate_limit: {{unit: second, requests_per_unit: {limit}}}\n"
    )
    result: dict = {}
    with contextlib.ExitStack() as stack:
        redis: RedisServer | None = None
        if on_redis:
            redis = stack.enter_context(redis_server(tmp / f"redis-{mode}"))
        count = 3 if on_redis else 1
        nodes = stack.enter_context(services(count, config, redis.url if redis else None))
        grpc_ports = [g for g, _ in nodes]
        admin_ports = [a for _, a in nodes]
        skew = SKEW[:count]
        time.sleep(1.0)  # a sync or two, so that each process knows the fleet's size

        failure_mode = "ratelimit_service_rate_limit_failure_mode_allowed_total"
        before = metric_sum(admin_ports, failure_mode)
        result["burst"] = asyncio.run(at_once(grpc_ports[0], "k=burst", 2 * limit))
        if count > 1:

            async def spread() -> list[dict[str, int]]:
                share = 2 * limit // count
                return await asyncio.gather(*(at_once(p, "k=spread", share) for p in grpc_ports))

            result["burst_spread"] = sum(t["admitted"] for t in asyncio.run(spread()))
        result["burst_failure_mode"] = metric_sum(admin_ports, failure_mode) - before

        before = metric_sum(admin_ports, failure_mode)
        tick = 0.002
        window = asyncio.run(
            drive(
                grpc_ports,
                skew,
                lambda s: limit / tick if s < tick else 2 * limit,
                seconds,
                DOMAIN,
                "k=window",
            )
        )
        result["window_max"] = max_in_any_window(window)
        answered = Timeline(window.bucket, admitted_at=window.admitted_answered_at)
        result["window_max_answered"] = max_in_any_window(answered)
        result["window_p99"] = p99(window.latencies)
        result["window_first"] = sum(1 for t in window.admitted_at if t < 1.0)
        result["window_mean"] = rate_between(window, 2, seconds)
        result["window_errors"] = window.errors
        result["window_failure_mode"] = metric_sum(admin_ports, failure_mode) - before

        before = metric_sum(admin_ports, failure_mode)
        step_at, step_seconds = 4.0, 9.0
        step = asyncio.run(
            drive(
                grpc_ports,
                skew,
                lambda s: 0.5 * limit if s < step_at else 3 * limit,
                step_seconds,
                DOMAIN,
                "k=step",
            )
        )
        result["step_reaction"] = reaction_time(step.rows(), step.bucket, step_at, limit, 0.10)
        result["step_rows"] = [r[2] for r in step.rows() if step_at <= r[0] < step_at + 2.5]
        result["step_after"] = rate_between(step, step_at + 2, step_seconds) / limit
        result["step_failure_mode"] = metric_sum(admin_ports, failure_mode) - before

        if redis is not None:
            before = metric_sum(admin_ports, failure_mode)

            async def frozen() -> Timeline:
                task = asyncio.create_task(
                    drive(grpc_ports, skew, lambda _: 2 * limit, 9.0, DOMAIN, "k=outage")
                )
                await asyncio.sleep(2.0)
                redis.pause()
                await asyncio.sleep(3.0)
                redis.resume()
                return await task

            outage = asyncio.run(frozen())
            during = [
                lat
                for at, lat in zip(outage.sent_at, outage.latencies, strict=True)
                if 2.0 <= at < 5.0
            ]
            result["outage_errors"] = outage.errors
            result["outage_p99_during"] = p99(during)
            result["outage_p99_before"] = p99(
                [lat for at, lat in zip(outage.sent_at, outage.latencies, strict=True) if at < 2.0]
            )
            result["outage_rate_during"] = rate_between(outage, 2.25, 5.0) / limit
            result["outage_max_after"] = max_in_any_window(
                Timeline(outage.bucket, admitted_at=[t for t in outage.admitted_at if t >= 5.0])
            )
            result["outage_failure_mode"] = metric_sum(admin_ports, failure_mode) - before
            result["outage_rows"] = [r[2] for r in outage.rows() if 4.5 <= r[0] < 7.5]
    return result


def overload(limit: int, tmp: Path) -> dict:
    config = tmp / "overload.yaml"
    config.write_text(
        f"domain: {DOMAIN}\ndescriptors:\n"
        f"  - key: open\n    mode: exact\n"
        f"    rate_limit: {{unit: second, requests_per_unit: {limit}}}\n"
        f"  - key: closed\n    mode: exact\n    failure_mode: closed\n"
        f"    rate_limit: {{unit: second, requests_per_unit: {limit}}}\n"
        f"  - key: local\n    mode: probabilistic\n"
        f"    rate_limit: {{unit: second, requests_per_unit: {limit}}}\n"
    )
    extra = ["--exact-max-pending", "16", "--redis-timeout", "1"]
    with services(1, config, None, extra) as n:
        ((grpc_port, _),) = n
        embedded = asyncio.run(at_once(grpc_port, "open=a", 2 * limit))
    with redis_server(tmp / "redis-overload") as redis, services(1, config, redis.url, extra) as n:
        ((grpc_port, admin_port),) = n

        async def frozen() -> list[dict[str, int]]:
            redis.pause()
            try:
                opened = asyncio.create_task(at_once(grpc_port, "open=a", 100))
                await asyncio.sleep(0.5)
                closed = asyncio.create_task(at_once(grpc_port, "closed=a", 100))
                local = asyncio.create_task(at_once(grpc_port, "local=a", 100))
                await asyncio.sleep(0.3)
            finally:
                redis.resume()
            return [await opened, await closed, await local]

        opened, closed, local = asyncio.run(frozen())
        counted = metric_sum([admin_port], "ratelimit_service_rate_limit_overloaded_total")
    return {
        "open": opened,
        "closed": closed,
        "local": local,
        "embedded": embedded,
        "overloaded_metric": counted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=200, help="N, per second")
    parser.add_argument("--seconds", type=float, default=6.0, help="length of the window run")
    args = parser.parse_args()
    limit = args.limit
    started = time.monotonic()
    lines = [
        f"rule: {limit}/second; Redis modes on 3 processes, embedded on 1",
        "| mode | burst at once (2N sent) | most in any 1 s window | mean after 2 s | "
        "step reaction | admitted per 250 ms after the step | outage |",
        "|---|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for mode, on_redis in MODES:
            label = f"{mode} {'Redis' if on_redis else 'embedded'}"
            print(f"{label} ...", flush=True)
            r = measure(mode, on_redis, limit, args.seconds, tmp)
            burst = r["burst"]
            extra = {k: v for k, v in burst.items() if k not in ("admitted", "denied")}
            outage = "n/a (no Redis)"
            if r["burst_failure_mode"]:
                extra["failure_mode answers, both bursts"] = int(r["burst_failure_mode"])
            if "burst_spread" in r:
                extra["spread evenly over the processes"] = r["burst_spread"]
            if on_redis:
                outage = (
                    f"errors {r['outage_errors']}; p99 {r['outage_p99_before'] * 1000:.1f} ms "
                    f"before, {r['outage_p99_during'] * 1000:.1f} ms during; admitted "
                    f"{r['outage_rate_during']:.2f}x N/s during; failure_mode answers "
                    f"{r['outage_failure_mode']:.0f}; most in 1 s after {r['outage_max_after']}; "
                    f"per 250 ms from 4.5 s: {', '.join(map(str, r['outage_rows']))}"
                )
            lines.append(
                f"| {label} | {burst['admitted']} of {2 * limit}{' ' + str(extra) if extra else ''}"
                f" | {r['window_max']} ({r['window_max'] / limit:.2f}x; by answer time "
                f"{r['window_max_answered']}; first second {r['window_first']}; p99 "
                f"{r['window_p99'] * 1000:.1f} ms) | "
                f"{r['window_mean'] / limit:.3f}x (errors {r['window_errors']}, failure_mode "
                f"answers {r['window_failure_mode']:.0f}) | "
                f"{r['step_reaction']:.2f} s (then {r['step_after']:.3f}x; failure_mode "
                f"answers {r['step_failure_mode']:.0f}) | "
                f"{', '.join(map(str, r['step_rows']))} | {outage} |"
            )
        print("overload ...", flush=True)
        o = overload(limit, tmp)
    lines.append(
        f"overload, --exact-max-pending 16, Redis frozen: exact open rule, 100 at once: "
        f"{o['open']}; exact closed rule, 100 at once: {o['closed']}; probabilistic rule, "
        f"100 at once: {o['local']}; overloaded_total {o['overloaded_metric']:.0f}. "
        f"Exact embedded, --exact-max-pending 16, {2 * limit} at once: {o['embedded']}"
    )
    lines.append(f"({time.monotonic() - started:.0f} s)")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
