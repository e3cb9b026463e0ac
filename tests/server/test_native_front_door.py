"""The native gRPC front door (``--grpc-engine native``: server/native_grpc.py,
native_wiring.py, h2_conn.py) in real service processes, against real clients: grpc.aio
and grpcio channels, h2load, a raw socket, a real Envoy.

Where the answer is deterministic it is compared with what a second process, on the
default engine (grpcio), answers to the same calls. grpc's channels to one target share
a connection (the global subchannel pool): a channel that must have a connection of its
own (a first call that decides how the connection is routed) says so (``own``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import hpack
import pytest
from envoy.service.rate_limit_quota.v3 import rlqs_pb2_grpc
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
from google.protobuf import text_format
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from ratelimit_harness.envoy import Envoy, ServiceProcess, Upstream
from ratelimit_harness.envoy_fixtures import CONFIG_DIR, shipped_bootstrap
from ratelimit_harness.fleet import redis_server, scrape
from ratelimit_harness.redis import RedisServer
from ratelimit_harness.rlqs_sim import usage_report
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.cli.client import build_request

pytestmark = pytest.mark.slow  # starts service processes (and redis-server, h2load, Envoy)

RULES = """\
domain: front
descriptors:
  # No mode: probabilistic on the default, exact under --mode exact.
  - key: k
    failure_mode: open
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: e
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 20}
  - key: wide
    rate_limit: {unit: second, requests_per_unit: 1000000}
"""
LIMIT = 20
RLS = "envoy.service.ratelimit.v3.RateLimitService"
SHOULD_RATE_LIMIT = f"/{RLS}/ShouldRateLimit"
OK, OVER_LIMIT = rls_pb2.RateLimitResponse.OK, rls_pb2.RateLimitResponse.OVER_LIMIT
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
MAX_REQUEST_BYTES = 100_000
"""Above the 64 KiB a stream may send before the service opens its window further."""
COMMON = (
    "--drain-timeout", "0",  # SIGTERM stops at once: a quick teardown
    "--max-request-bytes", str(MAX_REQUEST_BYTES),
    "--response-headers", "ratelimit",
    "--header-rule", "x-rule",
)  # fmt: skip
NATIVE = ("--grpc-engine", "native")
OWN = [("grpc.use_local_subchannel_pool", 1)]
"""A channel option: a connection of the channel's own."""
H2LOAD_RESULT = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed,"
    r" (\d+) errored, (\d+) timeout"
)


# ------------------------------------------------------------------ processes


@dataclass
class Pair:
    """The same rules and flags, on the native engine and on grpcio."""

    native: ServiceProcess
    grpcio: ServiceProcess


def start_all(*services: ServiceProcess) -> None:
    """Start the services side by side (each start waits for its process to be healthy)."""
    with ThreadPoolExecutor(len(services)) as pool:
        for started in [pool.submit(service.start) for service in services]:
            started.result()


@contextlib.contextmanager
def pair(
    config: Path, directory: Path, *extra: str, each: Sequence[str] = ("", "")
) -> Iterator[Pair]:
    native = ServiceProcess(config, directory, *NATIVE, *COMMON, *extra, *each[0].split())
    grpcio = ServiceProcess(config, directory, *COMMON, *extra, *each[1].split())
    try:
        start_all(native, grpcio)
        yield Pair(native, grpcio)
    finally:
        for service in (native, grpcio):
            service.stop()
            print(f"\n===== service log ({service.log_path}) =====\n{service.log()}")


def missing(what: str) -> None:
    """Skip locally, fail under CI (where .ci/run installs everything), as the suite's
    fixtures do."""
    if os.environ.get("CI"):
        pytest.fail(what)
    pytest.skip(what)


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("rules")
    (directory / "front.yaml").write_text(RULES)
    return directory


