"""``--plot DIR``: per rule, one PNG of its observed demand over the window with the
current and the proposed limit, and an index.html with the table. matplotlib is optional
(the ``test`` and ``bench`` extras): without it ``--plot`` says so before anything runs.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from ratelimit_service.tune.report import Outcome


def plotting_missing() -> str | None:
    """Why plots cannot be drawn here, or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib: pip install matplotlib (or the test extra)"
    return None


def file_name(key: str) -> str:
    """A stats key as a file name: anything but letters, digits, '.', '_' and '-' becomes '_'."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", key) + ".png"


def plot_rule(outcome: Outcome, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    seen = outcome.seen
    limit = seen.rule.limit
    figure, axes = plt.subplots(figsize=(9, 3.6))
    times: list[Any] = [datetime.fromtimestamp(t, UTC) for t, _ in seen.demand]
    axes.plot(times, [v for _, v in seen.demand], linewidth=0.8, label="observed demand")
    axes.axhline(limit.requests_per_unit, color="tab:red", linestyle="--", label="current limit")
    if outcome.proposed is not None and outcome.proposed != limit.requests_per_unit:
        axes.axhline(outcome.proposed, color="tab:green", label="proposed limit")
    axes.set_title(limit.stats_key + (" (shadow)" if limit.shadow_mode else ""))
    axes.set_ylabel(f"requests per {limit.period}")
    if seen.resolution is not None:
        axes.set_xlabel(seen.resolution.describe(), fontsize=8)
    top = max([v for _, v in seen.demand] + [limit.requests_per_unit, outcome.proposed or 0])
    axes.set_ylim(0, top * 1.15 or 1)
    axes.legend(loc="best", fontsize=8)
    figure.autofmt_xdate()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def write_plots(outcomes: Sequence[Outcome], table_text: str, directory: Path) -> None:
    """One PNG per rule with demand, then index.html."""
    directory.mkdir(parents=True, exist_ok=True)
    items = []
    for outcome in outcomes:
        if not outcome.seen.demand:
            continue
        path = directory / file_name(outcome.seen.rule.key)
        plot_rule(outcome, path)
        key = html.escape(outcome.seen.rule.key)
        items.append(f'<li><h2>{key}</h2><img src="{html.escape(path.name)}" alt="{key}"></li>')
    (directory / "index.html").write_text(
        '<!doctype html>\n<html><head><meta charset="utf-8"><title>ratelimit-service tune'
        "</title></head><body>\n<h1>ratelimit-service tune</h1>\n"
        f"<pre>{html.escape(table_text)}</pre>\n<ul>\n" + "\n".join(items) + "\n</ul>\n"
        "</body></html>\n"
    )
