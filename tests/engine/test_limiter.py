"""RateLimiter end to end in core types, with an injected clock, draw and embedded store."""

from __future__ import annotations

import asyncio
import textwrap
from collections.abc import Awaitable, Sequence

import pytest

from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.config_model import Mode, RateLimitConfig
from ratelimit_service.core.exact import ExactHit, ExactResult
from ratelimit_service.core.local_buckets import LocalBuckets, ProbabilisticBucket
from ratelimit_service.core.request import (
    UINT32_MAX,
    Code,
    Descriptor,
    InvalidRequest,
    Request,
    Response,
)
from ratelimit_service.core.units import Unit
from ratelimit_service.engine.limiter import Deciding, RateLimiter
from ratelimit_service.engine.stats import OVERFLOW_KEY, Stats
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.embedded import EmbeddedStore

OK = Code.OK
OVER = Code.OVER_LIMIT

CONFIG = """
domain: d
descriptors:
  - key: prob
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: p5
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: p0
    rate_limit: {unit: minute, requests_per_unit: 0}
  - key: ex
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: ex10
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: sec
    mode: exact
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: unl
    rate_limit: {unlimited: true}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: exshadow
    mode: exact
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: a
    mode: exact
    rate_limit: {name: a, unit: minute, requests_per_unit: 1}
  - key: b
    mode: exact
    rate_limit:
      name: b
      unit: minute
      requests_per_unit: 5
      replaces: [{name: a}]
  - key: pq
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: eq
    mode: exact
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: parent
    descriptors:
      - key: child
        mode: exact
        rate_limit: {unit: minute, requests_per_unit: 2}
  - key: closed
    mode: exact
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: open
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: pclosed
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 5}
"""


def config(text: str = CONFIG) -> RateLimitConfig:
    return load_config([ConfigFile("t.yaml", textwrap.dedent(text))])


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Draw:
    def __init__(self, value: float = 0.999) -> None:
        self.value = value

    def __call__(self) -> float:
        return self.value


class Harness:
    def __init__(
        self,
        *,
        stats: Stats | None = None,
        local: LocalBuckets | None = None,
        max_keys: int = 100_000,
        default_mode: Mode = Mode.PROBABILISTIC,
        global_shadow: bool = False,
        text: str = CONFIG,
    ) -> None:
        self.clock = Clock()
        self.draw = Draw()
        self.store = EmbeddedStore(clock=self.clock, max_keys=max_keys)
        self.limiter = RateLimiter(
            config(text),
            self.store,
            stats=stats,
            local=local,
            default_mode=default_mode,
            global_shadow=global_shadow,
            clock=self.clock,
            draw=self.draw,
        )

    @property
    def stats(self) -> Stats:
        return self.limiter.stats

    async def call(self, *descriptors: Descriptor | str, hits: int = 0) -> Response:
        """Descriptors as Descriptor objects or "key=value" shorthand."""
        built = [d if isinstance(d, Descriptor) else _parse(d) for d in descriptors]
        return await self.limiter.should_rate_limit(Request("d", built, hits_addend=hits))

    async def codes(self, *descriptors: Descriptor | str, hits: int = 0) -> list[Code]:
        response = await self.call(*descriptors, hits=hits)
        return [response.overall, *(status.code for status in response.statuses)]


def _parse(text: str) -> Descriptor:
    entries: list[tuple[str, str]] = []
    for part in text.split(","):
        key, _, value = part.partition("=")
        entries.append((key, value))
    return Descriptor(tuple(entries))


async def overall(h: Harness, *descriptors: Descriptor | str, times: int) -> list[Code]:
    return [(await h.call(*descriptors)).overall for _ in range(times)]


# --------------------------------------------------------------------------- basics


async def test_unknown_domain_is_ok_and_counted() -> None:
    h = Harness()
    for _ in range(3):
        response = await h.limiter.should_rate_limit(
            Request("nope", [_parse("k=v"), _parse("k=w")])
        )
        assert response.overall is OK
        assert [s.code for s in response.statuses] == [OK, OK]
        assert all(s.limit is None for s in response.statuses)
    assert h.stats.domain_not_found == {"nope": 3}
    assert h.stats.rules == {}


async def test_no_match_is_ok_without_limit() -> None:
    h = Harness()
    for descriptor in ("zzz=1", "parent=x", "parent=x,child=y,deeper=z", "ex=1,more=2"):
        response = await h.call(descriptor)
        assert response.overall is OK
        assert response.statuses[0].code is OK
        assert response.statuses[0].limit is None
    assert h.stats.rules == {}
    assert h.stats.domain_not_found == {}


