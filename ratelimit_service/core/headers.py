"""Rate-limit response headers, chosen the way envoyproxy/ratelimit chooses them.

The descriptor reported is the one that decided the answer (Response.decided, see
core/decision.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ratelimit_service.core.config_model import HeaderStyle
from ratelimit_service.core.decision import rule_name
from ratelimit_service.core.request import DescriptorStatus
from ratelimit_service.core.settings_table import default


@dataclass(frozen=True, slots=True)
class HeaderNames:
    limit: str = default("--header-limit")
    remaining: str = default("--header-remaining")
    reset: str = default("--header-reset")
    rule: str = default("--header-rule")
    """A header naming the deciding rule (its name, else its stats key); empty: none.
    Independent of the style: it may be the only header sent."""


DRAFT03_NAMES = HeaderNames("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset")


def rate_limit_headers(
    status: DescriptorStatus | None, style: HeaderStyle, names: HeaderNames
) -> list[tuple[str, str]]:
    """Header name/value pairs for Envoy to add to the client response, for the
    answer's deciding ``status`` (Response.decided); empty when off or when no
    descriptor had a limit."""
    if status is None or status.limit is None or (style is HeaderStyle.OFF and not names.rule):
        return []
    headers = _count_headers(status, style, names)
    if names.rule:
        headers.append((names.rule, rule_name(status.limit)))
    return headers


def _count_headers(
    status: DescriptorStatus, style: HeaderStyle, names: HeaderNames
) -> list[tuple[str, str]]:
    assert status.limit is not None
    if style is HeaderStyle.OFF:
        return []
    count = status.limit.requests_per_unit
    reset = str(math.ceil(status.reset_after or 0.0))
    if style is HeaderStyle.DRAFT03:
        window = status.limit.window_seconds
        return [
            (DRAFT03_NAMES.limit, f"{count}, {count};w={window}"),
            (DRAFT03_NAMES.remaining, str(status.remaining)),
            (DRAFT03_NAMES.reset, reset),
        ]
    return [
        (names.limit, str(count)),
        (names.remaining, str(status.remaining)),
        (names.reset, reset),
    ]
