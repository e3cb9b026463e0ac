"""ShouldRateLimit in core types: match, decide in each rule's mode, build the response.

Probabilistic rules are decided locally first (no await); exact rules go to the store in one batched
call. If the request ends up denied, probabilistic hits are given back, so a denied request consumes
no quota anywhere, except its costs: a descriptor's explicit hits_addend of 1 or more is usage
already spent, counted whatever the answer (core/exact.py is_cost and counts).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from ratelimit_service.core.calendar import CalendarPeriod, counted_under
from ratelimit_service.core.config_model import (
    DomainConfig,
    FailureMode,
    Mode,
    RateLimit,
    RateLimitConfig,
)
from ratelimit_service.core.decision import (
    answer,
    drop_replaced,
    hits_for,
    near_hits,
    near_threshold,
    role_of,
)
from ratelimit_service.core.exact import (
    CHECK,
    DECIDE,
    DENIED,
    ExactHit,
    ExactResult,
    HitRole,
    counts,
    denies,
    is_cost,
    request_denied,
)
from ratelimit_service.core.local_buckets import LocalBuckets, ProbabilisticBucket
from ratelimit_service.core.matching import (
    Match,
    find_limits,
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
from ratelimit_service.core.settings_table import default
from ratelimit_service.core.units import Unit
from ratelimit_service.engine.stats import RuleStats, Stats
from ratelimit_service.storage.base import Store, StoreOverloaded, StoreUnavailable

log = logging.getLogger(__name__)

MATCH_CACHE_SIZE = 10_000
# An Enum member read through its class costs a metaclass lookup: the request path reads these.
_OK = Code.OK
_OVER = Code.OVER_LIMIT
STORE_REFUSALS = (StoreUnavailable, StoreOverloaded)
"""What a store's hit raises, at once or from its reply, that Deciding.failed answers."""
_PLACEHOLDER = DescriptorStatus(_OK)
"""Fills a request's status list until every descriptor's own status is in."""


class Overloaded(Exception):
    """Exact descriptors only the store can decide, and too many requests wait for it: an
    error (the servicer sends RESOURCE_EXHAUSTED) lets the client's failure policy decide;
    admitting would break exactness without the store failing."""


class _Step:
    """A descriptor with a finite limit: what a repeated request reuses, read off once."""

    __slots__ = (
        "_period",
        "always_counted",
        "bucket_key",
        "burst",
        "calendar",
        "enforce",
        "exact",
        "fail_open",
        "hits",
        "index",
        "limit",
        "near",
        "quota",
        "requests_per_unit",
        "role",
        "rule_stats",
        "stats_key",
        "window_seconds",
        "zero",
    )

    def __init__(
        self,
        index: int,
        limit: RateLimit,
        match: Match,
        hits: int,
        near_ratio: float,
        cost: bool = False,
    ) -> None:
        self.index = index
        self.limit = limit
        self.hits = hits
        self.always_counted = counts(False, cost)
        """A cost: its hits count even when the request is denied (core/exact.py counts)."""
        self.exact = limit.mode is Mode.EXACT
        self.calendar = (
            CalendarPeriod(limit.unit, limit.calendar) if limit.calendar is not None else None
        )
        """A calendar rule's current period (core/calendar.py), in either mode."""
        self._period: tuple[float, float, str, int] = (0.0, 0.0, "", 0)
        """A probabilistic calendar rule's period start, end, key and window (period_bucket)."""
        self.zero = limit.requests_per_unit == 0
        """A limit of 0 denies every hit, in the process in every mode (no bucket, no store:
        a store that is away cannot turn it into an OK)."""
        self.role = role_of(limit)
        self.enforce = self.role is HitRole.ENFORCE
        self.quota = self.role is HitRole.QUOTA
        self.fail_open = limit.failure_mode is FailureMode.OPEN
        self.bucket_key = match.bucket_key
        self.stats_key = match.stats_key
        self.requests_per_unit = limit.requests_per_unit
        self.window_seconds = limit.window_seconds
        self.burst = limit.burst
        self.near = near_threshold(limit.requests_per_unit, near_ratio)
        self.rule_stats: RuleStats | None = None
        """The rule's counters, once they are known to be its own (not _overflow)."""

    def period_bucket(self, period: CalendarPeriod, now: float) -> tuple[str, int, float]:
        """A calendar rule's probabilistic key and window at ``now`` (counted_under, as exact
        mode counts) and its period's end; kept until then, so a request makes no key."""
        start, ends, key, window = self._period
        if not start <= now < ends:
            key, window = counted_under(self.bucket_key, self.window_seconds, period, now)
            start, ends = period.at(now)
            self._period = (start, ends, key, window)
        return key, window, ends


