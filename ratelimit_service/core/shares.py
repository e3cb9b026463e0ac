"""RLQS: a limit divided across a fleet of Envoys by demand, as token buckets Envoy
enforces itself (pure: the coordinator in engine/quota.py feeds it).

Each Envoy instance reports, per bucket, what it allowed and denied since its last
report; the service turns that into a demand (requests per second, on its own clock)
and gives every instance a max-min fair share of the limit by demand (:func:`water_level`;
what no one asks for is spread on top, so every instance has room to grow until its next
report). An instance just seen (no demand measured yet) asks for an equal part.

A share becomes a token bucket (Envoy 1.40 enforces only whole-second fill intervals,
and ignores ``requests_per_time_unit``): ``fill_interval`` is fixed per rule
(:func:`fill_seconds`: a new share then changes only the token counts, which Envoy
compares; it does not see a change of the seconds), ``tokens_per_fill`` the share of one
interval (at least 1: a fleet of n may exceed a tiny limit by up to n tokens per
interval), ``max_tokens`` what the instance has earned and not used, up to its part of
the rule's burst (at least 1): :func:`stored` and :func:`next_bucket` say why. Envoy
keeps the tokens of a bucket sent again unchanged, and starts a changed one full.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Split:
    """A max-min split of a limit, as the water level it fills to: an instance asking
    for ``asked`` gets ``min(asked, level) + spare``. Kept per counter, it gives an
    instance whose demand changed its fair share in O(1), without dividing again."""

    level: float
    """The most any instance gets before the spare (infinite when everyone's demand
    fits in the limit)."""
    spare: float
    """What no one asks for, spread evenly on top (0 when the limit is exceeded)."""

    def share(self, asked: float) -> float:
        return min(max(0.0, asked), self.level) + self.spare


def water_level(limit: float, asked: Mapping[str, float]) -> Split:
    """The max-min split of ``limit`` among instances asking for ``asked`` (water
    filling): those asking for less than an equal part of what is left get what they
    ask; the rest share it evenly."""
    if not asked:
        return Split(math.inf, limit)
    left, waiting = limit, sorted(max(0.0, a) for a in asked.values())
    for taken, want in enumerate(waiting):
        level = left / (len(waiting) - taken)
        if want > level:  # everyone left asks for more: an equal split
            return Split(level, 0.0)
        left -= want
    return Split(math.inf, left / len(waiting))


@dataclass(frozen=True, slots=True)
class TokenBucket:
    max_tokens: int
    tokens_per_fill: int
    fill_seconds: int


def fill_seconds(limit: int, window_seconds: int) -> int:
    """The rule's fill interval in whole seconds: 1, or as long as it takes the
    whole limit to earn one token (5 per minute: 12 s)."""
    if limit <= 0:
        return 1
    return max(1, math.ceil(window_seconds / limit))


def burst_part(share: float, limit: int, burst: int | None = None) -> float:
    """The most an instance whose share is ``share`` hits per window may store: its
    fraction of the rule's burst (the limit, or a smaller ``burst``)."""
    fraction = share / limit if limit > 0 else 0.0
    return fraction * (limit if burst is None else burst)


SMOOTH_SECONDS = 0.25
"""A new bucket holds at least this many seconds of the instance's share (up to its part of the
burst), so that an instance at its share does not deny hits that come in clumps."""


def token_bucket(
    share: float,
    limit: int,
    window_seconds: int,
    burst: int | None = None,
    stored: float | None = None,
) -> TokenBucket:
    """The token bucket of an instance whose share is ``share`` hits per window. Envoy's
    bucket refills continuously at tokens_per_fill / fill_interval and holds at most
    max_tokens, so max_tokens is only the burst: :func:`burst_part` (a smaller ``burst``
    also shortens the overshoot after a step in load), or what it has ``stored``, if less
    (what the instance gets at once)."""
    fill = fill_seconds(limit, window_seconds)
    per_fill = max(1, round(share * fill / window_seconds))
    most = burst_part(share, limit, burst)
    least = share * SMOOTH_SECONDS / window_seconds
    held = most if stored is None else min(most, max(least, stored))
    return TokenBucket(max_tokens=max(1, round(held)), tokens_per_fill=per_fill, fill_seconds=fill)


