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

from ratelimit_service.config.files import read_config_files
from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_loader import load_config
from ratelimit_service.tune.arithmetic import rules


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
