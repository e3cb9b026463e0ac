"""Exact-mode decision for all of one request's exact descriptors, taken together.

Every hit is checked against its sliding window first; the request is denied if an
enforcing descriptor is over, or if every quota-mode descriptor is. Only when the
request goes through do the admitted hits consume their windows, so a denied
request never eats quota of its other descriptors (envoyproxy/ratelimit increments
every counter, denied or not; see its issues #185 and #440). The Redis Lua script
implements the same rule.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from ratelimit_service.core.window import SlidingWindow


class HitRole(enum.IntEnum):
    ENFORCE = 0
    SHADOW = 1
    """Reported, never denies the request."""
    QUOTA = 2
    """Denies the request only when every quota descriptor is over."""


# Not frozen: a frozen dataclass's __init__ costs four times as much, and these are
# made per request. Treat them as immutable all the same.
@dataclass(slots=True)
class ExactHit:
    key: str
    limit: int
    window_seconds: int
    hits: int
    role: HitRole = HitRole.ENFORCE


@dataclass(slots=True)
class ExactResult:
    admitted: bool
    before: int
    """Hits in the window before this request."""
    remaining: int
    reset_after: float
    """Seconds until the window next frees room (over: until this request would fit)."""


def fits(window_count: int, hits: int, limit: int) -> bool:
    """Whether ``hits`` more fit; a check-only hit (0) fits while one more would."""
    return window_count + max(hits, 1) <= limit


def request_denied(roles: Sequence[HitRole], admitted: Sequence[bool]) -> bool:
    quota_seen = False
    quota_all_over = True
    for role, ok in zip(roles, admitted, strict=True):
        if role is HitRole.ENFORCE and not ok:
            return True
        if role is HitRole.QUOTA:
            quota_seen = True
            quota_all_over = quota_all_over and not ok
    return quota_seen and quota_all_over


def evaluate(
    hits: Sequence[ExactHit], windows: Sequence[SlidingWindow], now: float, commit: bool
) -> list[ExactResult]:
    """Decide ``hits`` against ``windows`` (index-aligned) and consume if allowed."""
    counts = [window.count(now) for window in windows]
    admitted = [fits(count, hit.hits, hit.limit) for count, hit in zip(counts, hits, strict=True)]
    consume = commit and not request_denied([hit.role for hit in hits], admitted)
    results: list[ExactResult] = []
    for hit, window, count, ok in zip(hits, windows, counts, admitted, strict=True):
        if ok and consume:
            window.add(now, hit.hits)
        after = window.total
        if ok:
            reset = window.next_drop(now)
        else:
            reset = window.wait_for_room(now, max(hit.hits, 1), hit.limit)
        results.append(
            ExactResult(
                admitted=ok,
                before=count,
                remaining=max(0, hit.limit - after),
                reset_after=reset,
            )
        )
    return results