async def test_nested_match() -> None:
    h = Harness()
    assert await overall(h, "parent=x,child=y", times=3) == [OK, OK, OVER]
    assert h.stats.rules["d.parent.child"].total_hits == 3


async def test_invalid_request_raises_and_counts() -> None:
    h = Harness()
    with pytest.raises(InvalidRequest, match="descriptor list must not be empty"):
        await h.limiter.should_rate_limit(Request("d", []))
    with pytest.raises(InvalidRequest, match="domain must not be empty"):
        await h.limiter.should_rate_limit(Request("", [_parse("k=v")]))
    assert h.stats.service_error == 2


async def test_unlimited() -> None:
    h = Harness()
    for _ in range(50):
        response = await h.call("unl=1", hits=1000)
        assert response.overall is OK
        status = response.statuses[0]
        assert status.code is OK
        assert status.remaining == UINT32_MAX == 4294967295
        assert status.limit is None
    assert h.stats.rules == {}


async def test_replaces() -> None:
    h = Harness()
    # b replaces a: a's 1/minute does not apply while b is in the request
    for _ in range(3):
        response = await h.call("a=1", "b=1")
        assert response.overall is OK
        assert response.statuses[0].limit is None
        limit = response.statuses[1].limit
        assert limit is not None and limit.name == "b"
    assert response.statuses[1].remaining == 2
    assert "d.a" not in h.stats.rules
    # alone, a is enforced
    assert await overall(h, "a=1", times=2) == [OK, OVER]


# --------------------------------------------------------------------------- shadow


async def test_shadow_mode_never_denies_probabilistic() -> None:
    h = Harness()
    for _ in range(5):
        response = await h.call("shadow=1")
        assert response.overall is OK
        assert response.statuses[0].code is OK
    rule = h.stats.rules["d.shadow"]
    assert rule.total_hits == 5
    assert rule.shadow_mode == 4
    assert rule.within_limit == 1


async def test_shadow_mode_never_denies_exact() -> None:
    h = Harness()
    assert await overall(h, "exshadow=1", times=5) == [OK] * 5
    assert h.stats.rules["d.exshadow"].shadow_mode == 4
    # a shadow rule over its limit does not stop an enforced one from consuming
    assert await h.codes("exshadow=1", "ex=1") == [OK, OK, OK]
    response = await h.call("ex=1")
    assert response.statuses[0].remaining == 1


async def test_global_shadow() -> None:
    h = Harness(global_shadow=True)
    codes = [await h.codes("ex=1") for _ in range(5)]
    assert codes == [[OK, OK]] * 3 + [[OK, OVER]] * 2
    assert h.stats.global_shadow_mode == 2
    assert h.stats.rules["d.ex"].over_limit == 2


# ------------------------------------------------------------------------ overrides and hits


async def test_per_request_limit_override() -> None:
    h = Harness(default_mode=Mode.EXACT)
    override = Descriptor((("ov", "x"), ("user", "u1")), override=(2, Unit.MINUTE))
    codes = [(await h.call(override)).overall for _ in range(3)]
    assert codes == [OK, OK, OVER]
    response = await h.call(override)
    limit = response.statuses[0].limit
    assert limit is not None
    assert (limit.requests_per_unit, limit.unit) == (2, Unit.MINUTE)
    rule = h.stats.rules["d.ov_x.user_u1"]
    assert (rule.total_hits, rule.over_limit) == (4, 2)
    # another value is another counter
    other = Descriptor((("ov", "x"), ("user", "u2")), override=(2, Unit.MINUTE))
    assert (await h.call(other)).overall is OK


async def test_override_on_configured_descriptor_wins() -> None:
    h = Harness(default_mode=Mode.EXACT)
    override = Descriptor((("ex10", "1"),), override=(1, Unit.MINUTE))
    codes = [(await h.call(override)).overall for _ in range(2)]
    assert codes == [OK, OVER]
    assert "d.ex10_1" in h.stats.rules
    assert "d.ex10" not in h.stats.rules