@dataclass(frozen=True, slots=True)
class _Plan:
    """A validated request's matches under one config, reused by a repeat (Request.plan)."""

    limiter: RateLimiter
    config: RateLimitConfig
    domain_found: bool
    local: tuple[_Step, ...]
    """The probabilistic steps, decided in the process."""
    exact: tuple[_Step, ...]
    """The exact steps, decided by the store in one call."""
    exact_quota: bool
    """Whether some exact step is in quota mode."""
    exact_costs: bool
    """Whether some exact step is a cost (counted even when the request is denied)."""
    exact_calendar: bool
    """Whether some exact step counts by the calendar (exact hits then made per request)."""
    unlimited: tuple[int, ...]
    unmatched: tuple[int, ...]
    """Descriptors no rule matches (or replaced by another's)."""
    exact_hits: tuple[ExactHit, ...]
    """The exact steps' hits when no probabilistic quota descriptor let the request through."""
    exact_owe: bool
    """Whether failure_mode admits the request when the store fails (Store.hit's ``owe``)."""
    all_local: bool
    """Every descriptor is a probabilistic step (see RateLimiter.decide_locally)."""


class Deciding:
    """A request whose exact rules wait for the store (RateLimiter.decide): ``waiting``
    gives their results, or raises StoreUnavailable or StoreOverloaded; :meth:`done` or
    :meth:`failed` makes the response from either, as every path must."""

    __slots__ = ("_exact", "_hits", "_limiter", "_now", "_statuses", "_taken", "waiting")

    def __init__(
        self,
        limiter: RateLimiter,
        exact: tuple[_Step, ...],
        hits: tuple[ExactHit, ...] | list[ExactHit],
        statuses: list[DescriptorStatus],
        taken: list[tuple[ProbabilisticBucket, int]],
        now: float,
    ) -> None:
        self._limiter, self._exact, self._hits = limiter, exact, hits
        self._statuses, self._taken, self._now = statuses, taken, now
        self.waiting: Awaitable[list[ExactResult]]

    def done(self, results: list[ExactResult]) -> Response:
        """The response from the store's results."""
        limiter = self._limiter
        limiter._record_exact(self._exact, results, self._statuses, self._now)
        return limiter._finish(self._statuses, self._taken)

    def settle(self, waited: asyncio.Future[list[ExactResult]]) -> Response:
        """The response once ``waiting`` (as a future) is done and not cancelled: :meth:`done`
        or :meth:`failed`; an unexpected exception is raised again."""
        exc = waited.exception()
        if exc is None:
            return self.done(waited.result())
        if isinstance(exc, STORE_REFUSALS):
            return self.failed(exc)
        raise exc

    def failed(self, exc: StoreUnavailable | StoreOverloaded) -> Response:
        """The response when the store failed (each rule's failure_mode) or was too busy
        (raises Overloaded when an open rule would have to be asked)."""
        limiter = self._limiter
        if isinstance(exc, StoreUnavailable):
            limiter.stats.store_error += 1
            log.debug("exact store unavailable: %s", exc)
            results = limiter._by_failure_mode(self._exact)
        else:
            results = limiter._overloaded(self._exact, self._hits, self._taken, exc)
        return self.done(results)


