"""The ``tune`` command: read each rule's observed demand from Prometheus, propose
``requests_per_unit = ceil(peak x (1 + headroom))``, print a table and a diff of the
rule files, and with ``--write`` apply it (``--promote``: also turn shadow rules whose
written limit would rarely have denied into enforced ones).

Nothing is written unless every query succeeded and the edited files load.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

from ratelimit_service.config.files import read_config_files
from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_loader import load_config
from ratelimit_service.tune.arithmetic import parse_duration, parse_stat, rules


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` with its ValueError's text as argparse's message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


_duration = _checked(parse_duration)
_stat = _checked(parse_stat)


def _fraction(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _percent(text: str) -> float:
    value = float(text.rstrip("% "))
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage from 0 to 100, got {text}")
    return value / 100


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _when(text: str) -> float:
    """Unix seconds or an ISO 8601 time with its zone."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected unix seconds or ISO 8601, got {text!r}"
        ) from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"give the time zone too (Z or +00:00): {text!r}")
    return moment.timestamp()


def add_tune_parser(commands: Any) -> None:
    """Register ``tune`` on the top-level subparsers."""
    tune = commands.add_parser(
        "tune",
        help="propose limits from the demand Prometheus observed (--write: apply them)",
        description=(__doc__ or "").replace("``", ""),
    )
    tune.add_argument("--prometheus", required=True, help="Prometheus base URL, http://HOST:PORT")
    tune.add_argument("--config", required=True, help="rule file, or directory of *.yaml/*.yml")
    tune.add_argument(
        "--window",
        type=_duration,
        default=parse_duration("14d"),
        metavar="DURATION",
        help="how far back to look (Prometheus durations: 14d, 36h, 2w; default 14d)",
    )
    tune.add_argument(
        "--headroom",
        type=_fraction,
        default=0.3,
        help="proposed = ceil(peak x (1 + HEADROOM)); default 0.3",
    )
    tune.add_argument(
        "--stat",
        type=_stat,
        metavar="max|pNN",
        help="the peak: max (default) or a quantile such as p99.9 (nearest rank)",
    )
    tune.add_argument(
        "--min-samples",
        type=_count,
        default=60,
        help="rules with fewer demand samples are listed and left alone (60)",
    )
    tune.add_argument(
        "--floor",
        type=_count,
        help="never propose below this (default: the current limit; with"
        " --allow-lower and no --floor: 1)",
    )
    tune.add_argument(
        "--allow-lower",
        action="store_true",
        help="let a proposal go below the current limit (down to --floor)",
    )
    tune.add_argument(
        "--promote",
        action="store_true",
        help="turn shadow_mode off for shadow rules whose would-deny share over"
        " the window is below --promote-below",
    )
    tune.add_argument(
        "--promote-below",
        type=_percent,
        default=0.001,
        metavar="PERCENT",
        help="percent of hits (default 0.1)",
    )
    tune.add_argument(
        "--write",
        action="store_true",
        help="rewrite the rule files (atomically; live reload picks them up)",
    )
    tune.add_argument(
        "--plot",
        type=Path,
        metavar="DIR",
        help="one PNG per rule (demand, current and proposed limit) and index.html",
    )
    tune.add_argument(
        "--scrape-interval",
        type=_duration,
        metavar="DURATION",
        help="default: measured from each rule's recent samples",
    )
    tune.add_argument(
        "--end",
        type=_when,
        metavar="TIME",
        help="the window's end, unix seconds or ISO 8601 (default: now)",
    )
    tune.add_argument("--timeout", type=float, default=30.0, help="seconds per Prometheus query")
    tune.add_argument("--merge-domain-config", action="store_true")


def _window_text(seconds: int) -> str:
    for size, suffix in ((86400, "d"), (3600, "h"), (60, "m")):
        if seconds % size == 0:
            return f"{seconds // size}{suffix}"
    return f"{seconds}s"


def cmd_tune(args: argparse.Namespace) -> int:
    from ratelimit_service.tune import report, rewrite
    from ratelimit_service.tune.observe import observe
    from ratelimit_service.tune.plots import plotting_missing, write_plots
    from ratelimit_service.tune.prometheus import PrometheusClient, PrometheusError

    if args.plot is not None and (missing := plotting_missing()):
        print(f"tune: {missing}", file=sys.stderr)
        return 1
    merge = bool(args.merge_domain_config)
    try:
        files = read_config_files(args.config)
        config = load_config(files, merge_domains=merge)
    except ConfigLoadError as exc:
        print(*exc.errors, sep="\n", file=sys.stderr)
        return 1
    options = report.Options(
        headroom=args.headroom,
        stat=args.stat,
        min_samples=args.min_samples,
        floor=args.floor,
        allow_lower=bool(args.allow_lower),
        promote=bool(args.promote),
        promote_below=args.promote_below,
        window_text=_window_text(args.window),
    )
    end = args.end if args.end is not None else time.time()
    listed = rules(config)
    try:
        client = PrometheusClient(args.prometheus, timeout=args.timeout)
        seen = [
            observe(client, rule, listed, end=end, window=args.window, scrape=args.scrape_interval)
            for rule in listed
        ]
    except PrometheusError as exc:
        print(f"tune: {exc}", file=sys.stderr)
        return 1
    outcomes = [report.decide(one, options) for one in seen]
    after = rewrite.new_texts(files, outcomes)
    try:
        rewrite.check_loads(files, after, merge)
    except rewrite.RewriteError as exc:
        print(f"tune: the edited rules would not load, nothing written: {exc}", file=sys.stderr)
        return 1
    table_text = report.table(outcomes, options)
    print(table_text, report.resolutions(outcomes), sep="", end="")
    print(report.shadow_report(outcomes, options), end="")
    print(report.unified_diff({f.name: f.text for f in files}, after) or "no changes\n", end="")
    if args.write:
        for f in files:
            if after[f.name] != f.text:
                rewrite.write_atomically(f.name, after[f.name])
                print(f"wrote {f.name}")
    if args.plot is not None:
        write_plots(outcomes, table_text, args.plot)
        print(f"plots: {args.plot / 'index.html'}")
    return 0