def stored(
    before: float, rate: float, elapsed: float, allowed: int, denied: int, max_tokens: float
) -> tuple[float, float]:
    """What an instance's bucket holds now, and what it lost to being full: it held
    ``before`` ``elapsed`` seconds ago, earned ``rate`` hits per second since and
    ``allowed`` that many; it holds between 0 and ``max_tokens``, and what it earned
    beyond that (at least this much: the bucket may also have been full in between)
    is lost. One that ``denied`` hits ran out meanwhile and is counted empty: the
    order of its hits is not reported, and a bucket counted fuller than it is would
    be handed tokens it never had.

    Every new share, a bucket that starts full, would otherwise hand each instance its
    whole part of the burst again: after a step in load the fleet would admit a whole
    burst more per round of reports. A new bucket holds what the instance has stored
    instead, and what it lost to a small bucket (bursty traffic, or less demand than its
    share) comes back as a larger one, up to its part of the burst.
    """
    left = before + rate * max(0.0, elapsed) - allowed
    held = 0.0 if denied else min(max_tokens, max(0.0, left))
    return held, max(0.0, left - max_tokens)


RAISE_AT = 1.25
"""A bucket whose rate is unchanged is sent again as it is until what the instance stored
and lost calls for a max_tokens this many times larger."""


def next_bucket(
    held: TokenBucket | None,
    share: float,
    worth: float | None,
    limit: int,
    window_seconds: int,
    burst: int | None = None,
) -> TokenBucket:
    """The bucket to send an instance that holds ``held`` (None: none yet, or a blanket rule) and
    whose share is now ``share``; ``worth``: what it has stored plus what it lost to a full bucket
    (None: a new instance, whose first bucket starts full). The held bucket when the rate is the
    same and max_tokens need not grow (RAISE_AT), else a new one holding ``worth``."""
    new = token_bucket(share, limit, window_seconds, burst, worth)
    rate = (new.tokens_per_fill, new.fill_seconds)
    if held is None or (held.tokens_per_fill, held.fill_seconds) != rate:
        return new
    most = max(1, round(burst_part(share, limit, burst)))
    if held.max_tokens > most or new.max_tokens >= RAISE_AT * held.max_tokens:
        return new
    return held


def window_reset(now: float, window_seconds: int) -> float:
    """Seconds until the fixed window holding ``now`` ends (windows aligned to the
    epoch, as the Go service's)."""
    return window_seconds - (now % window_seconds)


KEEP_WITHIN = 0.1
"""A new share up to this much above the one an instance holds keeps the old one, so
small changes of demand do not hand out fresh bursts."""


def window_index(wall: float, window_seconds: int) -> int:
    """Which fixed window (aligned to the epoch) the wall-clock time ``wall`` is in."""
    return int(wall // window_seconds)


def settle_share(fair: float, held: float | None, room: float) -> float:
    """The share to assign: an instance just seen gets its fair (even) share; one that
    holds a share gets the fair one, but at most ``room``: the limit less what the others
    hold now (they keep their buckets until their own next report; see counted_share),
    and keeps the one it holds while the fair one is at most KEEP_WITHIN above it."""
    if held is None:
        return fair
    share = max(0.0, min(fair, room))
    if held <= share <= held * (1 + KEEP_WITHIN):
        return held
    return share


def counted_share(share: float, demand: float | None, even: float) -> float:
    """What an instance's share counts for in the others' room: in full once its demand is measured,
    else at most ``even`` (the limit over the instances seen now). A first share is given before
    anyone knows how many will come (the first of a fleet starting together gets the whole limit,
    the second half of it ...): counted in full, they would add up to several times the limit and
    leave no room for anyone. The price: until such an instance reports, it may use its larger first
    bucket beside the others' grown ones (docs/benchmarks.md measures both sides)."""
    return min(share, even) if demand is None else share
