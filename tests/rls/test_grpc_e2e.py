"""End to end over the wire: a real service on loopback, a real grpc.aio client.

Most tests run in both modes. Probabilistic services get a long sync interval (and
a matching stale_after) so that nothing reconciles during a test: on the embedded
store a new bucket's credit is the whole limit, which makes a burst decide exactly
like exact mode until the first sync.
"""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from ratelimit_harness.fixtures import RunningService, make_request
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.config_model import Mode

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
Unit = rls_pb2.RateLimitResponse.RateLimit.Unit
SECOND = Unit.Value("SECOND")
MINUTE = Unit.Value("MINUTE")
HOUR = Unit.Value("HOUR")
UINT32_MAX = 2**32 - 1
RLS = "envoy.service.ratelimit.v3.RateLimitService"
ROUND_UP = 0.001
"""duration_until_reset goes out in whole milliseconds, rounded up."""

RULES = """
domain: d
descriptors:
  - key: k
    rate_limit: {unit: minute, requests_per_unit: 3, name: k_rule}
  - key: two
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: big
    rate_limit: {unit: hour, requests_per_unit: 100}
  - key: sec
    rate_limit: {unit: second, requests_per_unit: 10}
  - key: fifty
    rate_limit: {unit: minute, requests_per_unit: 50}
  - key: free
    rate_limit: {unlimited: true}
  - key: parent
    value: p
    descriptors:
      - key: child
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: shadow
    shadow_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: q1
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: q2
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: old
    rate_limit: {unit: minute, requests_per_unit: 1, name: old_rule}
  - key: new
    rate_limit:
      unit: minute
      requests_per_unit: 5
      replaces: [{name: old_rule}]
"""

MIXED_RULES = """
domain: m
descriptors:
  - key: e3
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: e5
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: p2
    mode: probabilistic
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: p5
    mode: probabilistic
    rate_limit: {unit: minute, requests_per_unit: 5}
  - key: pq
    mode: probabilistic
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: eq
    mode: exact
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 1}
  - key: pq100
    mode: probabilistic
    quota_mode: true
    rate_limit: {unit: minute, requests_per_unit: 100}
"""

BOTH_MODES = pytest.mark.parametrize(
    "mode", [Mode.EXACT, Mode.PROBABILISTIC], ids=lambda m: m.value
)

Starter = Callable[..., Awaitable[RunningService]]


@pytest.fixture
def start(write_config: Callable[..., Path], start_service: Starter) -> Starter:
    """Start a service on RULES (or other YAML) in one mode, with no sync during the test."""

    async def run(mode: Mode = Mode.PROBABILISTIC, rules: str = RULES, **settings: Any) -> Any:
        settings.setdefault("sync_interval", 30.0)
        settings.setdefault("stale_after", 300.0)
        return await start_service(write_config(rules), mode=mode, **settings)

    return run


async def codes(svc: RunningService, count: int, *descriptors: Any, **kw: Any) -> list[int]:
    return [(await svc.call(*descriptors, **kw)).overall_code for _ in range(count)]


async def http_get(url: str) -> tuple[int, str]:
    def fetch() -> tuple[int, str]:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    return await asyncio.to_thread(fetch)


async def metric_samples(svc: RunningService) -> dict[tuple[str, frozenset[Any]], float]:
    status, text = await http_get(svc.admin_url + "/metrics")
    assert status == 200
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def rule_counter(samples: dict[tuple[str, frozenset[Any]], float], name: str, key: str) -> float:
    return samples[(f"ratelimit_service_rate_limit_{name}_total", frozenset({("key", key)}))]


def reset_seconds(status: Any) -> float:
    return status.duration_until_reset.seconds + status.duration_until_reset.nanos / 1e9


# -- limits are enforced -------------------------------------------------------------------


