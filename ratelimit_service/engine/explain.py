"""Explain a request: the rules its descriptors match under the loaded config (the
limiter's own matching), with their current counts, recording no hit (core/explain.py
holds the result). An exact rule's count is a check-only store hit; a probabilistic
rule's is this process's bucket, if any, read without touching it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from ratelimit_service.core.calendar import CalendarPeriod, counted_under
from ratelimit_service.core.config_model import Mode, RateLimit
from ratelimit_service.core.exact import ExactHit, HitRole
from ratelimit_service.core.explain import DescriptorReport, Explanation, RuleState
from ratelimit_service.core.matching import Match
from ratelimit_service.core.request import Request, validate
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.storage.base import StoreOverloaded, StoreUnavailable

EXPLAIN_BUDGET = 1.0
"""Seconds the store may take to answer an explanation's checks, all rules together."""


async def explain(limiter: RateLimiter, request: Request, counts: bool = True) -> Explanation:
    """``request``'s explanation; ``counts``: False without a service behind the rules (the
    command line's). Raises InvalidRequest as ShouldRateLimit would."""
    validate(request, limiter.bounds)
    domain = limiter.config.domains.get(request.domain)
    if domain is None:
        empty = tuple(DescriptorReport(d.entries, ()) for d in request.descriptors)
        return Explanation(request.domain, False, empty)
    matched = limiter.matches(domain, request.descriptors)
    exact = await _exact_counts(limiter, matched) if counts else None
    reports = []
    for descriptor, kept in zip(request.descriptors, matched, strict=True):
        rules = [RuleState.of(limit, _count(limiter, limit, match, exact)) for limit, match in kept]
        reports.append(DescriptorReport(descriptor.entries, tuple(rules)))
    return Explanation(request.domain, True, tuple(reports))


async def _exact_counts(
    limiter: RateLimiter, matched: Sequence[Sequence[tuple[RateLimit, Match]]]
) -> dict[str, int]:
    """Hits in the window of every exact rule matched, by bucket key, in one check-only store
    call within EXPLAIN_BUDGET; empty when the store does not answer."""
    now = limiter.now()
    checks: dict[str, ExactHit] = {}
    for kept in matched:
        for limit, match in kept:
            if limit.mode is Mode.EXACT and not limit.unlimited and limit.requests_per_unit > 0:
                period = CalendarPeriod(limit.unit, limit.calendar) if limit.calendar else None
                key, window = counted_under(match.bucket_key, limit.window_seconds, period, now)
                checks[match.bucket_key] = ExactHit(
                    key, limit.requests_per_unit, window, 0, HitRole.SHADOW
                )
    if not checks:
        return {}
    deadline = asyncio.get_running_loop().time() + EXPLAIN_BUDGET
    try:
        results = await limiter.store.hit(list(checks.values()), commit=False, deadline=deadline)
    except (StoreUnavailable, StoreOverloaded):
        return {}
    return {key: result.before for key, result in zip(checks, results, strict=True)}


def _count(
    limiter: RateLimiter, limit: RateLimit, match: Match, exact: dict[str, int] | None
) -> int | None:
    """Hits in the rule's current window, or None when not known (``exact`` None: no counts)."""
    if exact is None or limit.unlimited:
        return None
    if limit.requests_per_unit == 0:
        return 0  # decided in the process, never counted
    if limit.mode is Mode.EXACT:
        return exact.get(match.bucket_key)
    period = CalendarPeriod(limit.unit, limit.calendar) if limit.calendar is not None else None
    key, _ = counted_under(match.bucket_key, limit.window_seconds, period, limiter.now())
    bucket = limiter.local.peek(key)
    return 0 if bucket is None else bucket.used()
