"""What ``explain`` reports about a request: the rules each descriptor matches, with
their limits and current counts, found without deciding anything (the admin page
``/explain`` and the command line's ``explain`` print it).

Plain data and its two renderings (JSON-ready dicts, and lines for people); the
engine fills it in (engine/explain.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ratelimit_service.core.config_model import RateLimit
from ratelimit_service.core.decision import rule_name


@dataclass(frozen=True, slots=True)
class RuleState:
    """One rule a descriptor matches, and its count in the current window."""

    rule: str
    """Its name for operators (core.decision.rule_name: the YAML name, else the stats key)."""
    stats_key: str
    limit: int | None
    """Requests per window; None: unlimited."""
    unit: str
    """The window in words: ``minute``, ``10 minutes``."""
    window_seconds: int
    mode: str
    shadow_mode: bool
    quota_mode: bool
    count: int | None
    """Hits counted in the current window as the service knows them (exact: the store's window;
    probabilistic: the fleet's count at the last sync plus this process's since); None when not
    known (rules read from files alone, the store not answering, or an unlimited rule)."""

    @classmethod
    def of(cls, limit: RateLimit, count: int | None) -> RuleState:
        return cls(
            rule=rule_name(limit),
            stats_key=limit.stats_key,
            limit=None if limit.unlimited else limit.requests_per_unit,
            unit=limit.period,
            window_seconds=limit.window_seconds,
            mode=limit.mode.value,
            shadow_mode=limit.shadow_mode,
            quota_mode=limit.quota_mode,
            count=count,
        )

    def text(self) -> str:
        if self.limit is None:
            return f"rule {self.rule}: unlimited"
        flags = "".join(
            f", {flag}" for flag, on in (("shadow", self.shadow_mode), ("quota", self.quota_mode))
            if on
        )  # fmt: skip
        count = "unknown" if self.count is None else f"{self.count} of {self.limit}"
        named = f" ({self.stats_key})" if self.stats_key != self.rule else ""
        return (
            f"rule {self.rule}{named}: {self.limit} per {self.unit}, {self.mode}{flags},"
            f" count {count}"
        )


@dataclass(frozen=True, slots=True)
class DescriptorReport:
    entries: tuple[tuple[str, str], ...]
    rules: tuple[RuleState, ...]
    """Empty: no rule matches (or the ones that do are replaced by another's)."""

    @property
    def label(self) -> str:
        return ",".join(f"{key}={value}" for key, value in self.entries)


@dataclass(frozen=True, slots=True)
class Explanation:
    domain: str
    domain_found: bool
    descriptors: tuple[DescriptorReport, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "domain": self.domain,
            "domain_found": self.domain_found,
            "descriptors": [
                {
                    "descriptor": report.label,
                    "entries": [list(entry) for entry in report.entries],
                    "rules": [
                        {name: getattr(rule, name) for name in _FIELDS} for rule in report.rules
                    ],
                }
                for report in self.descriptors
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Explanation:
        """What to_dict wrote (the command line reads the admin page's JSON)."""
        return cls(
            domain=str(data["domain"]),
            domain_found=bool(data["domain_found"]),
            descriptors=tuple(
                DescriptorReport(
                    tuple((str(key), str(value)) for key, value in item["entries"]),
                    tuple(
                        RuleState(**{name: rule[name] for name in _FIELDS})
                        for rule in item["rules"]
                    ),
                )
                for item in data["descriptors"]
            ),
        )

    def text(self) -> str:
        """Lines for people: the domain, then each descriptor and its rules."""
        missing = "" if self.domain_found else ": not in the loaded rules (every descriptor is OK)"
        lines = [f"domain {self.domain}{missing}"]
        for report in self.descriptors:
            texts = [rule.text() for rule in report.rules] or ["no rule matches"]
            lines += (f"  {report.label}: {text}" for text in texts)
        return "\n".join(lines) + "\n"


_FIELDS = RuleState.__slots__
