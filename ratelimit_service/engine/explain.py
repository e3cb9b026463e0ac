"""Explain a request: the rules its descriptors match under the loaded config, with
their current counts, read without recording a hit (core/explain.py holds the result).

The matching is the limiter's own (RateLimiter.matches), so explain says what a
ShouldRateLimit call would be decided against. Counts: an exact rule asks the store
for its window with a check-only hit (nothing committed); a probabilistic rule reads
this process's bucket, if it has one, without creating or touching it.
"""

from __future__ import annotations

from ratelimit_service.core.config_model import Mode, RateLimit
from ratelimit_service.core.exact import ExactHit, HitRole
from ratelimit_service.core.explain import DescriptorReport, Explanation, RuleState
from ratelimit_service.core.matching import Match
from ratelimit_service.core.request import Request, validate
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.storage.base import StoreOverloaded, StoreUnavailable


async def explain(limiter: RateLimiter, request: Request, counts: bool = True) -> Explanation:
    """``request``'s explanation; ``counts``: False when no count is meaningful (rules
    read from files by the command line, no service behind them). Raises
    InvalidRequest as ShouldRateLimit would for the same request."""
    validate(request, limiter.bounds)
    domain = limiter.config.domains.get(request.domain)
    if domain is None:
        empty = tuple(DescriptorReport(d.entries, ()) for d in request.descriptors)
        return Explanation(request.domain, False, empty)
    reports = []
    for descriptor, kept in zip(
        request.descriptors, limiter.matches(domain, request.descriptors), strict=True
    ):
        rules = []
        for limit, match in kept:
            count = await _count(limiter, limit, match) if counts else None
            rules.append(RuleState.of(limit, count))
        reports.append(DescriptorReport(descriptor.entries, tuple(rules)))
    return Explanation(request.domain, True, tuple(reports))


async def _count(limiter: RateLimiter, limit: RateLimit, match: Match) -> int | None:
    """Hits in the rule's current window, or None when not known."""
    if limit.unlimited:
        return None
    if limit.requests_per_unit == 0:
        return 0  # decided in the process, never counted
    if limit.mode is Mode.EXACT:
        check = ExactHit(
            match.bucket_key, limit.requests_per_unit, limit.window_seconds, 0, HitRole.SHADOW
        )
        try:
            results = await limiter.store.hit([check], commit=False)
        except (StoreUnavailable, StoreOverloaded):
            return None
        return results[0].before
    bucket = limiter.local.peek(match.bucket_key)
    if bucket is None:
        return 0
    return max(0, limit.requests_per_unit - bucket.remaining())