async def test_override_is_enforced_as_the_rule_it_matches() -> None:
    """A limit carried by the request on a descriptor of an exact rule that fails
    closed is decided by the store, and denied when the store fails, even where the
    default mode is probabilistic; on a descriptor matching no rule, the default mode
    decides (locally, without the store)."""
    h = Harness(default_mode=Mode.PROBABILISTIC)

    async def failing(*args: object, **kwargs: object) -> None:
        raise StoreUnavailable("store down")

    h.limiter.hit_store = failing  # type: ignore[assignment]  # the limiter's store call
    closed = Descriptor((("closed", "1"),), override=(100, Unit.MINUTE))
    assert (await h.call(closed)).overall is OVER  # exact, failure_mode closed
    assert h.stats.rules["d.closed_1"].failure_mode_denied == 1
    unmatched = Descriptor((("nothing", "1"),), override=(100, Unit.MINUTE))
    assert (await h.call(unmatched)).overall is OK  # probabilistic: no store call
    assert h.stats.rules["d.nothing_1"].failure_mode_denied == 0


async def test_request_hits_addend() -> None:
    h = Harness()
    remaining = []
    for _ in range(4):
        response = await h.call("ex10=1", hits=3)
        remaining.append((response.overall, response.statuses[0].remaining))
    assert remaining == [(OK, 7), (OK, 4), (OK, 1), (OVER, 0)]
    rule = h.stats.rules["d.ex10"]
    assert (rule.total_hits, rule.within_limit, rule.near_limit, rule.over_limit) == (12, 9, 1, 3)


async def test_descriptor_hits_addend() -> None:
    h = Harness()
    five = Descriptor((("ex10", "1"),), hits_addend=5)
    response = await h.call(five, hits=1)
    assert response.statuses[0].remaining == 5
    check = Descriptor((("ex10", "1"),), hits_addend=0)
    for _ in range(3):
        response = await h.call(check, hits=4)
        assert response.overall is OK
        assert response.statuses[0].remaining == 5  # check-only consumes nothing
    response = await h.call("ex10=1", hits=0)  # request 0 means 1
    assert response.statuses[0].remaining == 4
    assert (await h.call(Descriptor((("ex10", "1"),), hits_addend=4))).overall is OK
    # full: a check-only request is now over
    assert (await h.call(check)).overall is OVER
    assert h.stats.rules["d.ex10"].total_hits == 10


async def test_probabilistic_check_only_consumes_nothing() -> None:
    h = Harness()
    check = Descriptor((("prob", "1"),), hits_addend=0)
    for _ in range(10):
        assert (await h.call(check)).overall is OK
    assert await overall(h, "prob=1", times=4) == [OK, OK, OK, OVER]


# --------------------------------------------------------------------------- exact window


async def test_exact_sliding_window_has_no_burst_at_the_edge() -> None:
    h = Harness()
    h.clock.now = 1_000_000.999
    assert await overall(h, "sec=1", times=10) == [OK] * 10
    # a fixed window would reset here and admit 10 more
    h.clock.now = 1_000_001.0
    assert await overall(h, "sec=1", times=3) == [OVER] * 3
    h.clock.now = 1_000_001.9
    assert (await h.call("sec=1")).overall is OVER
    # once the slice of the burst has left (at most one slice after T) there is room again
    h.clock.now = 1_000_002.0
    assert await overall(h, "sec=1", times=11) == [OK] * 10 + [OVER]


async def test_exact_reset_after_and_remaining() -> None:
    h = Harness()
    h.clock.now = 1_000_000.5  # slice of 1 s; leaves the 60 s window at 1_000_061
    response = await h.call("ex=1")
    status = response.statuses[0]
    assert status.remaining == 2
    assert status.reset_after == 60.0  # 60.5 s to go; a reset is at most the window
    await h.call("ex=1")
    await h.call("ex=1")
    h.clock.now = 1_000_010.0
    response = await h.call("ex=1")
    status = response.statuses[0]
    assert (status.code, status.remaining) == (OVER, 0)
    assert status.reset_after == pytest.approx(51.0)


# ------------------------------------------------------------------- denials consume nothing


async def test_denied_request_refunds_probabilistic_credit() -> None:
    h = Harness()
    assert await h.codes("p5=1", "ex=1") == [OK, OK, OK]
    for _ in range(2):
        await h.call("ex=1")
    (bucket,) = h.limiter.local.buckets()
    assert (bucket.admitted, bucket.credit) == (1, 4.0)
    # ex is full: the request is denied, p5's admitted hit is given back
    for _ in range(5):
        assert await h.codes("p5=1", "ex=1") == [OVER, OK, OVER]
    assert (bucket.admitted, bucket.credit) == (1, 4.0)
    assert await overall(h, "p5=1", times=5) == [OK] * 4 + [OVER]


