"""RLQS through a real Envoy 1.40: the generator's bootstrap (envoy-config --rlqs
--bootstrap), a real service process, Envoy enforcing the token buckets the service
assigns. Envoy reports every 5 s (hard-coded in 1.40) and at once for a new bucket."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ratelimit_harness.envoy import Envoy, ServiceProcess, Upstream, validate
from ratelimit_harness.envoy_fixtures import rlqs_bootstrap, scrape

RULES = """\
domain: quota
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 4}
  - key: tenant
    value: blocked
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: tenant
    value: bursty
    rate_limit: {unit: second, requests_per_unit: 8, burst: 2}
  - key: path
    value: /healthz
    rate_limit: {unlimited: true}
"""


def rules(tmp_path: Path) -> Path:
    directory = tmp_path / "rules"
    directory.mkdir()
    (directory / "quota.yaml").write_text(RULES)
    return directory


def bootstrap(config: Path, service: ServiceProcess, upstream: Upstream, node: str) -> Any:
    return rlqs_bootstrap(config, service, upstream.port, node)


def codes(envoy: Envoy, tenant: str, count: int) -> list[int]:
    return [envoy.request("/api/x", {"x-tenant": tenant}).status for _ in range(count)]


def assigned(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
    tmp_path: Path,
) -> tuple[ServiceProcess, Envoy]:
    """A service, an Envoy on the generated bootstrap, and its first assignment for
    tenant acme: the first request makes the bucket (allowed: no assignment yet), and
    Envoy reports it at once."""
    config = rules(tmp_path)
    service = spawn_service(config)
    envoy = start_envoy(bootstrap(config, service, upstream, "envoy-a"))
    assert codes(envoy, "acme", 1) == [200]
    envoy.wait_for("the first assignment", lambda: 429 in codes(envoy, "acme", 6), timeout=10)
    return service, envoy


def test_the_generated_rlqs_bootstrap_validates(
    envoy_binary: str, spawn_service: Callable[..., ServiceProcess], upstream: Upstream,
    tmp_path: Path,
) -> None:  # fmt: skip
    config = rules(tmp_path)
    path = tmp_path / "rlqs.yaml"
    service = spawn_service(config)
    path.write_text(yaml.safe_dump(bootstrap(config, service, upstream, "envoy-a")))
    result = validate(envoy_binary, path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_envoy_enforces_the_assigned_token_bucket_and_it_refills(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
    tmp_path: Path,
) -> None:
    service, envoy = assigned(start_envoy, spawn_service, upstream, tmp_path)
    time.sleep(1.1)  # the subject: Envoy's bucket refills on its clock (4 a second, 4 stored)
    assert codes(envoy, "acme", 6) == [200] * 4 + [429] * 2
    denied = envoy.request("/api/x", {"x-tenant": "acme"})
    assert denied.status == 429 and denied.headers.get("x-ratelimit-by") == "rlqs"
    # A rule of 0 denies from the very first request; an unlimited path is never limited.
    assert codes(envoy, "blocked", 3) == [429] * 3
    assert [envoy.request("/healthz").status for _ in range(10)] == [200] * 10
    # The service saw one stream (one Envoy), its reports, and counted Envoy's decisions.
    # Two first reports (acme, blocked), then the periodic one, 5 s after the first.
    envoy.wait_for(
        "a periodic report",
        lambda: scrape(service)["ratelimit_rlqs_reports_total"] >= 3,
        timeout=10,
    )
    metrics = scrape(service)
    assert metrics["ratelimit_rlqs_streams"] == 1.0
    hits = metrics['ratelimit_service_rate_limit_total_hits_total{key="quota.tenant"}']
    denied = metrics['ratelimit_service_rate_limit_over_limit_total{key="quota.tenant"}']
    assert denied >= 3 and hits - denied >= 5


def test_a_burst_below_the_rate_holds_few_tokens_and_refills_at_the_rate(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
    tmp_path: Path,
) -> None:
    """8 a second with a burst of 2: Envoy's bucket holds 2 tokens but refills at 8 a
    second (continuously), so a burst after a pause gets 2, and a steady 6 a second
    all gets through."""
    config = rules(tmp_path)
    service = spawn_service(config)
    envoy = start_envoy(bootstrap(config, service, upstream, "envoy-b"))
    assert codes(envoy, "bursty", 1) == [200]  # no assignment yet
    envoy.wait_for("the assignment", lambda: 429 in codes(envoy, "bursty", 6), timeout=10)
    time.sleep(1.1)  # the subject: Envoy's bucket refills on its clock (a pause, then a burst)
    assert codes(envoy, "bursty", 5) == [200] * 2 + [429] * 3
    time.sleep(0.5)  # refilling again before the steady part
    steady = []
    for _ in range(12):  # 6 a second for 2 s
        time.sleep(1 / 6)  # pacing: the steady rate is the subject
        steady.append(envoy.request("/api/x", {"x-tenant": "bursty"}).status)
    assert steady.count(200) >= 11, steady


SHARED = """\
domain: quota
descriptors:
  - key: tenant
    rate_limit: {unit: second, requests_per_unit: 20}
