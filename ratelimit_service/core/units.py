"""Rate-limit units, with the wire values of envoy's RateLimitResponse.RateLimit.Unit."""

from __future__ import annotations

import enum


class Unit(enum.IntEnum):
    """Values equal the protobuf enum numbers so adapters convert with ``int()``."""

    SECOND = 1
    MINUTE = 2
    HOUR = 3
    DAY = 4
    MONTH = 5
    YEAR = 6
    WEEK = 7


# MONTH and YEAR are fixed lengths, as in envoyproxy/ratelimit (30 and 365 days).
UNIT_SECONDS: dict[Unit, int] = {
    Unit.SECOND: 1,
    Unit.MINUTE: 60,
    Unit.HOUR: 3600,
    Unit.DAY: 86400,
    Unit.WEEK: 7 * 86400,
    Unit.MONTH: 30 * 86400,
    Unit.YEAR: 365 * 86400,
}

_BY_NAME = {unit.name: unit for unit in Unit}


def parse_unit(text: str) -> Unit | None:
    """Return the unit named by ``text`` (case-insensitive), or None if there is none."""
    return _BY_NAME.get(text.upper())


def unit_from_wire(value: int) -> Unit | None:
    """Map a protobuf enum number to a unit; UNKNOWN (0) and unknown numbers give None."""
    try:
        return Unit(value)
    except ValueError:
        return None
