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

Each instance's demand and the windows' allowed hits live in the store (Store.quota):
in Redis every replica sees every Envoy that reports a counter to any of them, so
replicas compute the same split for the same fleet; on the embedded store one process
divides among the Envoys connected to it. What is the stream's own (when it last
reported a bucket, how long a bucket has been idle) stays here.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from ratelimit_service.core.config_model import RateLimitConfig
from ratelimit_service.core.matching import Match, bucket_entries, find_limits
from ratelimit_service.core.shares import (
    QuotaReport,
    QuotaView,
    TokenBucket,
    counted_share,
    fair_shares,
    held_elsewhere,
    per_window,
    settle_share,
    token_bucket,
    window_index,
    window_reset,
)
from ratelimit_service.engine.stats import Stats
from ratelimit_service.storage.base import Store, StoreUnavailable

log = logging.getLogger(__name__)

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


class Kind(enum.Enum):
    """What one bucket of a report is answered with."""

    ALLOW_ALL = "allow_all"
    DENY_ALL = "deny_all"
    ABANDON = "abandon"
    TOKEN_BUCKET = "token_bucket"


ALLOW_ALL = Kind.ALLOW_ALL
DENY_ALL = Kind.DENY_ALL
ABANDON = Kind.ABANDON
TOKEN_BUCKET = Kind.TOKEN_BUCKET


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
    kind: Kind
    token_bucket: TokenBucket | None = None
    ttl_seconds: int = TTL_SECONDS


@dataclass(slots=True)
class _Seen:
    """One instance's own view of one counter (kept per stream, not in the store)."""

    last_report: float
    demand: float | None = None
    idle: int = 0
    bucket: Mapping[str, str] | None = None
    """The bucket id the instance last reported for the counter (what a pushed
    assignment names)."""


@dataclass(slots=True)
class _Pending:
    """A bucket of a report whose rule limits it, on its way to the store."""

    usage: Usage
    match: Match
    seen: _Seen
    elapsed: float | None


