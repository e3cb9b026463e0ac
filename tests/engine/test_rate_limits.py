"""rate_limits: several limits on one descriptor ("3 a second and 5 a minute"). A
request is denied if any is over, and then consumes none of them; the status is the
most restrictive limit's; each limit has its own counter and stats key."""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import pytest

from ratelimit_harness.fleet import python_burst, redis_server, service_fleet
from ratelimit_service.core.config_loader import ConfigFile, check_config, load_config
from ratelimit_service.core.config_model import HeaderStyle
from ratelimit_service.core.headers import HeaderNames, rate_limit_headers
from ratelimit_service.core.request import Code, Descriptor, Request
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.storage.embedded import EmbeddedStore

RULES = """\
domain: d
descriptors:
  - key: user
    mode: {mode}
    rate_limits:
      - {{unit: second, requests_per_unit: 3}}
      - {{unit: minute, requests_per_unit: 5, name: sustained}}
"""


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def limiter(mode: str) -> tuple[RateLimiter, Clock]:
    clock = Clock()
    config = load_config([ConfigFile("r.yaml", RULES.format(mode=mode))])
    return RateLimiter(config, EmbeddedStore(clock=clock), clock=clock, draw=lambda: 0.999), clock


async def admitted(rate: RateLimiter, count: int, user: str = "u") -> int:
    request = Request("d", [Descriptor((("user", user),))])
    return sum([(await rate.should_rate_limit(request)).overall is Code.OK for _ in range(count)])


async def wait(rate: RateLimiter, clock: Clock, seconds: float) -> None:
    """Time passes, with a probabilistic sync every 0.25 s."""
    reconciler = Reconciler(rate.local, rate.store, 0.25, clock=clock)
    for _ in range(round(seconds / 0.25)):
        clock.now += 0.25
        await reconciler.sync_once()


async def test_3_a_second_and_5_a_minute_exact() -> None:
    """3 at once, then 2 after a second (the minute's 5 are used), then none."""
    rate, clock = limiter("exact")
    assert await admitted(rate, 6) == 3
    await wait(rate, clock, 1.25)  # past the second (an exact window is up to T + T/60)
    assert await admitted(rate, 6) == 2
    await wait(rate, clock, 1.25)
    assert await admitted(rate, 6) == 0
    stats = rate.stats.rules
    assert set(stats) == {"d.user.per_second", "d.user.sustained"}
    # Denied requests consumed neither limit, or the second burst would have met a
    # used-up minute; each limit's stats count every hit it saw.
    assert stats["d.user.sustained"].total_hits == 18


async def test_3_a_second_and_5_a_minute_probabilistic() -> None:
    """Probabilistic mode follows rates, so it admits no more than either limit allows,
    and after a burst it refills more cautiously than the exact windows: 3 at once, at
    most 3 in any later second, at most 5 in the minute."""
    rate, clock = limiter("probabilistic")
    seconds = [await admitted(rate, 6)]
    for _ in range(8):
        await wait(rate, clock, 1.0)
        seconds.append(await admitted(rate, 6))
    assert seconds[0] == 3
    assert max(seconds) <= 3 and 4 <= sum(seconds) <= 5, seconds


@pytest.mark.parametrize("mode", ["exact", "probabilistic"])
async def test_the_status_is_the_most_restrictive_limit(mode: str) -> None:
    rate, _ = limiter(mode)
    request = Request("d", [Descriptor((("user", "s"),))])
    first = (await rate.should_rate_limit(request)).statuses[0]
    assert first.limit is not None and first.limit.label == "per_second"  # 2 left of 3
    assert first.remaining == 2
    for _ in range(2):
        await rate.should_rate_limit(request)
    over = await rate.should_rate_limit(request)
    assert over.overall is Code.OVER_LIMIT
    assert over.statuses[0].code is Code.OVER_LIMIT and over.statuses[0].remaining == 0
    headers = dict(rate_limit_headers(over.decided, HeaderStyle.DRAFT03, HeaderNames()))
    assert headers["X-RateLimit-Limit"] == "3, 3;w=1"
    assert headers["X-RateLimit-Remaining"] == "0"


