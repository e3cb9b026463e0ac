"""TLS and mTLS on the gRPC listener (with certificate rotation); Redis TLS and ACL auth."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from ratelimit_harness.certs import CertPair, make_ca, make_cert
from ratelimit_harness.redis import free_port
from ratelimit_harness.waiting import eventually
from ratelimit_service.cli.client import build_request
from ratelimit_service.core.exact import ExactHit
from ratelimit_service.storage.base import StoreUnavailable
from ratelimit_service.storage.redis_store import RedisStore

pytestmark = [
    pytest.mark.slow,  # starts processes
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed"),
]

ENGINES = pytest.mark.parametrize("engine", ["grpcio", "native"])
"""TLS as grpcio serves it, and as the native front door does (--grpc-engine native)."""

RULES = (
    "domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: minute, requests_per_unit: 5}\n"
)


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, CertPair]:
    ca = make_ca(tmp_path / "pki", "ca")
    other = make_ca(tmp_path / "pki", "other")
    return {
        "ca": ca,
        "other": other,
        "server": make_cert(tmp_path / "pki", ca, "server"),
        "client": make_cert(tmp_path / "pki", ca, "client", client=True),
        "stranger": make_cert(tmp_path / "pki", other, "stranger", client=True),
        "server2": make_cert(tmp_path / "pki", other, "server2"),
    }


async def call(port: int, ca: Path, client: CertPair | None = None) -> int:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=ca.read_bytes(),
        private_key=client.key.read_bytes() if client else None,
        certificate_chain=client.cert.read_bytes() if client else None,
    )
    async with grpc.aio.secure_channel(f"localhost:{port}", credentials) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        response = await stub.ShouldRateLimit(build_request("d", ["a=1"], 0), timeout=5)
    return int(response.overall_code)


@ENGINES
async def test_tls_listener(write_config, start_service, pki, engine: str) -> None:
    svc = await start_service(
        write_config(RULES),
        tls_cert=str(pki["server"].cert),
        tls_key=str(pki["server"].key),
        grpc_engine=engine,
    )
    port = svc.service.grpc_port
    assert await call(port, pki["ca"].cert) == 1
    with pytest.raises(grpc.aio.AioRpcError):
        await call(port, pki["other"].cert)  # server certificate not trusted
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as plain:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rls_pb2_grpc.RateLimitServiceStub(plain).ShouldRateLimit(
                build_request("d", ["a=1"], 0), timeout=5
            )
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE


@ENGINES
async def test_mtls_requires_a_client_certificate(
    write_config, start_service, pki, engine: str
) -> None:
    svc = await start_service(
        write_config(RULES),
        tls_cert=str(pki["server"].cert),
        tls_key=str(pki["server"].key),
        tls_client_ca=str(pki["ca"].cert),
        grpc_engine=engine,
    )
    port = svc.service.grpc_port
    assert await call(port, pki["ca"].cert, pki["client"]) == 1
    with pytest.raises(grpc.aio.AioRpcError):
        await call(port, pki["ca"].cert)  # no client certificate
    with pytest.raises(grpc.aio.AioRpcError):
        await call(port, pki["ca"].cert, pki["stranger"])  # signed by another CA


@ENGINES
async def test_rotated_certificate_applies_to_new_connections(
    write_config, start_service, pki, tmp_path: Path, engine: str
) -> None:
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(pki["server"].cert, live / "tls.crt")
    shutil.copy(pki["server"].key, live / "tls.key")
    svc = await start_service(
        write_config(RULES),
        tls_cert=str(live / "tls.crt"),
        tls_key=str(live / "tls.key"),
        grpc_engine=engine,
    )
    port = svc.service.grpc_port
    assert await call(port, pki["ca"].cert) == 1
    shutil.copy(pki["server2"].cert, live / "tls.crt.new")
    shutil.copy(pki["server2"].key, live / "tls.key.new")
    for name in ("tls.crt", "tls.key"):  # a distinct mtime, set rather than waited for
        was = (live / name).stat().st_mtime_ns
        os.utime(live / f"{name}.new", ns=(was, was + 1_000_000_000))
    os.replace(live / "tls.key.new", live / "tls.key")
    os.replace(live / "tls.crt.new", live / "tls.crt")
    assert await call(port, pki["other"].cert) == 1  # the new chain is served
    assert svc.service.tls is not None and svc.service.tls.reloads == 1
    with pytest.raises(grpc.aio.AioRpcError):
        await call(port, pki["ca"].cert)


def test_cli_client_over_tls(tmp_path: Path, pki) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text(RULES)
    port, admin = free_port(), free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(config),
         "--grpc-addr", f"127.0.0.1:{port}", "--admin-addr", f"127.0.0.1:{admin}",
         "--tls-cert", str(pki["server"].cert), "--tls-key", str(pki["server"].key)],
    )  # fmt: skip
    try:
        from ratelimit_harness.fleet import wait_healthy

        wait_healthy(admin)
        result = subprocess.run(
            [sys.executable, "-m", "ratelimit_service", "client", "--addr", f"localhost:{port}",
             "--domain", "d", "--descriptor", "a=1", "--tls-ca", str(pki["ca"].cert)],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=10)
    assert result.returncode == 0, result.stderr
    assert "overall: OK" in result.stdout and "limit=5/MINUTE" in result.stdout


def _redis(args: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--save", "", "--appendonly", "no", "--bind", "127.0.0.1",
         *[a.replace("{port}", str(port)) for a in args]],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    eventually(lambda: socket.create_connection(("127.0.0.1", port), 1).close() is None,
               timeout=10, what="redis-server listening")  # fmt: skip
    return process, port


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
async def test_redis_acl_user(tmp_path: Path) -> None:
    process, port = _redis(["--port", "{port}", "--user", "default", "off",
                            "--user", "rls", "on", ">s3cret", "~rl:*", "+@all"])  # fmt: skip
    try:
        good = RedisStore(f"redis://rls:s3cret@127.0.0.1:{port}/0", request_timeout=1)
        assert (await good.hit([ExactHit("k", 2, 60, 1)], True))[0].admitted
        await good.close()
        bad = RedisStore(f"redis://rls:wrong@127.0.0.1:{port}/0", request_timeout=1)
        with pytest.raises(StoreUnavailable):
            await bad.hit([ExactHit("k", 2, 60, 1)], True)
        await bad.close()
    finally:
        process.kill()
        process.wait()


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
async def test_redis_over_tls(pki) -> None:
    server = pki["server"]
    process, port = _redis(["--port", "0", "--tls-port", "{port}",
                            "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
                            "--tls-ca-cert-file", str(pki["ca"].cert),
                            "--tls-auth-clients", "no"])  # fmt: skip
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={pki['ca'].cert}"
        store = RedisStore(url, request_timeout=1)
        assert (await store.hit([ExactHit("k", 2, 60, 1)], True))[0].remaining == 1
        await store.close()
        untrusted = RedisStore(f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={pki['other'].cert}")
        with pytest.raises(StoreUnavailable):
            await untrusted.sync([])
        with pytest.raises(StoreUnavailable):  # the request path's own connection, too
            await untrusted.hit([ExactHit("k", 2, 60, 1)], True)
        assert untrusted.redis.pipe is not None and untrusted.redis.pipe.connects == 0
        await untrusted.close()
    finally:
        process.kill()
        process.wait()


@ENGINES
async def test_rlqs_streams_on_the_mtls_port(write_config, start_service, pki, engine: str) -> None:
    """RLQS shares the RLS listener, so it needs the client certificate too."""
    from envoy.service.rate_limit_quota.v3 import rlqs_pb2, rlqs_pb2_grpc

    svc = await start_service(
        write_config(RULES),
        tls_cert=str(pki["server"].cert),
        tls_key=str(pki["server"].key),
        tls_client_ca=str(pki["ca"].cert),
        grpc_engine=engine,
    )
    report = rlqs_pb2.RateLimitQuotaUsageReports(
        domain="d",
        bucket_quota_usages=[
            rlqs_pb2.RateLimitQuotaUsageReports.BucketQuotaUsage(
                bucket_id=rlqs_pb2.BucketId(bucket={"a": "1"}), num_requests_allowed=1
            )
        ],
    )

    async def first_answer(client: CertPair | None) -> rlqs_pb2.RateLimitQuotaResponse:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=pki["ca"].cert.read_bytes(),
            private_key=client.key.read_bytes() if client else None,
            certificate_chain=client.cert.read_bytes() if client else None,
        )
        address = f"localhost:{svc.service.grpc_port}"
        async with grpc.aio.secure_channel(address, credentials) as channel:
            call = rlqs_pb2_grpc.RateLimitQuotaServiceStub(channel).StreamRateLimitQuotas()
            await call.write(report)
            answer = await call.read()
            call.cancel()
            return answer

    answer = await first_answer(pki["client"])
    (action,) = answer.bucket_action
    assert dict(action.bucket_id.bucket) == {"a": "1"}
    assert action.quota_assignment_action.rate_limit_strategy.token_bucket.max_tokens == 5
    with pytest.raises(grpc.aio.AioRpcError):
        await first_answer(None)


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
async def test_redis_tls_with_a_client_certificate_from_the_go_settings(pki) -> None:
    """REDIS_TLS with REDIS_TLS_CLIENT_CERT/KEY and REDIS_TLS_CACERT, as Envoy Gateway sets
    them, reach a Redis that requires client certificates; without one it refuses."""
    from ratelimit_service.cli.go_env import read_go_environment

    server = pki["server"]
    process, port = _redis(["--port", "0", "--tls-port", "{port}",
                            "--tls-cert-file", str(server.cert), "--tls-key-file", str(server.key),
                            "--tls-ca-cert-file", str(pki["ca"].cert),
                            "--tls-auth-clients", "yes"])  # fmt: skip
    go = {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": f"127.0.0.1:{port}", "REDIS_TLS": "true"}
    go |= {"REDIS_TLS_CACERT": str(pki["ca"].cert)}
    try:
        anonymous = read_go_environment(go, go_mode=False).values["--redis-url"].value
        go |= {"REDIS_TLS_CLIENT_CERT": str(pki["client"].cert)}
        go |= {"REDIS_TLS_CLIENT_KEY": str(pki["client"].key)}
        url = read_go_environment(go, go_mode=False).values["--redis-url"].value
        store = RedisStore(url, request_timeout=1)
        assert (await store.hit([ExactHit("k", 2, 60, 1)], True))[0].remaining == 1
        await store.sync([])
        await store.close()
        refused = RedisStore(anonymous, request_timeout=1)
        with pytest.raises(StoreUnavailable):
            await refused.hit([ExactHit("k", 2, 60, 1)], True)
        await refused.close()
    finally:
        process.kill()
        process.wait()
