"""A usage budget through a real Envoy 1.40, configured the two-phase way Envoy Gateway's
``cost.request``/``cost.response`` and Envoy AI Gateway's token limits configure it: the
ratelimit filter's own ``rate_limits`` hold a check (``hits_addend {number: 0}``) sent
before the request, and a report (``hits_addend {format: "%RESP(x-tokens)%"}``,
``apply_on_stream_done``) sent once the response is done, whose answer Envoy ignores.

Budget 6,000 tokens a minute, responses of 700: 20 sequential requests admit exactly 9
(⌈6000/700⌉), as envoyproxy/ratelimit does; the 9th report (700 with 400 left) is
counted though it does not fit, so the 10th check is denied. In exact mode on Redis
(one replica and two), on the embedded store, in probabilistic mode (one replica and
two), and started the Go way (``ratelimit`` with a Go deployment's environment, with and
without STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT). A report lands after its
response: before the next request the test waits until the service has counted it (its
rule's total_hits), so no request races its predecessor's report.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml

from ratelimit_harness.envoy import Address, Envoy, ServiceProcess, Upstream
from ratelimit_harness.envoy_fixtures import REPO, patient, undecided_calls
from ratelimit_harness.fixtures import ratelimit_command
from ratelimit_harness.redis import RedisServer, free_port
from ratelimit_harness.waiting import eventually

pytestmark = pytest.mark.slow

BUDGET, COST, REQUESTS = 6000, 700, 20
TOTAL_HITS = 'ratelimit_service_rate_limit_total_hits_total{key="ai.tenant"}'
SYNC_ROUNDS = "ratelimit_sync_rounds_total"

RULES = """\
domain: ai
descriptors:
  - key: tenant
    mode: {mode}
    rate_limit: {{unit: {unit}, requests_per_unit: {budget}}}
