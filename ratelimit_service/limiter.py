"""ShouldRateLimit in core types: match, decide in each rule's mode, build the response.

Probabilistic rules are decided locally first (no await); exact rules go to the
store in one batched call. If the request ends up denied, probabilistic hits are
given back, so a denied request consumes no quota anywhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ratelimit_service.core.config_model import (
    DomainConfig,
    FailureMode,
    Mode,
    RateLimit,
    RateLimitConfig,
)
from ratelimit_service.core.decision import drop_replaced, hits_for, overall_code, split_hits
from ratelimit_service.core.exact import ExactHit, ExactResult, HitRole
from ratelimit_service.core.local_buckets import LocalBuckets, ProbabilisticBucket
from ratelimit_service.core.matching import (
    Match,
    find_limit,
    override_bucket_key,
    override_stats_key,
    with_window,
)
from ratelimit_service.core.request import (
    UINT32_MAX,
    Code,
    Descriptor,
    DescriptorStatus,
    Request,
    RequestBounds,
    Response,
    validate,
)
from ratelimit_service.core.units import Unit
from ratelimit_service.stats import Stats
from ratelimit_service.storage.base import Store, StoreUnavailable

log = logging.getLogger(__name__)

MATCH_CACHE_SIZE = 10_000
_MISSING = object()


@dataclass(frozen=True, slots=True)
class _Plan:
    """A validated request's matches under one config: what stays the same each time
    the same request comes back (see Request.plan)."""

    limiter: RateLimiter
    config: RateLimitConfig
    domain_found: bool
    steps: tuple[tuple[int, RateLimit, Match, int], ...]
    """(descriptor index, limit, match, hits) of each descriptor with a finite limit."""
    unlimited: tuple[int, ...]
    exact_hits: tuple[ExactHit, ...]
    """What the store gets for the exact-mode steps, in order, when no probabilistic
    quota descriptor has let the request through (see _exact_hits)."""


@dataclass(slots=True)
class _Pending:
    """A descriptor with a limit, on its way through the decision."""

    index: int
    limit: RateLimit
    match: Match
    hits: int
    bucket: ProbabilisticBucket | None = None
    before: int = 0
    admitted: bool = True


class RateLimiter:
    def __init__(
        self,
        config: RateLimitConfig,
        store: Store,
        *,
        stats: Stats | None = None,
        local: LocalBuckets | None = None,
        bounds: RequestBounds | None = None,
        default_mode: Mode = Mode.PROBABILISTIC,
        global_shadow: bool = False,
        clock: Callable[[], float] = time.time,
        draw: Callable[[], float] | None = None,
    ) -> None:
        """``draw``: numbers in [0, 1) to compare with drop ratios. None (the default):
        each bucket's own evenly spread sequence (ProbabilisticBucket.next_draw), which
        scatters far less than random numbers; tests inject fixed values."""
        self.config = config
        self.store = store
        self.stats = stats if stats is not None else Stats()
        self.local = local if local is not None else LocalBuckets()
        self.bounds = bounds if bounds is not None else RequestBounds()
        self.default_mode = default_mode
        self.global_shadow = global_shadow
        self._clock = clock
        self._draw = draw
        self._matches: dict[tuple[str, tuple[tuple[str, str], ...]], object] = {}

    def swap_config(self, config: RateLimitConfig) -> None:
        """Install a new config; in-flight requests finish on the one they started with."""
        self.config = config
        self._matches = {}

    async def should_rate_limit(self, request: Request) -> Response:
        plan = request.plan
        if not (isinstance(plan, _Plan) and plan.config is self.config and plan.limiter is self):
            plan = self._plan(request)
        statuses = [DescriptorStatus(Code.OK) for _ in request.descriptors]
        if not plan.domain_found:
            self.stats.count_domain_not_found(request.domain)
            return Response(Code.OK, statuses)
        for index in plan.unlimited:
            statuses[index].remaining = UINT32_MAX
        pending = [_Pending(*step) for step in plan.steps]
        if pending:
            # No coroutine below this one: most requests never wait, and each
            # coroutine layer costs the request path about 0.3 µs.
            exact = self._decide_local(pending, statuses)
            if exact is not None:
                items, commit, quota_met = exact
                hits = plan.exact_hits if not quota_met else _exact_hits(items, quota_met)
                try:
                    results = await self.store.hit(hits, commit)
                except StoreUnavailable as exc:
                    self.stats.store_error += 1
                    log.debug("exact store unavailable: %s", exc)
                    results = [_failure_result(item.limit) for item in items]
                _record_exact(items, results, statuses)
        return self._finish(statuses, pending)

    def _plan(self, request: Request) -> _Plan:
        try:
            validate(request, self.bounds)
        except ValueError:
            self.stats.service_error += 1
            raise
        config = self.config
        domain = config.domains.get(request.domain)
        steps: list[tuple[int, RateLimit, Match, int]] = []
        unlimited: list[int] = []
        if domain is not None:
            matches = [self._match(domain, d) for d in request.descriptors]
            limits = [m.limit if m is not None else None for m in matches]
            drop_replaced(limits)
            for index, descriptor in enumerate(request.descriptors):
                limit, match = limits[index], matches[index]
                if limit is None or match is None:
                    continue
                if limit.unlimited:
                    unlimited.append(index)
                    continue
                steps.append((index, limit, match, hits_for(descriptor, request.hits_addend)))
        exact = [_Pending(*step) for step in steps if step[1].mode is Mode.EXACT]
        plan = _Plan(
            self,
            config,
            domain is not None,
            tuple(steps),
            tuple(unlimited),
            tuple(_exact_hits(exact, quota_met=False)),
        )
        request.plan = plan
        return plan

    def _match(self, domain: DomainConfig, descriptor: Descriptor) -> Match | None:
        if descriptor.override is None:
            # Matching builds key strings; most traffic repeats a few descriptors, so the
            # result is remembered (per config, bounded: cleared when full).
            cache_key = (domain.name, descriptor.entries)
            cache = self._matches
            match = cache.get(cache_key, _MISSING)
            if match is _MISSING:
                match = find_limit(domain, descriptor.entries)
                if len(cache) >= MATCH_CACHE_SIZE:
                    cache.clear()
                cache[cache_key] = match
            return match  # type: ignore[return-value]
        domain_name = domain.name
        requests_per_unit, unit = descriptor.override
        assert unit is not None  # validate() rejects UNKNOWN units
        key = override_stats_key(domain_name, descriptor.entries)
        limit = RateLimit(
            requests_per_unit=requests_per_unit,
            unit=Unit(unit),
            mode=self.default_mode,
            stats_key=key,
        )
        bucket = with_window(override_bucket_key(domain_name, descriptor.entries), limit)
        return Match(limit, key, bucket)

    def _decide_local(
        self, pending: list[_Pending], statuses: list[DescriptorStatus]
    ) -> tuple[list[_Pending], bool, bool] | None:
        """Decide the probabilistic descriptors; return the exact ones still to decide,
        whether to commit them and whether a quota is already met (None: none left)."""
        now = self._clock()
        local = self.local
        exact: list[_Pending] = []
        denied = False
        quota_seen = quota_ok = False  # probabilistic quota-mode descriptors
        stale = local.stale(now)
        for item in pending:
            limit = item.limit
            if limit.mode is Mode.EXACT:
                exact.append(item)
                continue
            bucket = local.get(
                item.match.bucket_key,
                limit.requests_per_unit,
                limit.window_seconds,
                now,
                limit.stats_key,
            )
            item.bucket = bucket
            item.before = max(0, limit.requests_per_unit - bucket.remaining())
            if stale:
                item.admitted = local.fail(
                    bucket, item.hits, limit.failure_mode is FailureMode.OPEN
                )
            else:
                draw = bucket.next_draw() if self._draw is None else self._draw()
                item.admitted = local.decide(bucket, item.hits, draw)
            status = statuses[item.index]
            status.remaining = bucket.remaining()
            status.reset_after = bucket.reset_estimate(now)
            role = _role(limit)
            if role is HitRole.QUOTA:
                quota_seen = True
                quota_ok = quota_ok or item.admitted
            elif role is HitRole.ENFORCE and not item.admitted:
                denied = True
        if not exact:
            return None
        exact_quota = any(_role(item.limit) is HitRole.QUOTA for item in exact)
        if quota_seen and not quota_ok and not exact_quota:
            denied = True  # every quota descriptor is over: the request is denied
        return exact, not denied, quota_ok

    def _finish(self, statuses: list[DescriptorStatus], pending: list[_Pending]) -> Response:
        stats = self.stats
        for item in pending:
            limit = item.limit
            status = statuses[item.index]
            status.limit = limit
            rule = stats.rule(item.match.stats_key)
            rule.total_hits += item.hits
            over, near, within = split_hits(
                limit.requests_per_unit, item.before, item.hits, item.admitted
            )
            rule.near_limit += near
            rule.within_limit += within
            if item.admitted:
                continue
            rule.over_limit += over
            if limit.shadow_mode:
                rule.shadow_mode += item.hits  # would have been denied; reported OK
            else:
                status.code = Code.OVER_LIMIT
                status.remaining = 0
        overall = overall_code(statuses)
        if overall is Code.OVER_LIMIT:
            self._refund(pending)
            if self.global_shadow:
                stats.global_shadow_mode += 1
                overall = Code.OK
        return Response(overall, statuses)

    @staticmethod
    def _refund(pending: list[_Pending]) -> None:
        """Give back probabilistic hits of a denied request."""
        for item in pending:
            bucket = item.bucket
            if bucket is not None and item.admitted and item.hits:
                bucket.credit += item.hits
                bucket.admitted -= item.hits


def _exact_hits(exact: list[_Pending], quota_met: bool) -> list[ExactHit]:
    """``quota_met``: a probabilistic quota descriptor already lets the request
    through, so exact quota hits can no longer deny it (they still consume)."""
    return [
        ExactHit(
            key=item.match.bucket_key,
            limit=item.limit.requests_per_unit,
            window_seconds=item.limit.window_seconds,
            hits=item.hits,
            role=_exact_role(item.limit, quota_met),
        )
        for item in exact
    ]


def _record_exact(
    exact: list[_Pending], results: list[ExactResult], statuses: list[DescriptorStatus]
) -> None:
    for item, result in zip(exact, results, strict=True):
        item.before = result.before
        item.admitted = result.admitted
        status = statuses[item.index]
        status.remaining = result.remaining
        status.reset_after = result.reset_after


def _role(limit: RateLimit) -> HitRole:
    if limit.shadow_mode:
        return HitRole.SHADOW
    if limit.quota_mode:
        return HitRole.QUOTA
    return HitRole.ENFORCE


def _exact_role(limit: RateLimit, quota_met: bool) -> HitRole:
    role = _role(limit)
    return HitRole.SHADOW if quota_met and role is HitRole.QUOTA else role


def _failure_result(limit: RateLimit) -> ExactResult:
    admitted = limit.failure_mode is FailureMode.OPEN
    return ExactResult(
        admitted=admitted,
        before=0,
        remaining=limit.requests_per_unit if admitted else 0,
        reset_after=0.0,
    )