@BOTH_MODES
async def test_exactly_the_limit_is_admitted_serially(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    assert await codes(svc, 7, "d", [("k", "a")]) == [OK] * 3 + [OVER] * 4
    # Another value of the same rule has its own counter.
    assert await codes(svc, 4, "d", [("k", "b")]) == [OK] * 3 + [OVER]


async def after_syncs(svc: RunningService, count: int) -> None:
    """Return once the service's reconciler has run ``count`` more syncs."""
    reconciler = svc.service.reconciler
    done = reconciler.syncs + count
    await eventually_async(lambda: reconciler.syncs >= done, timeout=5, what=f"{count} syncs")


async def test_probabilistic_first_burst_and_after_syncs_stay_within_limit(
    start: Starter,
) -> None:
    svc = await start(Mode.PROBABILISTIC, sync_interval=0.05, stale_after=3.0)
    admitted = 0
    for _ in range(3):
        burst = await codes(svc, 15, "d", [("k", "burst")])
        admitted += burst.count(OK)
        await after_syncs(svc, 2)  # between bursts
    assert 1 <= admitted <= 3
    # A fresh bucket's first burst, before its first sync, gets at most its whole limit.
    first = await asyncio.gather(*(svc.call("d", [("fifty", "x")]) for _ in range(80)))
    assert sum(r.overall_code == OK for r in first) <= 50


@BOTH_MODES
async def test_concurrent_calls_admit_exactly_the_limit(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    responses = await asyncio.gather(*(svc.call("d", [("fifty", "c")]) for _ in range(200)))
    assert sum(r.overall_code == OK for r in responses) == 50
    assert sum(r.overall_code == OVER for r in responses) == 150


# -- statuses ----------------------------------------------------------------------------


@BOTH_MODES
async def test_one_status_per_descriptor_in_order(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    response = await svc.call(
        "d",
        [("nomatch", "x")],
        [("k", "s")],
        [("free", "x")],
        [("two", "s")],
        [("parent", "p"), ("child", "c")],
        [("parent", "p")],
    )
    assert response.overall_code == OK
    statuses = response.statuses
    assert len(statuses) == 6
    assert all(s.code == OK for s in statuses)
    # no match: no limit, no remaining, no reset
    assert not statuses[0].HasField("current_limit")
    assert statuses[0].limit_remaining == 0
    assert not statuses[0].HasField("duration_until_reset")
    # k: 3/minute named k_rule
    limit = statuses[1].current_limit
    assert (limit.requests_per_unit, limit.unit, limit.name) == (3, MINUTE, "k_rule")
    assert statuses[1].limit_remaining == 2
    # unlimited
    assert not statuses[2].HasField("current_limit")
    assert statuses[2].limit_remaining == UINT32_MAX
    # two: 2/minute, no name
    limit = statuses[3].current_limit
    assert (limit.requests_per_unit, limit.unit, limit.name) == (2, MINUTE, "")
    assert statuses[3].limit_remaining == 1
    # nested: limit of the node reached by the last entry
    limit = statuses[4].current_limit
    assert (limit.requests_per_unit, limit.unit) == (10, SECOND)
    # a fresh key has its whole limit in both modes, less this hit
    assert statuses[4].limit_remaining == 9
    # a request that stops on a node without a limit gets none
    assert not statuses[5].HasField("current_limit")


@BOTH_MODES
async def test_limit_remaining_decreases_to_zero(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    remaining = []
    for _ in range(5):
        status = (await svc.call("d", [("k", "r")])).statuses[0]
        remaining.append((status.code, status.limit_remaining))
    assert remaining == [(OK, 2), (OK, 1), (OK, 0), (OVER, 0), (OVER, 0)]


@BOTH_MODES
@pytest.mark.parametrize(("key", "window"), [("k", 60.0), ("sec", 1.0), ("big", 3600.0)])
async def test_duration_until_reset_is_set_and_within_the_window(
    start: Starter, mode: Mode, key: str, window: float
) -> None:
    svc = await start(mode)
    status = (await svc.call("d", [(key, "t")])).statuses[0]
    assert status.HasField("duration_until_reset")
    assert 0 < reset_seconds(status) <= window + ROUND_UP


@BOTH_MODES
async def test_duration_until_reset_when_over_limit(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    await codes(svc, 2, "d", [("two", "t")])
    status = (await svc.call("d", [("two", "t")])).statuses[0]
    assert status.code == OVER
    assert 0 < reset_seconds(status) <= 60 + ROUND_UP


@BOTH_MODES
async def test_unknown_domain_and_no_match_are_ok_without_limit(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    cases = [("nope", [("k", "x")]), ("d", [("zzz", "x")]), ("d", [("k", "x"), ("deeper", "y")])]
    for domain, entries in cases:
        for _ in range(5):
            response = await svc.call(domain, entries, [("zzz", "y")])
            assert response.overall_code == OK
            assert len(response.statuses) == 2
            for status in response.statuses:
                assert status.code == OK
                assert not status.HasField("current_limit")
                assert status.limit_remaining == 0


@BOTH_MODES
async def test_unlimited_is_never_limited(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    for _ in range(20):
        response = await svc.call("d", [("free", "x")], hits_addend=1000)
        assert response.overall_code == OK
        assert response.statuses[0].limit_remaining == UINT32_MAX
        assert not response.statuses[0].HasField("current_limit")


@BOTH_MODES
async def test_replaces_drops_the_named_limit(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    for index in range(4):
        response = await svc.call("d", [("old", "x")], [("new", "x")])
        assert response.overall_code == OK
        replaced, replacing = response.statuses
        assert replaced.code == OK
        assert not replaced.HasField("current_limit")
        assert replacing.current_limit.requests_per_unit == 5
        assert replacing.limit_remaining == 4 - index
    # The replaced limit consumed nothing: alone, its first hit is still admitted.
    assert await codes(svc, 2, "d", [("old", "x")]) == [OK, OVER]


# -- shadow, quota, overall code ----------------------------------------------------------


@BOTH_MODES
async def test_shadow_mode_never_denies_and_is_counted(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    for _ in range(4):
        response = await svc.call("d", [("shadow", "x")])
        assert response.overall_code == OK
        assert response.statuses[0].code == OK
        assert response.statuses[0].current_limit.requests_per_unit == 1
    samples = await metric_samples(svc)
    assert rule_counter(samples, "shadow_mode", "d.shadow") == 3
    assert rule_counter(samples, "total_hits", "d.shadow") == 4
    assert rule_counter(samples, "within_limit", "d.shadow") == 1


@BOTH_MODES
async def test_overall_over_iff_a_non_shadow_descriptor_is_over(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    overall = []
    for _ in range(3):
        response = await svc.call("d", [("shadow", "o")], [("two", "o")])
        overall.append(response.overall_code)
        assert response.statuses[0].code == OK  # shadow: reported OK even when over
    assert overall == [OK, OK, OVER]


@BOTH_MODES
async def test_global_shadow_mode_reports_but_never_denies(start: Starter, mode: Mode) -> None:
    svc = await start(mode, shadow_mode=True)
    responses = [await svc.call("d", [("two", "g")]) for _ in range(4)]
    assert [r.overall_code for r in responses] == [OK] * 4
    assert [r.statuses[0].code for r in responses] == [OK, OK, OVER, OVER]
    samples = await metric_samples(svc)
    assert samples[("ratelimit_service_global_shadow_mode_total", frozenset())] == 2


@BOTH_MODES
async def test_quota_mode_denies_only_when_all_quota_descriptors_are_over(
    start: Starter, mode: Mode
) -> None:
    svc = await start(mode)
    first = await svc.call("d", [("q1", "x")], [("q2", "x")])
    assert first.overall_code == OK
    assert [s.code for s in first.statuses] == [OK, OK]
    second = await svc.call("d", [("q1", "x")], [("q2", "x")])
    assert second.overall_code == OK  # q2 still has room
    assert [s.code for s in second.statuses] == [OVER, OK]
    third = await svc.call("d", [("q1", "x")], [("q2", "x")])
    assert third.overall_code == OVER
    assert [s.code for s in third.statuses] == [OVER, OVER]
    # A non-quota descriptor that is over denies whatever the quota ones say.
    await codes(svc, 2, "d", [("two", "q")])
    fourth = await svc.call("d", [("q1", "y")], [("two", "q")])
    assert fourth.overall_code == OVER
    assert [s.code for s in fourth.statuses] == [OK, OVER]


@BOTH_MODES
async def test_denied_request_consumes_none_of_its_descriptors(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    assert await codes(svc, 3, "d", [("two", "z")], [("k", "z")]) == [OK, OK, OVER]
    # k was consumed by the two admitted requests only.
    status = (await svc.call("d", [("k", "z")])).statuses[0]
    assert (status.code, status.limit_remaining) == (OK, 0)


# -- hits_addend ----------------------------------------------------------------------------


@BOTH_MODES
async def test_request_hits_addend(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    zero = await svc.call("d", [("k", "h")], hits_addend=0)  # 0 means 1
    assert zero.statuses[0].limit_remaining == 2
    two = await svc.call("d", [("k", "h")], hits_addend=2)
    assert (two.overall_code, two.statuses[0].limit_remaining) == (OK, 0)
    assert (await svc.call("d", [("k", "h")], hits_addend=1)).overall_code == OVER
    fifty = await svc.call("d", [("big", "h")], [("fifty", "h")], hits_addend=50)
    assert fifty.overall_code == OK
    assert [s.limit_remaining for s in fifty.statuses] == [50, 0]
    # More than the limit in one request is denied and consumes nothing.
    over = await svc.call("d", [("big", "h2")], hits_addend=101)
    assert over.overall_code == OVER
    ok = await svc.call("d", [("big", "h2")], hits_addend=100)
    assert (ok.overall_code, ok.statuses[0].limit_remaining) == (OK, 0)


@BOTH_MODES
async def test_per_descriptor_hits_addend_zero_checks_without_consuming(
    start: Starter, mode: Mode
) -> None:
    svc = await start(mode)
    check = {"entries": [("two", "c")], "hits": 0}
    first = await svc.call("d", check)
    assert (first.overall_code, first.statuses[0].limit_remaining) == (OK, 2)
    one = await svc.call("d", [("two", "c")])
    assert one.statuses[0].limit_remaining == 1
    again = await svc.call("d", check)
    assert (again.overall_code, again.statuses[0].limit_remaining) == (OK, 1)
    assert (await svc.call("d", [("two", "c")])).overall_code == OK
    # Full: a check now reports OVER_LIMIT, and still consumes nothing.
    for _ in range(3):
        over = await svc.call("d", check)
        assert over.overall_code == OVER
        assert over.statuses[0].code == OVER
    samples = await metric_samples(svc)
    assert rule_counter(samples, "total_hits", "d.two") == 2


async def test_check_only_over_limit_has_a_reset_time(start: Starter) -> None:
    svc = await start(Mode.EXACT)
    await codes(svc, 2, "d", [("two", "r")])
    status = (await svc.call("d", {"entries": [("two", "r")], "hits": 0})).statuses[0]
    assert status.code == OVER
    assert 0 < reset_seconds(status) <= 60 + ROUND_UP


@BOTH_MODES
async def test_per_descriptor_hits_addend_wins_over_request_level(
    start: Starter, mode: Mode
) -> None:
    svc = await start(mode)
    response = await svc.call(
        "d", {"entries": [("big", "w")], "hits": 7}, [("fifty", "w")], hits_addend=3
    )
    assert [s.limit_remaining for s in response.statuses] == [93, 47]
    large = await svc.call("d", {"entries": [("big", "w2")], "hits": 2**32 - 1})
    assert large.overall_code == OVER  # valid on the wire, over any small limit


# -- per-request limit override ----------------------------------------------------------------


@BOTH_MODES
async def test_per_request_limit_override(start: Starter, mode: Mode) -> None:
    svc = await start(mode)
    override = {"entries": [("k", "ov")], "limit": (1, HOUR)}
    first = await svc.call("d", override)
    limit = first.statuses[0].current_limit
    assert (first.overall_code, limit.requests_per_unit, limit.unit) == (OK, 1, HOUR)
    assert first.statuses[0].limit_remaining == 0
    assert (await svc.call("d", override)).overall_code == OVER
    # Entries that match no rule: the override still applies when the domain is known.
    unmatched = {"entries": [("nothing", "here"), ("deeper", "x")], "limit": (2, MINUTE)}
    assert await codes(svc, 3, "d", unmatched) == [OK, OK, OVER]
    # On an unknown domain, an override is ignored.
    unknown = await svc.call("nope", {"entries": [("k", "ov")], "limit": (1, HOUR)})
    assert unknown.overall_code == OK
    assert not unknown.statuses[0].HasField("current_limit")
    samples = await metric_samples(svc)
    assert rule_counter(samples, "total_hits", "d.nothing_here.deeper_x") == 3


@BOTH_MODES
async def test_override_with_another_unit_does_not_reset_the_rule_counter(
    start: Starter, mode: Mode
) -> None:
    """The configured rule (2/minute) and an override on the same entries with another
    unit are different counters; interleaving them must not refill the rule."""
    svc = await start(mode)
    override = {"entries": [("two", "i")], "limit": (100, HOUR)}
    rule_codes = []
    for _ in range(4):
        rule_codes.append((await svc.call("d", [("two", "i")])).overall_code)
        assert (await svc.call("d", override)).overall_code == OK
    assert rule_codes == [OK, OK, OVER, OVER]
    status = (await svc.call("d", override)).statuses[0]
    assert status.limit_remaining == 95  # the override's own counter: 5 hits


# -- modes mixed in one request ------------------------------------------------------------------


async def test_mixed_exact_and_probabilistic_rules(start: Starter) -> None:
    svc = await start(Mode.PROBABILISTIC, rules=MIXED_RULES)
    # exact 3 + probabilistic 5: the exact rule denies the 4th request...
    results = [await svc.call("m", [("e3", "x")], [("p5", "x")]) for _ in range(4)]
    assert [r.overall_code for r in results] == [OK, OK, OK, OVER]
    assert [r.statuses[1].limit_remaining for r in results[:3]] == [4, 3, 2]
    # ... and the probabilistic hit of that denied request was given back.
    alone = await svc.call("m", [("p5", "x")])
    assert (alone.overall_code, alone.statuses[0].limit_remaining) == (OK, 1)

    # probabilistic 2 + exact 5: the probabilistic rule denies the 3rd request...
    results = [await svc.call("m", [("p2", "y")], [("e5", "y")]) for _ in range(3)]
    assert [r.overall_code for r in results] == [OK, OK, OVER]
    # ... which consumed nothing in the exact window.
    alone = await svc.call("m", [("e5", "y")])
    assert (alone.overall_code, alone.statuses[0].limit_remaining) == (OK, 2)


async def test_quota_over_across_modes_denies_without_consuming(start: Starter) -> None:
    svc = await start(Mode.PROBABILISTIC, rules=MIXED_RULES)
    # The only quota descriptor is probabilistic: once it is over, the request is denied,
    # and the exact descriptor of the denied request must not be consumed.
    assert await codes(svc, 2, "m", [("e3", "q")], [("pq", "q")]) == [OK, OVER]
    alone = await svc.call("m", [("e3", "q")])
    assert (alone.overall_code, alone.statuses[0].limit_remaining) == (OK, 1)


async def test_quota_met_across_modes_admits_and_consumes(start: Starter) -> None:
    svc = await start(Mode.PROBABILISTIC, rules=MIXED_RULES)
    # exact quota (1) over, probabilistic quota (100) not: admitted, so e3 consumes.
    results = [
        await svc.call("m", [("e3", "a")], [("eq", "a")], [("pq100", "a")]) for _ in range(4)
    ]
    assert [r.overall_code for r in results] == [OK, OK, OK, OVER]
    assert [r.statuses[0].limit_remaining for r in results[:3]] == [2, 1, 0]
    assert [r.statuses[1].code for r in results] == [OK, OVER, OVER, OVER]


# -- malformed requests --------------------------------------------------------------------------

MALFORMED = {
    "empty domain": (make_request("", [("k", "x")]), "domain"),
    "no descriptors": (make_request("d"), "descriptor"),
    "descriptor without entries": (make_request("d", [("k", "x")], []), "entries"),
    "empty key": (make_request("d", [("k", "x"), ("", "v")]), "empty key"),
    "1000 descriptors": (make_request("d", *[[("k", str(i))] for i in range(1000)]), "64"),
    "10 kB value": (make_request("d", [("k", "v" * 10_240)]), "1024"),
    "10 kB key": (make_request("d", [("k" * 10_240, "v")]), "1024"),
    "10 kB domain": (make_request("d" * 10_240, [("k", "v")]), "1024"),
    "33 entries": (make_request("d", [(f"k{i}", "v") for i in range(33)]), "32"),
    "override unit UNKNOWN": (
        make_request("d", {"entries": [("k", "x")], "limit": (5, 0)}),
        "unit",
    ),
    "hits_addend 2**40": (
        make_request("d", {"entries": [("k", "x")], "hits": 2**40}),
        "hits_addend",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
async def test_malformed_request_is_invalid_argument(start: Starter, case: str) -> None:
    request, hint = MALFORMED[case]
    svc = await start(Mode.EXACT)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await svc.stub.ShouldRateLimit(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert hint in (caught.value.details() or "")
    # The service keeps serving, and the bad request consumed nothing.
    response = await svc.call("d", [("k", "x")])
    assert (response.overall_code, response.statuses[0].limit_remaining) == (OK, 2)
    samples = await metric_samples(svc)
    assert (
        samples[("ratelimit_service_call_should_rate_limit_service_error_total", frozenset())] == 1
    )


# -- health, reflection, shutdown ------------------------------------------------------------


async def test_health_check_serving(start: Starter) -> None:
    svc = await start()
    stub = health_pb2_grpc.HealthStub(svc.channel)
    for name in ("", RLS, "ratelimit"):
        reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_reflection_lists_and_describes_the_service(start: Starter) -> None:
    svc = await start()
    stub = reflection_pb2_grpc.ServerReflectionStub(svc.channel)

    async def requests() -> Any:
        yield reflection_pb2.ServerReflectionRequest(list_services="")
        yield reflection_pb2.ServerReflectionRequest(file_containing_symbol=RLS)

    replies = [reply async for reply in stub.ServerReflectionInfo(requests())]
    assert len(replies) == 2
    names = {service.name for service in replies[0].list_services_response.service}
    assert {RLS, "grpc.health.v1.Health"} <= names
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in replies[1].file_descriptor_response.file_descriptor_proto
    ]
    rls_file = next(f for f in files if f.name == "envoy/service/ratelimit/v3/rls.proto")
    assert [s.name for s in rls_file.service] == ["RateLimitService"]
    assert [m.name for m in rls_file.service[0].method] == ["ShouldRateLimit"]


async def test_stop_turns_health_not_serving_then_refuses_calls(start: Starter) -> None:
    svc = await start()
    stub = health_pb2_grpc.HealthStub(svc.channel)
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=RLS))
    first = await asyncio.wait_for(watch.read(), 5)
    assert first.status == health_pb2.HealthCheckResponse.SERVING
    stopping = asyncio.create_task(svc.service.stop())
    second = await asyncio.wait_for(watch.read(), 5)
    assert second.status == health_pb2.HealthCheckResponse.NOT_SERVING
    await asyncio.wait_for(stopping, 10)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await svc.call("d", [("k", "x")])
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_burst_in_flight_at_stop_is_answered_or_refused_never_hangs(
    start: Starter,
) -> None:
    svc = await start(Mode.EXACT)
    assert (await svc.call("d", [("big", "s")])).overall_code == OK  # connection is up
    calls = [asyncio.ensure_future(svc.call("d", [("big", "s")])) for _ in range(50)]
    await asyncio.sleep(0)  # the calls are on their way
    stopping = asyncio.create_task(svc.service.stop())
    results = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
    await asyncio.wait_for(stopping, 10)
    answered = [r for r in results if isinstance(r, rls_pb2.RateLimitResponse)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(answered) + len(refused) == 50
    # Answers are real decisions: 1 + len(answered) hits of a 100/hour limit.
    assert sorted(r.statuses[0].limit_remaining for r in answered) == list(
        range(99 - len(answered), 99)
    )
    # Calls the stopping server did not take are refused (gRPC core cancels calls that
    # reached it but were not yet dispatched), never answered wrongly or left hanging.
    assert {r.code() for r in refused} <= {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}


# -- probabilistic staleness ---------------------------------------------------------------------


async def test_sync_interval_longer_than_stale_after_does_not_fail_open(
    start_service: Starter, write_config: Callable[..., Path]
) -> None:
    """A sync interval of 5 s is legal; the rules must keep limiting between syncs rather
    than fall back to failure_mode (open: admit all) once stale_after (here 0.2 s) has
    passed."""
    config = write_config(RULES)
    try:
        svc = await start_service(
            config, mode=Mode.PROBABILISTIC, sync_interval=5.0, stale_after=0.2
        )
    except ValueError:
        return  # refusing the combination is a fine answer too
    assert await codes(svc, 3, "d", [("two", "s")]) == [OK, OK, OVER]
    await asyncio.sleep(0.3)  # the subject: stale_after passes on the service's real clock
    assert await codes(svc, 3, "d", [("two", "s")]) == [OVER] * 3


async def test_request_larger_than_the_byte_bound_is_refused(write_config, start_service) -> None:
    import grpc

    config = write_config("domain: d\ndescriptors:\n  - key: k\n")
    svc = await start_service(config, max_request_bytes=2048)
    big = [("k", "v" * 1000), ("k2", "v" * 1000), ("k3", "v" * 1000)]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await svc.call("d", big)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (await svc.call("d", [("k", "v")])).overall_code == OK  # still serving
