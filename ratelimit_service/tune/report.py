"""What the tuner decided for each rule, and the text it prints: the table, the
resolution of each estimate, the shadow rules' would-deny report, and the diff."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ratelimit_service.tune.arithmetic import Stat, peak, propose, should_promote, stat_name
from ratelimit_service.tune.observe import Observation


@dataclass(frozen=True, slots=True)
class Options:
    headroom: float
    stat: Stat
    min_samples: int
    floor: int | None
    allow_lower: bool
    promote: bool
    promote_below: float
    window_text: str


@dataclass(frozen=True, slots=True)
class Outcome:
    """One rule's line: ``proposed`` None means the rule is left as it is, ``note`` why."""

    seen: Observation
    peak: float | None
    proposed: int | None
    promote: bool
    note: str

    @property
    def changes(self) -> bool:
        return self.promote or (
            self.proposed is not None and self.proposed != self.seen.rule.limit.requests_per_unit
        )


def decide(seen: Observation, options: Options) -> Outcome:
    """The proposal for one rule from what was observed, or the reason there is none."""
    limit = seen.rule.limit
    current = limit.requests_per_unit
    share = seen.share
    if current == 0:
        return Outcome(seen, None, None, False, "limit 0 denies everything on purpose")
    if not seen.has_series:
        return Outcome(seen, None, None, False, "no data")
    top: float | None = None
    proposed: int | None = None
    note = ""
    if seen.rule.per_value() and not seen.rule.series_by_value():
        note = (
            "one counter per value, but its stats add up every value:"
            " set detailed_metric: true to tune it"
        )
    elif len(seen.demand) < options.min_samples:
        note = f"too little data ({len(seen.demand)} of {options.min_samples} samples)"
    else:
        top = peak([v for _, v in seen.demand], options.stat)
        proposed = propose(
            top, options.headroom, current, floor=options.floor, allow_lower=options.allow_lower
        )
    lowered = proposed is not None and proposed < current
    promote = (
        options.promote
        and limit.shadow_mode
        and share is not None
        and should_promote(share, options.promote_below, lowered=lowered)
    )
    return Outcome(seen, top, proposed, promote, note)


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.6g}" if value < 1e6 else f"{value:.0f}"


def _share(seen: Observation) -> str:
    share = seen.share
    if share is None:
        return "-"
    return f"{share * 100:.3f} %" + (" (would)" if seen.rule.limit.shadow_mode else "")


def table(outcomes: Sequence[Outcome], options: Options) -> str:
    """One row per rule: what it is, what it saw, what it proposes."""
    peak_name = f"peak ({stat_name(options.stat)})"
    header = ("rule", "mode", "current", peak_name, "proposed", "denied", "note")
    rows = [header]
    for outcome in outcomes:
        limit = outcome.seen.rule.limit
        mode = limit.mode.value + (" shadow" if limit.shadow_mode else "")
        proposed = "-" if outcome.proposed is None else str(outcome.proposed)
        if outcome.promote:
            proposed += " enforce"
        note = outcome.note
        if not note and outcome.proposed == limit.requests_per_unit and not outcome.promote:
            note = "unchanged"
        current = f"{limit.requests_per_unit}/{limit.period}"
        top = _number(outcome.peak)
        rows.append((limit.stats_key, mode, current, top, proposed, _share(outcome.seen), note))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(line.rstrip() for line in lines) + "\n"


def resolutions(outcomes: Sequence[Outcome]) -> str:
    """Which estimate each proposal stands on, grouped by sentence."""
    groups: dict[str, list[str]] = {}
    for outcome in outcomes:
        res = outcome.seen.resolution
        if res is None or outcome.peak is None:
            continue
        sentence = res.describe()
        if not outcome.seen.scrape_measured:
            sentence += "; scrape interval assumed, no recent samples: give --scrape-interval"
        groups.setdefault(sentence, []).append(outcome.seen.rule.key)
    return "".join(f"resolution: {s}: {', '.join(keys)}\n" for s, keys in groups.items())


def shadow_report(outcomes: Sequence[Outcome], options: Options) -> str:
    """Per shadow rule: how often its written limit would have denied, for whom, if promoted."""
    lines = []
    for outcome in outcomes:
        seen = outcome.seen
        limit = seen.rule.limit
        if not limit.shadow_mode or not seen.has_series:
            continue
        share = seen.share
        text = (
            f"shadow {limit.stats_key}: the written limit {limit.requests_per_unit}/"
            f"{limit.period} would have denied {seen.denied:.0f} of "
            f"{seen.hits:.0f} hits over {options.window_text}"
        )
        if share is not None:
            text += f" ({share * 100:.3f} %)"
        lines.append(text)
        if seen.top_keys:
            who = ", ".join(f"{key} ({count:.0f})" for key, count in seen.top_keys)
            lines.append(f"  most denied: {who}")
        elif seen.denied > 0:
            lines.append("  for whom: set detailed_metric: true to see the keys")
        if options.promote:
            below = f"{options.promote_below * 100:g} %"
            if outcome.promote:
                lines.append(f"  promoted: shadow_mode off (below {below})")
            elif share is not None and share < options.promote_below:
                lines.append("  not promoted: the same change lowers its limit")
            else:
                lines.append(f"  not promoted: not below {below}")
    return "".join(line + "\n" for line in lines)


def unified_diff(before: Mapping[str, str], after: Mapping[str, str]) -> str:
    """A unified diff of every changed file, in file order."""
    parts: list[str] = []
    for name, text in before.items():
        new = after.get(name, text)
        if new != text:
            lines = text.splitlines(keepends=True), new.splitlines(keepends=True)
            parts.extend(difflib.unified_diff(*lines, fromfile=name, tofile=name))
    return "".join(parts)
