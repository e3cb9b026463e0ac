"""What the decision metadata costs an answer: rls/wire's encode_response with the
``dynamic_metadata`` (the request's domain given) and without it, side by side.

    python bench/decision_metadata.py            # ~10 s
    python bench/decision_metadata.py --quick    # a trial

The metadata is written in encode_response alone, so the difference between the two
is all it adds to the request path. Each round times both variants in turn (the
order alternating), for a typical answer of 1 descriptor and one of 5 (an OK, limits
prebuilt per config as the servicer has them); the figures are the medians of the
rounds' per-call times. Compare them with the service's CPU per request at the gRPC
port (docs/benchmarks.md, "Throughput and latency"), about 160-200 µs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from ratelimit_service.core.config_model import RateLimit
from ratelimit_service.core.decision import answer
from ratelimit_service.core.request import Code, DescriptorStatus, Response
from ratelimit_service.core.units import Unit
from ratelimit_service.rls.wire import LimitHeads, encode_response


def typical(descriptors: int) -> tuple[Response, LimitHeads]:
    limits = [
        RateLimit(1000 * (i + 1), Unit.MINUTE, name="" if i else "per-ip", stats_key=f"edge.k{i}")
        for i in range(descriptors)
    ]
    statuses = [DescriptorStatus(Code.OK, limit, 873 + i, 12.5) for i, limit in enumerate(limits)]
    return answer(statuses), LimitHeads(limits)


def per_call(call: Callable[[], object], calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return (time.perf_counter() - started) / calls


def measure(descriptors: int, rounds: int, calls: int) -> dict[str, float]:
    response, heads = typical(descriptors)
    variants = {
        "without": lambda: encode_response(response, None, heads),
        "with": lambda: encode_response(response, None, heads, "edge"),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for round_number in range(rounds):
        order = list(variants) if round_number % 2 == 0 else list(reversed(variants))
        for name in order:
            times[name].append(per_call(variants[name], calls))
    result = {name: statistics.median(values) * 1e6 for name, values in times.items()}
    result["added"] = result["with"] - result["without"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--quick", action="store_true", help="3 rounds of 2,000 calls")
    args = parser.parse_args()
    rounds, calls = (3, 2_000) if args.quick else (args.rounds, args.calls)
    results = {n: measure(n, rounds, calls) for n in (1, 5)}
    print("| descriptors | encode without µs | with metadata µs | added µs |")
    print("|---|---|---|---|")
    for n, result in results.items():
        print(f"| {n} | {result['without']:.2f} | {result['with']:.2f} | {result['added']:.2f} |")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
