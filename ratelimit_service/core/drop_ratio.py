"""The controller behind probabilistic mode: from fleet totals to a drop ratio and a credit.

The design we follow (Uber's Global Rate Limiter) sets ``ratio = max(0, (offered - limit) /
offered)`` from rates. We keep that as the steady state, but steer by the *budget* the
fleet may admit before the next sync, taken from a fleet-wide token bucket (refilled at
``limit / T``, holding up to :func:`capacity`: the limit, or the rule's ``burst``). That
gives:

* **The limit at once, then the limit rate.** An idle client may send up to the
  capacity at once (a fresh key of 10 per second admits 10 of 12 sent together, as
  the Go service and exact mode do); under sustained overload the bucket is empty,
  the budget is ``limit * interval / T`` and the ratio is Uber's formula.
  After a step from 0.5x to 3x the stored burst is spent and the fleet is back at
  the limit one second later, as an ideal token bucket of the same capacity is
  (docs/benchmarks.md, "Step reaction").
  Admissions flow smoothly at the limit rate (a sliding window, as in exact mode,
  instead re-admits a burst each time an old burst leaves the window). A 1 s window
  of a per-second rule sees at most 2x the limit (the stored burst plus a second's
  refill) plus the one interval's refill a sync hands out in advance; a rule that
  must react faster to a step in load sets a smaller ``burst``.
* **Burst guard.** A node may admit at most its share of the budget (its *credit*)
  until the next sync, and the stored tokens are spent at most half per interval
  (``TOKEN_SPEND``), the last interval's worth not at all (``TOKEN_RESERVE``), so a
  spike between syncs, or the first burst before any sync,
  overshoots little and leaves no debt that would starve the bucket afterwards.
* **The credit limits, the ratio spreads.** The ratio aims ``RATIO_SLACK`` above the
  budget, so a node whose rate estimate runs high still admits its whole credit;
  the credit then caps the count and the ratio only spreads admissions over the
  interval.
* **Small shares.** Over many processes a node's share of a small bucket is a
  fraction of a hit: the credit is at least one hit (:data:`MIN_CREDIT`), fractional
  grants carry over (:func:`carried_credit`), and a node that syncs a key seldom is
  granted its share of the refill since its last sync (``span``), so light traffic
  spread over the fleet is admitted rather than denied.
* **Low-rate limits.** With 5 per minute the offered rate is too noisy to steer by;
  the credit makes such buckets behave like a token bucket with a resolution of one
  sync interval.
* **Calendar budgets.** A budget counted by the calendar (core/calendar.py) has a
  bucket per period that does not refill: the budget is half of what is stored (all
  of it for a process alone), so a fleet spends what is left geometrically, and a
  node whose view misses the others' last admissions grants from half of it.
* **Fast attack, smooth decay.** The offered-rate estimate follows a rise at once
  (no lag on a spike) and falls with an exponential moving average (no oscillation
  after a dip). Each node also corrects the fleet's rate for the others' reports
  being older than its own (:func:`fleet_estimate`).

Rules that must never exceed the limit in any window use exact mode.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_SPEND = 0.5
"""Share of the stored tokens (or of a debt) the fleet may spend (repay) in one
interval. Each node sees the others' admissions up to one interval late, so handing
out all the tokens at once would let a burst overshoot them, and the debt would then
starve the bucket; spending half per interval drains them geometrically instead."""


TOKEN_RESERVE = 1.0
"""Stored tokens, in intervals of refill, that the fleet keeps rather than spends: the
budget spends half of what is stored above it (``TOKEN_SPEND``), none of what is
below. Each node's view of the bucket misses the admissions the others made since
their last sync, about an interval's worth after a step in load, so the last
interval's worth of stored tokens would look spendable to every node at once and the
fleet would run over the limit for the next intervals. Kept in store, they are spent
by no one under sustained overload (the fleet admits the refill, the limit). An idle
key still gets its whole burst at once: a new bucket's credit does not go through the
budget."""

RATIO_SLACK = 0.5
"""How far above the budget the ratio aims. The credit enforces the budget exactly;
a ratio aimed at it would undershoot whenever the fast-attack rate estimate runs high
(it keeps the highest recent reading), which it does on every noisy measurement."""


def capacity(limit: float, burst: float | None = None) -> float:
    """The most the fleet token bucket stores: the rule's ``burst`` when it sets one
    (a smaller burst reacts faster to a step in load), else the whole limit."""
    return float(limit if burst is None else burst)


@dataclass(frozen=True, slots=True)
class FleetView:
    """What the store reports for one bucket after a sync."""

    tokens: float
    """The fleet token bucket after this node's admitted hits were taken out."""
    offered_total: int
    """Monotonic count of hits offered to the whole fleet."""
    limit: float | None = None
    """The limit per window the bucket refilled at: the rule's, or in a zone the zone's
    part of it (see zone_limit); None: the rule's."""


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


def refill(
    tokens: float,
    elapsed: float,
    limit: float,
    window_seconds: float,
    burst: float | None = None,
) -> float:
    """The token bucket ``elapsed`` seconds later: refilled at limit/T, capped at its
    capacity."""
    full = capacity(limit, burst)
    return min(full, tokens + max(0.0, elapsed) * limit / window_seconds)


