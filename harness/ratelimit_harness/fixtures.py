"""The test suite's shared fixtures and helpers, as a pytest plugin (tests/conftest.py
names it in ``pytest_plugins``): a running service and its gRPC client, a real
redis-server, the repository's paths, RLS requests, the ``ratelimit`` command.

Test modules get the fixtures by name, as parameters, and import the helpers from
here."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from ratelimit_harness.fleet import redis_server as redis_process
from ratelimit_harness.redis import RedisServer, free_port
from ratelimit_harness.waiting import stop_process
from ratelimit_service.server.app import RateLimitService
from ratelimit_service.server.settings import Settings

REPO = Path(__file__).resolve().parent.parent.parent
"""The repository (this package is installed in editable mode from it)."""
# envoyproxy/ratelimit's acceptance files: beside the repository, or where
# ENVOY_RATELIMIT_COMPAT_DIR says.
COMPAT_ENV = "ENVOY_RATELIMIT_COMPAT_DIR"
COMPAT = Path(
    os.environ.get(COMPAT_ENV) or REPO.parent / "shared" / "compat" / "envoy-ratelimit"
).resolve()


@pytest.fixture(autouse=True)
def _root_logging_restored() -> Iterator[None]:
    """Every test leaves the root logger as it found it: a test that configures
    logging (configure_logging, ``serve`` in-process) hands its handler the stream
    pytest captures for that test, closed once the test ends; a service started by a
    later test would log into it ("I/O operation on closed file")."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def window_slices(fields: Mapping[Any, Any]) -> dict[int, int]:
    """An exact window hash (HGETALL, bytes or str) as {slice index: hits}, after
    checking its bookkeeping (exact_window.lua): sum is the sum of the slices, first the
    oldest, last the newest, and the hash holds nothing else."""
    text = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in fields.items()}
    slices = {int(k): v for k, v in text.items() if k not in ("sum", "first", "last")}
    assert slices, fields
    assert text["sum"] == sum(slices.values()), fields
    assert text["first"] == min(slices) and text["last"] == max(slices), fields
    return slices


@pytest.fixture
def write_config(tmp_path: Path) -> Callable[..., Path]:
    """Write YAML text (dedented) to a file in a fresh config directory; returns the dir."""
    directory = tmp_path / "config"
    directory.mkdir()

    def write(text: str, name: str = "rules.yaml") -> Path:
        (directory / name).write_text(textwrap.dedent(text))
        return directory

    return write


class RunningService:
    def __init__(self, service: RateLimitService, channel: grpc.aio.Channel) -> None:
        self.service = service
        self.channel = channel
        self.stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        self.admin_url = f"http://127.0.0.1:{service.admin.port}"

    async def call(
        self,
        domain: str,
        *descriptors: list[tuple[str, str]] | dict[str, Any],
        hits_addend: int = 0,
    ) -> rls_pb2.RateLimitResponse:
        request = make_request(domain, *descriptors, hits_addend=hits_addend)
        return await self.stub.ShouldRateLimit(request)


def make_request(
    domain: str, *descriptors: list[tuple[str, str]] | dict[str, Any], hits_addend: int = 0
) -> rls_pb2.RateLimitRequest:
    """Descriptors are entry lists, or dicts {"entries": [...], "limit": (n, unit), "hits": n}."""
    built = []
    for descriptor in descriptors:
        spec: dict[str, Any] = (
            descriptor if isinstance(descriptor, dict) else {"entries": descriptor}
        )
        message = ratelimit_pb2.RateLimitDescriptor(
            entries=[
                ratelimit_pb2.RateLimitDescriptor.Entry(key=k, value=v) for k, v in spec["entries"]
            ]
        )
        if "limit" in spec:
            count, unit = spec["limit"]
            message.limit.requests_per_unit = count
            message.limit.unit = unit
        if "hits" in spec:
            message.hits_addend.value = spec["hits"]
        built.append(message)
    return rls_pb2.RateLimitRequest(domain=domain, descriptors=built, hits_addend=hits_addend)


@pytest.fixture
async def start_service() -> AsyncIterator[Callable[..., object]]:
    """Start a real service on loopback ports; returns an async factory taking Settings kwargs."""
    started: list[RunningService] = []

    async def start(config_path: Path | str, **settings: object) -> RunningService:
        service = RateLimitService(
            Settings(
                config_path=str(config_path),
                grpc_addr=f"127.0.0.1:{free_port()}",
                admin_addr="127.0.0.1:0",
                shutdown_grace=0.5,
                **settings,  # type: ignore[arg-type]
            )
        )
        await service.start()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{service.grpc_port}")
        running = RunningService(service, channel)
        started.append(running)
        return running

    yield start
    for running in started:
        await running.channel.close()
        await running.service.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A running redis-server. Without one on the PATH the test is skipped locally and
    fails under CI, where .ci/run installs it."""
    if shutil.which("redis-server") is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed")
        pytest.skip("redis-server is not installed")
    with redis_process(tmp_path) as server:
        yield server


def settings_free_env() -> dict[str, str]:
    """The test's environment without anything the service reads as a setting (ours
    or envoyproxy/ratelimit's), for a process started as a Go deployment starts it."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH", "VIRTUAL_ENV")
    return {name: value for name, value in os.environ.items() if name in keep}


@contextlib.contextmanager
def ratelimit_command(env: Mapping[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``ratelimit`` (the image's /bin/ratelimit) with ``env`` alone, output to ``log``;
    terminated (SIGTERM, then SIGKILL) at the end."""
    binary = Path(sys.executable).with_name("ratelimit")
    assert binary.exists(), "the `ratelimit` console script is installed with the package"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [str(binary)], stdout=sink, stderr=subprocess.STDOUT,
            env={**settings_free_env(), **env},
        )  # fmt: skip
    try:
        yield process
    finally:
        stop_process(process, 20)


PROCESS_FIXTURES = frozenset(
    {"redis_server", "spawn_service", "start_envoy", "envoy_binary", "start_load"}
)
"""Fixtures that start real processes (redis-server, Envoy, services): a test using
any of them is marked ``slow``, so that ``-m "not slow"`` is the fast run."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if PROCESS_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def _tracing_sdk_or_skip() -> None:
    """The tracing extra, usable (opentelemetry-proto's own modules, not xds-protos's older
    copy): else the test is skipped locally, saying how to fix it, and fails under CI,
    where .ci/run installs it."""
    from ratelimit_service.engine.tracing import TracingUnavailable, check_sdk

    try:
        check_sdk()
    except TracingUnavailable as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))


@pytest.fixture
def grpc_receiver() -> Iterator[Any]:
    """An OTLP trace receiver over gRPC (otlp.py), running."""
    _tracing_sdk_or_skip()
    from ratelimit_harness.otlp import GrpcReceiver

    receiver = GrpcReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture
def http_receiver() -> Iterator[Any]:
    """An OTLP trace receiver over HTTP (otlp.py), running."""
    _tracing_sdk_or_skip()
    from ratelimit_harness.otlp import HttpReceiver

    receiver = HttpReceiver().start()
    yield receiver
    receiver.stop()
