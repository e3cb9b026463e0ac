"""The arithmetic of ``ratelimit-service tune``: which rules can be tuned, at what
resolution their demand is observable, the peak of that demand, the limit it
proposes, whether a shadow rule may be promoted, and the in-place edit of a rule file.

Pure: the numbers come from Prometheus through ``tune/``, the files through the CLI.
Rule files are edited as text at the positions PyYAML's marks give, never re-dumped,
so comments, order, quoting and flow style of everything else survive.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import yaml

from ratelimit_service.core.config_model import (
    DescriptorNode,
    NodeChildren,
    RateLimit,
    RateLimitConfig,
    list_label,
)
from ratelimit_service.core.units import UNIT_SECONDS, parse_unit

Stat = float | None
"""The statistic of the demand series: None for its maximum, else a quantile in (0, 1]."""


def parse_stat(text: str) -> Stat:
    """``max`` or ``pNN[.N]`` (``p99.9``: the 0.999 quantile); ValueError otherwise."""
    if text == "max":
        return None
    match = re.fullmatch(r"p(\d+(?:\.\d+)?)", text)
    if match is None or not 0 < float(match.group(1)) <= 100:
        raise ValueError(f"expected max or pNN (p99, p99.9), got {text!r}")
    return float(match.group(1)) / 100


def stat_name(stat: Stat) -> str:
    return "max" if stat is None else f"p{stat * 100:g}"


def peak(values: Sequence[float], stat: Stat) -> float:
    """The maximum, or the nearest-rank quantile: the smallest value at or above which
    a share ``stat`` of the values lie (no interpolation, so it is a value that was seen)."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    if stat is None:
        return ordered[-1]
    rank = max(1, math.ceil(stat * len(ordered) - 1e-9))
    return ordered[rank - 1]


def propose(
    observed: float,
    headroom: float,
    current: int,
    *,
    floor: int | None = None,
    allow_lower: bool = False,
) -> int:
    """``ceil(observed * (1 + headroom))``, held at or above the lower bound: ``floor``
    when given, else 1 with ``allow_lower`` (a 0 would deny everything), else the
    current limit; without ``allow_lower`` a rule is never lowered at all."""
    wanted = math.ceil(round(observed * (1 + headroom), 9))
    lower = floor if floor is not None else (1 if allow_lower else current)
    if not allow_lower:
        lower = max(lower, current)
    return max(wanted, lower)


def should_promote(share: float, below: float, *, lowered: bool) -> bool:
    """A shadow rule may be enforced when its written limit would have denied less
    than ``below`` of its hits; not when the same change lowers it, because the share
    was observed for the higher limit."""
    return share < below and not lowered


@dataclass(frozen=True, slots=True)
class Resolution:
    """How a rule's demand per unit is read: rates over ``range_seconds`` every ``step_seconds``."""

    step_seconds: int
    range_seconds: int
    scrape_seconds: float
    unit_seconds: int

    def describe(self) -> str:
        """The sentence the report prints, so nobody reads a 15 s average as a 1 s peak."""
        unit = _UNIT_NAMES.get(self.unit_seconds) or _duration(self.unit_seconds)
        text = (
            f"per-{unit} demand from rates over {_duration(self.range_seconds)} windows"
            f" every {_duration(self.step_seconds)}"
            f" (scrape interval {_duration(self.scrape_seconds)})"
        )
        if self.range_seconds > self.unit_seconds:
            text += f"; bursts shorter than {_duration(self.range_seconds)} are averaged out"
        return text


def resolution(scrape_seconds: float, unit_seconds: int) -> Resolution:
    """Step: the unit or the scrape interval, whichever is coarser. Range: the step,
    but at least two scrape intervals, because a rate needs two samples in its window
    wherever the scrapes fall."""
    step = max(unit_seconds, math.ceil(scrape_seconds))
    return Resolution(step, max(step, math.ceil(2 * scrape_seconds)), scrape_seconds, unit_seconds)


_UNIT_NAMES = {seconds: unit.name.lower() for unit, seconds in UNIT_SECONDS.items()}