class RateLimiter:
    def __init__(
        self,
        config: RateLimitConfig,
        store: Store,
        *,
        stats: Stats | None = None,
        local: LocalBuckets | None = None,
        bounds: RequestBounds | None = None,
        default_mode: Mode = default("--mode"),
        global_shadow: bool = default("--shadow-mode"),
        near_ratio: float = default("--near-limit-ratio"),
        clock: Callable[[], float] = time.time,
        draw: Callable[[], float] | None = None,
        count_denied_costs: bool = default("--count-denied-costs"),
    ) -> None:
        """``draw``: numbers in [0, 1) to compare with drop ratios; None: each bucket's evenly
        spread sequence (ProbabilisticBucket.next_draw), which scatters far less than random.
        ``count_denied_costs``: whether a cost counts when denied too (core/exact.py is_cost;
        off: the Go service's STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true)."""
        self.config = config
        self.count_denied_costs = count_denied_costs
        self.store = store
        self.hit_store = store.hit
        """``store.hit``, or tracing's wrapper of it (engine/tracing.py) when tracing is on."""
        self.near_ratio = near_ratio
        """Share of a limit past which admitted hits count as near_limit."""
        self.stats = stats if stats is not None else Stats()
        self.local = local if local is not None else LocalBuckets()
        self.bounds = bounds if bounds is not None else RequestBounds()
        self.default_mode = default_mode
        self.global_shadow = global_shadow
        self._clock = clock
        self._draw = draw
        self._matches: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Match, ...]] = {}

    def swap_config(self, config: RateLimitConfig) -> None:
        """Install a new config; in-flight requests finish on the one they started with."""
        self.config = config
        self._matches = {}

    async def should_rate_limit(self, request: Request, deadline: float | None = None) -> Response:
        """``deadline``: the event loop's time after which the caller cannot use the
        answer; exact rules wait for the store until then (None: the store's bound)."""
        decision = self.decide(request, deadline)
        if isinstance(decision, Response):
            return decision
        try:
            results = await decision.waiting
        except STORE_REFUSALS as exc:
            return decision.failed(exc)
        return decision.done(results)

    def decide(self, request: Request, deadline: float | None = None) -> Response | Deciding:
        """:meth:`should_rate_limit` without a coroutine: the response when the store is not
        waited for (no exact rule, or the store refused at once: too little time left, too
        many waiting), else a :class:`Deciding` whose ``waiting`` the caller awaits or
        watches, then settles (the native front door answers from a callback, no task)."""
        plan = self._plan(request)
        if plan.all_local:  # the servicer calls decide_locally() first; tests come here
            response = self.decide_locally(request)
            assert response is not None  # all_local
            return response
        if not plan.domain_found:
            self.stats.count_domain_not_found(request.domain)
            return Response(Code.OK, [DescriptorStatus(Code.OK) for _ in request.descriptors])
        statuses: list[DescriptorStatus] = [_PLACEHOLDER] * len(request.descriptors)
        for index in plan.unlimited:
            statuses[index] = DescriptorStatus(_OK, None, UINT32_MAX)
        for index in plan.unmatched:
            statuses[index] = DescriptorStatus(_OK)
        taken: list[tuple[ProbabilisticBucket, int]] = []
        commit, quota_met = True, False
        if plan.local:
            commit, quota_met = self._decide_local(plan.local, plan.exact_quota, statuses, taken)
        exact = plan.exact
        if not exact:
            return self._finish(statuses, taken)
        # Denied already (a probabilistic descriptor): the store only counts costs.
        counting = DECIDE if commit else DENIED if plan.exact_costs else CHECK
        now = self._clock() if plan.exact_calendar else 0.0
        if quota_met or plan.exact_calendar:
            hits: tuple[ExactHit, ...] | list[ExactHit] = _exact_hits(exact, quota_met, now)
            owe = commit and _admitted_on_failure(exact, hits)
        else:
            hits, owe = plan.exact_hits, commit and plan.exact_owe
        decision = Deciding(self, exact, hits, statuses, taken, now)
        try:
            decision.waiting = self.hit_store(hits, counting, owe, deadline)
        except STORE_REFUSALS as exc:
            return decision.failed(exc)
        return decision

    def now(self) -> float:
        """The limiter's clock, which calendar periods and probabilistic buckets read."""
        return self._clock()

    def _by_failure_mode(self, exact: tuple[_Step, ...]) -> list[ExactResult]:
        """Each exact step decided by its rule's failure_mode (the store failed)."""
        results = [_failure_result(step.limit) for step in exact]
        for step, result in zip(exact, results, strict=True):
            self._count_failure_mode(step, result.admitted)
        return results

    def _count_failure_mode(self, step: _Step, admitted: bool) -> None:
        rule = self.stats.rule(step.stats_key)
        if admitted:
            rule.failure_mode_allowed += step.hits
        else:
            rule.failure_mode_denied += step.hits

    def _overloaded(
        self,
        exact: tuple[_Step, ...],
        hits: list[ExactHit] | tuple[ExactHit, ...],
        taken: list[tuple[ProbabilisticBucket, int]],
        exc: StoreOverloaded,
    ) -> list[ExactResult]:
        """Too many requests wait for the store. Rules with failure_mode closed deny
        as they would without a store; if they alone do not deny the request and an
        open rule would have to be asked, the request is refused with Overloaded
        (its probabilistic hits given back) rather than admitted unchecked."""
        self.stats.store_overloaded += 1
        for step in exact:
            self.stats.rule(step.stats_key).overloaded += step.hits
        results = [_failure_result(step.limit) for step in exact]
        roles = [hit.role for hit in hits]
        if not request_denied(roles, [result.admitted for result in results]):
            undecided = [
                step.stats_key
                for step, role in zip(exact, roles, strict=True)
                if role is not HitRole.SHADOW and step.fail_open
            ]
            if undecided:
                self.local.give_back(taken)
                raise Overloaded(f"{exc}; not decided: {', '.join(undecided)}")
        return results

    def decide_locally(self, request: Request) -> Response | None:
        """The response when every descriptor is probabilistic (the common case), else None
        (:meth:`should_rate_limit`). Not a coroutine: most requests skip that layer."""
        plan = self._plan(request)
        if not plan.all_local:
            return None
        statuses: list[DescriptorStatus] = [_PLACEHOLDER] * len(request.descriptors)
        taken: list[tuple[ProbabilisticBucket, int]] = []
        commit, _ = self._decide_local(plan.local, False, statuses, taken)
        if commit:  # nothing denied: OK, with nothing to give back
            return answer(statuses, admit=True)
        return self._finish(statuses, taken)

    def rules_of(self, request: Request) -> list[tuple[int, str]]:
        """(descriptor index, stats key) of every rule the request matches, in descriptor
        order, for tracing: from its plan, else matched now (the config reloaded, or a
        request too large to be kept)."""
        plan = request.plan
        if not isinstance(plan, _Plan) or plan.config is not self.config:
            try:
                validate(request, self.bounds)
            except ValueError:
                return []  # answered INVALID_ARGUMENT: no rule
            plan = self._plan(request)
        return sorted((step.index, step.stats_key) for step in plan.local + plan.exact)

    def _plan(self, request: Request) -> _Plan:
        """The plan the request carries for this limiter and config, else a new one."""
        plan = request.plan
        if isinstance(plan, _Plan) and plan.config is self.config and plan.limiter is self:
            return plan
        try:
            validate(request, self.bounds)
        except ValueError:
            self.stats.service_error += 1
            raise
        config = self.config
        domain = config.domains.get(request.domain)
        steps: list[_Step] = []
        unlimited: list[int] = []
        unmatched: list[int] = []
        if domain is not None:
            matched = self.matches(domain, request.descriptors)
            for index, descriptor in enumerate(request.descriptors):
                kept = matched[index]
                if not kept:
                    unmatched.append(index)
                elif kept[0][0].unlimited:  # only ever alone
                    unlimited.append(index)
                else:
                    hits = hits_for(descriptor, request.hits_addend)
                    cost = is_cost(descriptor.hits_addend, self.count_denied_costs)
                    for limit, match in kept:
                        steps.append(_Step(index, limit, match, hits, self.near_ratio, cost))
        exact = tuple(step for step in steps if step.exact and not step.zero)
        local = tuple(step for step in steps if not step.exact or step.zero)
        exact_hits = tuple(_exact_hits(exact, quota_met=False))
        plan = _Plan(
            self,
            config,
            domain is not None,
            local,
            exact,
            any(step.role is HitRole.QUOTA for step in exact),
            any(step.always_counted for step in exact),
            any(step.calendar is not None for step in exact),
            tuple(unlimited),
            tuple(unmatched),
            exact_hits,
            _admitted_on_failure(exact, exact_hits),
            domain is not None and not (exact or unlimited or unmatched),
        )
        request.plan = plan
        return plan

    def matches(
        self, domain: DomainConfig, descriptors: list[Descriptor]
    ) -> list[list[tuple[RateLimit, Match]]]:
        """Each descriptor's limits and keys, less those another matched limit ``replaces``:
        what the request is decided against (explain shows it)."""
        found = [self._match(domain, d) for d in descriptors]
        limits: list[RateLimit | None] = [m.limit for matches in found for m in matches]
        drop_replaced(limits)
        remaining = iter(limits)
        kept: list[list[tuple[RateLimit, Match]]] = []
        for matches in found:  # a descriptor may have several (rate_limits)
            own = []
            for match in matches:
                limit = next(remaining)
                if limit is not None:
                    own.append((limit, match))
            kept.append(own)
        return kept

    def _match(self, domain: DomainConfig, descriptor: Descriptor) -> tuple[Match, ...]:
        """The descriptor's limits (none, one, or a ``rate_limits`` list); a limit the request
        carries replaces them, in its rule's mode and failure_mode, or the default mode."""
        # Remembered per config (cleared when full): most traffic repeats a few descriptors.
        cache_key = (domain.name, descriptor.entries)
        cache = self._matches
        matches = cache.get(cache_key)
        if matches is None:
            matches = find_limits(domain, descriptor.entries)
            if len(cache) >= MATCH_CACHE_SIZE:
                cache.clear()
            cache[cache_key] = matches
        if descriptor.override is None:
            return matches
        domain_name = domain.name
        requests_per_unit, unit = descriptor.override
        assert unit is not None  # validate() rejects UNKNOWN units
        key = override_stats_key(domain_name, descriptor.entries)
        rule = matches[0].limit if matches else None
        limit = RateLimit(
            requests_per_unit=requests_per_unit,
            unit=Unit(unit),
            mode=rule.mode if rule is not None else self.default_mode,
            failure_mode=rule.failure_mode if rule is not None else FailureMode.OPEN,
            stats_key=key,
        )
        bucket = with_window(override_bucket_key(domain_name, descriptor.entries), limit)
        return (Match(limit, key, bucket),)

    def _decide_local(
        self,
        steps: tuple[_Step, ...],
        exact_quota: bool,
        statuses: list[DescriptorStatus],
        taken: list[tuple[ProbabilisticBucket, int]],
    ) -> tuple[bool, bool]:
        """Decide and account the probabilistic descriptors; note in ``taken`` the hits they
        admitted (given back if the request is denied), except costs, which count whatever
        the answer. Returns whether exact descriptors may consume (nothing denied so far)
        and whether a probabilistic quota descriptor already lets the request through."""
        now = self._clock()
        local = self.local
        draw = self._draw
        stale = local.stale(now)
        enforce_over = quota_seen = quota_ok = False
        for step in steps:
            period = step.calendar
            if step.zero:
                window = step.window_seconds
                reset = window - now % window if period is None else period.until_end(now)
                status = DescriptorStatus(_OK, step.limit, 0, reset)
                self._account(step, 0, admitted := False, status)
                _put(statuses, step.index, status)
            else:
                limit = step.requests_per_unit
                if period is None:
                    bucket = local.get(
                        step.bucket_key, limit, step.window_seconds, now, step.stats_key, step.burst
                    )
                else:  # a calendar budget: a bucket per period, which does not refill
                    key, window, ends = step.period_bucket(period, now)
                    bucket = local.get(key, limit, window, now, step.stats_key, step.burst, ends)
                hits = step.hits
                before = bucket.used()
                if stale:
                    admitted = local.fail(bucket, hits, step.fail_open)
                    self._count_failure_mode(step, admitted)
                else:
                    admitted = bucket.take(hits, None if draw is None else draw())
                    if step.always_counted:
                        if not admitted:
                            bucket.charge(hits)
                    elif admitted and hits:
                        taken.append((bucket, hits))
                status = DescriptorStatus(
                    _OK, step.limit, bucket.remaining(), bucket.reset_estimate(now)
                )
                self._account(step, before, admitted, status)
                _put(statuses, step.index, status)
            if step.quota:
                quota_seen = True
                quota_ok = quota_ok or admitted
            elif step.enforce and not admitted:
                enforce_over = True
        # An exact quota descriptor, asked next, may yet admit the request.
        return not denies(enforce_over, quota_seen, quota_ok or exact_quota), quota_ok

    def _record_exact(
        self,
        steps: tuple[_Step, ...],
        results: list[ExactResult],
        statuses: list[DescriptorStatus],
        now: float,
    ) -> None:
        """Each exact step's status; a calendar rule resets at its period's end after ``now``."""
        for step, result in zip(steps, results, strict=True):
            calendar = step.calendar
            reset = result.reset_after if calendar is None else calendar.until_end(now)
            status = DescriptorStatus(_OK, step.limit, result.remaining, reset)
            self._account(step, result.before, result.admitted, status)
            _put(statuses, step.index, status)

    def _account(self, step: _Step, before: int, admitted: bool, status: DescriptorStatus) -> None:
        """Count the descriptor's hits in its rule's stats; deny it unless in shadow."""
        rule = step.rule_stats
        if rule is None:
            rule = self.stats.rule(step.stats_key)
            if self.stats.rules.get(step.stats_key) is rule:
                step.rule_stats = rule
        hits = step.hits
        rule.total_hits += hits
        if admitted:  # no call unless the hits come near the limit
            rule.within_limit += hits
            if before + hits > step.near:
                rule.near_limit += near_hits(step.near, before, hits)
                if step.exact:
                    self._near_key(step, before + hits)
            return
        rule.over_limit += hits
        if step.exact and not step.zero and before + hits > step.requests_per_unit:
            self._near_key(step, before + hits)  # over by the store's count, not by failure_mode
        if not step.quota and not step.enforce:  # shadow
            rule.shadow_mode += hits  # would have been denied; reported OK
            status.shadow_over = True
        else:
            status.code = _OVER
            status.remaining = 0

    def _near_key(self, step: _Step, used: int) -> None:
        """An exact key near or over its limit, for the status page."""
        self.stats.near_key(
            step.bucket_key, step.stats_key, used, step.requests_per_unit, step.window_seconds
        )

    def _finish(
        self, statuses: list[DescriptorStatus], taken: list[tuple[ProbabilisticBucket, int]]
    ) -> Response:
        """The answer (core.decision.answer); a denied request's probabilistic hits given back."""
        response = answer(statuses, self.global_shadow)
        if response.overall is _OVER or response.shadowed:
            self.local.give_back(taken)  # a denied request consumes no quota
            if response.shadowed:
                self.stats.global_shadow_mode += 1
        return response