async def test_probabilistic_denial_does_not_consume_exact_windows() -> None:
    h = Harness()
    for _ in range(5):
        assert await h.codes("p0=1", "ex=1") == [OVER, OVER, OK]
    response = await h.call("ex=1")
    assert response.overall is OK
    assert response.statuses[0].remaining == 2


async def test_draw_decides_against_the_ratio() -> None:
    h = Harness()
    assert (await h.call("p5=1")).overall is OK
    (bucket,) = h.limiter.local.buckets()
    bucket.ratio = 0.5
    h.draw.value = 0.4
    assert (await h.call("p5=1")).overall is OVER
    h.draw.value = 0.6
    assert (await h.call("p5=1")).overall is OK
    assert bucket.admitted == 2
    assert bucket.offered == 3


async def test_probabilistic_quota_over_denies_and_consumes_no_exact_window() -> None:
    """Overall OVER_LIMIT because every quota descriptor (here one, probabilistic) is over:
    the request is denied, so the exact window of "ex" must not be consumed."""
    h = Harness()
    assert (await h.call("pq=1")).overall is OK  # uses pq's only hit
    for _ in range(3):
        assert await h.codes("pq=1", "ex=2") == [OVER, OVER, OK]
    response = await h.call("ex=2")
    assert response.overall is OK
    assert response.statuses[0].remaining == 2


async def test_admitted_request_with_exact_quota_over_still_consumes() -> None:
    """A probabilistic quota descriptor is OK, so the request is admitted although the exact
    quota descriptor is over; the admitted enforced exact hit must then be counted."""
    h = Harness()
    assert (await h.call("eq=1")).overall is OK  # exhausts eq
    results = []
    for index in range(5):
        response = await h.call(f"pq=user{index}", "eq=1", "ex=3")
        results.append((response.overall, response.statuses[2].code))
    # ex allows 3 per minute: the 4th and 5th requests must be denied
    assert results == [(OK, OK)] * 3 + [(OVER, OVER)] * 2


# --------------------------------------------------------------------------- failure modes


class DownStore(EmbeddedStore):
    async def hit(
        self,
        hits: Sequence[ExactHit],
        commit: bool,
        owe: bool = False,
        deadline: float | None = None,
    ) -> list[ExactResult]:
        raise StoreUnavailable("down")


async def test_store_unavailable_applies_failure_mode() -> None:
    clock = Clock()
    limiter = RateLimiter(config(), DownStore(clock=clock), clock=clock, draw=Draw())
    open_response = await limiter.should_rate_limit(Request("d", [_parse("open=1")]))
    assert open_response.overall is OK
    assert open_response.statuses[0].remaining == 5
    closed_response = await limiter.should_rate_limit(Request("d", [_parse("closed=1")]))
    assert closed_response.overall is OVER
    assert limiter.stats.store_error == 2
    rules = limiter.stats.rules
    assert (rules["d.open"].failure_mode_allowed, rules["d.open"].failure_mode_denied) == (1, 0)
    assert (rules["d.closed"].failure_mode_allowed, rules["d.closed"].failure_mode_denied) == (0, 1)
    assert len(limiter.stats.near_keys) == 0  # denied by failure_mode, not by a count


class LaterStore(EmbeddedStore):
    """The embedded store's results, handed over when the test says; or ``refuse`` raised
    at once, as the batcher refuses a call with too little time left."""

    def __init__(self, clock: Clock, refuse: Exception | None = None) -> None:
        super().__init__(clock=clock)
        self.refuse = refuse
        self.waiting: list[tuple[asyncio.Future[list[ExactResult]], Awaitable[list[ExactResult]]]]
        self.waiting = []

    def hit(  # type: ignore[override]
        self,
        hits: Sequence[ExactHit],
        commit: int,
        owe: bool = False,
        deadline: float | None = None,
    ) -> Awaitable[list[ExactResult]]:
        if self.refuse is not None:
            raise self.refuse
        future: asyncio.Future[list[ExactResult]] = asyncio.get_running_loop().create_future()
        self.waiting.append((future, super().hit(hits, commit, owe, deadline)))
        return future

    async def reply(self, error: Exception | None = None) -> None:
        for future, results in self.waiting:
            if error is None:
                future.set_result(await results)
            else:  # Redis never counted them
                results.close()  # type: ignore[attr-defined]
                future.set_exception(error)
        self.waiting.clear()


