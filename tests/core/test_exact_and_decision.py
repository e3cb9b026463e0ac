"""Exact-mode batch decisions, the shared decision helpers, and request validation."""

from __future__ import annotations

import random

import pytest

from ratelimit_service.core.config_model import RateLimit
from ratelimit_service.core.decision import (
    drop_replaced,
    hits_for,
    near_hits,
    near_threshold,
    role_of,
    verdict,
)
from ratelimit_service.core.exact import ExactHit, HitRole, evaluate, fits, request_denied
from ratelimit_service.core.request import (
    UINT32_MAX,
    Code,
    Descriptor,
    DescriptorStatus,
    InvalidRequest,
    Request,
    RequestBounds,
    validate,
)
from ratelimit_service.core.units import Unit
from ratelimit_service.core.window import SlidingWindow

NOW = 1000.0

E = HitRole.ENFORCE
S = HitRole.SHADOW
Q = HitRole.QUOTA


def window_with(count: int, at: float = NOW) -> SlidingWindow:
    """A 60 s window (1 s slices) holding ``count`` hits added at ``at``."""
    window = SlidingWindow(60, 60)
    window.add(at, count)
    return window


def hit(limit: int, hits: int = 1, role: HitRole = E, key: str = "k") -> ExactHit:
    return ExactHit(key=key, limit=limit, window_seconds=60, hits=hits, role=role)


# --------------------------------------------------------------------------- fits / roles


@pytest.mark.parametrize(
    ("count", "hits", "limit", "expected"),
    [
        (0, 1, 1, True),
        (1, 1, 1, False),
        (0, 5, 5, True),
        (0, 6, 5, False),
        (4, 1, 5, True),
        (4, 2, 5, False),
        # check-only asks whether one more would fit
        (4, 0, 5, True),
        (5, 0, 5, False),
        (0, 0, 0, False),
    ],
)
def test_fits(count: int, hits: int, limit: int, expected: bool) -> None:
    assert fits(count, hits, limit) is expected


@pytest.mark.parametrize(
    ("roles", "admitted", "denied"),
    [
        ([], [], False),
        ([E], [True], False),
        ([E], [False], True),
        ([S], [False], False),
        ([S, E], [False, True], False),
        ([Q], [False], True),
        ([Q], [True], False),
        ([Q, Q], [False, True], False),
        ([Q, Q], [False, False], True),
        ([Q, E], [True, False], True),
        ([Q, S], [False, True], True),
        ([S, S], [False, False], False),
    ],
)
def test_request_denied(roles: list[HitRole], admitted: list[bool], denied: bool) -> None:
    assert request_denied(roles, admitted) is denied


# --------------------------------------------------------------------------- evaluate


def test_all_fit_commit_consumes_every_window() -> None:
    a, b = window_with(1), window_with(0)
    results = evaluate([hit(5, 2), hit(3, 3)], [a, b], NOW, commit=True)
    assert [r.admitted for r in results] == [True, True]
    assert [r.before for r in results] == [1, 0]
    assert [r.remaining for r in results] == [2, 0]
    assert a.count(NOW) == 3
    assert b.count(NOW) == 3


def test_no_commit_consumes_nothing() -> None:
    a, b = window_with(1), window_with(0)
    results = evaluate([hit(5, 2), hit(3, 3)], [a, b], NOW, commit=False)
    assert [r.admitted for r in results] == [True, True]
    assert [r.remaining for r in results] == [4, 3]
    assert a.count(NOW) == 1
    assert b.count(NOW) == 0


def test_denied_request_consumes_nothing_anywhere() -> None:
    full, free, shadow, quota = window_with(2), window_with(0), window_with(0), window_with(0)
    hits = [hit(2), hit(5, 3), hit(5, role=S), hit(5, role=Q)]
    results = evaluate(hits, [full, free, shadow, quota], NOW, commit=True)
    assert [r.admitted for r in results] == [False, True, True, True]
    assert full.count(NOW) == 2
    assert free.count(NOW) == 0
    assert shadow.count(NOW) == 0
    assert quota.count(NOW) == 0
    assert results[0].before == 2
    assert results[0].remaining == 0
    assert results[1].remaining == 5


def test_shadow_never_denies() -> None:
    over, enforce = window_with(3), window_with(0)
    results = evaluate([hit(3, role=S), hit(3)], [over, enforce], NOW, commit=True)
    assert [r.admitted for r in results] == [False, True]
    assert over.count(NOW) == 3  # the over shadow hit itself is not counted
    assert enforce.count(NOW) == 1
    alone = window_with(10)
    results = evaluate([hit(1, 5, role=S)], [alone], NOW, commit=True)
    assert results[0].admitted is False
    assert alone.count(NOW) == 10