"""


def tenant_action() -> dict[str, Any]:
    return {"request_headers": {"header_name": "x-tenant", "descriptor_key": "tenant"}}


def two_phase_bootstrap(services: list[Address], upstream: Upstream) -> dict[str, Any]:
    """Envoy on loopback: one listener, the ratelimit filter with the two-phase
    ``rate_limits`` on the filter itself (route-level rate_limits ignore hits_addend and
    apply_on_stream_done in Envoy 1.40), a generous timeout so that Envoy's failure
    mode never stands in for the service's answer."""
    ratelimit_filter = {
        "name": "envoy.filters.http.ratelimit",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
            "domain": "ai",
            "timeout": "5s",
            "failure_mode_deny": False,
            "rate_limit_service": {
                "grpc_service": {"envoy_grpc": {"cluster_name": "ratelimit"}},
                "transport_api_version": "V3",
            },
            "rate_limits": [
                {"actions": [tenant_action()], "hits_addend": {"number": 0}},
                {
                    "actions": [tenant_action()],
                    "hits_addend": {"format": "%RESP(x-tokens)%"},
                    "apply_on_stream_done": True,
                },
            ],
        },
    }
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "edge",
        "http_filters": [ratelimit_filter, router],
        "route_config": {
            "name": "edge",
            "virtual_hosts": [
                {
                    "name": "edge",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "upstream"}}],
                }
            ],
        },
    }
    return {
        "admin": {"address": socket("127.0.0.1", 0)},
        "static_resources": {
            "listeners": [
                {
                    "name": "edge",
                    "address": socket("127.0.0.1", 0),
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                cluster("ratelimit", services, http2=True),
                cluster("upstream", [("127.0.0.1", upstream.port)]),
            ],
        },
    }


def socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def cluster(name: str, addresses: list[Address], http2: bool = False) -> dict[str, Any]:
    found: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {"endpoint": {"address": socket(host, port)}} for host, port in addresses
                    ]
                }
            ],
        },
    }
    if http2:
        options = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        found["typed_extension_protocol_options"] = {
            options: {
                "@type": f"type.googleapis.com/{options}",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return found


@pytest.fixture
def costly_upstream() -> Iterator[Upstream]:
    """An upstream whose every response costs COST tokens (its x-tokens header)."""
    server = Upstream({"x-tokens": str(COST)}).start()
    yield server
    server.stop()


def sample(url: str, wanted: str) -> float:
    """One sample of a replica's /metrics (0 when absent)."""
    with urllib.request.urlopen(url, timeout=5) as page:
        for line in page.read().decode().splitlines():
            name, _, value = line.rpartition(" ")
            if name == wanted:
                return float(value)
    return 0.0


def reported(*metrics_urls: str, total: str = TOTAL_HITS) -> float:
    """The hits the service replicas were told of for the budget's rule (``total``, its
    total_hits: checks add 0, each report its cost, counted or not)."""
    return sum(sample(url, total) for url in metrics_urls)


def synced_twice(*metrics_urls: str) -> None:
    """Wait until every replica has started two more sync rounds (the count goes up
    as a round starts): the round that took the counts there is done."""
    rounds = [sample(url, SYNC_ROUNDS) for url in metrics_urls]
    eventually(
        lambda: all(
            sample(url, SYNC_ROUNDS) >= before + 2
            for url, before in zip(metrics_urls, rounds, strict=True)
        ),
        timeout=20,
        what="two sync rounds on every replica",
    )


def metrics_url(service: ServiceProcess) -> str:
    return f"http://127.0.0.1:{service.admin_port}/metrics"


def spend(
    envoy: Envoy, *metrics_urls: str, synced: bool = False, total: str = TOTAL_HITS
) -> list[int]:
    """REQUESTS sequential requests of one tenant; after each one admitted, wait until
    the service has its report (a condition, not a sleep), and with ``synced``
    (probabilistic mode) until the fleet has it: the replica that counted it has synced
    it, and then every replica has synced its view. No check races the report of the
    request before it."""
    statuses = []
    for _ in range(REQUESTS):
        status = envoy.request("/v1/chat", {"x-tenant": "acme"}).status
        statuses.append(status)
        if status == 200:
            spent = COST * statuses.count(200)
            eventually(
                lambda spent=spent: reported(*metrics_urls, total=total) >= spent,  # type: ignore[misc]
                timeout=20,
                what=f"the report of request {len(statuses)} received",
                context=lambda: envoy.log(40),
            )
            if synced:
                synced_twice(*metrics_urls)  # pushed to the fleet's bucket
                synced_twice(*metrics_urls)  # and read back by every replica
    return statuses


def assert_the_service_answered(envoy: Envoy, denied: int) -> None:
    """Every check got the service's own answer: none fell to Envoy's failure mode."""
    stats = envoy.stats()
    assert stats.get("cluster.upstream.ratelimit.error", 0) == 0
    assert stats.get("cluster.upstream.ratelimit.failure_mode_allowed", 0) == 0
    assert stats.get("cluster.upstream.ratelimit.over_limit", 0) == denied


StartEnvoy = Callable[..., Envoy]
SpawnService = Callable[..., ServiceProcess]


@pytest.mark.parametrize(
    ("mode", "store", "replicas"),
    [
        ("exact", "redis", 1),
        ("exact", "redis", 2),
        ("exact", "embedded", 1),
        ("probabilistic", "redis", 1),
        ("probabilistic", "redis", 2),
    ],
    ids=[
        "exact",
        "exact-2-replicas",
        "exact-embedded",
        "probabilistic",
        "probabilistic-2-replicas",
    ],
)
def test_a_token_budget_admits_until_it_is_spent(
    start_envoy: StartEnvoy,
    spawn_service: SpawnService,
    costly_upstream: Upstream,
    redis_server: RedisServer,
    tmp_path: Path,
    mode: str,
    store: str,
    replicas: int,
) -> None:
    # Probabilistic buckets refill continuously (limit/T): a budget per hour keeps the
    # refill over the test's few seconds below one request's cost.
    unit = "minute" if mode == "exact" else "hour"
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "ai.yaml").write_text(RULES.format(mode=mode, unit=unit, budget=BUDGET))
    flags = ["--redis-url", redis_server.url] if store == "redis" else []
    services = [spawn_service(rules, *flags, "--sync-interval", "0.1") for _ in range(replicas)]
    envoy = start_envoy(two_phase_bootstrap([s.address for s in services], costly_upstream))
    urls = [metrics_url(service) for service in services]
    statuses = spend(envoy, *urls, synced=mode == "probabilistic")
    admitted = statuses.count(200)
    assert statuses == [200] * admitted + [429] * (REQUESTS - admitted), statuses
    # Probabilistic replicas decide a check on their view of the fleet's bucket, synced
    # when they last saw the bucket: one whose view predates the 9th report admits one
    # more (a report settling late), then syncs and denies.
    late = 1 if mode == "probabilistic" and replicas > 1 else 0
    assert 9 <= admitted <= 9 + late, statuses
    assert_the_service_answered(envoy, denied=REQUESTS - admitted)


@pytest.mark.parametrize(
    ("stop_increment", "admitted"),
    [(None, 9), ("true", REQUESTS)],
    ids=["go-default", "stop-cache-key-increment"],
)
def test_a_token_budget_started_the_go_way(
    start_envoy: StartEnvoy,
    costly_upstream: Upstream,
    redis_server: RedisServer,
    tmp_path: Path,
    stop_increment: str | None,
    admitted: int,
) -> None:
    """``ratelimit`` with a Go deployment's environment: by default the over report is
    counted (9 admitted, as the Go service admits); with
    STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT=true a denied call counts nothing, costs
    included, so the 9th report is lost and every later check passes (as in Go)."""
    rules = tmp_path / "data" / "ratelimit" / "config"
    rules.mkdir(parents=True)
    (rules / "ai.yaml").write_text(RULES.format(mode="exact", unit="minute", budget=BUDGET))
    grpc_port, debug_port = free_port(), free_port()
    env = {
        "HOST": "127.0.0.1",
        "PORT": str(free_port()),
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": str(grpc_port),
        "DEBUG_HOST": "127.0.0.1",
        "DEBUG_PORT": str(debug_port),
        "RUNTIME_ROOT": str(tmp_path / "data"),
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "USE_STATSD": "false",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": f"127.0.0.1:{redis_server.port}",
    }
    if stop_increment is not None:
        env["STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT"] = stop_increment
    metrics = f"http://127.0.0.1:{debug_port}/metrics"
    log = tmp_path / "ratelimit.log"
    with ratelimit_command(env, log) as process:

        def answering() -> bool:
            if process.poll() is not None:
                pytest.fail(f"ratelimit exited {process.returncode}:\n{log.read_text()}")
            return reported(metrics) >= 0

        eventually(answering, what="ratelimit's debug port", context=log.read_text)
        envoy = start_envoy(two_phase_bootstrap([("127.0.0.1", grpc_port)], costly_upstream))
        statuses = spend(envoy, metrics)
    assert statuses == [200] * admitted + [429] * (REQUESTS - admitted)
    assert_the_service_answered(envoy, denied=REQUESTS - admitted)


EXAMPLE = REPO / "config" / "token-budget.yaml.example"


def test_the_token_budget_example_through_the_bootstrap_envoy_config_writes(
    start_envoy: StartEnvoy,
    spawn_service: SpawnService,
    costly_upstream: Upstream,
    redis_server: RedisServer,
) -> None:
    """config/token-budget.yaml.example served as it is, and the Envoy bootstrap
    ``envoy-config --bootstrap`` writes for it (its usage rule sent in the two-phase
    form, from the route's RateLimitPerRoute): 9 of 20 requests of 700 tokens on 6,000 a
    minute, and the denials carry the rule's JSON body."""
    service = spawn_service(EXAMPLE, "--redis-url", redis_server.url)
    generated = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "envoy-config", "--config", str(EXAMPLE),
         "--bootstrap", "--listen", "127.0.0.1:0", "--admin-address", "127.0.0.1:0",
         "--service-address", f"127.0.0.1:{service.grpc_port}",
         "--upstream-address", f"127.0.0.1:{costly_upstream.port}"],
        capture_output=True, text=True, timeout=60, check=True, cwd=REPO,
    ).stdout  # fmt: skip
    envoy = start_envoy(patient(yaml.safe_load(generated)))
    per_minute = 'ratelimit_service_rate_limit_total_hits_total{key="ai.tenant.tokens_per_minute"}'
    statuses = spend(envoy, metrics_url(service), total=per_minute)
    assert statuses == [200] * 9 + [429] * 11, statuses
    denied = envoy.request("/v1/chat", {"x-tenant": "acme"})
    assert denied.status == 429
    assert denied.headers["content-type"] == "application/json"
    assert json.loads(denied.body)["error"]["code"] == "token_budget"
    assert undecided_calls(envoy) == 0