def _duration(seconds: float) -> str:
    for size, suffix in ((86400, "d"), (3600, "h"), (60, "min")):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)} {suffix}"
    return f"{seconds:g} s"


def parse_duration(text: str) -> int:
    """Prometheus-style durations: ``90s``, ``15m``, ``2h``, ``14d``, ``2w``, or several
    (``1h30m``); seconds, at least 1."""
    parts = re.findall(r"(\d+)([smhdw])", text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ValueError(f"expected a duration like 90s, 15m, 2h, 14d, got {text!r}")
    size = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
    seconds = sum(int(n) * size[u] for n, u in parts)
    if seconds < 1:
        raise ValueError(f"duration must be at least 1s, got {text!r}")
    return seconds


# -- the rules ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Rule:
    """A limited rule, with the descriptor path that reaches it (for its series)."""

    limit: RateLimit
    path: tuple[DescriptorNode, ...]
    domain: str

    @property
    def key(self) -> str:
        return self.limit.stats_key

    @property
    def file(self) -> str:
        return self.limit.source.rpartition(":")[0]

    def per_value(self) -> bool:
        """Each value of some entry gets its own counter (a key without a value, or a
        wildcard without share_threshold)."""
        return any(
            node.value is None or (node.pattern is not None and not node.share_threshold)
            for node in self.path
        )

    def series_by_value(self) -> bool:
        """Its stats keys name the values (detailed_metric or value_to_metric), so each
        counter's own demand is observable."""
        return self.limit.detailed_metric or any(node.value_to_metric for node in self.path)

    def key_pattern(self) -> str | None:
        """An RE2 pattern (fully anchored, as PromQL's ``=~``) for the stats keys of this
        rule's series, or None when the key is the config path itself."""
        if not self.series_by_value():
            return None
        parts = [re.escape(self.domain)]
        for node in self.path:
            dynamic = self.limit.detailed_metric or node.value_to_metric
            if node.share_threshold or not dynamic:
                parts.append(re.escape(node.stats_element()))
            elif node.value is not None and node.pattern is None:
                parts.append(re.escape(f"{node.key}_{node.value}"))
            else:
                parts.append(re.escape(f"{node.key}_") + ".*")
        return r"\.".join(parts)


def rules(config: RateLimitConfig) -> list[Rule]:
    """Every rule with a counted limit, in file order; unlimited rules are left out."""
    found: list[Rule] = []
    for name, domain in config.domains.items():
        _collect(domain.root, (), name, found)
    return sorted(found, key=lambda r: (r.file, r.path[-1].line or 0))


def _collect(
    children: NodeChildren, path: tuple[DescriptorNode, ...], domain: str, into: list[Rule]
) -> None:
    for node in children:
        here = (*path, node)
        for limit in node.limits:  # one, or each of a rate_limits list
            if not limit.unlimited:
                into.append(Rule(limit, here, domain))
        _collect(node.children, here, domain, into)


def excluded_patterns(rule: Rule, others: Sequence[Rule]) -> list[str]:
    """Patterns of other rules' stats keys that ``rule``'s own pattern also matches,
    for the query to leave out: ``edge\\.tenant_.*`` meets the keys of a nested rule
    (``edge.tenant_a.path_/x``) and of a sibling with a value (``edge.tenant_premium``).
    A pattern more general than the rule's own (a shorter path, or as long with more
    values open) is kept: it would take the rule's own keys with it."""
    own = rule.key_pattern()
    if own is None:
        return []
    matcher = re.compile(own)
    found = []
    for other in others:
        if other is rule:
            continue
        pattern = other.key_pattern()
        if pattern is None:
            if matcher.fullmatch(other.key):
                found.append(re.escape(other.key))
        elif len(other.path) > len(rule.path) or (
            len(other.path) == len(rule.path) and pattern.count(".*") < own.count(".*")
        ):
            found.append(pattern)
    return found


# -- editing rule files -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Span:
    """A scalar's place in its file's text (character offsets) and its line (1-based)."""

    start: int
    end: int
    line: int


@dataclass(frozen=True, slots=True)
class RulePlaces:
    """Where one rule's editable values are: ``requests_per_unit``'s and
    ``shadow_mode``'s scalars; ``shared`` when a YAML alias reuses them elsewhere."""

    requests_per_unit: Span | None
    shadow_mode: Span | None
    shared: bool


_Found = tuple[str, tuple[yaml.Node, ...], yaml.Node | None, yaml.Node | None]
"""A stats key, the nodes an alias could share, and requests_per_unit's and shadow_mode's nodes."""


def rule_places(text: str) -> dict[str, RulePlaces]:
    """Each rule's places in one file, by stats key (config path). The file must load
    (the caller has loaded it); anything unexpected is simply not found."""
    document = yaml.compose(text, Loader=yaml.SafeLoader)
    if not isinstance(document, yaml.MappingNode):
        return {}
    fields = _fields(document)
    domain = fields.get("domain")
    if not isinstance(domain, yaml.ScalarNode):
        return {}
    found: list[_Found] = []
    _walk(fields.get("descriptors"), str(domain.value), found)
    uses = Counter(id(node) for _, nodes, _, _ in found for node in nodes)
    return {
        path: RulePlaces(_span(count), _span(shadow), any(uses[id(n)] > 1 for n in nodes))
        for path, nodes, count, shadow in found
    }


def _fields(node: yaml.MappingNode) -> dict[str, yaml.Node]:
    return {str(k.value): v for k, v in node.value if isinstance(k, yaml.ScalarNode)}


def _walk(node: yaml.Node | None, path: str, into: list[_Found]) -> None:
    """Collect every descriptor's limits, in file order."""
    if not isinstance(node, yaml.SequenceNode):
        return
    for item in node.value:
        if not isinstance(item, yaml.MappingNode):
            continue
        fields = _fields(item)
        key = fields.get("key")
        if not isinstance(key, yaml.ScalarNode):
            continue
        value_text = _text(fields.get("value"))
        config_path = f"{path}.{key.value}_{value_text}" if value_text else f"{path}.{key.value}"
        shadow = fields.get("shadow_mode")
        for stats_key, limit in _limit_nodes(fields, config_path):
            count = _fields(limit).get("requests_per_unit")
            shared = tuple(n for n in (item, limit, count, shadow) if n is not None)
            into.append((stats_key, shared, count, shadow))
        _walk(fields.get("descriptors"), config_path, into)


def _limit_nodes(
    fields: dict[str, yaml.Node], config_path: str
) -> list[tuple[str, yaml.MappingNode]]:
    """A descriptor's limits with their stats keys: ``rate_limit``'s, or each of
    ``rate_limits`` (labelled as the loader labels them)."""
    single = fields.get("rate_limit")
    if isinstance(single, yaml.MappingNode):
        return [(config_path, single)]
    listed = fields.get("rate_limits")
    if not isinstance(listed, yaml.SequenceNode):
        return []
    out = []
    for limit in listed.value:
        if not isinstance(limit, yaml.MappingNode):
            continue
        own = _fields(limit)
        unit = parse_unit(_text(own.get("unit")))
        multiplier = own.get("unit_multiplier")
        times = int(multiplier.value) if isinstance(multiplier, yaml.ScalarNode) else 1
        if unit is not None:
            out.append((f"{config_path}.{list_label(_text(own.get('name')), unit, times)}", limit))
    return out


def _text(node: yaml.Node | None) -> str:
    return str(node.value) if isinstance(node, yaml.ScalarNode) else ""


def _span(node: yaml.Node | None) -> Span | None:
    if not isinstance(node, yaml.ScalarNode):
        return None
    return Span(node.start_mark.index, node.end_mark.index, node.start_mark.line + 1)


def edit(text: str, replacements: Mapping[Span, str]) -> str:
    """``text`` with each span replaced; spans must not overlap."""
    out = text
    for span in sorted(replacements, key=lambda s: s.start, reverse=True):
        out = out[: span.start] + replacements[span] + out[span.end :]
    return out
