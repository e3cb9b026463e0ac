"""One RLQS counter's share bookkeeping (core/quota_counter.py): what the instances
hold of the replica's part, the room a share may grow into, the split by demand."""

from __future__ import annotations

import math

import pytest

from ratelimit_service.core.config_model import RateLimit
from ratelimit_service.core.matching import Match
from ratelimit_service.core.quota_counter import QuotaCounter, Seen
from ratelimit_service.core.units import Unit


def counter(part: float | None = 100.0, per_minute: bool = False) -> QuotaCounter:
    unit = Unit.MINUTE if per_minute else Unit.SECOND
    limit = RateLimit(requests_per_unit=100, unit=unit, stats_key="q.tenant")
    return QuotaCounter("q\x1ftenant\x1et\x1f1", Match(limit, "q.tenant", "b"), part=part)


def test_an_instance_asks_for_an_even_share_until_its_demand_is_measured() -> None:
    c = counter(per_minute=True)
    c.seen = {"a": Seen(0.0), "b": Seen(0.0, demand=0.5)}
    assert c.even() == 50.0
    assert c.asked(c.seen["a"], c.even()) == 50.0
    assert c.asked(c.seen["b"], c.even()) == 30.0  # 0.5/s over a 60 s window


def test_the_room_is_the_part_less_what_the_others_hold() -> None:
    c = counter()
    c.seen = {"a": Seen(0.0, demand=30.0), "b": Seen(0.0, demand=70.0)}
    even = c.even()
    c.assign("a", 30.0, even)
    c.assign("b", 60.0, even)
    assert c.held == 90.0
    assert c.room("a") == 40.0 and c.room("b") == 70.0 and c.room("new") == 10.0
    c.assign("b", 70.0, even)  # a new share replaces the old one in what is held
    assert c.held == 100.0 and c.room("a") == 30.0


def test_an_unmeasured_share_counts_for_at_most_an_even_share() -> None:
    c = counter()
    c.seen = {"first": Seen(0.0), "second": Seen(0.0)}
    c.assign("first", 100.0, c.even())  # given the whole part before the second came
    assert c.shares["first"] == 100.0 and c.counts["first"] == 50.0
    assert c.room("second") == 50.0
    c.seen["first"].demand = 100.0  # measured: counted in full
    c.resplit()
    assert c.counts["first"] == 100.0 and c.room("second") == 0.0


def test_resplit_divides_the_part_max_min_by_demand() -> None:
    c = counter()
    c.seen = {"a": Seen(0.0, demand=10.0), "b": Seen(0.0, demand=200.0)}
    c.resplit()
    assert c.split.share(10.0) == 10.0 and c.split.share(200.0) == 90.0
    c.part = 300.0  # the part grew past the fleet's demand: the spare spread on top
    c.resplit()
    assert c.split.level == math.inf
    assert c.split.share(10.0) == pytest.approx(55.0)
    assert c.split.share(200.0) == pytest.approx(245.0)


def test_removing_an_instance_frees_what_it_held() -> None:
    c = counter()
    c.seen = {"a": Seen(0.0, demand=50.0), "b": Seen(0.0, demand=50.0)}
    c.assign("a", 50.0, c.even())
    c.assign("b", 50.0, c.even())
    c.remove("b")
    assert list(c.seen) == ["a"] and "b" not in c.shares
    assert c.held == 50.0 and c.room("a") == 100.0
    c.remove("gone")  # an instance it never had: nothing changes
    assert c.held == 50.0


def test_before_its_first_publish_a_counter_has_no_part_to_divide() -> None:
    c = counter(part=None)
    c.seen = {"a": Seen(0.0)}
    assert c.even() == 0.0 and c.room("a") == 0.0
