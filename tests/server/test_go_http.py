"""envoyproxy/ratelimit's endpoints on a real service: /healthcheck and /json on
--http-addr, /rlconfig and /metrics on --debug-addr, over loopback HTTP.

HTTP goes over raw asyncio sockets on the test's own loop (the service shares it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_harness.fixtures import REPO, RunningService
from ratelimit_harness.redis import free_port
from ratelimit_harness.waiting import eventually, eventually_async
from ratelimit_service.server.app import RateLimitService, Settings

pytestmark = pytest.mark.slow  # starts processes

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT

RULES = """
domain: d
descriptors:
  - key: k
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 3, name: k_rule}
  - key: big
    mode: exact
    rate_limit: {unit: hour, requests_per_unit: 10}
  - key: free
    rate_limit: {unlimited: true}
"""

Starter = Callable[..., Awaitable[RunningService]]
Reply = tuple[int, dict[str, str], bytes]


@pytest.fixture
def start(write_config: Callable[..., Path], start_service: Starter) -> Starter:
    async def run(**settings: Any) -> RunningService:
        settings.setdefault("http_addr", "127.0.0.1:0")
        settings.setdefault("debug_addr", "127.0.0.1:0")
        settings.setdefault("sync_interval", 30.0)
        settings.setdefault("stale_after", 300.0)
        return await start_service(write_config(RULES), **settings)

    return run


def http_port(svc: RunningService) -> int:
    assert svc.service.http is not None
    return svc.service.http.port


def debug_port(svc: RunningService) -> int:
    assert svc.service.debug is not None
    return svc.service.debug.port


def request_bytes(
    method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: x"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}")
    if body is not None and "Transfer-Encoding" not in (headers or {}):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    """One response off a (possibly kept-alive) connection, by its Content-Length."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    body = await asyncio.wait_for(reader.readexactly(int(headers["content-length"])), 10)
    return status, headers, body


async def http(port: int, method: str, path: str, body: bytes | None = None) -> Reply:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes(method, path, body, {"Connection": "close"}))
        await writer.drain()
        return await read_reply(reader)
    finally:
        writer.close()


async def post_json(svc: RunningService, payload: Any) -> tuple[int, Any]:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    status, headers, raw = await http(http_port(svc), "POST", "/json", body)
    if headers["content-type"] == "application/json":
        return status, json.loads(raw)
    return status, raw.decode()


def one(key: str, value: str, **extra: Any) -> dict[str, Any]:
    return {"entries": [{"key": key, "value": value}], **extra}


# -- /healthcheck -------------------------------------------------------------------------


async def test_healthcheck_ok_then_500_while_stopping(start: Starter) -> None:
    svc = await start()
    status, headers, body = await http(http_port(svc), "GET", "/healthcheck")
    assert (status, body) == (200, b"OK")
    assert headers["content-type"].startswith("text/plain")
    assert (await http(http_port(svc), "GET", "/healthcheck?x=1"))[0] == 200
    # A connection opened while serving, used once stopping has begun (drain keeps
    # the listener up): the Go service answers 500 once it is not healthy.
    port = http_port(svc)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    svc.service.settings = replace(svc.service.settings, drain_timeout=0.5)
    stopping = asyncio.create_task(svc.service.stop(drain=True))
    await eventually_async(lambda: not svc.service.healthy(), timeout=5, what="stop begun")
    writer.write(request_bytes("GET", "/healthcheck"))
    await writer.drain()
    status, _, body = await read_reply(reader)
    writer.close()
    assert status == 500
    await asyncio.wait_for(stopping, 10)
    with pytest.raises(OSError):
        await http(port, "GET", "/healthcheck")


async def test_unknown_path_is_404_and_our_admin_stays(start: Starter) -> None:
    svc = await start()
    assert (await http(http_port(svc), "GET", "/metrics"))[0] == 404
    # Our own admin port still serves its pages beside the Go ones.
    status, _, body = await http(svc.service.admin.port, "GET", "/healthcheck")
    assert status == 200 and body.startswith(b"OK")
    assert len({svc.service.admin.port, http_port(svc), debug_port(svc)}) == 3


# -- /json --------------------------------------------------------------------------------


