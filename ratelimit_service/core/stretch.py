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
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

from ratelimit_service.core.tiers import TierReport, TierTotals

STRETCH = 4
"""At most how many sync intervals a bucket far below its limit waits between two reports:
its store work falls up to as much. The replica's sync still goes every interval (its
heartbeat, and the buckets near their limits)."""

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


def stepped_up(count: float, rate: float, seconds: float) -> bool:
    """Whether ``count`` hits over ``seconds`` are more than twice ``rate`` per second:
    a step up that is sent at once."""
    return count > 2.0 * rate * seconds