def test_each_limit_is_in_the_dump_with_its_label() -> None:
    config = load_config([ConfigFile("r.yaml", RULES.format(mode="exact"))])
    dump = config.dump()
    assert "d.user[per_second]: unit=SECOND requests_per_unit=3" in dump
    assert "d.user[sustained]: unit=MINUTE requests_per_unit=5" in dump
    assert [limit.stats_key for limit in config.limits()] == [
        "d.user.per_second",
        "d.user.sustained",
    ]


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (
            "    rate_limit: {unit: second, requests_per_unit: 1}\n"
            "    rate_limits: [{unit: minute, requests_per_unit: 5}]\n",
            "r.yaml:5: a descriptor has rate_limit or rate_limits, not both",
        ),
        ("    rate_limits: []\n", "r.yaml:4: rate_limits must be a non-empty list"),
        (
            "    rate_limits:\n      - {unlimited: true}\n",
            "r.yaml:5: unlimited has no place in rate_limits",
        ),
        (
            "    rate_limits:\n      - {unit: minute, requests_per_unit: 5}\n"
            "      - {unit: minute, requests_per_unit: 9}\n",
            "r.yaml:6: rate_limits has two limits labelled 'per_minute' (line 5)",
        ),
        (
            "    rate_limits:\n      - {unit: minute, requests_per_unit: 5, unit_multiplier: 0}\n",
            "r.yaml:5: unit_multiplier must be a whole number of at least 1",
        ),
    ],
)
def test_errors_say_file_line_and_cause(body: str, error: str) -> None:
    text = "domain: d\ndescriptors:\n  - key: user\n" + body
    errors = [str(e) for e in check_config([ConfigFile("r.yaml", text)])]
    assert len(errors) == 1 and errors[0].startswith(error), errors


async def test_two_limits_of_one_period_need_names_and_count_apart() -> None:
    text = (
        "domain: d\ndescriptors:\n  - key: user\n    mode: exact\n    rate_limits:\n"
        "      - {unit: minute, requests_per_unit: 2, name: a}\n"
        "      - {unit: minute, requests_per_unit: 4, name: b}\n"
    )
    clock = Clock()
    rate = RateLimiter(
        load_config([ConfigFile("r.yaml", text)]), EmbeddedStore(clock=clock), clock=clock
    )
    assert await admitted(rate, 5) == 2
    clock.now += 61  # both windows pass
    assert await admitted(rate, 5) == 2  # b still had room: a's denials consumed none of it
    # Each limit's stats count every hit it saw, as separate descriptors' do.
    assert rate.stats.rules["d.user.a"].over_limit == 6
    assert rate.stats.rules["d.user.b"].over_limit == 0


def test_tune_proposes_each_limit_of_a_list_in_place() -> None:
    from ratelimit_service.tune.arithmetic import edit, rule_places, rules

    text = RULES.format(mode="exact")
    config = load_config([ConfigFile("r.yaml", text)])
    assert [rule.key for rule in rules(config)] == ["d.user.per_second", "d.user.sustained"]
    places = rule_places(text)
    assert sorted(places) == ["d.user.per_second", "d.user.sustained"]
    second, minute = places["d.user.per_second"], places["d.user.sustained"]
    assert second.requests_per_unit is not None and minute.requests_per_unit is not None
    edited = edit(text, {second.requests_per_unit: "4", minute.requests_per_unit: "9"})
    assert "{unit: second, requests_per_unit: 4}" in edited
    assert "{unit: minute, requests_per_unit: 9, name: sustained}" in edited
    load_config([ConfigFile("r.yaml", edited)])  # and it still loads