def test_shadow_under_limit_is_consumed() -> None:
    window = window_with(0)
    evaluate([hit(3, role=S)], [window], NOW, commit=True)
    assert window.count(NOW) == 1


def test_quota_denies_only_when_all_quota_hits_are_over() -> None:
    q_over, q_ok, enforce = window_with(1), window_with(0), window_with(0)
    results = evaluate(
        [hit(1, role=Q), hit(1, role=Q), hit(5)], [q_over, q_ok, enforce], NOW, commit=True
    )
    assert [r.admitted for r in results] == [False, True, True]
    assert q_over.count(NOW) == 1
    assert q_ok.count(NOW) == 1
    assert enforce.count(NOW) == 1
    # now both quota windows are full: the request is denied and nothing is consumed
    results = evaluate(
        [hit(1, role=Q), hit(1, role=Q), hit(5)], [q_over, q_ok, enforce], NOW, commit=True
    )
    assert [r.admitted for r in results] == [False, False, True]
    assert enforce.count(NOW) == 1


def test_check_only_hit_reports_over_and_consumes_nothing() -> None:
    full = window_with(5)
    results = evaluate([hit(5, 0)], [full], NOW, commit=True)
    assert results[0].admitted is False
    assert results[0].before == 5
    assert full.count(NOW) == 5
    room = window_with(4)
    results = evaluate([hit(5, 0)], [room], NOW, commit=True)
    assert results[0].admitted is True
    assert results[0].remaining == 1
    assert room.count(NOW) == 4


def test_check_only_over_denies_the_request() -> None:
    full, other = window_with(5), window_with(0)
    results = evaluate([hit(5, 0), hit(5, 2)], [full, other], NOW, commit=True)
    assert [r.admitted for r in results] == [False, True]
    assert other.count(NOW) == 0


def test_check_only_over_reset_is_time_until_one_hit_fits() -> None:
    """A check-only hit that is over must say when one hit would fit, not "now"."""
    full = window_with(5, at=NOW - 30.5)  # slice leaves at NOW + 30
    results = evaluate([hit(5, 0)], [full], NOW, commit=False)
    assert results[0].admitted is False
    assert results[0].reset_after == pytest.approx(30.0)


def test_reset_after_values() -> None:
    window = window_with(3, at=NOW - 10.5)  # leaves at NOW + 50
    results = evaluate([hit(5, 1)], [window], NOW, commit=True)
    assert results[0].admitted
    assert results[0].reset_after == pytest.approx(50.0)  # next drop
    results = evaluate([hit(5, 2)], [window], NOW, commit=True)
    assert not results[0].admitted
    # the older slice frees 3, enough for 2 more
    assert results[0].reset_after == pytest.approx(50.0)
    results = evaluate([hit(5, 5)], [window], NOW, commit=True)
    assert not results[0].admitted
    # all 4 counted hits must go; the newest slice (NOW) leaves at NOW + 61, reported as
    # the window
    assert results[0].reset_after == 60.0


@pytest.mark.parametrize("into_slice", [0.0, 0.08, 0.5, 0.92, 0.999])
def test_reset_is_never_longer_than_the_window(into_slice: float) -> None:
    """A one-minute rule (60 slices of 1 s): a hit's slice leaves the window 60 to 61 s
    after the hit; admitted or denied, the reset said is at most the minute, and is the
    minute when the slice of a lone hit has more than a minute to go."""
    now = NOW + into_slice
    window = window_with(0)
    (admitted,) = evaluate([hit(2)], [window], now, commit=True)
    assert admitted.admitted and admitted.reset_after == 60.0  # leaves at NOW + 61
    (filled,) = evaluate([hit(2)], [window], now, commit=True)
    assert filled.admitted and filled.remaining == 0 and filled.reset_after == 60.0
    (denied,) = evaluate([hit(2)], [window], now, commit=True)
    assert not denied.admitted and denied.reset_after == 60.0
    # Later, the wait shrinks with the clock: the slice leaves at NOW + 61.
    later = NOW + 30.25
    (denied,) = evaluate([hit(2)], [window], later, commit=False)
    assert not denied.admitted and denied.reset_after == pytest.approx(61.0 - 30.25)
    (check,) = evaluate([hit(2, 0)], [window_with(1, at=now)], later, commit=False)
    assert check.admitted and check.reset_after == pytest.approx(61.0 - 30.25)


