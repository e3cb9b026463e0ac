"""Calendar periods: a day, a week (Monday first), a month or a year in a time zone.

A rule with ``calendar: <time zone>`` counts over the calendar period its unit names,
as budgets are billed: a month budget holds from local midnight on the 1st to local
midnight on the next 1st, and then starts again from nothing. Its periods are fixed
windows, not sliding ones, and not of one length (months of 28 to 31 days, days of 23
or 25 hours across a daylight-saving change). The time until the period ends is what
an answer's ``duration_until_reset`` says.

Time zones are the IANA database's (``zoneinfo``; the ``tzdata`` package carries it
where the system has none).
"""

from __future__ import annotations

import difflib
import functools
import math
import zoneinfo
from datetime import datetime, timedelta

from ratelimit_service.core.units import Unit

CALENDAR_UNITS = (Unit.DAY, Unit.WEEK, Unit.MONTH, Unit.YEAR)

KEPT_AFTER_END = 60.0
"""Seconds a calendar budget's fleet bucket is kept past its period's end (fleet_sync.lua
and the embedded store): hits of the period reported just after it still find it, and
the next period counts under a key of its own from the end on."""


class UnknownTimeZone(ValueError):
    """A time zone the IANA database does not have; the message suggests a close one."""


@functools.cache
def _zone_names() -> tuple[str, ...]:
    return tuple(sorted(zoneinfo.available_timezones()))


def time_zone(name: str) -> zoneinfo.ZoneInfo:
    """The time zone ``name`` (``UTC``, ``Europe/Paris``), or UnknownTimeZone."""
    try:
        if name and "\x00" not in name:
            return zoneinfo.ZoneInfo(name)
    except (zoneinfo.ZoneInfoNotFoundError, ValueError):
        pass
    close = difflib.get_close_matches(name, _zone_names(), n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else " (an IANA name, e.g. Europe/Paris)"
    raise UnknownTimeZone(f"unknown time zone '{name}'{hint}")


def _period_bounds(unit: Unit, local: datetime) -> tuple[datetime, datetime]:
    """The local midnights that start the calendar ``unit`` holding ``local`` and the next one."""
    day = local.replace(hour=0, minute=0, second=0, microsecond=0, fold=0)
    if unit is Unit.DAY:
        return day, day + timedelta(days=1)
    if unit is Unit.WEEK:
        start = day - timedelta(days=day.weekday())
        return start, start + timedelta(days=7)
    if unit is Unit.MONTH:
        start = day.replace(day=1)
        return start, start.replace(year=start.year + start.month // 12, month=start.month % 12 + 1)
    start = day.replace(month=1, day=1)
    return start, start.replace(year=start.year + 1)


class CalendarPeriod:
    """The current period of one calendar unit in one time zone, as epoch seconds [start, end),
    worked out again only once ``now`` leaves it (a request reads two floats)."""

    __slots__ = ("end", "start", "unit", "zone")

    def __init__(self, unit: Unit, zone: str) -> None:
        if unit not in CALENDAR_UNITS:
            raise ValueError(f"{unit.name.lower()} is not a calendar unit")
        self.unit = unit
        self.zone = time_zone(zone)
        self.start = self.end = 0.0

    def at(self, now: float) -> tuple[float, float]:
        """The period holding ``now``: its start and end in epoch seconds."""
        if not self.start <= now < self.end:
            start, end = _period_bounds(self.unit, datetime.fromtimestamp(now, self.zone))
            self.start, self.end = start.timestamp(), end.timestamp()
        return self.start, self.end

    def until_end(self, now: float) -> float:
        """Seconds from ``now`` to the period's end: when its count starts again."""
        return self.at(now)[1] - now


def counted_under(
    key: str, window_seconds: int, period: CalendarPeriod | None, now: float
) -> tuple[str, int]:
    """The store key and window length an exact hit is counted under: the rule's own key and rolling
    window, or, for a calendar rule, a key of the current period's (``key@start``) with a window as
    long as the period. A sliding window that long over a key that only holds this period's hits
    counts every one of them: a fixed window, with no change to the stores or their script; the
    period before expires with its key."""
    if period is None:
        return key, window_seconds
    start, end = period.at(now)
    return f"{key}@{int(start)}", math.ceil(end - start)