async def test_an_rlqs_bucket_gets_the_tightest_of_its_limits() -> None:
    from ratelimit_service.engine.quota import TOKEN_BUCKET, QuotaCoordinator, Usage
    from ratelimit_service.engine.stats import Stats

    clock = Clock()
    config = load_config([ConfigFile("r.yaml", RULES.format(mode="exact"))])
    quota = QuotaCoordinator(
        lambda: config, Stats(), EmbeddedStore(clock=clock), clock=clock, wall=clock
    )
    (action,) = await quota.report("envoy-1", "d", [Usage({"user": "u"}, 1, 0)])
    assert action.kind is TOKEN_BUCKET and action.token_bucket is not None
    bucket = action.token_bucket
    # 5 a minute is tighter than 3 a second: its rate, not 3 a second.
    assert bucket.tokens_per_fill / bucket.fill_seconds == pytest.approx(5 / 60, rel=0.25)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server")
def test_3_a_second_and_5_a_minute_across_three_processes_on_redis(tmp_path: Path) -> None:
    config = tmp_path / "config"
    config.mkdir()
    (config / "r.yaml").write_text(RULES.format(mode="exact"))
    with redis_server(tmp_path) as redis, service_fleet(3, config, redis.url) as nodes:
        ports = [node.grpc_port for node in nodes]
        bursts = []
        for _ in range(3):
            bursts.append(asyncio.run(python_burst(ports, "d", "user=u", 6, 6))["OK"])
            time.sleep(1.25)  # the scenario: the next burst a second later
    assert bursts == [3, 2, 0]


async def test_shadow_mode_detailed_metric_and_replaces_work_on_each_limit() -> None:
    text = """\
domain: d
descriptors:
  - key: watch
    shadow_mode: true
    detailed_metric: true
    mode: exact
    rate_limits:
      - {unit: second, requests_per_unit: 1}
      - {unit: minute, requests_per_unit: 2}
  - key: old
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 1, name: old}
  - key: new
    mode: exact
    rate_limits:
      - {unit: minute, requests_per_unit: 3, name: wide, replaces: [{name: old}]}
"""
    clock = Clock()
    rate = RateLimiter(
        load_config([ConfigFile("r.yaml", text)]), EmbeddedStore(clock=clock), clock=clock
    )
    watch = Request("d", [Descriptor((("watch", "x"),))])
    codes = [(await rate.should_rate_limit(watch)).overall for _ in range(4)]
    assert codes == [Code.OK] * 4  # shadow: counted, never denied
    assert rate.stats.rules["d.watch_x.per_second"].shadow_mode == 3
    assert rate.stats.rules["d.watch_x.per_minute"].shadow_mode == 2
    both = Request("d", [Descriptor((("old", "o"),)), Descriptor((("new", "n"),))])
    admitted = [(await rate.should_rate_limit(both)).overall for _ in range(4)]
    assert admitted == [Code.OK] * 3 + [Code.OVER_LIMIT]  # old (1 a minute) replaced by wide


QUOTA_RULES = """\
domain: d
descriptors:
  - key: user
    mode: {mode}
    quota_mode: true
    rate_limits:
      - {{unit: minute, requests_per_unit: 2, name: small}}
      - {{unit: hour, requests_per_unit: 5, name: large}}
"""


@pytest.mark.parametrize("mode", ["exact", "probabilistic"])
async def test_quota_limits_deny_only_when_every_one_is_over(mode: str) -> None:
    """quota_mode: a request is denied only when every quota limit is over, so while the
    hour's quota remains the minute's being spent does not deny: the answer is OK in
    both modes (not a shadow-mode OK), the descriptor's status is the quota that still
    admits, and the request counts where it fits."""
    clock = Clock()
    config = load_config([ConfigFile("q.yaml", QUOTA_RULES.format(mode=mode))])
    rate = RateLimiter(config, EmbeddedStore(clock=clock), clock=clock, draw=lambda: 0.999)
    request = Request("d", [Descriptor((("user", "u"),))])
    answers = [await rate.should_rate_limit(request) for _ in range(6)]
    assert [a.overall for a in answers] == [Code.OK] * 5 + [Code.OVER_LIMIT]
    assert not any(a.shadowed for a in answers)
    third = answers[2].statuses[0]
    assert third.limit is not None and third.limit.name == "large"
    assert (third.code, third.remaining) == (Code.OK, 2)