"""


def offer(envoy: Envoy, rate: float, seconds: float, results: list[int]) -> None:
    """Open-loop-ish: one request every 1/rate seconds on a schedule, for ``seconds``."""
    start = time.monotonic()
    for n in range(int(rate * seconds)):
        delay = start + n / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing: the offered rate is the subject
        results.append(envoy.request("/api/x", {"x-tenant": "shared"}).status)


def test_two_envoys_share_one_limit(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
    tmp_path: Path,
) -> None:
    directory = tmp_path / "shared"
    directory.mkdir()
    (directory / "quota.yaml").write_text(SHARED)
    service = spawn_service(directory)
    envoys = [start_envoy(bootstrap(directory, service, upstream, n)) for n in ("a", "b")]
    results: list[list[int]] = [[], []]
    threads = [
        threading.Thread(target=offer, args=(envoy, 30.0, 20.0, out))
        for envoy, out in zip(envoys, results, strict=True)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    admitted = [out.count(200) for out in results]
    print("admitted per Envoy:", admitted)
    # 1.5x the limit offered to each, 3x in all: the two together admit the limit
    # (20/s over 20 s), within 20 %; each gets a fair part of it.
    assert 320 <= sum(admitted) <= 480, admitted
    assert all(120 <= count <= 280 for count in admitted), admitted
    instances = scrape(service)['ratelimit_rlqs_instances{bucket="quota.tenant=shared/1s"}']
    assert instances == 2.0


def test_assignments_outlive_a_service_restart_and_envoy_reconnects(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
    tmp_path: Path,
) -> None:
    service, envoy = assigned(start_envoy, spawn_service, upstream, tmp_path)
    service.kill()
    # The token bucket Envoy holds still limits while the service is gone (TTL 15 s).
    time.sleep(1.1)  # the subject: Envoy's bucket refills on its own while the service is gone
    assert codes(envoy, "acme", 6) == [200] * 4 + [429] * 2
    service.start()
    # Envoy opens a new stream at its next report (every 5 s) and is answered again.
    envoy.wait_for(
        "Envoy's new stream",
        lambda: scrape(service).get("ratelimit_rlqs_streams") == 1.0,
        timeout=12,
    )
    time.sleep(1.1)  # the subject: Envoy's bucket refills on its clock
    assert codes(envoy, "acme", 6) == [200] * 4 + [429] * 2


PERIOD = """\
domain: quota
descriptors:
  - key: tenant
    rate_limit: {unit: second, unit_multiplier: 10, requests_per_unit: 4}
"""


def test_a_period_of_several_units_through_a_real_envoy(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
    tmp_path: Path,
) -> None:
    """4 per 10 s becomes a token bucket of whole-second fills at that rate: after
    the stored tokens, about one request in 2.5 s passes, where 4 a second would let
    four a second through."""
    directory = tmp_path / "period"
    directory.mkdir()
    (directory / "quota.yaml").write_text(PERIOD)
    service = spawn_service(directory)
    envoy = start_envoy(bootstrap(directory, service, upstream, "envoy-p"))
    assert codes(envoy, "acme", 1) == [200]
    envoy.wait_for("the first assignment", lambda: 429 in codes(envoy, "acme", 6), timeout=10)
    passed = 0
    for _ in range(10):  # two seconds, a request every 0.2 s
        passed += codes(envoy, "acme", 1) == [200]
        time.sleep(0.2)  # pacing: the rate over the period is the subject
    assert passed <= 2  # 4 a second would have passed about 8