async def test_decide_answers_at_once_when_the_store_refuses_at_once() -> None:
    clock = Clock()
    refusal = StoreUnavailable("redis: answers take 40.0 ms lately, 15.0 ms left")
    limiter = RateLimiter(config(), LaterStore(clock, refusal), clock=clock, draw=Draw())
    response = limiter.decide(Request("d", [_parse("closed=1")]))
    assert isinstance(response, Response)  # no future to wait for: answered in the read
    assert response.overall is OVER
    assert limiter.stats.store_error == 1
    assert limiter.stats.rules["d.closed"].failure_mode_denied == 1


@pytest.mark.parametrize("error", [None, StoreUnavailable("redis: no answer in 15 ms")])
async def test_a_decision_settled_from_its_future_is_the_awaited_one(
    error: Exception | None,
) -> None:
    """The native front door settles a Deciding from a callback; should_rate_limit awaits
    it: the same answers, counted the same, the store's or failure_mode's."""
    answers = []
    for awaited in (True, False):
        clock = Clock()
        store = LaterStore(clock)
        limiter = RateLimiter(config(), store, clock=clock, draw=Draw())
        for _ in range(4):
            request = Request("d", [_parse("ex=1"), _parse("closed=1")])
            if awaited:
                call = asyncio.ensure_future(limiter.should_rate_limit(request))
                await asyncio.sleep(0)
                await store.reply(error)
                response = await call
            else:
                decision = limiter.decide(request)
                assert isinstance(decision, Deciding)
                waiting = asyncio.ensure_future(decision.waiting)
                await store.reply(error)
                await asyncio.sleep(0)
                assert waiting.done()
                response = decision.settle(waiting)
            answers.append((awaited, response.overall, [s.remaining for s in response.statuses]))
        rule = limiter.stats.rules["d.ex"]
        answers.append((awaited, rule.within_limit, rule.over_limit, limiter.stats.store_error))
    by_path = {path: [a[1:] for a in answers if a[0] is path] for path in (True, False)}
    assert by_path[True] == by_path[False]
    if error is None:  # ex allows 3 a minute: the 4th is denied by the count
        assert [a[0] for a in by_path[True][:4]] == [OK, OK, OK, OVER]
    else:  # closed denies by failure_mode, every time
        assert [a[0] for a in by_path[True][:4]] == [OVER] * 4


async def test_exact_keys_near_or_over_their_limit_are_remembered_with_their_count() -> None:
    clock = Clock()
    limiter = RateLimiter(config(), EmbeddedStore(clock=clock), clock=clock, draw=Draw())
    for _ in range(4):  # 4 of 5: up to the near-limit mark (80 %), not past it
        await limiter.should_rate_limit(Request("d", [_parse("open=1")]))
    assert len(limiter.stats.near_keys) == 0
    await limiter.should_rate_limit(Request("d", [_parse("open=1")]))
    ((key, near),) = limiter.stats.near_keys.items()
    assert (near.rule, near.used, near.limit, near.window_seconds) == ("d.open", 5, 5, 60)
    for _ in range(2):  # denied: over the limit, shown at the limit
        await limiter.should_rate_limit(Request("d", [_parse("open=1")]))
    assert [(k, n.used) for k, n in limiter.stats.near_keys.items()] == [(key, 5)]


def _bucket(h: Harness, key: str) -> ProbabilisticBucket:
    # Bucket keys are "domain, key=value..., window"; any window will do here.
    prefix = f"d\x1f{key}\x1e1\x1f"
    return next(b for b in h.limiter.local.buckets() if b.key.startswith(prefix))


async def test_stale_sync_applies_failure_mode_to_probabilistic_rules() -> None:
    h = Harness()
    h.limiter.local.last_sync_ok = h.clock.now - 10.0  # stale_after is 3 s by default
    assert await overall(h, "pclosed=1", times=2) == [OVER, OVER]
    assert await overall(h, "p5=1", times=8) == [OK] * 8  # open: past the credit
    p5 = _bucket(h, "p5")
    # offered counts; hits let through by the failure policy are not charged
    assert (p5.offered, p5.admitted, p5.credit) == (8, 0, 5.0)
    assert _bucket(h, "pclosed").offered == 2
    rules = h.limiter.stats.rules
    assert (rules["d.pclosed"].failure_mode_denied, rules["d.p5"].failure_mode_allowed) == (2, 8)
    # fresh again: the credit decides
    h.limiter.local.last_sync_ok = h.clock.now
    assert await overall(h, "pclosed=1", times=6) == [OK] * 5 + [OVER]


