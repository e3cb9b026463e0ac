"""The zone aggregator's core (core/zones.py) on a set clock, without Redis: the lease's
term on a replica's own clock, the pass's arithmetic; and lease.lua and zone_write.lua's
fence on a real redis-server, on a clock the test sets, held equal to their model
(LeaseTable, here: no process runs a lease of its own), called and read as the zone
store calls and reads them (lease_args, write_args, lease_reply, zone_write_reply)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pytest
import redis.asyncio as aioredis

from ratelimit_harness.redis import script_on_test_clock, set_test_clock
from ratelimit_service.core.drop_ratio import FleetView
from ratelimit_service.core.stretch import STRETCH, join_slot
from ratelimit_service.core.tiers import Fenced, TierTotals
from ratelimit_service.core.zones import (
    FRESH_US,
    PRESENCE,
    PROBABILISTIC,
    Change,
    Leadership,
    Lease,
    LeaseState,
    ZoneBucket,
    ZoneBuckets,
    ZoneKeys,
    ZonePass,
    ZoneShare,
    ZoneTotals,
    reserved_part,
)
from ratelimit_service.storage.redis_calls import script_text
from ratelimit_service.storage.script_calls import (
    lease_args,
    lease_reply,
    write_args,
    zone_write_reply,
)

TTL, MARGIN = 1.0, 0.125


@dataclass(slots=True)
class LeaseTable:
    """A zone's lease and fencing counter as lease.lua and zone_write.lua keep them in
    the zone store: the model the scripts are held to (no process runs a lease of its
    own: zones need Redis)."""

    holder: str | None = None
    token: int = 0
    """The holder's fencing token."""
    expires_us: int = 0
    highest: int = 0
    """The fencing counter: the last token handed out, or a higher one a write brought."""

    def ask(self, who: str, ttl_us: int, now_us: int, floor: int | None = None) -> Lease:
        """``who`` asks for the lease at ``now_us``: the holder renews it; anyone takes
        it once it has expired, with the next token. ``floor``: a token a write of
        ``who`` was refused against; a holder whose token is not above it gets a new one
        above both it and the counter."""
        if self.holder is not None and self.expires_us > now_us:
            if self.holder != who:
                return Lease(LeaseState.HELD_BY_ANOTHER, self.holder, self.token)
            if floor is not None and floor >= self.token:
                self.highest = max(self.highest, floor) + 1
                self.token = self.highest
            self.expires_us = now_us + ttl_us
            return Lease(LeaseState.RENEWED, who, self.token)
        self.highest = max(self.highest, floor if floor is not None else 0) + 1
        self.holder, self.token, self.expires_us = who, self.highest, now_us + ttl_us
        return Lease(LeaseState.TAKEN, who, self.token)

    def write(self, token: int) -> Fenced | None:
        """A write to the zone store with ``token`` (zone_write.lua): refused below the
        counter; a higher token raises it."""
        if token < self.highest:
            return Fenced(self.highest)
        self.highest = token
        return None


def taken(token: int, holder: str = "me") -> Lease:
    return Lease(LeaseState.TAKEN, holder, token)


def renewed(token: int, holder: str = "me") -> Lease:
    return Lease(LeaseState.RENEWED, holder, token)


def held_by(holder: str, token: int) -> Lease:
    return Lease(LeaseState.HELD_BY_ANOTHER, holder, token)


# -- the term, on the replica's own clock ---------------------------------------------


def test_a_term_ends_a_margin_before_the_lease_could_expire() -> None:
    """Taken by a call sent at 10.0 and answered at 10.2: the store started the lease's
    time to live no earlier than 10.0, so the replica aggregates until 10.875 (10.0 +
    1.0 - 0.125), measured from the send, not from the answer."""
    term = Leadership(TTL, MARGIN)
    assert term.answered(taken(3), sent_at=10.0, now=10.2) == Change.TOOK
    assert term.leading(10.874) and term.term(10.874) == 3
    assert not term.leading(10.875) and term.term(10.875) is None


def test_renewals_that_fail_do_not_end_the_term_before_it_runs_out() -> None:
    """Renewals every 0.25 s fail (the zone store slow or away): the replica keeps
    aggregating until its term ends, then stops, said once."""
    term = Leadership(TTL, MARGIN)
    term.answered(taken(1), sent_at=0.0, now=0.01)
    assert [term.failed(now) for now in (0.25, 0.5, 0.75)] == [Change.NONE] * 3
    assert term.leading(0.8)
    assert term.failed(1.0) == Change.LAPSED
    assert term.failed(1.25) == Change.NONE and not term.leading(1.25)
    # The lease was still its own in the store: it aggregates again, same token.
    assert term.answered(renewed(1), sent_at=1.5, now=1.51) == Change.RESUMED
    assert term.until == 1.5 + TTL - MARGIN and term.token == 1


