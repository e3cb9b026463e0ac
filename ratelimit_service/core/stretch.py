"""Reports that wait: a probabilistic bucket far below its limit is sent to the store
less often.

A replica's store work grows with the buckets it sends (docs/scale.md): each bucket's
sync every ``--sync-interval``. While the fleet offers a bucket far less than its
limit, nothing the store would answer changes a decision, so its report may wait, up
to :data:`STRETCH` intervals; near the limit, or on a step up, it is sent every
interval. The rule: core/local_buckets.py ``LocalBuckets.can_wait``.

RLQS publishes do not wait: a replica's part of a limit holds room for its Envoys to
grow into, which the other replicas cannot take until it publishes again, so a replica
that waited would hold a step on the others back by as many intervals.
"""

from __future__ import annotations

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


def stepped_up(count: float, rate: float, seconds: float) -> bool:
    """Whether ``count`` hits over ``seconds`` are more than twice ``rate`` per second:
    a step up that is sent at once."""
    return count > 2.0 * rate * seconds