async def test_a_denied_request_gives_back_only_what_it_was_charged() -> None:
    """Hits let through by the failure policy were never charged: a request denied
    by another descriptor must not credit them back (that would mint credit)."""
    h = Harness()
    h.limiter.local.last_sync_ok = h.clock.now - 10.0  # stale
    for _ in range(3):
        await h.call("ex=1")  # the exact limit (3 per minute) is now spent
    assert await h.codes("p5=1", "ex=1") == [OVER, OK, OVER]
    p5 = _bucket(h, "p5")
    assert (p5.offered, p5.admitted, p5.credit) == (1, 0, 5.0)
    h.limiter.local.last_sync_ok = h.clock.now  # fresh: a charged hit is given back
    assert await h.codes("p5=1", "ex=1") == [OVER, OK, OVER]
    assert (p5.offered, p5.admitted, p5.credit) == (2, 0, 5.0)


# --------------------------------------------------------------------------- stats


async def test_stats_counters() -> None:
    h = Harness()
    assert await overall(h, "ex10=1", times=12) == [OK] * 10 + [OVER] * 2
    rule = h.stats.rules["d.ex10"]
    assert rule.total_hits == 12
    assert rule.over_limit == 2
    assert rule.near_limit == 2  # the 9th and 10th hits are past 80 %
    assert rule.within_limit == 10
    assert rule.shadow_mode == 0


async def test_stats_counters_probabilistic() -> None:
    h = Harness()
    assert await overall(h, "p5=1", times=7) == [OK] * 5 + [OVER] * 2
    rule = h.stats.rules["d.p5"]
    assert (rule.total_hits, rule.within_limit, rule.near_limit, rule.over_limit) == (7, 5, 1, 2)


async def test_stats_keys_are_bounded() -> None:
    h = Harness(stats=Stats(max_keys=2), default_mode=Mode.EXACT)
    for index in range(5):
        override = Descriptor((("user", f"u{index}"),), override=(10, Unit.MINUTE))
        await h.call(override)
    assert set(h.stats.rules) == {"d.user_u0", "d.user_u1", OVERFLOW_KEY}
    assert h.stats.rules[OVERFLOW_KEY].total_hits == 3
    assert h.stats.overflowed_keys == 3


async def test_domain_not_found_keys_are_bounded() -> None:
    h = Harness(stats=Stats(max_keys=2))
    for index in range(5):
        await h.limiter.should_rate_limit(Request(f"x{index}", [_parse("k=v")]))
    assert h.stats.domain_not_found == {"x0": 1, "x1": 1, OVERFLOW_KEY: 3}


# --------------------------------------------------------------------------- bounds under a flood


async def test_injected_parts_are_used() -> None:
    local, stats = LocalBuckets(max_buckets=7), Stats(max_keys=3)
    h = Harness(local=local, stats=stats)
    assert h.limiter.local is local
    assert h.limiter.stats is stats


async def test_local_buckets_bounded_under_a_flood() -> None:
    local = LocalBuckets(max_buckets=100)
    h = Harness(local=local)
    for index in range(1000):
        assert (await h.call(f"prob=client{index}")).overall is OK
        assert len(local) <= 100
    assert len(local) == 100
    assert local.evicted_overflow == 900


async def test_a_bucket_in_use_is_not_the_one_evicted() -> None:
    """The request path finds known buckets without LocalBuckets.get(); it must still
    mark them used, or a busy bucket would be evicted (and lose its state) first."""
    local = LocalBuckets(max_buckets=2)
    h = Harness(local=local)
    for key in ("prob=a", "prob=b", "prob=a", "prob=c"):
        assert (await h.call(key)).overall is OK
    kept = sorted(bucket.key.split("\x1f")[1] for bucket in local.buckets())
    assert kept == ["prob\x1ea", "prob\x1ec"]
    h.clock.now += 5.0
    await h.call("prob=a")
    assert {bucket.last_used for bucket in local.buckets()} == {h.clock.now - 5.0, h.clock.now}


