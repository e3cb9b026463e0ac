"""RLQS: the coordinator that divides each limit among the Envoys that report usage.

Envoy's rate_limit_quota filter enforces token buckets itself and reports, per bucket,
what it allowed and denied, every 5 s (Envoy 1.40's fixed interval) and once at once
for a bucket it has just created. For every report the coordinator

1. maps each bucket id to the same YAML rule an RLS descriptor would meet
   (core.matching.bucket_entries, then find_limit): same limits, shadow mode, live
   reload;
2. measures each instance's demand per bucket, (allowed + denied) per second on the
   service's own clock (Envoy's ``time_elapsed`` is whole seconds, and 0 on a first
   report);
3. divides the limit among the instances that report that bucket by demand, max-min
   fair (core.shares), and answers each bucket with the instance's token bucket, with
   a TTL of a few report intervals; rules of a minute or longer also count the fleet's
   reported allowed hits per fixed window and answer DENY_ALL until the window resets
   once it is used up. Buckets no rule limits get ALLOW_ALL; shadow rules ALLOW_ALL
   and count what the limit would have denied.

The fleet is the Envoys connected to this process (the state is in memory). Several
replicas of the service each divide among their own Envoys.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from ratelimit_service.core.config_model import RateLimitConfig
from ratelimit_service.core.matching import Match, bucket_entries, find_limit
from ratelimit_service.core.shares import TokenBucket, fair_shares, token_bucket, window_reset
from ratelimit_service.engine.stats import Stats

REPORT_INTERVAL = 5.0
"""Seconds between Envoy 1.40's reports (hard-coded there)."""
TTL_SECONDS = 15
"""assignment_time_to_live: three report intervals, so an assignment outlives a lost
report or a restarting service; whole seconds (Envoy 1.40 drops the nanos, and a TTL
under a second expires at once)."""
ABANDON_AFTER = 3
"""Reports in a row with nothing allowed or denied after which an instance is told to
abandon the bucket (it subscribes again with its next request)."""
FORGET_AFTER = 3 * REPORT_INTERVAL
"""Seconds after which an instance that stopped reporting a bucket no longer takes a
share of it."""
MIN_ELAPSED = 0.5
"""A report sooner than this after the previous one measures no demand (Envoy's first
report of a bucket comes at once, then the periodic ones)."""


ALLOW_ALL = "allow_all"
DENY_ALL = "deny_all"
ABANDON = "abandon"


@dataclass(frozen=True, slots=True)
class Usage:
    """One bucket of one report."""

    bucket: Mapping[str, str]
    allowed: int
    denied: int


@dataclass(frozen=True, slots=True)
class Action:
    """What one bucket of a report is answered with: a blanket rule, a token bucket,
    or ABANDON."""

    bucket: Mapping[str, str]
    kind: str
    """ALLOW_ALL, DENY_ALL, ABANDON, or "token_bucket"."""
    token_bucket: TokenBucket | None = None
    ttl_seconds: int = TTL_SECONDS


@dataclass(slots=True)
class _Seen:
    """One instance's view of one bucket."""

    last_report: float
    demand: float | None = None
    idle: int = 0


@dataclass(slots=True)
class _Fleet:
    """One counter (a rule's bucket key) across the instances that report it."""

    instances: dict[str, _Seen] = field(default_factory=dict)
    window: int = -1
    used: int = 0
    """Allowed hits reported in the current fixed window (rules of a minute or more)."""