class QuotaCoordinator:
    def __init__(
        self,
        config: Callable[[], RateLimitConfig],
        stats: Stats,
        store: Store,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``config``: the rules in force now (the limiter's, so reloads apply at the
        next report)."""
        self._config = config
        self._stats = stats
        self._store = store
        self._clock = clock
        self._wall = wall
        self._seen: dict[tuple[str, str], _Seen] = {}
        """(instance, counter) → what this process knows of the instance's reports."""
        self._last: dict[str, tuple[QuotaView, int]] = {}
        """Each counter's last view from the store, with the index of the fixed window
        it counts (kept for a store outage, and for the metrics page)."""
        self._shares: dict[str, dict[str, float]] = {}
        """Each counter's share last assigned to each instance, in hits per window."""
        self._pushers: dict[str, Callable[[list[Action]], bool]] = {}
        """Each connected instance's way to receive assignments between its reports
        (its stream's outbox; False when it is full)."""

        self.closing = asyncio.Event()
        """Set by close_streams: every stream ends, and a new one ends at once."""
        self.streams = 0
        self.reports = 0
        self.assignments = 0
        self.abandons = 0
        self.malformed = 0
        """Buckets with an empty id (Envoy ignores any answer to them)."""
        self.store_errors = 0
        self.pushed = 0
        """Assignments sent between an instance's reports (a share grown into room
        another instance's report freed)."""
        self.pushes_dropped = 0

    async def report(self, instance: str, domain: str, usages: Iterable[Usage]) -> list[Action]:
        """Account one report of ``instance`` and answer each of its buckets."""
        self.reports += 1
        now, config = self._clock(), self._config()
        rules = config.domains.get(domain)
        if rules is None:
            self._stats.count_domain_not_found(domain)
        answers: list[Action | _Pending] = []
        for usage in usages:
            if not usage.bucket:
                self.malformed += 1
                continue
            entries = () if rules is None else bucket_entries(rules, usage.bucket)
            match = None if rules is None else tightest(find_limits(rules, entries))
            if match is None or match.limit.unlimited:
                answers.append(Action(usage.bucket, ALLOW_ALL))
            elif match.limit.requests_per_unit == 0 and not match.limit.shadow_mode:
                # A limit of 0 needs no count: denied whatever the store says or does.
                self._count(match.stats_key, usage, False, 0.0)
                answers.append(Action(usage.bucket, DENY_ALL))
            else:
                answers.append(self._observe(instance, usage, match, now))
        pending = [a for a in answers if isinstance(a, _Pending)]
        views = await self._fleet(instance, pending)
        actions = []
        for answer in answers:
            if isinstance(answer, _Pending):
                answer_action = self._decide(instance, answer, views[answer.match.bucket_key])
                actions.append(answer_action)
            else:
                actions.append(answer)
        self.assignments += sum(1 for a in actions if a.kind != ABANDON)
        self.abandons += sum(1 for a in actions if a.kind == ABANDON)
        self._grow_others(instance, pending, views)
        return actions

    def _observe(self, instance: str, usage: Usage, match: Match, now: float) -> _Pending:
        """The instance's demand for the counter, on this process's clock."""
        log.debug("report from %s: %s %d/%d", instance, usage.bucket, usage.allowed, usage.denied)
        seen = self._seen.get((instance, match.bucket_key))
        elapsed = None if seen is None else now - seen.last_report
        if seen is None:
            seen = self._seen[(instance, match.bucket_key)] = _Seen(now)
        offered = usage.allowed + usage.denied
        seen.bucket = usage.bucket
        seen.idle = seen.idle + 1 if offered == 0 else 0
        if elapsed is not None and elapsed >= MIN_ELAPSED:
            seen.demand = offered / elapsed
            seen.last_report = now
        return _Pending(usage, match, seen, elapsed)

    async def _fleet(self, instance: str, pending: list[_Pending]) -> dict[str, QuotaView]:
        """Every counter's view of the fleet, from the store; the last known one (this
        instance's part updated) while the store is away."""
        reports = [
            QuotaReport(
                p.match.bucket_key,
                instance,
                p.seen.demand,
                p.usage.allowed,
                p.match.limit.window_seconds,
            )
            for p in pending
        ]
        if not reports:
            return {}
        try:
            views = await self._store.quota(reports, FORGET_AFTER)
        except StoreUnavailable:
            self.store_errors += 1
            views = [self._without_store(instance, report) for report in reports]
        wall = self._wall()
        for report, view in zip(reports, views, strict=True):
            self._last[report.key] = (view, window_index(wall, report.window_seconds))
        return {report.key: view for report, view in zip(reports, views, strict=True)}

    def _without_store(self, instance: str, report: QuotaReport) -> QuotaView:
        """The counter's last view with this report added, while the store is away. The
        window's allowed hits start again at 0 when its window has passed, so a rule
        that used up a minute is not held at DENY_ALL for the whole outage."""
        last, index = self._last.get(report.key, (QuotaView({}, 0), -1))
        used = last.used if index == window_index(self._wall(), report.window_seconds) else 0
        demands = {**last.demands, instance: report.demand}
        return QuotaView(demands, used + report.allowed)

    def _decide(self, instance: str, pending: _Pending, view: QuotaView) -> Action:
        usage, limit, seen = pending.usage, pending.match.limit, pending.seen
        if seen.idle >= ABANDON_AFTER:
            log.debug("%s idle on %s: abandoned", instance, usage.bucket)
            del self._seen[(instance, pending.match.bucket_key)]
            self._release(instance, [pending.match.bucket_key])
            return Action(usage.bucket, ABANDON)
        window = limit.window_seconds
        # Demands are per second, the limit per window: shares are per window.
        demands = per_window(view, window)
        demands.setdefault(instance, None)
        assigned = self._shares.setdefault(pending.match.bucket_key, {})
        for name in [n for n in assigned if n not in demands]:  # gone from the fleet
            del assigned[name]
        fair = fair_shares(float(limit.requests_per_unit), demands)
        exhausted = window > 1 and view.used >= limit.requests_per_unit
        held_by_others = held_elsewhere(instance, assigned, demands, limit.requests_per_unit)
        share = settle_share(
            fair[instance], assigned.get(instance), limit.requests_per_unit - held_by_others
        )
        assigned[instance] = share
        allowance = share / window * (pending.elapsed or 0)
        self._count(pending.match.stats_key, usage, limit.shadow_mode, allowance)
        if limit.shadow_mode:
            return Action(usage.bucket, ALLOW_ALL)
        if exhausted:
            reset = max(1, math.ceil(window_reset(self._wall(), window)))
            return Action(usage.bucket, DENY_ALL, ttl_seconds=reset)
        if limit.requests_per_unit == 0:
            return Action(usage.bucket, DENY_ALL)
        bucket = token_bucket(share, limit.requests_per_unit, window, limit.burst)
        return Action(usage.bucket, TOKEN_BUCKET, bucket)

    def _grow_others(
        self, instance: str, pending: list[_Pending], views: Mapping[str, QuotaView]
    ) -> None:
        """Push, now, a larger bucket to every other instance on this process whose
        fair share the room ``instance``'s report just freed lets grow. Without it a
        share grows only at the instance's own next report, after the one that freed
        the room: a shift of demand from one Envoy to another waited up to two and a
        half report intervals. Shares only grow here, into room nobody holds, so the
        fleet still never holds more than the limit; shrinking waits for each
        instance's own report, which measures its demand."""
        pushes: dict[str, list[Action]] = {}
        for item in pending:
            limit, key = item.match.limit, item.match.bucket_key
            view, assigned = views[key], self._shares.get(key)
            window, most = limit.window_seconds, limit.requests_per_unit
            if assigned is None or limit.shadow_mode or most == 0:
                continue
            if window > 1 and view.used >= most:  # DENY_ALL until the window resets
                continue
            demands = per_window(view, window)
            fair = fair_shares(float(most), demands)
            even = most / len(demands) if demands else float(most)
            counted = {n: counted_share(h, demands.get(n), even) for n, h in assigned.items()}
            held_in_all = sum(counted.values())
            for other, held in list(assigned.items()):
                seen = self._seen.get((other, key))
                if other == instance or other not in self._pushers or other not in fair:
                    continue
                if seen is None or seen.bucket is None:
                    continue
                room = most - (held_in_all - counted[other])
                share = settle_share(fair[other], held, room)
                if share <= held:
                    continue
                # Granted one after the other: each grows into what is left.
                assigned[other] = share
                now_counted = counted_share(share, demands.get(other), even)
                held_in_all += now_counted - counted[other]
                counted[other] = now_counted
                bucket = token_bucket(share, most, window, limit.burst)
                pushes.setdefault(other, []).append(Action(seen.bucket, TOKEN_BUCKET, bucket))
        for other, actions in pushes.items():
            log.debug("pushed to %s: %s", other, [a.bucket for a in actions])
            if self._pushers[other](actions):
                self.pushed += len(actions)
                self.assignments += len(actions)
            else:
                self.pushes_dropped += len(actions)

    def attach(self, instance: str, push: Callable[[list[Action]], bool]) -> None:
        """``instance``'s stream takes assignments between its reports through ``push``."""
        self._pushers[instance] = push

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

    def close_streams(self) -> None:
        """The service is stopping: end every stream now, with a status (the servicer
        answers UNAVAILABLE), instead of leaving them open until the server's grace
        runs out and gRPC cancels them. An Envoy's stream never ends by itself, so
        otherwise every stop waits out the whole grace. Envoy keeps the assignments it
        holds until their TTL and opens a new stream at its next report (to another
        replica, or to this one restarted). Call it once the service no longer needs
        to answer reports (after draining), before the gRPC server stops."""
        self.closing.set()

    def forget(self, instance: str) -> None:
        """A stream ended: drop what this process kept of it (the store forgets the
        instance once it has been silent for FORGET_AFTER)."""
        self.streams -= 1
        self._pushers.pop(instance, None)
        counters = [k[1] for k in self._seen if k[0] == instance]
        for counter in counters:
            del self._seen[(instance, counter)]
        self._release(instance, counters)

    def _release(self, instance: str, counters: Iterable[str]) -> None:
        """``instance`` no longer reports ``counters`` here: forget its share, and the
        counters no stream of this process reports any more (so memory follows the
        buckets in use, not every bucket id ever seen)."""
        for counter in counters:
            shares = self._shares.get(counter)
            if shares is not None:
                shares.pop(instance, None)
                if not shares:
                    del self._shares[counter]
            if counter not in self._shares:
                self._last.pop(counter, None)

    def demands(self) -> dict[str, dict[str, float | None]]:
        """Each counter's instances and their demand, as last read from the store (for
        the metrics page)."""
        return {key: dict(view.demands) for key, (view, _) in self._last.items()}

    def shares(self) -> dict[str, dict[str, float]]:
        """Each counter's share last assigned to each instance of this process's
        streams, in hits per window."""
        return {key: dict(shares) for key, shares in self._shares.items()}


def tightest(matches: tuple[Match, ...]) -> Match | None:
    """The limit an RLQS bucket is held to when its rule has several (rate_limits):
    Envoy enforces one token bucket per bucket, so the one of the lowest rate (limit
    per second of its period) wins; the others are not enforced separately."""
    if not matches:
        return None
    return min(matches, key=lambda m: m.limit.requests_per_unit / m.limit.window_seconds)
