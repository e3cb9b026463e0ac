"""The immutable rule tree that a loaded configuration becomes: the loader builds it once
per (re)load and the request path only reads it, so a reload is an atomic swap of one
reference and needs no locks."""

from __future__ import annotations

import enum
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ratelimit_service.core.units import UNIT_SECONDS, Unit


class Mode(enum.Enum):
    """How a rule decides: a store round trip per hit, or a locally cached drop ratio."""

    EXACT = "exact"
    PROBABILISTIC = "probabilistic"


class FailureMode(enum.Enum):
    """What a rule answers when its store cannot be reached in time."""

    OPEN = "open"
    CLOSED = "closed"


class HeaderStyle(enum.Enum):
    """Which rate-limit headers an answer asks Envoy to add to the client response
    (--response-headers)."""

    OFF = "off"
    RATELIMIT = "ratelimit"
    """``RateLimit-Limit`` / ``-Remaining`` / ``-Reset`` (names configurable), as the Go service."""
    DRAFT03 = "draft03"
    """``X-RateLimit-*`` of draft-ietf-httpapi-ratelimit-headers-03, as Envoy's own
    ``enable_x_ratelimit_headers: DRAFT_VERSION_03`` writes them (limit with ``;w=``)."""


MAX_OVER_LIMIT_BODY = 16 * 1024
"""The largest ``over_limit.body`` a rule may give (bytes, UTF-8): every denial by the
rule carries it, and Envoy holds it in memory per 429."""


@dataclass(frozen=True, slots=True)
class OverLimitAnswer:
    """What a rule's 429 says (YAML ``over_limit``): the body Envoy sends instead of its
    own (the RLS answer's ``raw_body``) and, when given, its content type."""

    body: bytes
    content_type: str | None = None


@dataclass(frozen=True, slots=True)
class UsageSource:
    """Where Envoy finds what a response cost (YAML ``usage``): a response header, or a dynamic
    metadata key (namespace, key). ``envoy-config`` sends such a rule's descriptors twice: a check
    at cost 0 before the request, and the cost once the stream is done."""

    header: str | None = None
    metadata: tuple[str, str] | None = None

    @property
    def hits_format(self) -> str:
        """Envoy's substitution format for the report's ``hits_addend``."""
        if self.header is not None:
            return f"%RESP({self.header})%"
        assert self.metadata is not None
        namespace, key = self.metadata
        return f"%DYNAMIC_METADATA({namespace}:{key})%"


@dataclass(frozen=True, slots=True)
class RateLimit:
    """One limit: a count per window, with everything that decides how it is enforced."""

    requests_per_unit: int
    unit: Unit
    unit_multiplier: int = 1
    """The period is this many units: {unit: minute, unit_multiplier: 10} is 10 minutes."""
    name: str = ""
    unlimited: bool = False
    replaces: frozenset[str] = frozenset()
    shadow_mode: bool = False
    quota_mode: bool = False
    detailed_metric: bool = False
    mode: Mode = Mode.PROBABILISTIC
    failure_mode: FailureMode = FailureMode.OPEN
    burst: int | None = None
    """Probabilistic mode: the most a fresh or idle key admits at once (None: the
    limit). Exact windows always admit the limit."""
    calendar: str | None = None
    """A time zone: the rule counts over calendar periods of its unit there (a month
    from local midnight on the 1st; core/calendar.py), each starting from nothing;
    None: a rolling window of ``window_seconds``."""
    stats_key: str = ""
    metadata: Mapping[str, Any] | None = None
    over_limit: OverLimitAnswer | None = None
    """The body (and content type) of a 429 that this rule decided."""
    usage: UsageSource | None = None
    """A usage budget: where Envoy reads a response's cost (envoy-config's two-phase
    form). The service counts costs by the descriptor's own ``hits_addend`` either way."""
    source: str = ""
    label: str = ""
    """Within a ``rate_limits`` list, what tells this limit from the others (its name,
    or its period: ``per_second``, ``per_10_minutes``): its stats key and its counter
    carry it. Empty for a single ``rate_limit``."""

    @property
    def window_seconds(self) -> int:
        """The period's length: every mode counts, refills and resets over it."""
        return UNIT_SECONDS[self.unit] * self.unit_multiplier

    @property
    def period(self) -> str:
        return period_text(self.unit, self.unit_multiplier)


def period_text(unit: Unit, multiplier: int = 1) -> str:
    """A period in words: ``minute``, or ``10 minutes``."""
    name = unit.name.lower()
    return name if multiplier == 1 else f"{multiplier} {name}s"