def test_concurrent_streams_overshoot_by_at_most_one_response_each(
    start_envoy: StartEnvoy,
    spawn_service: SpawnService,
    costly_upstream: Upstream,
    redis_server: RedisServer,
    tmp_path: Path,
) -> None:
    """Four streams of one tenant at once, each sending until denied, none waiting for
    its reports: a check passes while the window has room, so each stream can have one
    response in flight when the budget runs out. Admitted: at least ⌈B/c⌉ and at most
    one response more per stream (⌈B/c⌉ + 3 measured, docs/configuration.md; + 4 allows
    for a stream's own report settling after its next check); afterwards the window
    holds every report."""
    streams = 4
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "ai.yaml").write_text(RULES.format(mode="exact", unit="minute", budget=BUDGET))
    service = spawn_service(rules, "--redis-url", redis_server.url)
    envoy = start_envoy(two_phase_bootstrap([service.address], costly_upstream))

    def stream() -> int:
        admitted = 0
        while envoy.request("/v1/chat", {"x-tenant": "acme"}).status == 200:
            admitted += 1
        return admitted

    with ThreadPoolExecutor(streams) as pool:
        admitted = sum(pool.map(lambda _: stream(), range(streams)))
    assert 9 <= admitted <= 9 + streams, admitted
    # Every admitted response was charged: the reports reach the service in full.
    eventually(
        lambda: reported(metrics_url(service)) >= COST * admitted,
        timeout=20,
        what="every report received",
    )
    assert reported(metrics_url(service)) == COST * admitted
    assert_the_service_answered(envoy, denied=streams)
