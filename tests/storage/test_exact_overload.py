"""Overload is explicit: past --exact-max-pending requests waiting for Redis, an exact
request is refused with RESOURCE_EXHAUSTED (the client's own failure policy decides),
or denied where a failure_mode: closed rule would deny it anyway; never admitted
unchecked. A real service on a real redis-server, held still with SIGSTOP so that
requests pile up."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest

from ratelimit_harness.fixtures import make_request
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.core.config_model import Mode

pytestmark = pytest.mark.serial  # timing: run alone, after the parallel part

RULES = """\
domain: over
descriptors:
  - key: open
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: closed
    mode: exact
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 100}
  - key: local
    mode: probabilistic
    rate_limit: {unit: minute, requests_per_unit: 100}
"""
OVER = 2


def metrics(service) -> str:
    with urllib.request.urlopen(service.admin_url + "/metrics", timeout=5) as response:
        return response.read().decode()


async def test_requests_past_the_bound_are_refused_or_denied_never_admitted(
    start_service, write_config, redis_server
) -> None:
    service = await start_service(
        write_config(RULES),
        redis_url=redis_server.url,
        redis_timeout=2.0,
        exact_max_pending=2,
        mode=Mode.EXACT,
    )
    stub = service.stub
    assert (await stub.ShouldRateLimit(make_request("over", [("open", "a")]))).overall_code == 1
    redis_server.pause()
    try:
        stuck = [
            asyncio.ensure_future(stub.ShouldRateLimit(make_request("over", [("open", "a")])))
            for _ in range(2)
        ]
        store = service.service.store
        await eventually_async(  # both wait for the frozen Redis: the bound is reached
            lambda: store.metrics().figures["exact_pending"] >= 2, timeout=5, what="two pending"
        )
        assert not any(call.done() for call in stuck)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.ShouldRateLimit(make_request("over", [("open", "b")]), timeout=1)
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "not decided: over.open" in (refused.value.details() or "")
        # A closed rule denies without the store, as it would on a failure.
        denied = await stub.ShouldRateLimit(make_request("over", [("closed", "c")]), timeout=1)
        assert denied.overall_code == OVER
        # A request also carrying a probabilistic descriptor gives its hit back.
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.ShouldRateLimit(
                make_request("over", [("local", "l")], [("open", "d")]), timeout=1
            )
        (bucket,) = service.service.local.buckets()
        assert (bucket.offered, bucket.admitted) == (1, 0)
    finally:
        redis_server.resume()
    answered = await asyncio.gather(*stuck)
    assert [r.overall_code for r in answered] == [1, 1]  # decided by Redis once it woke
    text = await asyncio.to_thread(metrics, service)  # the admin server shares this loop
    assert "ratelimit_service_call_should_rate_limit_store_overloaded_total 3.0" in text
    assert 'ratelimit_service_rate_limit_overloaded_total{key="over.open"} 2.0' in text
    assert 'ratelimit_service_rate_limit_overloaded_total{key="over.closed"} 1.0' in text
    assert 'ratelimit_store{name="exact_overloaded",store="redis"} 3.0' in text
    assert 'ratelimit_service_rate_limit_failure_mode_allowed_total{key="over.open"} 0.0' in text
