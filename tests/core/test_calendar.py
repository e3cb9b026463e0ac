"""Calendar periods in a time zone: where each starts and ends, local midnight to local
midnight, across month lengths and daylight-saving changes."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from ratelimit_service.core.calendar import CalendarPeriod, UnknownTimeZone, time_zone
from ratelimit_service.core.units import Unit

PARIS = ZoneInfo("Europe/Paris")


def at(zone: ZoneInfo, *fields: int) -> float:
    return datetime(*fields, tzinfo=zone).timestamp()


def test_a_month_runs_from_local_midnight_on_the_1st_to_the_next_1st() -> None:
    period = CalendarPeriod(Unit.MONTH, "Europe/Paris")
    now = at(PARIS, 2026, 2, 14, 15, 30)
    assert period.at(now) == (at(PARIS, 2026, 2, 1), at(PARIS, 2026, 3, 1))
    assert period.until_end(now) == at(PARIS, 2026, 3, 1) - now
    # The last instant of February is still February; midnight on the 1st is March.
    assert period.at(at(PARIS, 2026, 3, 1) - 0.001)[0] == at(PARIS, 2026, 2, 1)
    assert period.at(at(PARIS, 2026, 3, 1)) == (at(PARIS, 2026, 3, 1), at(PARIS, 2026, 4, 1))
    # December rolls into the next year.
    assert period.at(at(PARIS, 2026, 12, 31, 23)) == (at(PARIS, 2026, 12, 1), at(PARIS, 2027, 1, 1))


def test_the_same_instant_is_in_different_months_in_different_zones() -> None:
    instant = at(ZoneInfo("UTC"), 2026, 5, 31, 23, 30)  # 01:30 on June 1st in Paris
    assert CalendarPeriod(Unit.MONTH, "UTC").at(instant)[0] == at(ZoneInfo("UTC"), 2026, 5, 1)
    assert CalendarPeriod(Unit.MONTH, "Europe/Paris").at(instant)[0] == at(PARIS, 2026, 6, 1)


def test_days_across_daylight_saving_are_23_and_25_hours() -> None:
    day = CalendarPeriod(Unit.DAY, "Europe/Paris")
    start, end = day.at(at(PARIS, 2026, 3, 29, 12))  # clocks go forward at 02:00
    assert end - start == 23 * 3600
    start, end = day.at(at(PARIS, 2026, 10, 25, 12))  # and back at 03:00
    assert end - start == 25 * 3600


def test_weeks_start_on_monday_and_years_on_january_1st() -> None:
    week = CalendarPeriod(Unit.WEEK, "UTC")
    utc = ZoneInfo("UTC")
    assert week.at(at(utc, 2026, 12, 4, 20)) == (at(utc, 2026, 11, 30), at(utc, 2026, 12, 7))
    year = CalendarPeriod(Unit.YEAR, "America/New_York")
    ny = ZoneInfo("America/New_York")
    assert year.at(at(ny, 2026, 7, 4)) == (at(ny, 2026, 1, 1), at(ny, 2027, 1, 1))


def test_a_period_is_worked_out_again_only_when_left() -> None:
    period = CalendarPeriod(Unit.DAY, "UTC")
    first = period.at(1_000_000.0)
    period.start, period.end = 0.0, 2_000_000.0  # what it holds is what it answers
    assert period.at(1_500_000.0) == (0.0, 2_000_000.0)
    assert period.at(2_000_000.0) != first and period.at(2_000_000.0)[0] == 1_987_200.0


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("Europe/Pari", "unknown time zone 'Europe/Pari'; did you mean 'Europe/Paris'?"),
        ("Mars/Olympus", "unknown time zone 'Mars/Olympus' (an IANA name, e.g. Europe/Paris)"),
        ("", "unknown time zone '' (an IANA name, e.g. Europe/Paris)"),
        ("../etc/passwd", "unknown time zone '../etc/passwd' (an IANA name, e.g. Europe/Paris)"),
    ],
)
def test_an_unknown_time_zone_is_named_with_a_suggestion(name: str, message: str) -> None:
    with pytest.raises(UnknownTimeZone) as caught:
        time_zone(name)
    assert str(caught.value) == message


def test_only_calendar_units() -> None:
    with pytest.raises(ValueError, match="minute is not a calendar unit"):
        CalendarPeriod(Unit.MINUTE, "UTC")