def test_a_renewal_answered_after_the_term_it_gives_does_not_make_a_leader() -> None:
    term = Leadership(TTL, MARGIN)
    term.answered(taken(1), sent_at=0.0, now=0.01)
    assert term.answered(renewed(1), sent_at=0.5, now=1.5) == Change.LAPSED
    assert not term.leading(1.5)
    assert Leadership(TTL, MARGIN).answered(taken(2), sent_at=0.0, now=0.9) == Change.NONE


def test_another_holder_ends_the_term_and_a_new_take_is_a_takeover() -> None:
    term = Leadership(TTL, MARGIN)
    assert term.answered(held_by("other", 4), sent_at=0.0, now=0.01) == Change.NONE
    assert term.answered(taken(5), sent_at=1.0, now=1.01) == Change.TOOK
    assert term.answered(held_by("other", 6), sent_at=1.2, now=1.21) == Change.LOST
    assert term.holder == "other" and not term.leading(1.21)
    # Its own lease expired in the store while it still counted (a clock that ran
    # slow): the new take is a new term, a takeover.
    term.answered(taken(7), sent_at=2.0, now=2.01)
    assert term.answered(taken(8), sent_at=2.5, now=2.51) == Change.TOOK


def test_a_refused_write_ends_its_term_and_names_the_token_to_get_above() -> None:
    term = Leadership(TTL, MARGIN)
    term.answered(taken(3), sent_at=0.0, now=0.01)
    assert term.refused(3, highest=4, now=0.2) == Change.FENCED
    assert not term.leading(0.2) and term.floor == 4
    assert term.answered(renewed(3), sent_at=0.25, now=0.26) == Change.RESUMED
    assert term.floor == 4  # not above it yet: asked again
    term.answered(renewed(5), sent_at=0.5, now=0.51)
    assert term.floor is None and term.term(0.6) == 5
    # A late pass of an earlier term is refused: the present term goes on.
    assert term.refused(3, highest=5, now=0.7) == Change.NONE and term.leading(0.7)


# -- the lease table (lease.lua's twin) -------------------------------------------------


def test_the_lease_changes_hands_only_when_it_has_expired_and_each_take_has_a_new_token() -> None:
    table = LeaseTable()
    assert table.ask("a", 1_000, now_us=0) == Lease(LeaseState.TAKEN, "a", 1)
    assert table.ask("b", 1_000, now_us=999) == Lease(LeaseState.HELD_BY_ANOTHER, "a", 1)
    assert table.ask("a", 1_000, now_us=999) == Lease(LeaseState.RENEWED, "a", 1)
    assert table.ask("b", 1_000, now_us=1_998) == Lease(LeaseState.HELD_BY_ANOTHER, "a", 1)
    assert table.ask("b", 1_000, now_us=1_999) == Lease(LeaseState.TAKEN, "b", 2)
    assert table.ask("b", 1_000, now_us=5_000) == Lease(LeaseState.TAKEN, "b", 3)


def test_writes_below_the_counter_are_refused_and_a_holder_gets_above_a_refusal() -> None:
    table = LeaseTable()
    table.ask("a", 1_000, now_us=0)
    table.ask("b", 1_000, now_us=2_000)  # b holds token 2
    assert table.write(1) == Fenced(2)  # a's late write
    assert table.write(2) is None
    assert table.ask("a", 1_000, now_us=2_100, floor=9) == Lease(
        LeaseState.HELD_BY_ANOTHER, "b", 2
    )  # a deposed replica's floor changes nothing
    assert table.ask("b", 1_000, now_us=2_200, floor=9) == Lease(LeaseState.RENEWED, "b", 10)
    assert table.write(2) == Fenced(10)
    assert table.write(12) is None and table.highest == 12  # a higher token raises it