async def test_json_decides_with_the_grpc_limiter(start: Starter) -> None:
    svc = await start()
    status, answer = await post_json(svc, {"domain": "d", "descriptors": [one("k", "a")]})
    assert status == 200
    assert answer["overallCode"] == "OK"
    [first] = answer["statuses"]
    assert first["code"] == "OK"
    assert first["currentLimit"] == {"name": "k_rule", "requestsPerUnit": 3, "unit": "MINUTE"}
    assert first["limitRemaining"] == 2
    reset = float(first["durationUntilReset"].rstrip("s"))
    # The same counter as gRPC: one gRPC call, then /json sees one left, then none.
    response = await svc.call("d", [("k", "a")])
    assert response.overall_code == OK
    assert response.statuses[0].limit_remaining == 1
    grpc_reset = response.statuses[0].duration_until_reset.ToNanoseconds() / 1e9
    assert reset > 0 and abs(reset - grpc_reset) < 1
    status, answer = await post_json(svc, {"domain": "d", "descriptors": [one("k", "a")]})
    assert status == 200 and answer["overallCode"] == "OK"
    assert "limitRemaining" not in answer["statuses"][0]  # 0 is omitted, as protojson does
    status, answer = await post_json(svc, {"domain": "d", "descriptors": [one("k", "a")]})
    assert status == 429
    assert answer["overallCode"] == "OVER_LIMIT"
    assert answer["statuses"][0]["code"] == "OVER_LIMIT"
    assert (await svc.call("d", [("k", "a")])).overall_code == OVER
    # Another value has its own counter.
    assert (await post_json(svc, {"domain": "d", "descriptors": [one("k", "b")]}))[0] == 200


async def test_json_field_names_hits_addend_and_statuses(start: Starter) -> None:
    svc = await start()
    # Proto names and JSON names are both accepted; a descriptor's hits_addend wins
    # over the request's; an unlimited rule and an unknown key come back too.
    payload = {
        "domain": "d",
        "hits_addend": 2,
        "descriptors": [
            one("big", "x", hitsAddend=4),
            one("big", "y"),
            one("free", "x"),
            one("nothing", "x"),
        ],
    }
    status, answer = await post_json(svc, payload)
    assert status == 200
    big_x, big_y, free, nothing = answer["statuses"]
    assert big_x["limitRemaining"] == 6
    assert big_y["limitRemaining"] == 8
    assert free == {"code": "OK", "limitRemaining": 4294967295}
    assert nothing == {"code": "OK"}
    # What /json counted, gRPC sees.
    response = await svc.call("d", [("big", "x")])
    assert response.statuses[0].limit_remaining == 5


async def test_json_per_request_limit_override(start: Starter) -> None:
    svc = await start()
    override = one("other", "z", limit={"requestsPerUnit": 1, "unit": "HOUR"})
    payload = {"domain": "d", "descriptors": [override]}
    first = await post_json(svc, payload)
    second = await post_json(svc, payload)
    assert first[0] == 200 and first[1]["statuses"][0]["currentLimit"] == {
        "requestsPerUnit": 1,
        "unit": "HOUR",
    }
    assert second[0] == 429


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not a JSON RateLimitRequest"),
        (b"", "not a JSON RateLimitRequest"),
        (b'{"domain": "d", "descriptorz": []}', "descriptorz"),
        (b'{"domain": 5}', "not a JSON RateLimitRequest"),
        (b"\xff\xfe", "not a JSON RateLimitRequest"),
        (b"{}", "domain"),
        (b'{"domain": "d"}', "descriptor"),
    ],
    ids=[
        "syntax",
        "empty",
        "unknown-field",
        "wrong-type",
        "not-utf8",
        "no-domain",
        "no-descriptors",
    ],
)
async def test_json_bad_requests_are_400_with_the_reason(
    start: Starter, body: bytes, reason: str
) -> None:
    svc = await start()
    status, text = await post_json(svc, body)
    assert status == 400
    assert text.startswith("Bad Request: ")
    assert reason in text
    # Refused requests are counted like gRPC's (service_error), and the port still works.
    if reason in ("domain", "descriptor"):
        assert svc.service.stats.service_error == 1
    assert (await post_json(svc, {"domain": "d", "descriptors": [one("k", "a")]}))[0] == 200


