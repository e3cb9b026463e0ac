"""RLQS: a limit divided across a fleet of Envoys by demand, as token buckets Envoy
enforces itself (pure: the coordinator in engine/quota.py feeds it).

Each Envoy instance reports, per bucket, what it allowed and denied since its last
report; the service turns that into a demand (requests per second, on its own clock)
and gives every instance a share of the limit:

* **Max-min fair, by demand.** Instances asking for less than an equal share get what
  they ask for; the rest is split evenly among the others (water filling). What no
  one asks for is spread evenly on top, so that every instance has room to grow
  until the next report.
* **An even share for an instance just seen** (no demand measured yet): it counts as
  asking for an equal part of the limit.

A share becomes a token bucket (Envoy 1.40 enforces only whole-second fill
intervals, and ignores ``requests_per_time_unit``): ``fill_interval`` is fixed per rule
(:func:`fill_seconds`, so that a new share changes only the token counts, which Envoy
compares; it does not see a change of the seconds), ``tokens_per_fill`` the share of
one interval (at least 1: a share below one token per interval rounds up, so a fleet
of n may exceed a tiny limit by up to n tokens per interval), ``max_tokens`` the
instance's part of the rule's burst (the limit, or ``burst``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass


def fair_shares(limit: float, demands: Mapping[str, float | None]) -> dict[str, float]:
    """Each instance's share of ``limit`` (same unit as the demands). ``None``: an
    instance with no demand measured yet, counted as asking for an equal share."""
    if not demands:
        return {}
    even = limit / len(demands)
    asked = {name: even if d is None else max(0.0, d) for name, d in demands.items()}
    shares: dict[str, float] = {}
    left, waiting = limit, sorted(asked, key=lambda name: (asked[name], name))
    while waiting:
        level = left / len(waiting)
        name = waiting[0]
        if asked[name] > level:  # everyone left asks for more: an equal split
            for other in waiting:
                shares[other] = level
            return shares
        shares[name] = asked[name]
        left -= asked[name]
        waiting.pop(0)
    spare = left / len(shares)  # demand below the limit: the rest spread evenly
    return {name: share + spare for name, share in shares.items()}


@dataclass(frozen=True, slots=True)
class QuotaReport:
    """What one report says of one counter, for the fleet's tier (the store)."""

    key: str
    """The rule's bucket key (its values and window)."""
    instance: str
    demand: float | None
    """Requests per second this instance offered since its last report; None: not
    measured yet (counted as an even share)."""
    allowed: int
    window_seconds: int


@dataclass(frozen=True, slots=True)
class QuotaView:
    """The fleet's tier's answer for one counter."""

    demands: dict[str, float | None]
    """Every instance that reported the counter lately (this one included)."""
    used: int
    """Allowed hits reported in the current fixed window (windows aligned to the
    epoch), this report's included."""


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


def token_bucket(
    share: float, limit: int, window_seconds: int, burst: int | None = None
) -> TokenBucket:
    """The token bucket of an instance whose share is ``share`` hits per window."""
    fill = fill_seconds(limit, window_seconds)
    fraction = share / limit if limit > 0 else 0.0
    per_fill = max(1, round(share * fill / window_seconds))
    most = max(per_fill, round(fraction * (limit if burst is None else burst)))
    return TokenBucket(max_tokens=max(1, most), tokens_per_fill=per_fill, fill_seconds=fill)


def window_reset(now: float, window_seconds: int) -> float:
    """Seconds until the fixed window holding ``now`` ends (windows aligned to the
    epoch, as the Go service's)."""
    return window_seconds - (now % window_seconds)