def test_two_replicas_never_aggregate_at_once() -> None:
    """Two replicas ask for one lease every quarter of its time to live, their calls
    delayed on the way there and back (up to 0.3 s each way) or lost, now and then
    paused for up to 1.5 s, their clocks running at their own rates (within 1 %) from
    their own origins. Just after every answer (a term only starts at one) at most one
    replica's term is running on its own clock; and the lease does change hands."""
    rng = random.Random(5)
    handovers = 0
    for _ in range(50):
        table = LeaseTable()
        terms = {name: Leadership(TTL, MARGIN) for name in "ab"}
        # Each replica's clock: its own origin, its own rate.
        clocks = {name: (rng.uniform(0, 100), rng.uniform(0.99, 1.01)) for name in "ab"}

        calls = []  # (when the store runs it, when the answer arrives, who, when sent)
        for name in "ab":
            t = rng.uniform(0, 0.25)
            while t < 60:
                if rng.random() < 0.9:  # else lost
                    there, back = (rng.choice([0.001, 0.01, rng.uniform(0, 0.3)]) for _ in "12")
                    calls.append((t + there, t + there + back, name, t))
                t += 0.25 + (rng.random() < 0.05) * rng.uniform(0, 1.5)
        answers = []
        for ran, back, name, sent in sorted(calls):
            before = table.holder
            lease = table.ask(name, int(TTL * 1e6), round(ran * 1e6))
            handovers += lease.state == LeaseState.TAKEN and before not in (None, name)
            answers.append((back, name, lease, sent))
        for back, name, lease, sent in sorted(answers, key=lambda answer: answer[0]):
            terms[name].answered(lease, clock(clocks[name], sent), clock(clocks[name], back))
            leading = [n for n in "ab" if terms[n].leading(clock(clocks[n], back))]
            assert len(leading) <= 1, (back, leading)
    assert handovers >= 50


def clock(own: tuple[float, float], t: float) -> float:
    """A replica's clock at real time ``t``: (origin, rate)."""
    return own[0] + t * own[1]


# -- the pass ---------------------------------------------------------------------------


def counter(key: str, demand: float, used: int = 0, forwarded: int = 0) -> ZoneTotals:
    return ZoneTotals(f"h:{key}", key, demand, 2, 100.0, 1, used, forwarded, 7)


def bucket(key: str, offered: int, admitted: int, created_us: int) -> ZoneBucket:
    return ZoneBucket(f"f:{key}", key, offered, admitted, 300, 1, 10, created_us)


def test_a_pass_publishes_the_zones_sums_and_writes_back_its_parts() -> None:
    """Presence first, then each counter with its demand and the hits allowed since the
    last forward, then each bucket with its rate of offered hits between two passes."""
    arithmetic = ZonePass("a", interval=1.0)
    now_us = 100 * FRESH_US
    old_us = now_us - 2 * FRESH_US
    first = arithmetic.plan([counter("c", 60.0, used=50, forwarded=20)],
                            ZoneBuckets(now_us, 3, [bucket("p", 1_000, 500, old_us)]))  # fmt: skip
    assert [r.key for r in first.reports] == [PRESENCE, "c"]  # the bucket: measured next
    assert (first.reports[1].demand, first.reports[1].allowed) == (60.0, 30)
    second = arithmetic.plan([], ZoneBuckets(now_us + 500_000, 3,
                                             [bucket("p", 1_100, 550, old_us)]))  # fmt: skip
    (report,) = second.reports[1:]
    assert report.key == PROBABILISTIC + "p" and report.demand == 200.0  # 100 in 0.5 s
    assert (report.instances, report.allowed, report.limit) == (3, 540, 300.0)
    presence = TierTotals(0.0, 0.0, 2, 2, 0, 0.0)
    shares, zones = arithmetic.shares(second, [presence, TierTotals(123.4567, 0, 0, 2, 0, 0.0)])
    assert zones == 2 and shares == [("f:p", ZoneShare(123457, 0, 0, 550))]
    answers = [presence, TierTotals(40.0, 0, 0, 2, 77, 0.0)]
    assert arithmetic.shares(first, answers) == ([("h:c", ZoneShare(40_000, 77, 7, 50))], 2)