async def test_json_response_headers_as_grpc_adds_them(start: Starter) -> None:
    from ratelimit_service.core.config_model import HeaderStyle

    svc = await start(response_headers=HeaderStyle.RATELIMIT)
    status, answer = await post_json(svc, {"domain": "d", "descriptors": [one("k", "h")]})
    assert status == 200
    headers = {h["key"]: h["value"] for h in answer["responseHeadersToAdd"]}
    assert headers["RateLimit-Limit"] == "3"
    assert headers["RateLimit-Remaining"] == "2"


async def test_keep_alive_chunked_and_expect_continue(start: Starter) -> None:
    svc = await start()
    reader, writer = await asyncio.open_connection("127.0.0.1", http_port(svc))
    body = json.dumps({"domain": "d", "descriptors": [one("k", "c")]}).encode()
    try:
        remaining = []
        for _ in range(2):  # two requests on one connection
            writer.write(request_bytes("POST", "/json", body))
            await writer.drain()
            status, headers, raw = await read_reply(reader)
            assert headers["connection"] == "keep-alive"
            remaining.append((status, json.loads(raw)["statuses"][0]["limitRemaining"]))
        assert remaining == [(200, 2), (200, 1)]
        half = len(body) // 2
        first, second = body[:half], body[half:]
        chunked = b"%x\r\n%s\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(first), first, len(second), second)
        head = {"Transfer-Encoding": "chunked", "Expect": "100-continue"}
        writer.write(request_bytes("POST", "/json", b"", head) + chunked)
        await writer.drain()
        continued = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert continued.startswith(b"HTTP/1.1 100")
        status, _, raw = await read_reply(reader)
        assert (status, json.loads(raw)["statuses"][0].get("limitRemaining", 0)) == (200, 0)
    finally:
        writer.close()


async def test_a_body_over_the_request_bound_is_413(start: Starter) -> None:
    svc = await start(max_request_bytes=1000)
    status, _, body = await http(http_port(svc), "POST", "/json", b"x" * 1001)
    assert status == 413
    assert b"1001" in body


# -- the debug port -----------------------------------------------------------------------


