"""RLQS: the coordinator that divides each limit among the Envoys that report usage.

Envoy's rate_limit_quota filter enforces token buckets itself and reports, per bucket, what it
allowed and denied, every 5 s (Envoy 1.40's fixed interval), and at once for a new bucket. For every
report the coordinator

1. maps each bucket id to the YAML rule an RLS descriptor would meet (core.matching.bucket_entries,
   then find_limits): same limits, shadow mode, reload;
2. measures each instance's demand per bucket, (allowed + denied) per second on the service's clock
   (Envoy's ``time_elapsed`` is whole seconds, and 0 on a first report);
3. divides the limit among the instances reporting the bucket by demand, and answers with the
   instance's token bucket, with a TTL of a few report intervals; rules of a minute or longer also
   count the fleet's allowed hits per fixed window and answer DENY_ALL once it is used up, until it
   resets. Buckets no rule limits get ALLOW_ALL; shadow rules ALLOW_ALL and count what the limit
   would have denied.

The division has two tiers (core/tiers.py). Every ``interval`` this replica publishes per counter
its totals to the store (its instances' demand and count, the hits they allowed) and reads back the
fleet's sums, which set its part of the limit. Between publishes a report is answered from that
part, divided among the replica's instances max-min by demand (core/shares.py), without a store
call; a counter's first report waits for one publish, so a restarted replica does not hand out the
whole limit again. With the store away each replica keeps its last part (fail-static). On the
embedded store the one process is the whole fleet.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from ratelimit_service.core.config_model import RateLimit, RateLimitConfig
from ratelimit_service.core.matching import Match, bucket_entries, find_limits
from ratelimit_service.core.quota_counter import QuotaCounter, Seen
from ratelimit_service.core.settings_table import default
from ratelimit_service.core.shares import (
    TokenBucket,
    next_bucket,
    settle_share,
    stored,
    window_index,
    window_reset,
)
from ratelimit_service.core.stretch import STRETCH, join_slot, joins_moved
from ratelimit_service.core.tiers import TierReport, TierTotals, member_demand
from ratelimit_service.engine.background import BackgroundTask, every
from ratelimit_service.engine.stats import SLICE, Stats
from ratelimit_service.storage.base import Store, StoreUnavailable

log = logging.getLogger(__name__)

REPORT_INTERVAL = 5.0
"""Seconds between Envoy 1.40's reports (hard-coded there)."""
TTL_SECONDS = 15
"""assignment_time_to_live: three report intervals, outliving a lost report or a restart;
whole seconds (Envoy 1.40 drops the nanos: a TTL under a second expires at once)."""
ABANDON_AFTER = 3
"""Idle reports in a row after which an instance is told to abandon the bucket."""
FORGET_AFTER = 3 * REPORT_INTERVAL
"""Seconds after which an instance that stopped reporting a bucket loses its share."""
MIN_ELAPSED = 0.5
"""Seconds since the last report under which a report measures no demand (a first comes at once)."""


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
    """One bucket's answer: a blanket rule, a token bucket, or ABANDON."""

    bucket: Mapping[str, str]
    kind: Kind
    token_bucket: TokenBucket | None = None
    ttl_seconds: int = TTL_SECONDS


@dataclass(frozen=True, slots=True)
class CounterView:
    """A copy of one counter for the status page and /metrics, taken between two reports."""

    key: str
    stats_key: str
    limit: RateLimit
    part: float | None
    """This replica's part of the limit, hits per window (None: not published yet)."""
    totals: TierTotals | None
    used: int
    """The fleet's allowed hits in the current window (0 once a new one began)."""
    instances: tuple[tuple[str, float | None, float | None, float | None], ...]
    """Each instance reporting it here: (name, demand per second, share in hits per window,
    tokens per second of its token bucket), each None while unknown or absent."""


@dataclass(slots=True)
class _Pending:
    """A bucket of a report whose rule limits it, waiting for its counter's part."""

    usage: Usage
    counter: QuotaCounter
    seen: Seen
    elapsed: float | None