async def test_exact_windows_bounded_under_a_flood() -> None:
    h = Harness(max_keys=100)
    for index in range(1000):
        assert (await h.call(f"ex=client{index}")).overall is OK
    stats = h.store.metrics().figures
    assert stats["exact_keys"] == 100
    assert stats["evictions"] == 900


# --------------------------------------------------------------------------- reload


async def test_reload_keeps_probabilistic_counts() -> None:
    h = Harness()
    assert await overall(h, "prob=1", times=2) == [OK, OK]
    h.limiter.swap_config(config(CONFIG.replace("requests_per_unit: 3}", "requests_per_unit: 4}")))
    response = await h.call("prob=1")
    assert response.overall is OK
    limit = response.statuses[0].limit
    assert limit is not None and limit.requests_per_unit == 4
    (bucket,) = h.limiter.local.buckets()
    assert (bucket.limit, bucket.admitted) == (4, 3)


FLIP = """
domain: d
mode: {mode}
descriptors:
  - key: k
    rate_limit: {{unit: minute, requests_per_unit: 3}}
"""


async def test_a_change_of_mode_carries_no_count_over() -> None:
    """docs/operations.md, "Changing a rule's mode": each mode keeps its own counts, so a
    change meets the key's counts of the other mode as that mode left them, without
    what this one admitted."""
    h = Harness(text=FLIP.format(mode="probabilistic"))
    assert await overall(h, "k=1", times=4) == [OK, OK, OK, OVER]
    h.limiter.swap_config(config(FLIP.format(mode="exact")))
    assert await overall(h, "k=1", times=4) == [OK, OK, OK, OVER]  # a fresh window
    h.limiter.swap_config(config(FLIP.format(mode="probabilistic")))
    (bucket,) = h.limiter.local.buckets()
    assert bucket.admitted == 3  # probabilistic's own three; exact's are not in it
    assert await overall(h, "k=1", times=1) == [OVER]
    h.limiter.swap_config(config(FLIP.format(mode="exact")))
    assert await overall(h, "k=1", times=1) == [OVER]  # the window holds exact's three
    h.clock.now += 62  # they have left the window
    assert await overall(h, "k=1", times=4) == [OK, OK, OK, OVER]


async def test_a_reused_request_follows_a_reload() -> None:
    """The servicer passes the same Request object for equal bytes, and the limiter
    keeps its matches on it: a reload must still apply to it at once."""
    h = Harness()
    request = Request("d", [_parse("prob=1")])
    first = await h.limiter.should_rate_limit(request)
    assert first.statuses[0].limit is not None
    assert first.statuses[0].limit.requests_per_unit == 3
    h.limiter.swap_config(config(CONFIG.replace("requests_per_unit: 3}", "requests_per_unit: 4}")))
    again = await h.limiter.should_rate_limit(request)
    assert again.statuses[0].limit is not None
    assert again.statuses[0].limit.requests_per_unit == 4
    h.limiter.swap_config(config(CONFIG.replace("prob", "renamed")))
    unmatched = await h.limiter.should_rate_limit(request)
    assert unmatched.statuses[0].limit is None


async def test_an_invalid_request_stays_invalid_when_reused() -> None:
    h = Harness()
    request = Request("d", [Descriptor(())])
    for _ in range(2):
        with pytest.raises(InvalidRequest, match="descriptor 0 has no entries"):
            await h.limiter.should_rate_limit(request)
    assert h.stats.service_error == 2


async def test_default_draws_follow_each_buckets_sequence() -> None:
    """Without an injected draw, a bucket at ratio 0.5 admits every other request
    or so: 50 of 100 to within 2, where random draws land outside 48..52 more often
    than not (62 %)."""
    clock = Clock()
    limiter = RateLimiter(config(), EmbeddedStore(clock=clock), clock=clock)
    request = Request("d", [_parse("p5=a")])
    await limiter.should_rate_limit(request)
    bucket = limiter.local.buckets()[0]
    bucket.ratio, bucket.credit = 0.5, 1e9
    codes = [(await limiter.should_rate_limit(request)).overall for _ in range(100)]
    assert abs(codes.count(Code.OK) - 50) <= 2


# --------------------------------------------------------------------------- the local fast path


