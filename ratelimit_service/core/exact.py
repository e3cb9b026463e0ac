"""Exact-mode decision for all of one request's exact descriptors, taken together.

Every hit is checked against its sliding window first; whether the request is denied
is :func:`denies`, which hits are then counted :func:`counts`: each rule stated once,
for every path. resources/exact_window.lua states the same rules for Redis, held to
these functions by tests/storage/test_exact_script_vs_core.py.
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


CHECK = 0
"""``commit`` of a call that only looks: nothing is counted (explain, a Cluster's first pass)."""
DECIDE = 1
"""``commit`` of a request decided here: counted as :func:`counts` says."""
DENIED = 3
"""``commit`` of a request already denied by descriptors decided elsewhere (a
probabilistic one): only its costs are counted. (2 is the Redis script's forced
commit of owed hits, storage/exact_batcher.py FORCE.)"""


def is_cost(hits_addend: int | None, count_denied_costs: bool) -> bool:
    """Whether a descriptor's hits are a cost: an explicit per-descriptor
    ``hits_addend`` of 1 or more (a usage Envoy reports once spent, such as the tokens
    of a response), counted whatever the answer unless ``count_denied_costs`` is off
    (the Go service's STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true). An explicit 0 is a
    check; no per-descriptor value (the request's hits_addend, or 1) is an admission."""
    return count_denied_costs and hits_addend is not None and hits_addend >= 1


def counts(admitted: bool, cost: bool) -> bool:
    """Whether a decided hit is counted in its window: when ``admitted`` (it fits and its request
    goes through, so a denied request never eats quota of its other descriptors, unlike
    envoyproxy/ratelimit: its issues #185 and #440), or when it is a ``cost`` (:func:`is_cost`:
    usage already spent), whatever the request's other descriptors decided. A cost may so take its
    window past the limit; checks of that budget are denied until it has room again."""
    return admitted or cost


# Not frozen: a frozen dataclass's __init__ costs four times as much, and these are
# made per request. Treat them as immutable all the same.
@dataclass(slots=True)
class ExactHit:
    key: str
    limit: int
    window_seconds: int
    hits: int
    role: HitRole = HitRole.ENFORCE
    cost: bool = False
    """Counted whatever the answer (:func:`is_cost`)."""


@dataclass(slots=True)
class ExactResult:
    admitted: bool
    before: int
    """Hits in the window before this request."""
    remaining: int
    reset_after: float
    """Seconds until the window next frees room (over: until this request would fit), at most the
    window: a rule's reset is never longer than its unit. (A slice leaves the window up to one slice
    width after the window has passed since its hits, see core/window.py, so a client back after a
    reset of the whole window may still find it counted, for less than a slice.)"""


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
    hits: Sequence[ExactHit], windows: Sequence[SlidingWindow], now: float, commit: int
) -> list[ExactResult]:
    """Decide ``hits`` against ``windows`` (index-aligned) and count what ``commit`` says
    (CHECK, DECIDE or True, DENIED)."""
    before = [window.count(now) for window in windows]
    admitted = [fits(count, hit.hits, hit.limit) for count, hit in zip(before, hits, strict=True)]
    consume = commit == DECIDE and not request_denied([hit.role for hit in hits], admitted)
    results: list[ExactResult] = []
    for hit, window, count, ok in zip(hits, windows, before, admitted, strict=True):
        if commit and counts(ok and consume, hit.cost):
            window.add(now, hit.hits)
        if ok:
            reset = window.next_drop(now)
        else:
            reset = window.wait_for_room(now, max(hit.hits, 1), hit.limit)
        remaining = max(0, hit.limit - window.total)
        results.append(ExactResult(ok, count, remaining, min(reset, hit.window_seconds)))
    return results