def test_reset_is_at_most_the_window_for_every_window_and_clock() -> None:
    """Random hits on windows of 1 s to an hour, on an injected clock: every reset is
    within [0, window], admitted or not."""
    rng = random.Random(5)
    for seconds in (1, 7, 60, 3600):
        window = SlidingWindow(seconds, 60)
        now = rng.uniform(0, 10 * seconds)
        for _ in range(400):
            now += rng.choice([0.0, rng.uniform(0, seconds / 30), rng.uniform(0, seconds)])
            hits = rng.choice([0, 1, 1, 2, 5])
            limit = rng.randint(0, 12)
            request = ExactHit("k", limit, seconds, hits)
            (result,) = evaluate([request], [window], now, commit=True)
            assert 0.0 <= result.reset_after <= seconds, (seconds, now, result)


def test_hits_larger_than_limit_never_fit() -> None:
    window = window_with(0)
    results = evaluate([hit(3, 4)], [window], NOW, commit=True)
    assert results[0].admitted is False
    assert window.count(NOW) == 0
    assert results[0].remaining == 3


# --------------------------------------------------------------------------- hits_for


@pytest.mark.parametrize(
    ("descriptor_hits", "request_hits", "expected"),
    [
        (None, 0, 1),
        (None, 1, 1),
        (None, 7, 7),
        (0, 0, 0),
        (0, 5, 0),
        (3, 0, 3),
        (3, 7, 3),
    ],
)
def test_hits_for(descriptor_hits: int | None, request_hits: int, expected: int) -> None:
    descriptor = Descriptor((("k", "v"),), hits_addend=descriptor_hits)
    assert hits_for(descriptor, request_hits) == expected


# --------------------------------------------------------------------------- drop_replaced


def rl(
    name: str = "", replaces: tuple[str, ...] = (), quota: bool = False, shadow: bool = False
) -> RateLimit:
    return RateLimit(
        requests_per_unit=10,
        unit=Unit.SECOND,
        name=name,
        replaces=frozenset(replaces),
        quota_mode=quota,
        shadow_mode=shadow,
    )


def test_drop_replaced() -> None:
    a, b, c = rl("a"), rl("b", ("a",)), rl("c")
    limits: list[RateLimit | None] = [a, b, None, c]
    drop_replaced(limits)
    assert limits == [None, b, None, c]


def test_drop_replaced_several_and_unnamed() -> None:
    a, b, unnamed = rl("a"), rl("b"), rl("")
    replacer = rl("r", ("a", "b", "missing"))
    limits: list[RateLimit | None] = [a, unnamed, b, replacer]
    drop_replaced(limits)
    assert limits == [None, unnamed, None, replacer]


def test_drop_replaced_mutual_and_no_replaces() -> None:
    a, b = rl("a", ("b",)), rl("b", ("a",))
    limits: list[RateLimit | None] = [a, b]
    drop_replaced(limits)
    assert limits == [None, None]
    plain: list[RateLimit | None] = [rl("a"), rl("b"), None]
    before = list(plain)
    drop_replaced(plain)
    assert plain == before


# --------------------------------------------------------------------------- near-limit hits


@pytest.mark.parametrize(
    ("limit", "before", "hits", "near"),
    [
        (10, 0, 5, 0),
        (10, 5, 3, 0),  # after = 8 = threshold: not near
        (10, 7, 2, 1),  # crosses the threshold
        (10, 8, 2, 2),
        (10, 9, 1, 1),
        (10, 0, 10, 2),
        (10, 9, 0, 0),  # check-only
        (100, 79, 2, 1),
        (100, 80, 1, 1),
        (100, 78, 2, 0),
        (1, 0, 1, 1),  # threshold int(0.8) = 0
        (5, 3, 1, 0),  # threshold 4
        (5, 4, 1, 1),
    ],
)
def test_near_hits(limit: int, before: int, hits: int, near: int) -> None:
    """Admitted hits past 80 % of the limit count as near, as envoyproxy/ratelimit
    counts them (denied hits are all over_limit: see the limiter's stats tests)."""
    assert near_hits(near_threshold(limit), before, hits) == near


# --------------------------------------------------------------------------- verdict

OK = Code.OK
OVER = Code.OVER_LIMIT


def status(code: Code, quota: bool | None, shadow: bool = False) -> DescriptorStatus:
    limit = None if quota is None else rl(quota=quota, shadow=shadow)
    return DescriptorStatus(code, limit)


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ([], OK),
        ([(OK, None)], OK),
        ([(OK, False)], OK),
        ([(OVER, False)], OVER),
        ([(OK, False), (OVER, False)], OVER),
        ([(OVER, True)], OVER),
        ([(OVER, True), (OK, True)], OK),
        ([(OVER, True), (OVER, True)], OVER),
        ([(OVER, True), (OK, False)], OVER),
        ([(OK, True), (OVER, False)], OVER),
        ([(OK, None), (OVER, True), (OK, True)], OK),
    ],
)
def test_overall_code(statuses: list[tuple[Code, bool | None]], expected: Code) -> None:
    assert verdict([status(code, quota) for code, quota in statuses])[0] is expected