class QuotaCoordinator:
    def __init__(
        self,
        config: Callable[[], RateLimitConfig],
        stats: Stats,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``config``: the rules in force now (the limiter's, so reloads apply at the
        next report)."""
        self._config = config
        self._stats = stats
        self._clock = clock
        self._wall = wall
        self._fleets: dict[str, _Fleet] = {}
        self.streams = 0
        self.reports = 0
        self.assignments = 0
        self.abandons = 0
        self.malformed = 0
        """Buckets with an empty id (Envoy ignores any answer to them)."""

    def report(self, instance: str, domain: str, usages: Iterable[Usage]) -> list[Action]:
        """Account one report of ``instance`` and answer each of its buckets."""
        self.reports += 1
        now, config = self._clock(), self._config()
        rules = config.domains.get(domain)
        if rules is None:
            self._stats.count_domain_not_found(domain)
        actions = []
        for usage in usages:
            if not usage.bucket:
                self.malformed += 1
                continue
            entries = () if rules is None else bucket_entries(rules, usage.bucket)
            match = None if rules is None else find_limit(rules, entries)
            if match is None or match.limit.unlimited:
                actions.append(Action(usage.bucket, ALLOW_ALL))
                continue
            actions.append(self._decide(instance, usage, match, now))
        self.assignments += sum(1 for a in actions if a.kind != ABANDON)
        self.abandons += sum(1 for a in actions if a.kind == ABANDON)
        return actions

    def _decide(self, instance: str, usage: Usage, match: Match, now: float) -> Action:
        limit = match.limit
        fleet = self._fleets.setdefault(match.bucket_key, _Fleet())
        seen = fleet.instances.get(instance)
        elapsed = None if seen is None else now - seen.last_report
        if seen is None:
            seen = fleet.instances[instance] = _Seen(last_report=now)
        offered = usage.allowed + usage.denied
        seen.idle = seen.idle + 1 if offered == 0 else 0
        if elapsed is not None and elapsed >= MIN_ELAPSED:
            seen.demand = offered / elapsed
            seen.last_report = now
        if seen.idle >= ABANDON_AFTER:
            del fleet.instances[instance]
            return Action(usage.bucket, ABANDON)
        for name, other in list(fleet.instances.items()):  # instances that went away
            if name != instance and now - other.last_report > FORGET_AFTER:
                del fleet.instances[name]
        window = limit.window_seconds
        # Demands are per second, the limit per window: shares are per window.
        demands = {
            name: None if s.demand is None else s.demand * window
            for name, s in fleet.instances.items()
        }
        share = fair_shares(float(limit.requests_per_unit), demands)[instance]
        self._count(match.stats_key, usage, limit.shadow_mode, share / window * (elapsed or 0))
        if limit.shadow_mode:
            return Action(usage.bucket, ALLOW_ALL)
        if window > 1:
            index = math.floor(self._wall() / window)
            if index != fleet.window:
                fleet.window, fleet.used = index, 0
            fleet.used += usage.allowed
            if fleet.used >= limit.requests_per_unit:
                reset = max(1, math.ceil(window_reset(self._wall(), window)))
                return Action(usage.bucket, DENY_ALL, ttl_seconds=reset)
        if limit.requests_per_unit == 0:
            return Action(usage.bucket, DENY_ALL)
        bucket = token_bucket(share, limit.requests_per_unit, window, limit.burst)
        return Action(usage.bucket, "token_bucket", bucket)

    def _count(self, stats_key: str, usage: Usage, shadow: bool, allowance: float) -> None:
        """Envoy's decisions, counted as the RLS path counts its own; for a shadow
        rule, the hits beyond the instance's share (``allowance``: hits it may admit
        in the period reported) are what the limit would have denied."""
        rule = self._stats.rule(stats_key)
        rule.total_hits += usage.allowed + usage.denied
        over = usage.denied
        if shadow:
            over = max(0, usage.allowed - math.ceil(allowance)) if allowance else 0
            rule.shadow_mode += over
        rule.within_limit += usage.allowed + usage.denied - over
        rule.over_limit += over

    def connected(self) -> None:
        self.streams += 1

    def forget(self, instance: str) -> None:
        """A stream ended: the instance no longer takes a share of anything."""
        self.streams -= 1
        for fleet in self._fleets.values():
            fleet.instances.pop(instance, None)
        for key in [k for k, f in self._fleets.items() if not f.instances]:
            del self._fleets[key]

    def shares(self) -> dict[str, dict[str, float | None]]:
        """Each counter's instances and their measured demand (for the metrics page)."""
        return {
            key: {name: seen.demand for name, seen in fleet.instances.items()}
            for key, fleet in self._fleets.items()
        }