def test_a_counter_steady_over_the_limit_goes_every_stretch_passes_keeping_its_part() -> None:
    """The zone asks 300/s of a limit of 100/s, steadily, and its part is the fleet's by
    demand: after its first pass the counter goes to the global store every STRETCH
    passes (the presence every pass), and a pass it waits keeps its last part, its
    allowed hits held to forward. A pass with a report new to the aggregator is joining."""
    arithmetic = ZonePass("a", interval=1.0)
    presence = TierTotals(0.0, 0.0, 2, 2, 0, 0.0)
    answer = TierTotals(50.0, 600.0, 4, 2, 0, 100.0)  # the limit by demand: 300 of 600
    went = []
    for number in range(1 + 2 * STRETCH):
        plan = arithmetic.plan([counter("c", 300.0, used=50 + number, forwarded=20)],
                               ZoneBuckets(number * 1_000_000, 2, []))  # fmt: skip
        new = {join_slot(PRESENCE), join_slot("c")} if number == 0 else set()
        assert arithmetic.joining(plan) == new
        going = arithmetic.going(plan, STRETCH)
        went.append(going)
        answers = [a for a, go in zip([presence, answer], going, strict=True) if go]
        merged = arithmetic.merge(plan, going, answers)
        shares, _ = arithmetic.shares(plan, merged, [], going)
        held = ZoneShare(50_000, 0, 7, 50 + number) if going[1] else ZoneShare(50_000, 0, 7, 20)
        assert shares == [("h:c", held)]
    assert all(go[0] for go in went)  # the presence every pass
    assert [n for n, go in enumerate(went) if go[1]] == [0, STRETCH, 2 * STRETCH]
    assert arithmetic.going(plan, 1) == [True, True]  # no stretch: every pass


def test_a_new_bucket_is_measured_since_its_creation_and_reserves_the_others_parts() -> None:
    arithmetic = ZonePass("a", interval=1.0)
    now_us = 10**15
    plan = arithmetic.plan([], ZoneBuckets(now_us, 1, [bucket("p", 300, 100, now_us - 2 * 10**6)]))
    (report,) = plan.reports[1:]
    assert report.demand == 150.0  # 300 since its creation 2 s ago
    # Created within two passes: while one zone of three has published it, its part is
    # at most a third of the limit.
    shares, _ = arithmetic.shares(
        plan, [TierTotals(0, 0, 3, 3, 0, 0.0), TierTotals(300, 0, 1, 1, 0, 0.0)]
    )
    assert shares == [("f:p", ZoneShare(100_000, 0, 0, 100))]


def test_a_zones_admitted_count_that_fell_keeps_what_was_forwarded() -> None:
    """A replica gave back credit it paid in advance (its report a negative count): the
    zone's admitted count falls below what was forwarded. Nothing is forwarded, and the
    forwarded count stays, so the count rising to it again is not forwarded twice."""
    arithmetic = ZonePass("a", interval=1.0)
    now_us = 10**15
    old_us = now_us - 2 * FRESH_US
    arithmetic.plan([], ZoneBuckets(now_us, 1, [bucket("p", 300, 5, old_us)]))
    plan = arithmetic.plan([], ZoneBuckets(now_us + 10**6, 1, [bucket("p", 400, 5, old_us)]))
    (report,) = plan.reports[1:]
    assert report.allowed == 0  # 5 admitted, 10 forwarded
    shares, _ = arithmetic.shares(
        plan, [TierTotals(0, 0, 1, 1, 0, 0.0), TierTotals(300, 0, 1, 1, 0, 0.0)]
    )
    assert shares == [("f:p", ZoneShare(300_000, 0, 0, 10))]


def test_a_calendar_budget_is_folded_into_the_global_bucket_and_allotted_by_demand() -> None:
    """A calendar budget's bucket goes to the global store as a node's report (the hits
    the zone admitted since the last forward, the time to the period's end); the zone is
    allotted, on top of what it admitted, its share by demand of half of what the global
    bucket has left (two zones), and nothing new while the global bucket was not read
    (its admissions are then forwarded at the next pass)."""
    arithmetic = ZonePass("a", interval=1.0)
    now_us = 10**15
    ends_us = now_us + 3_600 * 10**6
    rolling = bucket("p", 1_000, 500, now_us - 2 * FRESH_US)
    budget = ZoneBucket("f:m", "m", 1_000, 700, 10_000, 2_678_400, 100, now_us - 2 * FRESH_US,
                        ends_us)  # fmt: skip
    arithmetic.plan([], ZoneBuckets(now_us - 10**6, 2, [rolling, replace(budget, offered=900)]))
    plan = arithmetic.plan([], ZoneBuckets(now_us, 2, [rolling, budget]))
    assert plan.reports[2].demand == 100.0  # 100 offered in a second
    (report,) = arithmetic.calendar_reports(plan)
    assert (report.key, report.limit, report.window_seconds) == ("m", 10_000, 2_678_400)
    assert (report.admitted, report.offered, report.ends_in) == (600, 0, 3_600.0)
    assert not report.refills
    presence = TierTotals(0.0, 0.0, 2, 2, 0, 0.0)
    # The fleet's demand not known yet: an even share; then this zone's quarter.
    answers = [presence, TierTotals(1.0, 0, 0, 2, 0, 0.0), TierTotals(0.001, 0.0, 0, 2, 0, 0.0)]
    shares, _ = arithmetic.shares(plan, answers, [FleetView(4_000.0, 0)])
    assert shares[1] == ("f:m", ZoneShare(1, 0, 0, 700, 700 + 4_000 / 2 / 2))
    answers[2] = TierTotals(0.001, 400.0, 0, 2, 0, 0.0)
    shares, _ = arithmetic.shares(plan, answers, [FleetView(4_000.0, 0)])
    assert shares[1][1].allot == 700 + 4_000 / 2 / 4
    # While the other zone has not published the budget, what it may hold of it (a new
    # bucket's half) is not allotted.
    answers[2] = TierTotals(0.001, 400.0, 0, 1, 0, 0.0)
    shares, _ = arithmetic.shares(plan, answers, [FleetView(9_000.0, 0)])
    assert shares[1][1].allot == 700 + (9_000 - 5_000) / 2 / 4
    shares, _ = arithmetic.shares(plan, answers, [FleetView(-50.0, 0)])  # overspent
    assert shares[1][1].allot == 700
    shares, _ = arithmetic.shares(plan, answers, None)
    assert shares[1] == ("f:m", ZoneShare(1, 0, 0, 100, None))
    assert shares[0] == ("f:p", ZoneShare(1_000, 0, 0, 500, None))