async def test_debug_port_rlconfig_and_metrics(start: Starter) -> None:
    svc = await start()
    for _ in range(4):
        await svc.call("d", [("k", "m")])
    status, _, rlconfig = await http(debug_port(svc), "GET", "/rlconfig")
    assert status == 200
    assert rlconfig == (await http(svc.service.admin.port, "GET", "/rlconfig"))[2]
    assert b"d.k: unit=MINUTE requests_per_unit=3" in rlconfig
    status, headers, metrics = await http(debug_port(svc), "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    text = metrics.decode()
    assert 'ratelimit_service_rate_limit_total_hits_total{key="d.k"} 4.0' in text
    assert 'ratelimit_service_rate_limit_over_limit_total{key="d.k"} 1.0' in text
    assert (await http(debug_port(svc), "GET", "/"))[2] == b"/rlconfig\n/metrics\n"
    assert (await http(debug_port(svc), "GET", "/healthcheck"))[0] == 404


async def test_off_unless_asked(write_config: Callable[..., Path], start_service: Starter) -> None:
    svc = await start_service(write_config(RULES))
    assert svc.service.http is None and svc.service.debug is None
    assert svc.service.statsd is None


async def test_a_busy_http_port_fails_start_and_frees_the_others(
    write_config: Callable[..., Path],
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        grpc_port = free_port()
        service = RateLimitService(
            Settings(
                config_path=str(write_config(RULES)),
                grpc_addr=f"127.0.0.1:{grpc_port}",
                admin_addr="127.0.0.1:0",
                http_addr=f"127.0.0.1:{taken}",
            )
        )
        with pytest.raises(OSError, match=r"\(http\)"):
            await service.start()
        admin_port = service.admin.port
    for port in (grpc_port, admin_port):  # nothing left listening
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", port))


# -- the command line ---------------------------------------------------------------------


def _get(url: str, data: bytes | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, data=data, timeout=5) as reply:
            return int(reply.status), reply.read()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read()


def test_serve_flags_and_environment(write_config: Callable[..., Path]) -> None:
    """``serve --http-addr`` with ``RATELIMIT_DEBUG_ADDR`` from the environment, as a
    real process: healthcheck, /json, /rlconfig; SIGTERM turns /healthcheck to 500."""
    http_at, debug_at, grpc_at, admin_at = (free_port() for _ in range(4))
    env = {**os.environ, "RATELIMIT_DEBUG_ADDR": f"127.0.0.1:{debug_at}"}
    process = subprocess.Popen(
        [
            sys.executable, "-m", "ratelimit_service", "serve",
            "--config", str(write_config(RULES)),
            "--grpc-addr", f"127.0.0.1:{grpc_at}", "--admin-addr", f"127.0.0.1:{admin_at}",
            "--http-addr", f"127.0.0.1:{http_at}", "--drain-timeout", "3", "--drain-quiet", "3",
        ],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:

        def healthy() -> bool:
            assert process.poll() is None, process.stdout and process.stdout.read()
            return _get(f"http://127.0.0.1:{http_at}/healthcheck") == (200, b"OK")

        eventually(healthy, what="the HTTP port's /healthcheck OK")
        body = json.dumps({"domain": "d", "descriptors": [one("k", "cli")]}).encode()
        status, raw = _get(f"http://127.0.0.1:{http_at}/json", body)
        assert status == 200 and json.loads(raw)["statuses"][0]["limitRemaining"] == 2
        status, raw = _get(f"http://127.0.0.1:{debug_at}/rlconfig")
        assert status == 200 and b"d.k: unit=MINUTE" in raw
        process.send_signal(signal.SIGTERM)
        eventually(  # draining: the port still answers, with 500
            lambda: _get(f"http://127.0.0.1:{http_at}/healthcheck")[0] == 500,
            timeout=10, what="/healthcheck 500 while draining",
        )  # fmt: skip
        assert process.wait(20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("value", ["8080", "host:port", "h:99999", "[::1:80"])
def test_bad_addresses_stop_the_start(value: str, write_config: Callable[..., Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "serve", "--config",
         str(write_config(RULES)), "--http-addr", value],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--http-addr" in result.stderr
    assert any(why in result.stderr for why in ("HOST:PORT", "unbalanced brackets", "out of range"))
    assert "Traceback" not in result.stderr


def test_debug_addr_with_workers_is_refused(write_config: Callable[..., Path]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "serve", "--config",
         str(write_config(RULES)), "--workers", "2", "--redis-url", "redis://127.0.0.1:1",
         "--debug-addr", "127.0.0.1:0"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--debug-addr with --workers" in result.stderr


@pytest.mark.slow
def test_http_port_shared_by_workers(
    write_config: Callable[..., Path], redis_server: Any, tmp_path: Path
) -> None:
    """--workers 2 --http-addr: both workers bind the port (SO_REUSEPORT, like gRPC), so
    the supervisor sees both serving; /json on fresh connections counts in Redis."""
    from ratelimit_harness.fleet import wait_healthy

    http_at, grpc_at, admin_at = free_port(), free_port(), free_port()
    log = tmp_path / "service.log"
    with log.open("wb") as out:  # the child keeps its own copy of the file
        process = subprocess.Popen(
            [
                sys.executable, "-m", "ratelimit_service", "serve",
                "--config", str(write_config(RULES)), "--redis-url", redis_server.url,
                "--workers", "2", "--redis-timeout", "0.5",
                "--grpc-addr", f"127.0.0.1:{grpc_at}", "--admin-addr", f"127.0.0.1:{admin_at}",
                "--http-addr", f"127.0.0.1:{http_at}",
            ],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        wait_healthy(
            admin_at, context=lambda: log.read_text(errors="replace")[-4000:], process=process
        )
        eventually(  # a worker that could not bind would not be serving
            lambda: _get(f"http://127.0.0.1:{admin_at}/healthcheck")
            == (200, b"OK\nworkers: 2/2 serving\n"),
            timeout=10, what="both workers serving",
        )  # fmt: skip
        payload = json.dumps({"domain": "d", "descriptors": [one("big", "w")]}).encode()
        codes = [_get(f"http://127.0.0.1:{http_at}/json", payload)[0] for _ in range(12)]
        assert codes == [200] * 10 + [429] * 2
    finally:
        process.terminate()
        process.wait(timeout=30)