def list_label(name: str, unit: Unit, multiplier: int = 1) -> str:
    """What tells a limit of a ``rate_limits`` list from the others: its name, else its
    period (``per_second``, ``per_10_minutes``)."""
    return name or "per_" + period_text(unit, multiplier).replace(" ", "_")


class WildcardPattern:
    """A value pattern where each ``*`` matches zero or more characters: a lone trailing
    ``*`` (the common case, e.g. ``/api/*``) is checked with ``startswith``; anything
    else compiles to an anchored regular expression."""

    __slots__ = ("_prefix", "_regex", "text")

    def __init__(self, text: str) -> None:
        self.text = text
        self._prefix: str | None = None
        self._regex: re.Pattern[str] | None = None
        if text.find("*") == len(text) - 1:
            self._prefix = text[:-1]
        else:
            self._regex = re.compile(".*".join(map(re.escape, text.split("*"))), re.DOTALL)

    def matches(self, value: str) -> bool:
        if self._prefix is not None:
            return value.startswith(self._prefix)
        assert self._regex is not None
        return self._regex.fullmatch(value) is not None


@dataclass(slots=True)
class NodeChildren:
    """The descriptors one level below a node, indexed the way matching needs them."""

    exact: dict[tuple[str, str], DescriptorNode] = field(default_factory=dict)
    wildcards: list[DescriptorNode] = field(default_factory=list)
    defaults: dict[str, DescriptorNode] = field(default_factory=dict)
    _keys: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    def key_order(self) -> tuple[str, ...]:
        """The level's distinct keys, each where it first stands in the level's order (exact
        values, wildcards, defaults): what an RLQS bucket is matched by, one try per key
        however many values the rules list. Taken once: a level is complete once loaded."""
        if self._keys is None:
            self._keys = tuple(dict.fromkeys(node.key for node in self))
        return self._keys

    def __iter__(self) -> Iterator[DescriptorNode]:
        yield from self.exact.values()
        yield from self.wildcards
        yield from self.defaults.values()

    def __len__(self) -> int:
        return len(self.exact) + len(self.wildcards) + len(self.defaults)


@dataclass(slots=True)
class DescriptorNode:
    """One ``key``/``value`` entry of the YAML tree."""

    key: str
    value: str | None
    children: NodeChildren
    config_path: str
    pattern: WildcardPattern | None = None
    share_threshold: bool = False
    value_to_metric: bool = False
    detailed_metric: bool = False
    line: int | None = None
    limits: tuple[RateLimit, ...] = ()
    """Every limit of the node: none, the one of ``rate_limit``, or each of ``rate_limits`` (a
    request is denied if any of them is over). An ``unlimited`` limit is only ever alone."""

    def stats_element(self) -> str:
        """The part of the roll-up stats key this node contributes (``key`` or ``key_value``)."""
        return self.key if self.value is None else f"{self.key}_{self.value}"


@dataclass(frozen=True, slots=True)
class DomainConfig:
    name: str
    root: NodeChildren
    source: str


@dataclass(frozen=True, slots=True)
class RateLimitConfig:
    """Every loaded domain. Swapped whole on reload."""

    domains: Mapping[str, DomainConfig]

    def dump(self) -> str:
        """Text for the admin ``/rlconfig`` page: one line per limit, like the Go service."""
        lines: list[str] = []
        for domain in sorted(self.domains):
            _dump_children(self.domains[domain].root, lines)
        return "\n".join(lines) + ("\n" if lines else "")

    def limits(self) -> Iterator[RateLimit]:
        for domain in self.domains.values():
            yield from _walk_limits(domain.root)


def _walk_limits(children: NodeChildren) -> Iterator[RateLimit]:
    for node in children:
        yield from node.limits
        yield from _walk_limits(node.children)


def _dump_children(children: NodeChildren, lines: list[str]) -> None:
    for node in children:
        for limit in node.limits:
            if limit.unlimited:
                text = "unlimited"
            else:
                text = f"unit={limit.unit.name} requests_per_unit={limit.requests_per_unit}"
                if limit.unit_multiplier != 1:
                    text += f" unit_multiplier={limit.unit_multiplier}"
            flags = [f"mode={limit.mode.value}", f"failure_mode={limit.failure_mode.value}"]
            if limit.shadow_mode:
                flags.append("shadow_mode")
            if limit.quota_mode:
                flags.append("quota_mode")
            if limit.name:
                flags.append(f"name={limit.name}")
            where = f"{node.config_path}[{limit.label}]" if limit.label else node.config_path
            lines.append(f"{where}: {text}, {', '.join(flags)}")
        _dump_children(node.children, lines)