def test_a_new_buckets_part_leaves_room_for_the_zones_not_heard_yet() -> None:
    assert reserved_part(100.0, 100.0, 1, 2) == 50.0  # b not heard: half for a
    assert reserved_part(30.0, 100.0, 1, 2) == 30.0  # never more than its part
    assert reserved_part(100.0, 100.0, 2, 3) == pytest.approx(66.67, abs=0.01)
    assert reserved_part(100.0, 100.0, 2, 2) == 100.0  # every zone heard
    assert reserved_part(100.0, 100.0, 1, 1) == 100.0


def test_a_zones_keys() -> None:
    keys = ZoneKeys.of("rl:", "eu-1")
    assert (keys.counters, keys.buckets, keys.zones, keys.lease, keys.fence) == (
        "rl:zone:eu-1:counters", "rl:zone:eu-1:buckets", "rl:zone:eu-1:zones",
        "rl:zone:eu-1:lease", "rl:zone:eu-1:fence",
    )  # fmt: skip


# -- the scripts and their twin -----------------------------------------------------------


async def test_the_lease_script_and_the_zone_writes_fence_keep_what_their_model_keeps(
    redis_server,
) -> None:
    """Replicas ask for the lease at random moments (now and then naming a token they
    were refused against), and write back with their token, a stale one now and then.
    After every call the scripts' answers equal LeaseTable's on the same clock; every
    branch runs (taken, renewed, held, a holder's floor, refused and accepted writes)."""
    rng = random.Random(3)
    client = aioredis.Redis.from_url(redis_server.url)
    lease = script_on_test_clock("lease.lua")
    write = script_text("zone_write.lua")
    table, ttl_us = LeaseTable(), 10_000_000
    tokens: dict[str, int] = {}
    now_us = 1_700_000_000_000_000
    seen: dict[str, int] = {}
    await client.delete("z:lease", "z:fence", "z:zones")
    try:
        for step in range(600):
            now_us += rng.choice([rng.randrange(3_000_000), rng.randrange(25_000_000)])
            await set_test_clock(client, now_us)
            who = rng.choice(["r1", "r2", "r3"])
            if rng.random() < 0.6:
                floor = rng.choice([None, None, None, table.highest + rng.randint(-2, 3)])
                args = lease_args(who, ttl_us, floor)
                raw = await client.eval(lease, 2, "z:lease", "z:fence", *args)
                want = table.ask(who, ttl_us, now_us, floor)
                assert lease_reply(raw) == want, step
                tokens[who] = want.token if want.holder == who else tokens.get(who, 0)
                kind = want.state.name + ("+floor" if floor is not None else "")
            else:
                token = max(0, tokens.get(who, 0) - (rng.random() < 0.2))
                args = write_args([], None, 1000, token)
                raw = await client.eval(write, 2, "z:zones", "z:fence", *args)
                refused = table.write(token)
                assert zone_write_reply(raw) == (refused if refused is not None else 0), step
                kind = "refused" if refused is not None else "written"
            seen[kind] = seen.get(kind, 0) + 1
        for kind in ("TAKEN", "RENEWED", "HELD_BY_ANOTHER", "RENEWED+floor", "refused",
                     "written"):  # fmt: skip
            assert seen.get(kind, 0) >= 5, seen
    finally:
        await client.aclose()