def zone_limit(
    limit: float, full: float, zone_part: int | None, window_us: int, zones: int | None = None
) -> tuple[float, float]:
    """The limit and capacity a zone's fleet bucket refills at: the zone's part of the
    limit (``zone_part``, thousandths of a hit per second, set by the zone's
    aggregator) when it is below the limit, the capacity in proportion; before the
    bucket's first part, the limit over the number of ``zones`` (a new hot bucket
    in ten zones would otherwise start at ten times the limit). The twin of
    fleet_sync.lua's zone branch: the same operations, in the same order."""
    if zone_part is not None:
        part = zone_part * window_us / 1_000_000_000
    elif zones is not None and zones > 1:
        part = limit / zones
    else:
        return limit, full
    if part < limit:
        return part, full * part / limit
    return limit, full


def take(tokens: float, admitted: int, limit: float) -> float:
    """Spend admitted hits; the debt is bounded by one window's worth."""
    return max(-float(limit), tokens - admitted)


def spendable(tokens: float, refill: float, nodes: int) -> float:
    """What the fleet may spend of its stored ``tokens`` in the next interval (negative:
    a debt repaid), given an interval's ``refill``: half of what is stored above the
    :data:`TOKEN_RESERVE`, half of a debt. A process alone sees every admission in its
    view, so it spends (or repays) all of it, as an ideal token bucket does."""
    if nodes <= 1:
        return tokens
    if tokens < 0.0:
        return TOKEN_SPEND * tokens
    return TOKEN_SPEND * max(0.0, tokens - TOKEN_RESERVE * refill)


def control(
    *,
    limit: float,
    window_seconds: float,
    tokens: float,
    fleet_rate: float,
    local_rate: float,
    interval: float,
    nodes: int = 1,
    span: float | None = None,
    refills: bool = True,
) -> Control:
    """Ratio and credit for the next ``interval`` seconds.

    ``fleet_rate`` and ``local_rate`` are offered hits per second for the fleet and
    for this node. The credit is this node's share of the budget, by its share of
    the offered traffic (an equal share when nothing was offered yet). ``span``
    (default: ``interval``) is how long since this node last synced the bucket: a
    node that sees a key now and then is granted its share of the refill over that
    span, as its share is measured over it, never more than the whole fleet could
    spend in the next interval (the stored tokens and an interval's refill).
    ``refills``: False for a calendar budget, whose bucket does not refill within its
    period: the budget is what is stored, spent as the stored tokens are.
    """
    span = interval if span is None else max(interval, span)
    refilled = limit if refills else 0.0
    # A debt (negative tokens) is repaid at the same pace: repaid in full at once, the
    # debt a burst leaves after a step would starve the next interval.
    refill = refilled * interval / window_seconds
    budget = max(0.0, spendable(tokens, refill, nodes) + refilled * span / window_seconds)
    expected = fleet_rate * span
    aim = budget * (1.0 + RATIO_SLACK)
    ratio = 0.0 if expected <= aim else 1.0 - aim / expected
    if fleet_rate > 0.0:
        share = min(1.0, local_rate / fleet_rate)
    else:
        share = 1.0 / max(1, nodes)
    most = max(0.0, tokens) + refill
    return Control(ratio=ratio, credit=min(budget * share, most))


MIN_CREDIT = 1.0
"""The least credit a node holds for a bucket whose fleet has tokens: one hit. An equal
share of a small bucket over many processes (10 over 40) is under one hit, so without
this floor every process would deny the first hit of a key it has not seen, and a
key's light traffic spread over the fleet would be denied almost entirely. The cost is
bounded: a burst on a fresh key that reaches every process at once admits at most
one hit per process where the burst is smaller than the fleet."""


def initial_credit(full: float, nodes: int) -> float:
    """Credit of a bucket this node has never synced: an equal share of a full bucket
    (all of it for a process alone, or one that has not synced yet), at least one hit
    (:data:`MIN_CREDIT`) unless the bucket holds nothing (a limit of 0 denies)."""
    return min(full, max(MIN_CREDIT, full / max(1, nodes)))


def carried_credit(granted: float, left: float, last_grant: float, nodes: int) -> float:
    """The credit after a sync: the new grant; while the grants are under one hit (this
    one and the last), what was left of the last one added, up to one hit. A process
    with a small share of a small bucket (10 per second over 40 processes) is granted
    a fraction of a hit per sync; carried over, the fractions add up to the hit its
    share entitles it to, so the fleet admits its light traffic instead of denying
    every hit. What is carried stays within one hit per process and only grows from
    grants, which the fleet's budget bounds; a grant of a hit or more (a busy
    process) is never topped up by an earlier one. A process alone is granted the
    whole budget, whose unspent part stays in the fleet's bucket and comes back in the
    next grant: carried as well, it would count twice."""
    if granted >= MIN_CREDIT or last_grant >= MIN_CREDIT or nodes <= 1:
        return granted
    return min(MIN_CREDIT, granted + left)


def fleet_estimate(fleet_rate: float, local_rate: float, local_before: float | None) -> float:
    """The fleet's offered rate now, from a measured rate that lags.

    The fleet total a node reads at its sync holds its own report for the interval
    just ended, but the other nodes' reports cover intervals that ended up to one
    interval earlier. When this node's rate rises, the others' most likely rose in
    proportion: scale their part by this node's rise against the average of its last
    two intervals (the span the others' reports cover). On a fleet-wide step that
    removes most of the lag; when only this node rises, it overestimates the fleet
    for an interval or two, which errs towards dropping, not towards overshoot."""
    fleet = max(fleet_rate, local_rate)
    if not local_before or local_rate <= local_before:
        return fleet
    lagged = (local_before + local_rate) / 2
    return max(fleet, (fleet - local_rate) * local_rate / lagged + local_rate)
