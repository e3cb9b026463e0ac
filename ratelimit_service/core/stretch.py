"""Reports that wait: a probabilistic bucket far below its limit, and an RLQS counter
steady well over its limit, are sent to the store less often.

A replica's store work grows with the buckets it sends (docs/scale.md): each bucket's
sync every ``--sync-interval``, each counter's publish every ``--rlqs-publish-interval``.
While the fleet offers a probabilistic bucket far less than its limit, nothing the store
would answer changes a decision, so its report may wait, up to :data:`STRETCH`
intervals; near the limit, or on a step up, it is sent every interval. The rule:
core/local_buckets.py ``LocalBuckets.can_wait``.

An RLQS counter below its limit is published every interval: a replica's part then
holds room for its Envoys to grow into, which the other replicas cannot take until it
publishes again, so a replica that waited would hold a step on the others back. Well
over the limit no part holds room (each is the limit by demand), and while this
replica's demand and instances stay where it last published them, its publish would
change no part: it may wait, up to STRETCH intervals (:func:`steady_over`). A step on
another replica is then divided within STRETCH intervals, the fleet held at the limit
meanwhile (a part grows only into what the others leave).

A probabilistic bucket steady well over its limit (a fleet of PREPAID_NODES processes
or more) waits too, up to STRETCH intervals, but paid in advance: over the limit each
process's admissions are held by its credit, which a sync grants an interval at a
time, and the others must see a grant as spent before it is, or they would grant the
same tokens again. Its report charges the fleet's bucket for the intervals of its wait
at once, the process grants itself that credit an interval at a time, and the next
report gives back what it did not spend (:func:`prepaid_wait`, :func:`prepaid_unspent`;
core/local_buckets.py ``LocalBuckets.waits_over``). A step either way is sent at once.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from ratelimit_service.core.tiers import TierReport, TierTotals

STRETCH = 4
"""At most how many sync intervals a bucket far below its limit, or steady well over it,
waits between two reports: its store work falls up to as much. The replica's sync still
goes every interval (its heartbeat, and the buckets near their limits)."""

FAR_BELOW = 4.0
"""A bucket is far below its limit while the fleet could offer this many times its rate
within the limit. Its report waiting delays the others' view of it by up to STRETCH
intervals; from this far below, a step up to several times the limit is read within
an interval still (the step shows in this replica's own rate, which sends at once).
Closer, from half the limit, the others' late counts arriving all at once on the step
read as a larger fleet rate and the fleet undershoots for a second."""


def far_below(rate: float, limit_rate: float) -> bool:
    """Whether an offered ``rate`` is far below a ``limit_rate`` (both per second)."""
    return rate * FAR_BELOW <= limit_rate


OVER = 1.25
"""An RLQS counter is well over its limit while the fleet's demand is at least this many
times the limit: each replica's part is then at most 0.8 of its demand."""
FAIR = 0.99
"""A part at least this share of the limit by demand is the fair one (the store rounds
parts down to a thousandth of a hit per second)."""
STEADY = 0.1
"""A replica's demand is steady while within this fraction of what it last published:
a part a tenth short of the demand stays used whole (over the limit, a part is at most
OVER's 0.8 of it), and the fleet's demand moves by a tenth of this replica's share."""


def steady_over(report: TierReport, last: TierReport, answer: TierTotals) -> bool:
    """Whether a member's publish of ``report`` may wait, ``last`` being its last publish
    the store answered with ``answer``: the fleet's demand at least OVER times the limit
    the parts divide and the member's part its fair one, the limit by demand (not held
    short by room the others held); its demand within STEADY of the last, its instances
    and the rule's limit the same; and the rule of a second (a longer one's count of its
    window would come late)."""
    fleet, limit, was = answer.demand, answer.limit, last.demand
    over = fleet > 0 and fleet >= OVER * limit and answer.part >= FAIR * limit * was / fleet
    same = report.instances == last.instances and report.limit == last.limit
    return over and same and report.window_seconds == 1 and abs(report.demand - was) <= STEADY * was


JOIN_SLOTS = 64
"""Slots of a store's count of joins (joins.lua): a member new to a counter adds one to
the counter's slot, and a member whose publishes wait publishes, in its next round, the
counters of the slots that moved. New counters elsewhere (another domain, a key per
client) end the waits of a sixty-fourth of the counters each, not of all of them."""


def join_slot(key: str) -> int:
    """The slot of the count of joins that a counter's newcomers add to."""
    return zlib.crc32(key.encode()) % JOIN_SLOTS


def joins_moved(
    seen: Sequence[int] | None, counts: Sequence[int], added: Sequence[int]
) -> set[int] | None:
    """The slots whose count of joins moved since ``seen`` (this member's last read),
    other than by this member's own additions (``added``, one each, made by the read
    that returned ``counts``); None: every slot (nothing read before, or the counts
    went back: the store restarted empty)."""
    if seen is None or len(seen) != len(counts):
        return None
    pairs = list(zip(counts, seen, strict=True))
    if any(now < was for now, was in pairs):
        return None
    own = set(added)
    return {slot for slot, (now, was) in enumerate(pairs) if now - was != int(slot in own)}


PREPAID_NODES = 8
"""A probabilistic bucket over its limit waits only in a fleet of at least this many
processes: its wait is paid in advance (:func:`prepaid_wait`), a lump the fleet's
bucket takes at once, which in a small fleet is a large share of the limit (a step
then settles slowly), and where a few processes sync, their syncs cost the store
little anyway."""


SETTLED = 8
"""A probabilistic bucket over its limit waits (:func:`prepaid_wait`) once this many of
its reports in a row found it well over its limit, its bucket at most half full: after
a step, the fleet first settles at the limit (its ratio and the nodes' shares), every
interval."""


def prepaid_wait(
    place: int,
    ramp: int,
    pace: float,
    count: float,
    rate: float,
    seconds: float,
    stretch: int,
) -> tuple[int, int]:
    """How a probabilistic bucket steady well over its limit waits after this report:
    (intervals until its next report, hits paid in advance for the intervals after the
    first). Its admissions are held by its credit, an interval's grant; to go ``n``
    intervals between reports it is granted ``n - 1`` times its ``pace`` more (its
    share of an interval's refill, what its grant is once steady), which its report
    charges to the fleet's bucket at once (and the next report gives back what it did
    not spend), so the others see them as spent: over the limit, waiting runs the
    fleet over nothing. Its reports fall on its turns, every ``stretch`` intervals from
    its ``place`` among them (this interval's number plus the process's and the
    bucket's offsets): the fleet's reports of a bucket spread over the intervals, as
    its syncs do over an interval, or the fleet would read the bucket's tokens all at
    once and spend them all at once. ``ramp``: the longest wait this report may pay
    for, one interval more each report, so that the fleet's payments begin a grant at
    a time. ``count`` hits offered over ``seconds`` against its smoothed ``rate``: a
    rate that moved (:func:`moved`) waits no more."""
    if moved(count, rate, seconds):
        return 1, 0
    n = min(stretch - place % stretch, ramp)
    paid = int(pace * (n - 1))
    return (n, paid) if paid >= 1 else (1, 0)


def prepaid_unspent(ramp: int, stretch: int) -> float:
    """Intervals of a bucket's refill that the fleet's waits over its limit hold paid in
    advance and not yet spent, as a process paying for a wait of ``ramp`` intervals
    (:func:`prepaid_wait`) reckons it: each process of the fleet waits as it does,
    one report behind (its ramp one less), and holds on average half of what its wait
    paid. Added to the fleet's tokens the process reads, it keeps the fleet's view
    where a sync every interval would leave it: without it, the fleet would take the
    payments in advance for admissions and hold back as much, once, as its waits
    begin."""
    return max(0, min(ramp - 2, stretch - 1)) / 2


def moved(count: float, rate: float, seconds: float) -> bool:
    """Whether ``count`` hits over ``seconds`` are more than twice ``rate`` per second or
    less than half of it: a step (a count over an interval scatters too much for a
    closer bound to tell a step from chance)."""
    expected = rate * seconds
    return expected <= 0 or count > 2.0 * expected or 2.0 * count < expected


def stepped_up(count: float, rate: float, seconds: float) -> bool:
    """Whether ``count`` hits over ``seconds`` are more than twice ``rate`` per second:
    a step up that is sent at once."""
    return count > 2.0 * rate * seconds
