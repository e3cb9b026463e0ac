"""The controller behind probabilistic mode: from fleet totals to a drop ratio and a credit.

The seed design sets ``ratio = max(0, (offered - limit) / offered)`` from rates. We
keep that as the steady state but compute it from the *budget* the sliding window
leaves for the next sync interval, which gives three improvements:

* **Burst guard.** The budget for the next interval is
  ``limit - admitted_in_window + expiring_in_interval``; a node may admit at most
  its share of that budget (its *credit*) until the next sync, so a spike between
  syncs, or the very first burst before any sync, cannot overshoot the window by
  more than rounding. In steady state the budget is ``limit * interval / T`` and the
  ratio reduces to the seed's formula.
* **Low-rate limits.** With 5 per minute the offered rate is too noisy to steer by;
  the credit makes such buckets behave like an exact sliding window with a
  resolution of one sync interval.
* **Fast attack, smooth decay.** The offered-rate estimate follows a rise at once
  (no lag on a spike) and falls with an exponential moving average (no
  oscillation after a dip).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the store reports for one bucket after a sync."""

    admitted_in_window: int
    """Hits admitted by the whole fleet within the sliding window."""
    expiring: int
    """Of those, hits that leave the window before the next sync."""
    offered_total: int
    """Monotonic count of hits offered to the whole fleet."""
    nodes: int = 1
    """Nodes that reported this bucket recently."""
    reset_after: float = 0.0
    """Seconds until the window's count next goes down."""


@dataclass(frozen=True, slots=True)
class Control:
    ratio: float
    credit: float


def smoothed_rate(previous: float | None, measured: float, decay: float) -> float:
    """Follow rises immediately, fall by exponential smoothing with weight ``decay``."""
    if previous is None or measured >= previous:
        return measured
    return previous + decay * (measured - previous)


def control(
    *,
    limit: int,
    view: FleetView,
    fleet_rate: float,
    local_rate: float,
    interval: float,
) -> Control:
    """Ratio and credit for the next ``interval`` seconds.

    ``fleet_rate`` and ``local_rate`` are offered hits per second for the fleet and
    for this node. The credit is this node's share of the budget, by its share of
    the offered traffic (an equal share when nothing was offered yet).
    """
    budget = max(0.0, float(limit - view.admitted_in_window + view.expiring))
    expected = fleet_rate * interval
    ratio = 0.0 if expected <= budget else 1.0 - budget / expected
    if fleet_rate > 0.0:
        share = min(1.0, local_rate / fleet_rate)
    else:
        share = 1.0 / max(1, view.nodes)
    return Control(ratio=ratio, credit=budget * share)


def initial_credit(limit: int, nodes: int) -> float:
    """Credit of a bucket this node has never synced: an equal share of a whole window."""
    return limit / max(1, nodes)