async def test_statuses_agree_with_the_buckets_own_estimates() -> None:
    """After each decision the status says what the bucket says: its remaining()
    and reset_estimate()."""
    h = Harness()
    await h.call("p5=1")
    bucket = _bucket(h, "p5")
    cases = [(5.0, 0, 0.0), (5.0, 3, 1.0), (2.5, 1, 4.0), (0.0, 2, 30.0), (4.0, 0, 100.0)]
    resets: list[float | None] = []
    for tokens, admitted, since_sync in cases:
        bucket.tokens, bucket.admitted, bucket.credit = tokens, admitted, 10.0
        bucket.synced_at = h.clock.now - since_sync
        status = (await h.call("p5=1")).statuses[0]
        assert status.remaining == bucket.remaining()
        assert status.reset_after == pytest.approx(bucket.reset_estimate(h.clock.now))
        resets.append(status.reset_after)
    assert len(set(resets)) >= 3  # the cases reach the formula, not only its zero


async def test_decide_locally_answers_only_requests_without_the_store() -> None:
    h = Harness()
    twin = Harness()
    local_only = ["prob=1", "p5=2"], ["p5=2", "shadow=1"], ["pq=1"], ["p0=1"]
    for descriptors in local_only:
        for _ in range(3):
            built = [_parse(text) for text in descriptors]
            response = h.limiter.decide_locally(Request("d", built))
            expected = await twin.call(*descriptors)
            assert response == expected
    for needs_more in (["ex=1"], ["prob=1", "ex=1"], ["prob=1", "nomatch=1"], ["unl=1"]):
        request = Request("d", [_parse(text) for text in needs_more])
        assert h.limiter.decide_locally(request) is None
    assert h.limiter.decide_locally(Request("elsewhere", [_parse("prob=1")])) is None
    counted = {key: vars_of(rule) for key, rule in h.stats.rules.items()}
    assert counted == {key: vars_of(rule) for key, rule in twin.stats.rules.items()}
    assert counted["d.p0"]["over_limit"] == 3
    assert (counted["d.p5"]["within_limit"], counted["d.p5"]["over_limit"]) == (5, 1)
    assert counted["d.shadow"]["shadow_mode"] == 2


def vars_of(rule: object) -> dict[str, int]:
    return {name: getattr(rule, name) for name in rule.__slots__}  # type: ignore[attr-defined]


ZERO = """
domain: z
descriptors:
  - key: blocked
    mode: exact
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: pblocked
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: open
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: free
    mode: exact
    rate_limit: {unlimited: true}
"""


class CountingDownStore(DownStore):
    """A store that is away, and counts how often it was asked."""

    asked = 0

    async def hit(
        self,
        hits: Sequence[ExactHit],
        commit: bool,
        owe: bool = False,
        deadline: float | None = None,
    ) -> list[ExactResult]:
        self.asked += 1
        return await super().hit(hits, commit, owe, deadline)


@pytest.mark.parametrize("descriptor", ["blocked=x", "pblocked=x"])
async def test_a_limit_of_0_denies_without_the_store(descriptor: str) -> None:
    """In exact and probabilistic mode, with the store away and failure_mode open:
    a limit of 0 needs no count, so nothing can turn it into an OK."""
    clock = Clock()
    store = CountingDownStore(clock=clock)
    limiter = RateLimiter(config(ZERO), store, clock=clock, draw=Draw(0.0))
    for _ in range(3):
        response = await limiter.should_rate_limit(Request("z", [_parse(descriptor)]))
        assert response.overall is OVER
        assert response.statuses[0].remaining == 0
        assert 0 < response.statuses[0].reset_after <= 1
    assert store.asked == 0
    rule = limiter.stats.rules[f"z.{descriptor.split('=')[0]}"]
    assert (rule.over_limit, rule.failure_mode_allowed) == (3, 0)


async def test_a_limit_of_0_beside_a_store_rule_denies_and_consumes_nothing() -> None:
    clock = Clock()
    store = EmbeddedStore(clock=clock)
    limiter = RateLimiter(config(ZERO), store, clock=clock, draw=Draw(0.0))
    request = Request("z", [_parse("blocked=x"), _parse("open=y"), _parse("free=z")])
    for _ in range(7):
        response = await limiter.should_rate_limit(request)
        assert response.overall is OVER
        assert [s.code for s in response.statuses] == [OVER, OK, OK]
    alone = await limiter.should_rate_limit(Request("z", [_parse("open=y")]))
    assert alone.statuses[0].remaining == 4  # the denied requests took none of it
    unlimited = await limiter.should_rate_limit(Request("z", [_parse("free=z")]))
    assert unlimited.overall is OK