class QuotaCoordinator:
    def __init__(
        self,
        config: Callable[[], RateLimitConfig],
        stats: Stats,
        store: Store,
        *,
        interval: float = default("--rlqs-publish-interval"),
        stretch: int = STRETCH,
        member: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        """``config``: the rules in force (the limiter's: reloads apply at the next report).
        ``interval``: seconds between publishes; ``stretch``: rounds a counter steady well
        over its limit may wait (core/stretch.py; 1: none). ``member``: this replica's
        unique name."""
        self._config = config
        self._stats = stats
        self._store = store
        self._clock = clock
        self._wall = wall
        self.interval = interval
        self.stretch = stretch
        self._failing = False
        """The last publish failed: every counter goes in the next, none waits."""
        self._joins: list[int] | None = None
        """The store's counts of members new to a counter, per slot, as last read
        (Store.joins, core/stretch.py join_slot)."""
        self._joined: set[int] = set()
        """Slots of the counters this replica published for the first time, to add to the
        store's counts in the next round."""
        self.member = member or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._counters: dict[str, QuotaCounter] = {}
        self._of: dict[str, set[str]] = {}
        """Instance → the counters it reports here."""
        self._pushers: dict[str, Callable[[list[Action]], bool]] = {}
        """Each instance's stream outbox for assignments between reports (False: full)."""
        self._first: dict[int, asyncio.Future[None]] = {}
        """Counters whose first publish is in flight, by id() (the publishing report holds
        each alive): reports that meet one wait on it."""
        self._background = BackgroundTask("rlqs-publish", self.run)

        self.closing = asyncio.Event()
        """Set by close_streams: every stream ends, and a new one ends at once."""
        self.streams = 0
        self.reports = 0
        self.assignments = 0
        self.abandons = 0
        self.malformed = 0
        """Buckets with an empty id (Envoy ignores any answer to them)."""
        self.publishes = 0
        self.bucket_updates = 0
        """Counter totals sent to the store, a monotonic count (docs/scale.md)."""
        self.last_updates = 0
        """Counter totals the last round's publish sent."""
        self.store_errors = 0
        self.pushed = 0
        self.pushes_dropped = 0

    async def report(self, instance: str, domain: str, usages: Iterable[Usage]) -> list[Action]:
        """Account one report of ``instance`` and answer each of its buckets."""
        self.reports += 1
        now, rules = self._clock(), self._config().domains.get(domain)
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
        counters = [a.counter for a in answers if isinstance(a, _Pending)]
        if any(counter.part is None for counter in counters):  # else no store, no wait
            await self._first_parts(counters)
        actions = [a if isinstance(a, Action) else self._decide(instance, a) for a in answers]
        self.assignments += sum(1 for a in actions if a.kind != ABANDON)
        self.abandons += sum(1 for a in actions if a.kind == ABANDON)
        return actions

    def _observe(self, instance: str, usage: Usage, match: Match, now: float) -> _Pending:
        """The instance's demand for the counter, on this process's clock."""
        log.debug("report from %s: %s %d/%d", instance, usage.bucket, usage.allowed, usage.denied)
        counter = self._counters.get(match.bucket_key)
        if counter is None:
            counter = self._counters[match.bucket_key] = QuotaCounter(match.bucket_key, match)
        self._follow_rule(counter, match)
        seen = counter.seen.get(instance)
        elapsed = None if seen is None else now - seen.last_report
        if seen is None:
            seen = counter.seen[instance] = Seen(now)
            self._of.setdefault(instance, set()).add(counter.key)
            if counter.part is not None:
                counter.resplit()  # once per instance joining: its even share counts
        self._spent(seen, usage, now)
        offered = usage.allowed + usage.denied
        seen.bucket = usage.bucket
        seen.idle = seen.idle + 1 if offered == 0 else 0
        if elapsed is not None and elapsed >= MIN_ELAPSED:
            seen.demand = offered / elapsed
            seen.last_report = now
        self._add_used(counter, usage.allowed)
        return _Pending(usage, counter, seen, elapsed)

    @staticmethod
    def _spent(seen: Seen, usage: Usage, now: float) -> None:
        """What the instance's bucket holds now and lost to being full (earned less allowed)."""
        if seen.saved is None or seen.sent is None:
            return
        rate = seen.sent.tokens_per_fill / seen.sent.fill_seconds
        elapsed, most = now - seen.saved_at, seen.sent.max_tokens
        seen.saved, seen.lost = stored(seen.saved, rate, elapsed, usage.allowed, usage.denied, most)
        seen.saved_at = now

    @staticmethod
    def _follow_rule(counter: QuotaCounter, match: Match) -> None:
        """A reloaded limit applies at once; the replica keeps its fraction until a publish."""
        before, now = counter.match.limit, match.limit
        counter.match = match
        if counter.part is None or before.requests_per_unit == now.requests_per_unit:
            return
        fraction = counter.part / before.requests_per_unit if before.requests_per_unit else 1.0
        counter.part = fraction * now.requests_per_unit
        counter.resplit()

    def _add_used(self, counter: QuotaCounter, allowed: int) -> None:
        """Count allowed hits in the fleet's window (a new one starts at 0, store or not)."""
        index = window_index(self._wall(), counter.window_seconds)
        if index != counter.window:
            counter.window, counter.used = index, 0
        counter.used += allowed
        counter.unpublished += allowed

    async def _first_parts(self, counters: list[QuotaCounter]) -> None:
        """Counters never published get their part from the store, in one call, before
        they are answered; a report meeting one whose first publish is in flight waits."""
        first = self._first
        fresh = list({id(c): c for c in counters if c.part is None and id(c) not in first}.values())
        waiting = {id(f): f for c in counters if (f := first.get(id(c))) is not None}
        if fresh:
            done = asyncio.get_running_loop().create_future()
            for counter in fresh:
                first[id(counter)] = done
            try:
                await self._publish([(counter, self._totals(counter)) for counter in fresh])
            finally:
                for counter in fresh:
                    del first[id(counter)]
                done.set_result(None)
        for future in waiting.values():
            await asyncio.shield(future)

    def _decide(self, instance: str, pending: _Pending) -> Action:
        usage, counter, seen = pending.usage, pending.counter, pending.seen
        limit = counter.match.limit
        if seen.idle >= ABANDON_AFTER:
            log.debug("%s idle on %s: abandoned", instance, usage.bucket)
            self._drop(instance, counter)
            return Action(usage.bucket, ABANDON)
        window, even = limit.window_seconds, counter.even()
        fair = counter.split.share(counter.asked(seen, even))
        share = settle_share(fair, counter.shares.get(instance), counter.room(instance))
        counter.assign(instance, share, even)
        allowance = share / window * (pending.elapsed or 0)
        self._count(counter.match.stats_key, usage, limit.shadow_mode, allowance)
        if limit.shadow_mode:
            seen.sent = seen.saved = None
            return Action(usage.bucket, ALLOW_ALL)
        if window > 1 and counter.used >= limit.requests_per_unit:
            seen.sent = seen.saved = None  # the next window's first bucket starts full
            reset = max(1, math.ceil(window_reset(self._wall(), window)))
            return Action(usage.bucket, DENY_ALL, ttl_seconds=reset)
        return Action(usage.bucket, TOKEN_BUCKET, self._bucket(counter, seen, share))

    def _bucket(self, counter: QuotaCounter, seen: Seen, share: float) -> TokenBucket:
        """The bucket to send for ``share``: the one the instance holds if it will do, else a
        new one (Envoy starts it full with what the instance has stored)."""
        limit = counter.match.limit
        worth = None if seen.saved is None else seen.saved + seen.lost
        bucket = next_bucket(
            seen.sent, share, worth, limit.requests_per_unit, limit.window_seconds, limit.burst
        )
        if bucket != seen.sent:
            seen.sent, seen.saved, seen.lost = bucket, float(bucket.max_tokens), 0.0
            seen.saved_at = self._clock()
        return bucket

    # -- the replica's tier: publish totals, divide the part -----------------------------

    async def tick(self) -> None:
        """One publish round: forget silent instances, publish (all but the counters that
        may wait), push grown shares."""
        now = self._clock()
        for counter in list(self._counters.values()):
            for name in [n for n, s in counter.seen.items() if now - s.last_report > FORGET_AFTER]:
                self._drop(name, counter)
        stretch = 1 if self._failing else self.stretch
        due: list[tuple[QuotaCounter, TierReport]] = []
        waiting: list[tuple[QuotaCounter, TierReport]] = []
        for counter in self._counters.values():
            if counter.part is None:
                continue
            report = self._totals(counter)
            (waiting if counter.can_wait(report, stretch) else due).append((counter, report))
        if waiting or self._joined:
            try:
                moved = await self._joins_moved()
            except StoreUnavailable as exc:  # a hung store costs a round one timeout, not two
                self._away(exc)
                return
            woken = [moved is None or join_slot(c.key) in moved for c, _ in waiting]
            due += [pair for pair, wake in zip(waiting, woken, strict=True) if wake]
            waiting = [pair for pair, wake in zip(waiting, woken, strict=True) if not wake]
        for counter, _ in waiting:
            counter.waited += 1
        self.last_updates = len(due)
        if due and await self._publish(due):  # the store splits it into calls
            for counter, _ in due:
                self._grow(counter)

    async def _joins_moved(self) -> set[int] | None:
        """Tell the store the slots of the counters this replica was new to since the last
        round, and read its counts of joins in the same call (Store.joins): the slots
        another member joined a counter of since the last read (None: all of them). Their
        counters' publishes do not wait this round, so a newcomer's even share is given up
        within a round or two of its first publish. Raises StoreUnavailable (the slots are
        told next round)."""
        added = sorted(self._joined)
        counts = await self._store.joins(added)
        self._joined.difference_update(added)  # a first publish meanwhile: next round
        seen, self._joins = self._joins, counts
        return joins_moved(seen, counts, added)

    async def _publish(self, due: list[tuple[QuotaCounter, TierReport]]) -> bool:
        """Publish each counter's totals and take the new parts; False when the store is
        away (parts kept; one never published gets the whole limit, as RLS's failure_mode)."""
        reports = [report for _, report in due]
        self.bucket_updates += len(reports)
        try:
            answers = await self._store.publish(reports, FORGET_AFTER)
        except StoreUnavailable as exc:
            self._away(exc)
            for counter, _ in due:
                if counter.part is None:
                    counter.part = float(counter.match.limit.requests_per_unit)
                    counter.resplit()
            return False
        self.publishes += 1
        self._failing = False
        for (counter, report), totals in zip(due, answers, strict=True):
            if counter.published is None:  # its first publish: the store took it as new
                self._joined.add(join_slot(counter.key))
            window = counter.window_seconds
            index = window_index(self._wall(), window)
            counter.unpublished -= report.allowed
            if index != counter.window:
                counter.window, counter.unpublished = index, 0
            counter.used = totals.used + counter.unpublished
            counter.totals = totals
            counter.published, counter.waited = report, 0
            counter.part = totals.part * window
            counter.resplit()
        return True

    def _away(self, exc: StoreUnavailable) -> None:
        """A call of the round failed: parts are kept, and the next round publishes every
        counter (none waits), which tells when the store answers again."""
        self.store_errors += 1
        self._failing = True
        log.debug("the store did not answer, parts kept: %s", exc)

    def _totals(self, counter: QuotaCounter) -> TierReport:
        """This replica's totals of a counter: its instances' demand per second (unmeasured:
        an even share of the fleet's) and allowed hits."""
        window = counter.window_seconds
        rate = counter.match.limit.requests_per_unit / window
        everyone = counter.totals.instances if counter.totals else len(counter.seen)
        measured = [s.demand for s in counter.seen.values() if s.demand is not None]
        demand = member_demand(measured, len(counter.seen) - len(measured), rate / max(1, everyone))
        return TierReport(
            counter.key, self.member, demand, len(counter.seen), counter.unpublished, window, rate
        )

    def _grow(self, counter: QuotaCounter) -> None:
        """Push now a larger bucket to each instance whose fair share grew into room nobody
        holds, rather than at its next report. Shares only grow here, so the instances never
        hold more than the part; shrinking waits for the instance's report."""
        limit = counter.match.limit
        if limit.shadow_mode or counter.part is None:
            return
        if limit.window_seconds > 1 and counter.used >= limit.requests_per_unit:
            return  # DENY_ALL until the window resets
        even = counter.even()
        for name, held in list(counter.shares.items()):
            seen = counter.seen.get(name)
            if name not in self._pushers or seen is None or seen.bucket is None:
                continue
            fair = counter.split.share(counter.asked(seen, even))
            share = settle_share(fair, held, counter.room(name))
            if share <= held:
                continue
            counter.assign(name, share, even)  # one after the other: each into what is left
            before = (seen.sent, seen.saved, seen.lost, seen.saved_at)
            bucket = self._bucket(counter, seen, share)
            if bucket == before[0]:
                continue  # the same bucket (rounded): Envoy has it
            log.debug("pushed to %s: %s", name, seen.bucket)
            if self._pushers[name]([Action(seen.bucket, TOKEN_BUCKET, bucket)]):
                self.pushed += 1
                self.assignments += 1
            else:
                self.pushes_dropped += 1  # the instance keeps the bucket it holds
                seen.sent, seen.saved, seen.lost, seen.saved_at = before

    def _drop(self, instance: str, counter: QuotaCounter) -> None:
        """``instance`` no longer reports ``counter``; a counter nobody reports goes."""
        counter.remove(instance)
        counters = self._of.get(instance)
        if counters is not None:
            counters.discard(counter.key)
            if not counters:
                del self._of[instance]
        if not counter.seen:
            del self._counters[counter.key]
        elif counter.part is not None:
            counter.resplit()

    async def run(self) -> None:
        """Publish every ``interval`` seconds."""
        await every(self.interval, self.tick, "RLQS publish round", self._failed)

    def _failed(self) -> None:
        self.store_errors += 1

    def start(self) -> None:
        self._background.start()

    async def stop(self) -> None:
        await self._background.stop()

    # -- streams -------------------------------------------------------------------------

    def attach(self, instance: str, push: Callable[[list[Action]], bool]) -> None:
        """``instance``'s stream takes assignments between its reports through ``push``."""
        self._pushers[instance] = push

    def _count(self, stats_key: str, usage: Usage, shadow: bool, allowance: float) -> None:
        """Envoy's decisions, counted as RLS counts its own; for a shadow rule, the hits
        beyond ``allowance`` (the instance's share of the period) would have been denied."""
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
        """End every stream now (the servicer answers UNAVAILABLE): an Envoy's stream never
        ends by itself, so each stop would wait out the server's grace. Envoy keeps its
        assignments until their TTL and opens a new stream at its next report. Call it
        after draining, before the gRPC server stops."""
        self.closing.set()

    def forget(self, instance: str) -> None:
        """A stream ended: drop what this process kept of it (the store forgets it later)."""
        self.streams -= 1
        self._pushers.pop(instance, None)
        for key in list(self._of.get(instance, ())):
            self._drop(instance, self._counters[key])

    def view(self) -> Iterator[CounterView | None]:
        """Each counter reported here, copied; a None every SLICE instances, a point to yield."""
        wall, copied = self._wall(), 0
        for counter in list(self._counters.values()):
            instances = tuple(
                (name, seen.demand, counter.shares.get(name), _per_second(seen.sent))
                for name, seen in list(counter.seen.items())
            )
            current = window_index(wall, counter.window_seconds) == counter.window
            match = counter.match
            yield CounterView(
                counter.key,
                match.stats_key,
                match.limit,
                counter.part,
                counter.totals,
                counter.used if current else 0,
                instances,
            )
            copied += 1 + len(instances)
            if copied >= SLICE:
                copied = 0
                yield None


def _per_second(bucket: TokenBucket | None) -> float | None:
    return None if bucket is None else bucket.tokens_per_fill / bucket.fill_seconds


def tightest(matches: tuple[Match, ...]) -> Match | None:
    """The limit of lowest rate an RLQS bucket is held to when its rule has several
    (rate_limits): Envoy enforces one token bucket per bucket."""
    if not matches:
        return None
    return min(matches, key=lambda m: m.limit.requests_per_unit / m.limit.window_seconds)
