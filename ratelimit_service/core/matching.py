"""Find the limit that applies to one request descriptor, the way envoyproxy/ratelimit does.

Each entry in order picks a child of the current node (:func:`_child`). A limit applies
only on the node reached by the *last* entry; a request that ends early, goes deeper
than the config, or ends on a node without a limit gets none.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ratelimit_service.core.config_model import (
    DescriptorNode,
    DomainConfig,
    NodeChildren,
    RateLimit,
)

Entries = Sequence[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Match:
    """A matched limit plus the keys that identify its counter and its stats."""

    limit: RateLimit
    stats_key: str
    bucket_key: str


def match_nodes(domain: DomainConfig, entries: Entries) -> list[DescriptorNode] | None:
    """The node matched by each entry, or None when some entry matches nothing."""
    children = domain.root
    path: list[DescriptorNode] = []
    for key, value in entries:
        node = _child(children, key, value)
        if node is None:
            return None
        path.append(node)
        children = node.children
    return path


def _child(children: NodeChildren, key: str, value: str) -> DescriptorNode | None:
    """The child an entry matches: the exact ``key``/``value`` one, else the first wildcard
    (config order) whose pattern matches, else the key's valueless default."""
    node = children.exact.get((key, value))
    if node is not None:
        return node
    for wildcard in children.wildcards:
        if wildcard.key == key and wildcard.pattern is not None and wildcard.pattern.matches(value):
            return wildcard
    return children.defaults.get(key)


def bucket_entries(domain: DomainConfig, bucket: Mapping[str, str]) -> Entries:
    """An RLQS bucket id (a map, unordered) as descriptor entries, in the order the rules nest its
    keys: at each level the first key (in the level's order: exact values, wildcards, defaults) that
    the bucket has and that matches a rule; keys no rule nests come last, sorted, so they reach no
    limit (as a request that goes deeper than the config)."""
    entries: list[tuple[str, str]] = []
    left = dict(bucket)
    children: NodeChildren | None = domain.root
    while left and children is not None:
        node = None
        for key in children.key_order():
            if key in left and (node := _child(children, key, left[key])) is not None:
                break
        if node is None:
            break
        entries.append((node.key, left.pop(node.key)))
        children = node.children
    entries += sorted(left.items())
    return tuple(entries)


def find_limits(domain: DomainConfig, entries: Entries) -> tuple[Match, ...]:
    """Every limit for ``entries`` in ``domain`` (one, or each of a ``rate_limits``
    list), with its stats and bucket keys; empty if none."""
    path = match_nodes(domain, entries)
    if not path or not path[-1].limits:
        return ()
    values = bucket_key(domain.name, path, entries)
    return tuple(
        Match(limit, stats_key(domain.name, path, entries, limit), with_window(values, limit))
        for limit in path[-1].limits
    )


def find_limit(domain: DomainConfig, entries: Entries) -> Match | None:
    """The limit for ``entries`` in ``domain`` (the first, for a ``rate_limits`` list),
    with its stats and bucket keys; None if none."""
    matches = find_limits(domain, entries)
    return matches[0] if matches else None


def stats_key(domain: str, path: list[DescriptorNode], entries: Entries, limit: RateLimit) -> str:
    """The stats key: the config path, the request path (detailed_metric), or a mix of both
    (value_to_metric); share_threshold nodes always show their pattern."""
    detailed = limit.detailed_metric
    if not detailed and not any(node.value_to_metric for node in path):
        return limit.stats_key
    parts = [
        _element(key, value)
        if (detailed or node.value_to_metric) and not node.share_threshold
        else node.stats_element()
        for node, (key, value) in zip(path, entries, strict=True)
    ]
    return ".".join([domain, *parts, *([limit.label] if limit.label else [])])


def override_stats_key(domain: str, entries: Entries) -> str:
    """Stats key of a request that carries its own ``limit``: the full request path."""
    return ".".join([domain, *(_element(key, value) for key, value in entries)])


def _element(key: str, value: str) -> str:
    """``key_value``, or just ``key`` for an empty value (as the Go service writes it)."""
    return f"{key}_{value}" if value else key


def bucket_key(domain: str, path: list[DescriptorNode], entries: Entries) -> str:
    """Identity of a counter: the request's values, except share_threshold nodes, whose
    matches all share the pattern's counter. Separators are escaped in values, so two
    different descriptors can never share a key (the Go service's ``key_value`` joining
    lets ``a=b_c`` collide with ``a_b=c``)."""
    parts = [domain]
    for node, (key, value) in zip(path, entries, strict=True):
        shown = node.value if node.share_threshold and node.value is not None else value
        parts.append(_escape(key) + "\x1e" + _escape(shown))
    return "\x1f".join(parts)


def with_window(key: str, limit: RateLimit) -> str:
    """A counter is per descriptor values *and* window: the same values under another
    unit (after a reload, or in a per-request override) must not share its count; nor
    two limits of one ``rate_limits`` list (their labels differ)."""
    if limit.label:
        return f"{key}\x1d{limit.label}\x1f{limit.window_seconds}"
    return f"{key}\x1f{limit.window_seconds}"


def override_bucket_key(domain: str, entries: Entries) -> str:
    parts = [domain, *(_escape(key) + "\x1e" + _escape(value) for key, value in entries)]
    return "\x1f".join(parts)


def _escape(text: str) -> str:
    if "\\" in text or "\x1e" in text or "\x1f" in text:
        return text.replace("\\", "\\\\").replace("\x1e", "\\r").replace("\x1f", "\\u")
    return text
