"""The service started exactly as Envoy Gateway's default deployment starts envoyproxy/ratelimit:
`/bin/ratelimit` (our `ratelimit` script) with its environment, rules from an ADS server over
mTLS, a real redis-server at REDIS_URL=host:port, gRPC served over mTLS, probes on
/healthcheck; then a rule change pushed by xDS applied."""

from __future__ import annotations

import asyncio
import socket
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from ratelimit_harness.certs import CertPair, make_ca, make_cert
from ratelimit_harness.fixtures import make_request, ratelimit_command
from ratelimit_harness.redis import RedisServer, free_port
from ratelimit_harness.waiting import eventually_async
from ratelimit_harness.xds import AdsServer, domain, limit
from ratelimit_service.config import rls_conf_pb2 as rls

pytestmark = pytest.mark.slow  # starts processes

GO_PORTS = {"PORT": 8080, "GRPC_PORT": 8081, "DEBUG_PORT": 6070}
"""The Go service's default ports, which Envoy Gateway's deployment relies on."""


def _free_on_every_interface(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def _ports() -> dict[str, str]:
    """Nothing when 8080, 8081 and 6070 are free (the deployment's exact environment);
    else free ports, so that a busy machine cannot fail the test for a reason of its own."""
    if all(_free_on_every_interface(port) for port in GO_PORTS.values()):
        return {}
    return {name: str(free_port()) for name in GO_PORTS}


def _envoy_gateway_env(
    certs: dict[str, CertPair], ads_port: int, redis_port: int, data: Path
) -> dict[str, str]:
    """Envoy Gateway's environment for the rate-limit container (reference notes §10),
    its file paths pointed at this test's certificates."""
    service = certs["ratelimit"]
    ca = str(certs["ca"].cert)
    return {
        "RUNTIME_ROOT": str(data),
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "RUNTIME_IGNOREDOTFILES": "true",
        "RUNTIME_WATCH_ROOT": "false",
        "LOG_LEVEL": "info",
        "USE_STATSD": "false",
        "CONFIG_TYPE": "GRPC_XDS_SOTW",
        "CONFIG_GRPC_XDS_SERVER_URL": f"localhost:{ads_port}",
        "CONFIG_GRPC_XDS_NODE_ID": "envoy-ratelimit",
        "FORCE_START_WITHOUT_INITIAL_CONFIG": "true",
        "GRPC_SERVER_USE_TLS": "true",
        "GRPC_SERVER_TLS_CERT": str(service.cert),
        "GRPC_SERVER_TLS_KEY": str(service.key),
        "GRPC_SERVER_TLS_CA_CERT": ca,
        "CONFIG_GRPC_XDS_SERVER_USE_TLS": "true",
        "CONFIG_GRPC_XDS_CLIENT_TLS_CERT": str(service.cert),
        "CONFIG_GRPC_XDS_CLIENT_TLS_KEY": str(service.key),
        "CONFIG_GRPC_XDS_SERVER_TLS_CACERT": ca,
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": f"127.0.0.1:{redis_port}",
    }


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertPair]:
    directory = tmp_path_factory.mktemp("eg-certs")
    ca = make_ca(directory)
    return {
        "ca": ca,
        # One certificate for the service, used both ways: gRPC server and xDS client.
        "ratelimit": make_cert(directory, ca, "ratelimit", client=True, server=True),
        "gateway": make_cert(directory, ca, "envoy-gateway"),
        "envoy": make_cert(directory, ca, "envoy", client=True),
    }


