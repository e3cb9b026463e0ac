"""The controller behind probabilistic mode: from fleet totals to a drop ratio and a credit.

Uber's Global Rate Limiter sets ``ratio = max(0, (offered - limit) / offered)`` from rates.
That is the steady state here too, but each node steers by the *budget* the fleet may admit
before the next sync, taken from a fleet-wide token bucket (refilled at ``limit / T``,
holding up to :func:`capacity`), and admits at most its share of it (its *credit*):

* An idle client may send the capacity at once, as exact mode and the Go service do;
  under sustained overload the bucket is empty and the ratio is Uber's formula. A window
  of T sees at most 2x the limit (plus the one interval's refill a sync hands out in
  advance); a rule that must react faster to a step in load sets a smaller ``burst``.
* The credit limits, the ratio only spreads admissions over the interval
  (:data:`RATIO_SLACK`); stored tokens are spent gradually (:data:`TOKEN_SPEND`,
  :data:`TOKEN_RESERVE`), so a spike between syncs overshoots little and leaves no debt.
* Small shares over many processes: at least one hit (:data:`MIN_CREDIT`), fractions
  carried over (:func:`carried_credit`), and the refill since a node's last sync of a
  key (``span``). Low rates (5 per minute) behave as a token bucket at the resolution
  of one sync interval.
* A calendar budget's bucket does not refill: the fleet spends what is left geometrically.
* The offered-rate estimate follows a rise at once and decays smoothly
  (:func:`smoothed_rate`), corrected for the other nodes' reports lagging
  (:func:`fleet_estimate`).

Reasons and measurements: docs/design.md, "Probabilistic mode". Rules that must never
exceed the limit in any window use exact mode.
"""

from __future__ import annotations

from dataclasses import dataclass

TOKEN_SPEND = 0.5
"""Share of the stored tokens (or of a debt) the fleet may spend (repay) in one
interval. Each node sees the others' admissions up to one interval late, so handing
out all the tokens at once would let a burst overshoot them, and the debt would then
starve the bucket; spending half per interval drains them geometrically instead."""

TOKEN_RESERVE = 1.0
"""Stored tokens, in intervals of refill, that the fleet keeps rather than spends. Each
node's view misses the others' admissions since their last sync, about an interval's
worth after a step in load, so that last interval's worth would look spendable to every
node at once and run the fleet over the limit. An idle key still gets its whole burst at
once: a new bucket's credit does not go through the budget."""

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
    tokens: float, elapsed: float, limit: float, window_seconds: float, burst: float | None = None
) -> float:
    """The token bucket ``elapsed`` seconds later: refilled at limit/T, capped at its capacity."""
    return min(capacity(limit, burst), tokens + max(0.0, elapsed) * limit / window_seconds)


def zone_limit(
    limit: float, full: float, zone_part: int | None, window_us: int, zones: int | None = None
) -> tuple[float, float]:
    """The limit and capacity a zone's fleet bucket refills at: the zone's part of the
    limit (``zone_part``, thousandths of a hit per second) when below the limit, the
    capacity in proportion; before the first part, the limit over the ``zones`` (or a
    new hot bucket in ten zones would start at ten times the limit). The twin of
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
    span, never more than the fleet could spend in the next interval (the stored
    tokens and an interval's refill). ``refills``: False for a calendar budget, whose
    budget is what is stored, spent as the stored tokens are.
    """
    span = interval if span is None else max(interval, span)
    refilled = limit if refills else 0.0
    refill = refilled * interval / window_seconds
    budget = max(0.0, spendable(tokens, refill, nodes) + refilled * span / window_seconds)
    expected = fleet_rate * span
    aim = budget * (1.0 + RATIO_SLACK)
    ratio = 0.0 if expected <= aim else 1.0 - aim / expected
    share = node_share(local_rate, fleet_rate, nodes)
    return Control(ratio=ratio, credit=min(budget * share, max(0.0, tokens) + refill))


def node_share(local_rate: float, fleet_rate: float, nodes: int) -> float:
    """A node's share of the fleet's budget: of the offered traffic, or an equal one
    while nothing was offered."""
    return min(1.0, local_rate / fleet_rate) if fleet_rate > 0.0 else 1.0 / max(1, nodes)


MIN_CREDIT = 1.0
"""The least credit a node holds for a bucket whose fleet has tokens: one hit. An equal share of a
small bucket over many processes (10 over 40) is under one hit, and without this floor a key's light
traffic spread over the fleet would be denied almost entirely. The cost: a burst on a fresh key that
reaches every process at once admits at most one hit per process."""


def initial_credit(full: float, nodes: int) -> float:
    """Credit of a bucket this node has never synced: an equal share of a full bucket
    (all of it for a process alone, or one that has not synced yet), at least one hit
    (:data:`MIN_CREDIT`) unless the bucket holds nothing (a limit of 0 denies)."""
    return min(full, max(MIN_CREDIT, full / max(1, nodes)))


def carried_credit(granted: float, left: float, last_grant: float, nodes: int) -> float:
    """The credit after a sync: the new grant; while the grants are under one hit (this
    one and the last), what was left of the last one added, up to one hit. Carried over,
    the fractions of a hit a small share gets per sync add up to the hit it is entitled
    to; what is carried stays within one hit per process and only grows from grants,
    which the fleet's budget bounds. A process alone is granted the whole budget, whose
    unspent part comes back in the next grant: carried as well, it would count twice."""
    if granted >= MIN_CREDIT or last_grant >= MIN_CREDIT or nodes <= 1:
        return granted
    return min(MIN_CREDIT, granted + left)


def fleet_estimate(fleet_rate: float, local_rate: float, local_before: float | None) -> float:
    """The fleet's offered rate now, from a measured rate that lags.

    The fleet total a node reads at its sync holds its own report for the interval
    just ended, but the other nodes' reports cover intervals that ended up to one
    interval earlier. When this node's rate rises, the others' most likely rose in
    proportion: scale their part by this node's rise against the average of its last
    two intervals (the span the others' reports cover). When only this node rises, it
    overestimates the fleet for an interval or two: it errs towards dropping."""
    fleet = max(fleet_rate, local_rate)
    if not local_before or local_rate <= local_before:
        return fleet
    lagged = (local_before + local_rate) / 2
    return max(fleet, (fleet - local_rate) * local_rate / lagged + local_rate)
