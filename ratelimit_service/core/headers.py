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
    """Header name/value pairs for Envoy to add to the client response, for the answer's deciding
    ``status`` (Response.decided); empty when off or when no descriptor had a limit."""
    if status is None or status.limit is None or (style is HeaderStyle.OFF and not names.rule):
        return []
    headers: list[tuple[str, str]] = []
    if style is not HeaderStyle.OFF:
        count = status.limit.requests_per_unit
        shown, limit = names, str(count)
        if style is HeaderStyle.DRAFT03:
            shown, limit = DRAFT03_NAMES, f"{count}, {count};w={status.limit.window_seconds}"
        headers = [
            (shown.limit, limit),
            (shown.remaining, str(status.remaining)),
            (shown.reset, str(math.ceil(status.reset_after or 0.0))),
        ]
    if names.rule:
        headers.append((names.rule, rule_name(status.limit)))
    return headers