def _healthcheck(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthcheck", timeout=2) as page:
            return int(page.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _codes(
    port: int, certs: dict[str, CertPair] | None, times: int, key: str = "user"
) -> list[int]:
    """Decisions over mTLS, as Envoy Gateway's Envoys ask for them (``certs`` None:
    plain gRPC)."""
    if certs is None:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    else:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=certs["ca"].cert.read_bytes(),
            private_key=certs["envoy"].key.read_bytes(),
            certificate_chain=certs["envoy"].cert.read_bytes(),
        )
        channel = grpc.secure_channel(f"localhost:{port}", credentials)
    with channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        request = make_request("gateway", [(key, "alice")])
        return [stub.ShouldRateLimit(request, timeout=5).overall_code for _ in range(times)]


def _refused_without_a_client_certificate(port: int, certs: dict[str, CertPair]) -> bool:
    credentials = grpc.ssl_channel_credentials(root_certificates=certs["ca"].cert.read_bytes())
    with grpc.secure_channel(f"localhost:{port}", credentials) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        try:
            stub.ShouldRateLimit(make_request("gateway", [("user", "x")]), timeout=3)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


async def _until(check: Callable[[], bool], timeout: float, what: str, log: Path) -> None:
    await eventually_async(
        lambda: asyncio.to_thread(check), timeout=timeout, what=what, context=log.read_text
    )


async def test_envoy_gateways_deployment_runs_and_takes_rules_by_xds(
    tmp_path: Path, certs: dict[str, CertPair], redis_server: RedisServer
) -> None:
    gateway = certs["gateway"]
    server_credentials = grpc.ssl_server_credentials(
        [(gateway.key.read_bytes(), gateway.cert.read_bytes())],
        root_certificates=certs["ca"].cert.read_bytes(),
        require_client_auth=True,
    )
    ads = await AdsServer(server_credentials).start()
    ads.push("v1", [domain("gateway", limit("user", 3))])
    ports = _ports()
    env = {
        **_envoy_gateway_env(certs, ads.port, redis_server.port, tmp_path / "data"),
        **ports,
    }
    http_port, grpc_port = int(ports.get("PORT", 8080)), int(ports.get("GRPC_PORT", 8081))
    log = tmp_path / "ratelimit.log"
    try:
        with ratelimit_command(env, log):
            await _until(lambda: _healthcheck(http_port) == 200, 20, "/healthcheck 200", log)
            first = await ads.request()
            assert first.node.id == "envoy-ratelimit"
            assert first.type_url.endswith("ratelimit.config.ratelimit.v3.RateLimitConfig")
            await _until(lambda: _codes(grpc_port, certs, 1, "probe") == [1], 10, "rules", log)
            # The deployment's own rule, decided over mTLS: 3 a minute.
            assert await asyncio.to_thread(_codes, grpc_port, certs, 5) == [1, 1, 1, 2, 2]
            assert await asyncio.to_thread(_refused_without_a_client_certificate, grpc_port, certs)
            await _until(
                lambda: bool(redis.Redis(port=redis_server.port).keys("*")), 5, "Redis keys", log
            )
            # A rule change pushed by xDS: the limit is now 10 a minute, under a new key.
            ads.push("v2", [domain("gateway", limit("team", 10))])
            ack = await _ack(ads, "v2")
            assert ack.error_detail.code == 0
            assert await asyncio.to_thread(_codes, grpc_port, certs, 11, "team") == [1] * 10 + [2]
            assert await asyncio.to_thread(_codes, grpc_port, certs, 4, "user") == [1] * 4
            # A change that does not load is NACKed; the running rules stay.
            bad = rls.RateLimitDescriptor(key="team", rate_limit=rls.RateLimitPolicy(unit=0))
            ads.push("v3", [domain("gateway", bad)])
            nack = await _ack(ads, "v2")
            assert "invalid rate limit unit" in nack.error_detail.message
            assert await asyncio.to_thread(_codes, grpc_port, certs, 1, "team") == [2]
    finally:
        await ads.stop()
    output = log.read_text()
    assert "Traceback" not in output, output


async def _ack(ads: AdsServer, version: str) -> Any:
    """The next request the service sends that names ``version`` and a nonce."""
    for _ in range(10):
        request = await ads.request()
        if request.response_nonce and request.version_info == version:
            return request
    pytest.fail(f"no ACK/NACK naming {version}")


async def test_without_force_start_the_service_listens_once_xds_sent_rules(
    tmp_path: Path,
) -> None:
    """FORCE_START_WITHOUT_INITIAL_CONFIG=false (the Go default): nothing listens until
    the xDS server has sent rules that load; then the rules are served at once."""
    ads = await AdsServer().start()
    ports = {name: str(free_port()) for name in GO_PORTS}
    env = {
        "CONFIG_TYPE": "GRPC_XDS_SOTW",
        "CONFIG_GRPC_XDS_SERVER_URL": f"127.0.0.1:{ads.port}",
        "USE_STATSD": "false",
        "HOST": "127.0.0.1",
        "DEBUG_HOST": "127.0.0.1",
        **ports,
    }
    log = tmp_path / "ratelimit.log"
    http_port = int(ports["PORT"])
    try:
        with ratelimit_command(env, log):
            first = await ads.request()  # the service asked for rules...
            assert first.node.id == "default"
            await asyncio.sleep(1.0)  # an absence (not healthy without rules): nothing to await
            assert await asyncio.to_thread(_healthcheck, http_port) == 0  # ...and waits
            ads.push("v1", [domain("gateway", limit("user", 2))])
            await _until(lambda: _healthcheck(http_port) == 200, 10, "/healthcheck 200", log)
            codes = await asyncio.to_thread(_codes, int(ports["GRPC_PORT"]), None, 3)
            assert codes == [1, 1, 2]
    finally:
        await ads.stop()
    assert "waiting for the first rules from xDS server" in log.read_text()
