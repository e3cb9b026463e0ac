"""The controller behind probabilistic mode: from fleet totals to a drop ratio and a credit.

The seed design sets ``ratio = max(0, (offered - limit) / offered)`` from rates. We
keep that as the steady state, but steer by the *budget* the fleet may admit before
the next sync, taken from a fleet-wide token bucket (capacity ``limit``, refilled at
``limit / T``). That gives:

* **Bursts up to the limit, then the limit rate.** An idle client may send up to
  ``limit`` at once; under sustained overload the bucket is empty, the budget is
  ``limit * interval / T`` and the ratio is exactly the seed's formula. Admissions
  flow smoothly at the limit rate (a sliding window, as in exact mode, instead
  re-admits a burst each time an old burst leaves the window).
* **Burst guard.** A node may admit at most its share of the budget (its *credit*)
  until the next sync, and the stored tokens are spent at most half per interval
  (``TOKEN_SPEND``), so a spike between syncs, or the first burst before any sync,
  overshoots little and leaves no debt that would starve the bucket afterwards.
* **Low-rate limits.** With 5 per minute the offered rate is too noisy to steer by;
  the credit makes such buckets behave like a token bucket with a resolution of one
  sync interval.
* **Fast attack, smooth decay.** The offered-rate estimate follows a rise at once
  (no lag on a spike) and falls with an exponential moving average (no oscillation
  after a dip).

The price of the token bucket: an interval of length T can see up to 2x the limit
when a full bucket is emptied and then refilled during T (the Go service's fixed
window allows the same across its edge). Rules that must never exceed the limit in
any window use exact mode.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_SPEND = 0.5
"""Share of the stored tokens the fleet may spend in one interval. Each node sees the
others' admissions up to one interval late, so handing out all the tokens at once
lets a burst overshoot them and the debt then starves the bucket; spending half per
interval (a geometric drain) cut the undershoot after a 0.5x -> 3x step from 0.31x to
0.76x of the limit in the fleet simulation, for a burst spread over a few intervals."""


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the store reports for one bucket after a sync."""

    tokens: float
    """The fleet token bucket after this node's admitted hits were taken out."""
    offered_total: int
    """Monotonic count of hits offered to the whole fleet."""


@dataclass(frozen=True, slots=True)
class SyncResult:
    """A store's answer to one sync: live nodes, and a view per reported bucket."""

    nodes: int
    views: list[FleetView]


@dataclass(frozen=True, slots=True)
class Control:
    ratio: float
    credit: float


def smoothed_rate(previous: float | None, measured: float, decay: float) -> float:
    """Follow rises immediately, fall by exponential smoothing with weight ``decay``."""
    if previous is None or measured >= previous:
        return measured
    return previous + decay * (measured - previous)


def refill(tokens: float, elapsed: float, limit: int, window_seconds: float) -> float:
    """The token bucket ``elapsed`` seconds later: refilled at limit/T, capped at limit."""
    return min(float(limit), tokens + max(0.0, elapsed) * limit / window_seconds)


def take(tokens: float, admitted: int, limit: int) -> float:
    """Spend admitted hits; the debt is bounded by one window's worth."""
    return max(-float(limit), tokens - admitted)


def control(
    *,
    limit: int,
    window_seconds: float,
    tokens: float,
    fleet_rate: float,
    local_rate: float,
    interval: float,
    nodes: int = 1,
) -> Control:
    """Ratio and credit for the next ``interval`` seconds.

    ``fleet_rate`` and ``local_rate`` are offered hits per second for the fleet and
    for this node. The credit is this node's share of the budget, by its share of
    the offered traffic (an equal share when nothing was offered yet).
    """
    stored = TOKEN_SPEND * tokens if tokens > 0 else tokens  # a debt is repaid in full
    budget = max(0.0, stored + limit * interval / window_seconds)
    expected = fleet_rate * interval
    ratio = 0.0 if expected <= budget else 1.0 - budget / expected
    if fleet_rate > 0.0:
        share = min(1.0, local_rate / fleet_rate)
    else:
        share = 1.0 / max(1, nodes)
    return Control(ratio=ratio, credit=budget * share)


def initial_credit(limit: int, nodes: int) -> float:
    """Credit of a bucket this node has never synced: an equal share of a full bucket."""
    return limit / max(1, nodes)
