"""Two or more revisions of the service side by side with the null server, under h2load.

    python bench/ab_revisions.py --rev 52b0834 --rev HEAD --mode exact --redis
    python bench/ab_revisions.py --rev HEAD~1 --rev HEAD --descriptors 1,5 --rounds 5
    python bench/ab_revisions.py --rev HEAD --tree /tmp/build   # holds ratelimit_service/

A change to the request path usually moves throughput by a few percent, less than
the noise between two invocations of bench/throughput.py. So this script measures
the revisions in one run, in rotated rounds (noise falls on all alike): each
revision's ``ratelimit_service`` package is taken from git (``git archive``) into a
temporary directory (or a directory given with ``--tree`` is used as it is: say, a
build with compiled modules) and served from there (``PYTHONPATH``), on the same
config as bench/throughput.py, beside the null server. It prints, per revision and descriptor
count, the median saturated req/s, its ratio to the null server, the p99 as a
multiple of the null server's and the server's CPU per request.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
from io import BytesIO
from pathlib import Path

import throughput as tp

from ratelimit_service.testing.redis import free_port

REPO = Path(__file__).resolve().parent.parent


def export(rev: str, into: Path) -> Path:
    """The revision's ``ratelimit_service`` package under ``into/<rev>``."""
    archive = subprocess.run(
        ["git", "archive", rev, "ratelimit_service"], cwd=REPO, capture_output=True, check=True
    ).stdout
    target = into / rev.replace("/", "_").replace("~", "-").replace("^", "-")
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.11.4 and later
            tar.extractall(target, filter="data")
        else:
            tar.extractall(target)
    return target


def served_from(source: Path) -> list[str]:
    """The command prefix that imports ``ratelimit_service`` from ``source``, checked.

    PYTHONSAFEPATH keeps ``python -m`` from putting the working directory first on
    the path: without it, run from the repository, every revision would import the
    working tree's package (as this script did until the seventh session)."""
    prefix = ["env", "PYTHONSAFEPATH=1", f"PYTHONPATH={source}", sys.executable]
    where = subprocess.run(
        [*prefix, "-c", "import ratelimit_service; print(ratelimit_service.__file__)"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    if not Path(where).resolve().is_relative_to(source.resolve()):
        raise SystemExit(f"{source}: python imports ratelimit_service from {where} instead")
    return prefix


def start_revision(
    processes: tp.Processes,
    name: str,
    source: Path,
    config: Path,
    flags: list[str],
    cpus: frozenset[int] | None = None,
) -> tp.Server:
    grpc_port, admin_port = free_port(), free_port()
    process = processes.start(
        name.replace("/", "_"),
        [*served_from(source), "-m", "ratelimit_service", "serve",
         "--config", str(config), "--grpc-addr", f"127.0.0.1:{grpc_port}",
         "--admin-addr", f"127.0.0.1:{admin_port}", *flags],
        cpus,
    )  # fmt: skip
    tp.wait_healthy(admin_port)
    return tp.Server(name, grpc_port, admin_port, process.pid)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", action="append", default=[], help="a git revision")
    parser.add_argument(
        "--tree", action="append", default=[], help="a directory holding ratelimit_service/"
    )
    parser.add_argument("--mode", choices=["probabilistic", "exact"], default="probabilistic")
    parser.add_argument("--redis", action="store_true", help="serve on a redis-server")
    parser.add_argument("--descriptors", default="1", help="comma-separated, e.g. 1,5")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3)
    parser.add_argument(
        "--pin", action="store_true",
        help="servers on CPU 0, h2load and redis-server on CPU 1 (as bench/throughput.py --pin)",
    )  # fmt: skip
    args = parser.parse_args()
    counts = [int(n) for n in args.descriptors.split(",")]
    servers_on, load_on = tp.pinning(args.pin)
    progress = tp.Progress()
    results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
    with tp.lab() as (directory, processes, redis_servers):
        config = directory / "config"
        config.mkdir()
        (config / "bench.yaml").write_text(tp.CONFIG)
        flags = ["--mode", args.mode]
        if args.redis:
            flags += ["--redis-url", tp.start_redis(directory, redis_servers, load_on).url]
        sources = [(rev, export(rev, directory / "src")) for rev in args.rev]
        sources += [(tree, Path(tree).resolve()) for tree in args.tree]
        if not sources:
            parser.error("give at least one --rev or --tree")
        progress(f"starting the null server and {len(sources)} services ({' '.join(flags)})")
        servers = [tp.start_null(processes, servers_on)]
        for name, source in sources:
            servers.append(start_revision(processes, name, source, config, flags, servers_on))
        bodies = tp.write_bodies(directory, counts)
        log = directory / "h2load.log"
        tp.warm_up(servers, bodies, log, load_on)
        for round_ in range(args.rounds):
            shift = round_ % len(servers)
            for server in servers[shift:] + servers[:shift]:
                for count, body in bodies.items():
                    progress(f"round {round_ + 1}/{args.rounds}: {server.name}, {count} descr.")
                    before = tp.cpu_seconds(server.pid)
                    h2 = tp.run_h2load(server.port, body, "saturate", args.seconds, log, load_on)
                    cpu = (tp.cpu_seconds(server.pid) - before) / max(h2.done, 1) * 1e6
                    results.setdefault((server.name, count), []).append((h2.rps, h2.p99_us, cpu))
    print(
        "\n| revision | descr. | req/s | ratio to null | per-round ratios, min-max "
        "| p99 ÷ null's | CPU µs/req | rounds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for count in counts:
        null = results[("null server", count)]
        null_rps = statistics.median(r[0] for r in null)
        null_p99 = statistics.median(r[1] for r in null)
        for server in servers:
            runs = results[(server.name, count)]
            rps = statistics.median(r[0] for r in runs)
            p99 = statistics.median(r[1] for r in runs)
            cpu = statistics.median(r[2] for r in runs)
            each = ", ".join(f"{r[0]:,.0f}" for r in runs)
            # Each round's ratio to the null server's run of the same round: the
            # spread says how far the median ratio can be trusted.
            paired = [r[0] / n[0] for r, n in zip(runs, null, strict=True)]
            print(f"| {server.name} | {count} | {rps:,.0f} | {rps / null_rps:.3f} "
                  f"| {min(paired):.3f}-{max(paired):.3f} "
                  f"| {p99 / null_p99:.2f} | {cpu:.0f} | {each} |")  # fmt: skip


if __name__ == "__main__":
    os.chdir(REPO)
    main()