@pytest.fixture(scope="module")
def embedded(config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Both engines on the embedded store (``k`` probabilistic)."""
    with pair(config, tmp_path_factory.mktemp("embedded")) as services:
        yield services


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        missing("redis-server is not installed")
    with redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def on_redis(
    config: Path, redis: RedisServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    """Both engines deciding exactly on one Redis, each under its own key prefix."""
    with pair(
        config,
        tmp_path_factory.mktemp("on-redis"),
        "--mode", "exact", "--redis-url", redis.url,
        each=("--redis-key-prefix native:", "--redis-key-prefix grpcio:"),
    ) as services:  # fmt: skip
        yield services


# ------------------------------------------------------------------ clients


def channel(service: ServiceProcess, own: bool = False) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}", options=OWN if own else None)


def rls(chan: grpc.aio.Channel) -> Any:
    return rls_pb2_grpc.RateLimitServiceStub(chan).ShouldRateLimit


def health(chan: grpc.aio.Channel) -> health_pb2_grpc.HealthStub:
    return health_pb2_grpc.HealthStub(chan)


def request(*descriptors: str, domain: str = "front") -> rls_pb2.RateLimitRequest:
    return build_request(domain, list(descriptors), 0)


def normalized(response: rls_pb2.RateLimitResponse) -> str:
    """The response without what depends on the moment it was decided (the time to the
    window's reset), as text (map keys sorted)."""
    copy = rls_pb2.RateLimitResponse()
    copy.CopyFrom(response)
    for status in copy.statuses:
        status.ClearField("duration_until_reset")
    kept = [h for h in copy.response_headers_to_add if h.key.lower() != "ratelimit-reset"]
    del copy.response_headers_to_add[:]
    copy.response_headers_to_add.extend(kept)
    return str(text_format.MessageToString(copy, as_one_line=True))


async def status_of(call: Any) -> tuple[grpc.StatusCode, str]:
    """The gRPC status a call ended with (OK and "" when it returned)."""
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


async def burst(service: ServiceProcess, req: Any, count: int) -> list[rls_pb2.RateLimitResponse]:
    """``count`` calls at once over one channel (one connection)."""
    async with channel(service, own=True) as chan:
        call = rls(chan)
        return list(await asyncio.gather(*(call(req, timeout=10) for _ in range(count))))


def metrics(service: ServiceProcess) -> dict[str, float]:
    page = scrape(service.admin_port)
    wanted = {
        "started": 'ratelimit_grpc_server_calls_total{result="started"}',
        "succeeded": 'ratelimit_grpc_server_calls_total{result="succeeded"}',
        "failed": 'ratelimit_grpc_server_calls_total{result="failed"}',
        "rls": "ratelimit_server_should_rate_limit_total_requests_total",
        "latency": "ratelimit_server_should_rate_limit_response_time_seconds_count",
        "failure_open": 'ratelimit_service_rate_limit_failure_mode_allowed_total{key="front.k"}',
    }
    return {name: page.get(sample, 0.0) for name, sample in wanted.items()}


def grown(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: after[name] - before[name] for name in after}


def calls_counted(service: ServiceProcess, before: dict[str, float]) -> dict[str, float]:
    """The gRPC call counts since ``before`` (started, succeeded, failed)."""
    now = grown(metrics(service), before)
    return {name: now[name] for name in ("started", "succeeded", "failed")}


# ------------------------------------------------------------------ 1. decisions


async def test_exact_on_redis_admits_exactly_the_limit_as_grpcio_does(on_redis: Pair) -> None:
    req = request("k=exact-burst")
    answers: dict[str, list[rls_pb2.RateLimitResponse]] = {}
    for name, service in (("native", on_redis.native), ("grpcio", on_redis.grpcio)):
        before = metrics(service)
        answers[name] = await burst(service, req, LIMIT + 10)
        codes = Counter(a.overall_code for a in answers[name])
        assert codes == {OK: LIMIT, OVER_LIMIT: 10}, (name, codes)
        counted = grown(metrics(service), before)
        assert counted["rls"] == LIMIT + 10, (name, counted)
    native, grpcio = (sorted(normalized(a) for a in answers[n]) for n in ("native", "grpcio"))
    assert native == grpcio
    # What was compared: the headers asked for (the reset one left out), the rule's name.
    remaining = 'key: "RateLimit-Remaining" value: "19"'
    assert any(remaining in text and '"x-rule" value: "front.k"' in text for text in native)
    assert all(
        "RateLimit-Reset" in [header.key for header in answer.response_headers_to_add]
        for answer in answers["native"]
    )


async def test_probabilistic_admits_first_then_denies_as_grpcio_does(embedded: Pair) -> None:
    req = request("k=probabilistic-burst")
    first: dict[str, str] = {}
    denied: dict[str, set[str]] = {}
    for name, service in (("native", embedded.native), ("grpcio", embedded.grpcio)):
        async with channel(service, own=True) as chan:
            call = rls(chan)
            answer = await call(req, timeout=5)
            assert answer.overall_code == OK, (name, answer)
            first[name] = normalized(answer)
            answers = list(await asyncio.gather(*(call(req, timeout=10) for _ in range(30))))
            for _ in range(100):  # a probabilistic limit: denials come, not at a set call
                if any(a.overall_code == OVER_LIMIT for a in answers):
                    break
                answers.append(await call(req, timeout=5))
        assert {a.overall_code for a in answers} <= {OK, OVER_LIMIT}, name
        denied[name] = {normalized(a) for a in answers if a.overall_code == OVER_LIMIT}
        assert denied[name], f"{name}: never OVER_LIMIT over {len(answers)} calls"
    assert first["native"] == first["grpcio"]
    assert denied["native"] == denied["grpcio"]
    assert len(denied["native"]) == 1, denied  # one shape: limit 20/minute, 0 remaining


# ------------------------------------------------------------------ 2. statuses, health


async def test_invalid_requests_get_grpcios_status_and_details(embedded: Pair) -> None:
    empty_domain = request("k=v", domain="")
    seen: dict[str, list[tuple[grpc.StatusCode, str]]] = {}
    for name, service in (("native", embedded.native), ("grpcio", embedded.grpcio)):
        async with channel(service, own=True) as chan:
            raw = chan.unary_unary(SHOULD_RATE_LIMIT)  # bytes in and out
            seen[name] = [
                await status_of(rls(chan)(empty_domain, timeout=5)),
                await status_of(rls(chan)(request(domain="front"), timeout=5)),
                await status_of(raw(b"\xff\xff\xff", timeout=5)),  # not a RateLimitRequest
            ]
    assert seen["native"] == seen["grpcio"]
    assert seen["native"][0] == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "rate limit domain must not be empty",
    )
    assert all(code is grpc.StatusCode.INVALID_ARGUMENT for code, _ in seen["native"])


async def test_health_check_as_grpcio_answers_it(embedded: Pair) -> None:
    seen: dict[str, list[Any]] = {}
    for name, service in (("native", embedded.native), ("grpcio", embedded.grpcio)):
        async with channel(service, own=True) as chan:
            check = health(chan).Check
            seen[name] = [
                (await check(health_pb2.HealthCheckRequest(service=""), timeout=5)).status,
                (await check(health_pb2.HealthCheckRequest(service=RLS), timeout=5)).status,
                await status_of(check(health_pb2.HealthCheckRequest(service="nope"), timeout=5)),
            ]
    assert seen["native"][:2] == [SERVING, SERVING]
    assert seen["native"][2][0] is grpc.StatusCode.NOT_FOUND
    assert seen["native"] == seen["grpcio"]


async def test_watch_is_spliced_on_a_connection_of_its_own(embedded: Pair) -> None:
    async with channel(embedded.native, own=True) as chan:
        watch = health(chan).Watch(health_pb2.HealthCheckRequest(service=RLS))
        first = await asyncio.wait_for(watch.read(), 5)
        assert first.status == SERVING
        # The connection is grpcio's now: ShouldRateLimit on it is answered there too.
        assert (await rls(chan)(request("wide=w"), timeout=5)).overall_code == OK
        watch.cancel()


async def test_other_methods_on_a_connection_that_began_natively_are_relayed(
    embedded: Pair,
) -> None:
    """A gRPC client shares one connection between its channels to a target: after a
    ShouldRateLimit, health Watch (server streaming, metadata both ways), an RLQS stream
    (bidirectional) and an unknown method on that connection are grpcio's answers,
    relayed; ShouldRateLimit is served on beside them."""
    async with channel(embedded.native, own=True) as chan:
        assert (await rls(chan)(request("wide=w"), timeout=5)).overall_code == OK
        watch = health(chan).Watch(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert (await asyncio.wait_for(watch.read(), 5)).status == SERVING
        stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(chan)
        stream = stub.StreamRateLimitQuotas(metadata=(("x-envoy-node-id", "envoy-r"),))
        for round_ in range(2):  # two reports, two answers: both ways, message by message
            await stream.write(usage_report("front", {"k": f"relayed{round_}"}, 1, 0, 0))
            answer = await asyncio.wait_for(stream.read(), 5)
            (action,) = answer.bucket_action
            assert dict(action.bucket_id.bucket) == {"k": f"relayed{round_}"}
            token_bucket = action.quota_assignment_action.rate_limit_strategy.token_bucket
            assert token_bucket.max_tokens == LIMIT
        assert (await rls(chan)(request("wide=w"), timeout=5)).overall_code == OK
        unknown = chan.unary_unary("/no.Such/Method")(b"", timeout=5)
        code, _ = await status_of(unknown)
        assert code is grpc.StatusCode.UNIMPLEMENTED
        await stream.done_writing()
        watch.cancel()
        stream.cancel()


# ------------------------------------------------------------------ 3. RLQS, reflection


async def test_rlqs_stream_gets_its_assignment_through_the_splice(embedded: Pair) -> None:
    buckets = []
    for service in (embedded.native, embedded.grpcio):
        async with channel(service, own=True) as chan:
            stub = rlqs_pb2_grpc.RateLimitQuotaServiceStub(chan)
            stream = stub.StreamRateLimitQuotas(metadata=(("x-envoy-node-id", "envoy-a"),))
            await stream.write(usage_report("front", {"k": "quota"}, 1, 0, 0))
            answer = await asyncio.wait_for(stream.read(), 5)
            stream.cancel()
        (action,) = answer.bucket_action
        assert dict(action.bucket_id.bucket) == {"k": "quota"}
        buckets.append(action.quota_assignment_action.rate_limit_strategy.token_bucket)
    assert buckets[0].max_tokens == LIMIT, buckets[0]
    assert buckets[0] == buckets[1]


def test_reflection_lists_the_services_through_the_splice(embedded: Pair) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{embedded.native.grpc_port}", options=OWN) as chan:
        services = ProtoReflectionDescriptorDatabase(chan).get_services()
    assert set(services) == {
        RLS,
        "envoy.service.rate_limit_quota.v3.RateLimitQuotaService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    }


# ------------------------------------------------------------------ 4. h2load


def framed(*descriptors: str) -> bytes:
    """A ShouldRateLimit request in gRPC's framing, as bench/throughput.py builds it."""
    message: bytes = request(*descriptors).SerializeToString()
    return struct.pack(">BI", 0, len(message)) + message


def h2load(port: int, body: Path, *flags: str) -> tuple[list[int], str]:
    """h2load's request counts (total, started, done, succeeded, failed, errored,
    timeout) and its output."""
    command = [
        "h2load", "-n", "400", "-c", "4", "-m", "8", "-t", "1", "-d", str(body),
        "-H", "content-type: application/grpc", "-H", "te: trailers", "-N", "3s", *flags,
        f"http://127.0.0.1:{port}{SHOULD_RATE_LIMIT}",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    found = H2LOAD_RESULT.search(out)
    assert found is not None, out
    return [int(n) for n in found.groups()], out


@pytest.fixture
def h2load_binary() -> str:
    binary = shutil.which("h2load")
    if binary is None:
        missing("h2load is not installed (Debian: nghttp2-client)")
    assert binary is not None
    return binary


@pytest.mark.parametrize("windows", [(), ("-w", "10", "-W", "10")], ids=["default", "1KiB"])
@pytest.mark.parametrize(
    "descriptors",
    # Answers of 550 bytes (a few fit a 1 KiB window, not all of a connection's), and of
    # 1.5 KiB (none fits it whole: sent in pieces as the client opens its window).
    [("wide=a", "wide=b", "wide=c"), tuple(f"wide=v{i}" for i in range(12))],
    ids=["small", "large"],
)
def test_h2load_every_call_succeeds(
    embedded: Pair,
    tmp_path: Path,
    h2load_binary: str,
    windows: tuple[str, ...],
    descriptors: tuple[str, ...],
) -> None:
    body = tmp_path / "body.bin"
    body.write_bytes(framed(*descriptors))
    before = metrics(embedded.native)
    counts, out = h2load(embedded.native.grpc_port, body, *windows)
    assert counts == [400, 400, 400, 400, 0, 0, 0], out
    # h2load reads no trailers: the service says each call ended OK.
    assert calls_counted(embedded.native, before) == {
        "started": 400,
        "succeeded": 400,
        "failed": 0,
    }


# ------------------------------------------------------------------ 5. /metrics


async def test_metrics_count_every_native_call_once(embedded: Pair) -> None:
    counted: dict[str, dict[str, float]] = {}
    for name, service in (("native", embedded.native), ("grpcio", embedded.grpcio)):
        before = metrics(service)
        async with channel(service, own=True) as chan:
            call = rls(chan)
            for _ in range(5):  # decided locally (probabilistic)
                assert (await call(request("k=counted"), timeout=5)).overall_code == OK
            exact = [await call(request("e=counted"), timeout=5) for _ in range(LIMIT + 2)]
            assert [a.overall_code for a in exact] == [OK] * LIMIT + [OVER_LIMIT] * 2
            code, _ = await status_of(call(request("k=v", domain=""), timeout=5))
            assert code is grpc.StatusCode.INVALID_ARGUMENT
            check = health(chan).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert (await check).status == SERVING
        counted[name] = grown(metrics(service), before)
    rls_calls = 5 + LIMIT + 2 + 1
    assert counted["native"]["rls"] == rls_calls, counted
    assert counted["native"]["latency"] == rls_calls, counted
    assert {k: counted["native"][k] for k in ("started", "succeeded", "failed")} == {
        "started": rls_calls + 1,
        "succeeded": rls_calls,
        "failed": 1,
    }
    assert counted["native"] == counted["grpcio"]


async def test_refusals_count_as_failed_calls(embedded: Pair) -> None:
    """Calls refused (an unknown method, relayed to grpcio, which refuses it; a request
    over the bound, refused by the front door) are started and failed, never RLS requests."""
    before = metrics(embedded.native)
    async with channel(embedded.native, own=True) as chan:
        assert (await rls(chan)(request("wide=w"), timeout=5)).overall_code == OK
        code, _ = await status_of(chan.unary_unary("/no.Such/Method")(b"", timeout=5))
        assert code is grpc.StatusCode.UNIMPLEMENTED
        code, _ = await status_of(rls(chan)(request("k=" + "x" * MAX_REQUEST_BYTES), timeout=5))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
    counted = grown(metrics(embedded.native), before)
    assert (counted["started"], counted["succeeded"], counted["failed"]) == (3, 1, 2), counted
    assert counted["rls"] == 1, counted


# ------------------------------------------------------------------ 6. deadlines


@pytest.mark.serial  # 20 ms deadlines
async def test_paused_redis_answers_by_failure_mode_within_the_deadline(
    on_redis: Pair, redis: RedisServer
) -> None:
    req = request("k=paused")
    service = on_redis.native
    async with channel(service, own=True) as chan:
        call = rls(chan)
        assert (await call(req, timeout=5)).overall_code == OK  # Redis reached
        before = metrics(service)
        outcomes: Counter[str] = Counter()
        slowest = 0.0

        async def one() -> None:
            nonlocal slowest
            started = time.monotonic()
            try:
                answer = await call(req, timeout=0.020)
            except grpc.aio.AioRpcError as exc:
                outcomes[exc.code().name] += 1
            else:
                outcomes[rls_pb2.RateLimitResponse.Code.Name(answer.overall_code)] += 1
            slowest = max(slowest, time.monotonic() - started)

        redis.pause()
        try:
            for _ in range(20):
                await one()
            await asyncio.gather(*(one() for _ in range(20)))
        finally:
            redis.resume()
        assert set(outcomes) <= {"OK", "DEADLINE_EXCEEDED"}, outcomes
        assert outcomes["OK"] >= 36, outcomes
        assert slowest < 1.0, slowest  # ended by the deadline at the latest, not hanging
        # Redis back (another rule: the hits admitted while it was away are owed to it).
        assert (await call(request("wide=paused"), timeout=5)).overall_code == OK

    def answered() -> dict[str, float]:
        return grown(metrics(service), before)

    # Every call (and the last) answered by the service, by failure_mode while paused.
    counted = await eventually_async(
        lambda: (now := answered())["failure_open"] >= 40 and now,
        timeout=5,
        what="every paused call answered by failure_mode",
        context=lambda: str(answered()),
    )
    assert counted["failure_open"] == 40, counted
    assert counted["succeeded"] >= outcomes["OK"] + 1, counted


# ------------------------------------------------------------------ 7. shutdown


async def test_sigterm_drains_through_the_native_door_then_exits_0(
    config: Path, tmp_path: Path
) -> None:
    service = ServiceProcess(
        config, tmp_path, *NATIVE, "--drain-timeout", "10", "--drain-quiet", "0.5"
    ).start()
    try:
        async with channel(service, own=True) as chan, channel(service, own=True) as spliced:
            call, check = rls(chan), health(chan).Check
            watch = health(spliced).Watch(health_pb2.HealthCheckRequest(service=RLS))
            assert (await asyncio.wait_for(watch.read(), 5)).status == SERVING
            answers: list[tuple[float, int | str]] = []
            stop = asyncio.Event()

            async def traffic() -> None:
                while not stop.is_set():
                    try:
                        answer = await call(request("wide=drain"), timeout=2)
                    except grpc.aio.AioRpcError as exc:
                        answers.append((time.monotonic(), exc.code().name))
                    else:
                        answers.append((time.monotonic(), answer.overall_code))
                    await asyncio.sleep(0.01)  # pacing: steady calls during the drain

            task = asyncio.create_task(traffic())
            try:
                assert (await check(health_pb2.HealthCheckRequest(), timeout=5)).status == SERVING
                assert service.process is not None
                service.process.send_signal(signal.SIGTERM)

                async def not_serving() -> bool:
                    answer = await check(health_pb2.HealthCheckRequest(service=RLS), timeout=2)
                    return bool(answer.status == NOT_SERVING)

                await eventually_async(not_serving, timeout=5, what="NOT_SERVING")
                turned = time.monotonic()
                # grpcio, behind the splice, says so on the Watch stream.
                assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
                watch.cancel()  # its connection stays open, idle
                await eventually_async(
                    lambda: sum(1 for at, _ in answers if at > turned) >= 10,
                    timeout=5,
                    what="calls answered while draining",
                )
            finally:
                stop.set()
                await task
            stopped = time.monotonic()
            during = [outcome for at, outcome in answers if at > turned]
            assert during == [OK] * len(during), during
            code = await asyncio.to_thread(service.process.wait, 15)
            exited = time.monotonic() - stopped
        assert code == 0, service.log()
        # 0.5 s of quiet ends the drain; nothing in flight after it (an idle spliced
        # connection is grpcio's to close) should hold the exit for the 5 s grace.
        assert exited < 3.0, (exited, service.log())
    finally:
        service.stop()


# ------------------------------------------------------------------ 8. bad input


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
GOAWAY, PROTOCOL_ERROR, FRAME_SIZE_ERROR = 0x7, 0x1, 0x6


def frames(data: bytes) -> list[tuple[int, bytes]]:
    """The HTTP/2 frames in ``data``: (type, payload) each."""
    found, at = [], 0
    while at + 9 <= len(data):
        length = int.from_bytes(data[at : at + 3])
        found.append((data[at + 3], data[at + 9 : at + 9 + length]))
        at += 9 + length
    return found


def test_garbage_gets_the_connection_closed_and_others_are_served(embedded: Pair) -> None:
    port = embedded.native.grpc_port
    for garbage, error in (
        (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", PROTOCOL_ERROR),
        # The preface, then SETTINGS of 5 bytes (entries are 6).
        (PREFACE + b"\x00\x00\x05\x04\x00\x00\x00\x00\x00" + b"\0" * 5, FRAME_SIZE_ERROR),
    ):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(garbage)
            received = b""
            while chunk := sock.recv(65536):  # until the service closes (else a timeout)
                received += chunk
        goaways = [payload for kind, payload in frames(received) if kind == GOAWAY]
        assert [int.from_bytes(payload[4:8]) for payload in goaways] == [error], received

    async def still_serving() -> int:
        async with channel(embedded.native, own=True) as chan:
            return int((await rls(chan)(request("wide=w"), timeout=5)).overall_code)

    assert asyncio.run(still_serving()) == OK


def test_an_aged_connection_is_told_to_go_away_then_closed(config: Path, tmp_path: Path) -> None:
    """--grpc-max-connection-age on the native engine: past the age a GOAWAY (NO_ERROR,
    the last call's stream named), and the connection closed once its calls are
    answered (at the latest when its grace is over)."""
    age, grace = 0.5, 0.5
    service = ServiceProcess(
        config, tmp_path, *NATIVE, *COMMON,
        "--grpc-max-connection-age", str(age), "--grpc-max-connection-age-grace", str(grace),
    )  # fmt: skip
    service.start()
    try:
        block = hpack.Encoder().encode(
            [(":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Check"),
             (":authority", "t"), ("content-type", "application/grpc"), ("te", "trailers")]
        )  # fmt: skip
        call = (
            PREFACE
            + h2_frame(0x4, 0, 0)  # SETTINGS, empty
            + h2_frame(0x1, 0x4, 1, block)  # HEADERS, END_HEADERS
            + h2_frame(0x0, 0x1, 1, b"\0\0\0\0\0")  # DATA: an empty message, END_STREAM
        )
        with socket.create_connection(("127.0.0.1", service.grpc_port), timeout=10) as sock:
            opened = time.monotonic()
            sock.sendall(call)
            received = b""
            while chunk := sock.recv(65536):  # until the service closes (else a timeout)
                received += chunk
            lasted = time.monotonic() - opened
    finally:
        service.stop()
    goaways = [payload[:8] for kind, payload in frames(received) if kind == GOAWAY]
    assert goaways == [struct.pack(">II", 1, 0)], received
    # No call open: closed with the GOAWAY (the loop's timer may fire a hair early).
    assert age - 0.01 <= lasted < age + grace + 3, lasted


def h2_frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream_id)
        + payload
    )


async def test_request_size_bound_as_grpcio_applies_it(embedded: Pair) -> None:
    seen: dict[str, list[tuple[grpc.StatusCode, str]]] = {}
    for name, service in (("native", embedded.native), ("grpcio", embedded.grpcio)):
        async with channel(service, own=True) as chan:
            call = rls(chan)
            seen[name] = [
                # Over the bound.
                await status_of(call(request("k=" + "x" * (MAX_REQUEST_BYTES + 1)), timeout=5)),
                # Under it, over the 64 KiB a stream's window first allows: received whole,
                # then refused for its too long value.
                await status_of(call(request("k=" + "x" * 80_000), timeout=5)),
            ]
            assert (await call(request("wide=w"), timeout=5)).overall_code == OK
    assert seen["native"][0][0] is grpc.StatusCode.RESOURCE_EXHAUSTED, seen
    assert seen["native"][1][0] is grpc.StatusCode.INVALID_ARGUMENT, seen
    assert [code for code, _ in seen["native"]] == [code for code, _ in seen["grpcio"]]
    assert seen["native"][1] == seen["grpcio"][1]


# ------------------------------------------------------------------ a real Envoy


def test_envoy_limits_through_the_native_engine(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    upstream: Upstream,
) -> None:
    service = spawn_service(CONFIG_DIR, *NATIVE)
    envoy = start_envoy(shipped_bootstrap(upstream, [service]))
    statuses = [envoy.request("/api/write/1", {"x-tenant": "acme"}).status for _ in range(8)]
    assert statuses == [200] * 5 + [429] * 3
    stats = envoy.stats()
    assert stats["cluster.upstream.ratelimit.ok"] == 5, stats
    assert stats["cluster.upstream.ratelimit.over_limit"] == 3, stats
    assert stats.get("cluster.upstream.ratelimit.error", 0) == 0, stats
    # Envoy's gRPC health checks (Health/Check) are answered by the native door too.
    assert stats.get("cluster.ratelimit.health_check.success", 0) >= 1, stats
    assert stats.get("cluster.ratelimit.health_check.failure", 0) == 0, stats
    counted = metrics(service)
    assert counted["rls"] == 8, counted
    assert counted["started"] >= 8 + 1 and counted["failed"] == 0, counted


async def test_grpcio_behind_an_abstract_socket_without_a_writable_temporary_directory(
    config: Path, start_service: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only root file system (the shipped Kubernetes manifests): no private
    directory for grpcio's socket, so an abstract one; RLQS reaches grpcio both ways,
    spliced (its own connection) and relayed (after ShouldRateLimit)."""
    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/read-only")
    running = await start_service(config)
    port = running.service.grpc_port
    assert running.service._backend_dir is None
    report = usage_report("front", {"k": "abstract"}, 1, 0, 0)
    for relayed in (False, True):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=OWN) as chan:
            if relayed:
                assert (await rls(chan)(request("wide=w"), timeout=5)).overall_code == OK
            stream = rlqs_pb2_grpc.RateLimitQuotaServiceStub(chan).StreamRateLimitQuotas(
                metadata=(("x-envoy-node-id", f"envoy-{relayed}"),)
            )
            await stream.write(report)
            answer = await asyncio.wait_for(stream.read(), 5)
            stream.cancel()
        (action,) = answer.bucket_action
        assert dict(action.bucket_id.bucket) == {"k": "abstract"}
