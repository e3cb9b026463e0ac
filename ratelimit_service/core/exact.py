"""Exact-mode decision for all of one request's exact descriptors, taken together.

Every hit is checked against its sliding window first; the request is denied by
:func:`denies` (the one statement of the rule, which every path calls). Only when the
request goes through do the admitted hits consume their windows, so a denied
request never eats quota of its other descriptors (envoyproxy/ratelimit increments
every counter, denied or not; see its issues #185 and #440). resources/exact_window.lua
states the same rule for Redis, held to :func:`denies` by
tests/storage/test_exact_script_vs_core.py.
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
    """Seconds until the window next frees room (over: until this request would fit), at
    most the window: a rule's reset is never longer than its unit. (A slice leaves the
    window up to one slice width after the window has passed since its hits, see
    core/window.py, so a client back after a reset of the whole window may still find
    it counted, for less than a slice.)"""


def fits(window_count: int, hits: int, limit: int) -> bool:
    """Whether ``hits`` more fit; a check-only hit (0) fits while one more would."""
    return window_count + max(hits, 1) <= limit


def denies(enforce_over: bool, quota_seen: bool, quota_admitted: bool) -> bool:
    """The denial rule, stated once: a request is denied if an enforcing descriptor is
    over (``enforce_over``), or if it has quota descriptors (``quota_seen``) and every
    one of them is over (none ``quota_admitted``). Shadow descriptors never deny."""
    return enforce_over or (quota_seen and not quota_admitted)


def request_denied(roles: Sequence[HitRole], admitted: Sequence[bool]) -> bool:
    """:func:`denies` for descriptors given by role, each admitted or not."""
    enforce_over = quota_seen = quota_admitted = False
    for role, ok in zip(roles, admitted, strict=True):
        if role is HitRole.ENFORCE:
            enforce_over = enforce_over or not ok
        elif role is HitRole.QUOTA:
            quota_seen = True
            quota_admitted = quota_admitted or ok
    return denies(enforce_over, quota_seen, quota_admitted)


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
        if reset > hit.window_seconds:
            reset = hit.window_seconds
        results.append(
            ExactResult(
                admitted=ok,
                before=count,
                remaining=max(0, hit.limit - after),
                reset_after=reset,
            )
        )
    return results