def _put(statuses: list[DescriptorStatus], index: int, status: DescriptorStatus) -> None:
    """A descriptor's status: of several limits (rate_limits), the :func:`_tighter`."""
    current = statuses[index]
    if current is _PLACEHOLDER or _tighter(status, current):
        statuses[index] = status


def _tighter(a: DescriptorStatus, b: DescriptorStatus) -> bool:
    """Whether ``a`` speaks for a descriptor's limits rather than ``b``: an over-limit one
    first, then the least remaining; but among quota limits, which deny only when all are
    over (core/exact.py denies), one that still admits, as the limiter's verdict did."""
    if (a.code is _OVER) != (b.code is _OVER):
        quota = a.limit is not None and a.limit.quota_mode and not a.limit.shadow_mode
        return (a.code is _OVER) != quota
    return _left(a) < _left(b)


def _left(status: DescriptorStatus) -> int:
    return UINT32_MAX if status.remaining is None else status.remaining


def _exact_hits(exact: tuple[_Step, ...], quota_met: bool, now: float = 0.0) -> list[ExactHit]:
    """``quota_met``: a probabilistic quota descriptor lets the request through, so exact
    quota hits only consume. A calendar step counts under its period at ``now``."""
    hits = []
    for step in exact:
        key, window = counted_under(step.bucket_key, step.window_seconds, step.calendar, now)
        role = HitRole.SHADOW if quota_met and step.quota else step.role
        hits.append(
            ExactHit(key, step.requests_per_unit, window, step.hits, role, step.always_counted)
        )
    return hits


def _admitted_on_failure(
    exact: tuple[_Step, ...], hits: tuple[ExactHit, ...] | list[ExactHit]
) -> bool:
    """Whether failure_mode lets the request's exact part through when the store fails."""
    roles = [hit.role for hit in hits]
    return bool(exact) and not request_denied(roles, [step.fail_open for step in exact])


def _failure_result(limit: RateLimit) -> ExactResult:
    admitted = limit.failure_mode is FailureMode.OPEN
    return ExactResult(
        admitted=admitted,
        before=0,
        remaining=limit.requests_per_unit if admitted else 0,
        reset_after=0.0,
    )