def test_a_rule_both_shadow_and_quota_is_shadow_it_admits_nothing() -> None:
    """Its status is always OK (shadow): counted as a quota descriptor that admits, it
    would switch the other quota rules off."""
    statuses = [status(OK, True, shadow=True), status(OVER, True)]
    assert role_of(statuses[0].limit) is HitRole.SHADOW  # type: ignore[arg-type]
    assert verdict(statuses)[0] is OVER


def test_the_deciding_rule_of_a_denial_is_over_its_limit() -> None:
    """On a denial by quota rules (none enforcing over), the deciding rule is a quota
    rule over its limit, not an OK rule that happens to have less remaining."""
    enforce_ok = DescriptorStatus(OK, rl(), 0)
    quota_over = DescriptorStatus(OVER, rl(quota=True), 0)
    assert verdict([enforce_ok, quota_over]) == (OVER, quota_over)
    enforce_over = DescriptorStatus(OVER, rl(), 0)
    assert verdict([enforce_ok, enforce_over, quota_over]) == (OVER, enforce_over)
    quota_ok = DescriptorStatus(OK, rl(quota=True), 3)
    # Admitted: the nearest to its limit, the first of equals (as the headers report it).
    assert verdict([quota_ok, quota_over, enforce_ok]) == (OK, quota_over)


# --------------------------------------------------------------------------- validate

BOUNDS = RequestBounds(max_descriptors=3, max_entries=2, max_text_length=8)


def desc(
    *entries: tuple[str, str],
    override: tuple[int, Unit | None] | None = None,
    hits_addend: int | None = None,
) -> Descriptor:
    return Descriptor(tuple(entries), override=override, hits_addend=hits_addend)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (Request("", [desc(("k", "v"))]), "rate limit domain must not be empty"),
        (Request("d", []), "rate limit descriptor list must not be empty"),
        (Request("d", [desc(("k", "v"))] * 4), "too many descriptors: 4 (at most 3)"),
        (Request("d" * 9, [desc(("k", "v"))]), "domain longer than 8 characters"),
        (Request("d", [desc(("k", "v")), desc()]), "descriptor 1 has no entries"),
        (
            Request("d", [desc(("a", "1"), ("b", "2"), ("c", "3"))]),
            "descriptor 0 has 3 entries (at most 2)",
        ),
        (Request("d", [desc(("", "v"))]), "descriptor 0 has an entry with an empty key"),
        (
            Request("d", [desc(("k" * 9, "v"))]),
            "descriptor 0 has an entry longer than 8 characters",
        ),
        (
            Request("d", [desc(("k", "v")), desc(("k", "v" * 9))]),
            "descriptor 1 has an entry longer than 8 characters",
        ),
        (
            Request("d", [desc(("k", "v"), override=(5, None))]),
            "descriptor 0 has a limit override with an unknown unit",
        ),
        (
            Request("d", [desc(("k", "v"), hits_addend=UINT32_MAX + 1)]),
            f"descriptor 0 hits_addend exceeds {UINT32_MAX}",
        ),
    ],
)
def test_validate_messages(request_: Request, message: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate(request_, BOUNDS)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "request_",
    [
        Request("d", [desc(("k", "v"))]),
        Request("d" * 8, [desc(("k" * 8, "v" * 8), ("a", ""))] * 3),
        Request("d", [desc(("k", "v"), override=(5, Unit.MINUTE))]),
        Request("d", [desc(("k", "v"), hits_addend=UINT32_MAX)]),
        Request("d", [desc(("k", "v"), hits_addend=0)]),
    ],
)
def test_validate_accepts(request_: Request) -> None:
    validate(request_, BOUNDS)


def test_default_bounds() -> None:
    bounds = RequestBounds()
    validate(Request("d", [desc(("k", "v" * 1024))] * 64), bounds)
    with pytest.raises(InvalidRequest, match="too many descriptors: 65"):
        validate(Request("d", [desc(("k", "v"))] * 65), bounds)
    with pytest.raises(InvalidRequest, match="longer than 1024"):
        validate(Request("d", [desc(("k", "v" * 1025))]), bounds)
    with pytest.raises(InvalidRequest, match="33 entries"):
        validate(Request("d", [desc(*[("k", "v")] * 33)]), bounds)
