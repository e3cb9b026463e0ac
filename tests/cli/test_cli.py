"""The command line, as real subprocesses: serve, client, check-config, signals, environment."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from ratelimit_harness.fixtures import REPO, free_port, make_request
from ratelimit_harness.waiting import eventually
from ratelimit_service.core.config_loader import UNIT_NAMES

pytestmark = pytest.mark.slow  # starts processes

VALID_UNITS = f"; valid units: {UNIT_NAMES}"

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RATELIMIT_")}
BASE_ENV["PYTHONUNBUFFERED"] = "1"

CLI_RULES = """\
domain: cli
descriptors:
  - key: user
    mode: exact
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: trial
    mode: exact
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
"""

# No mode anywhere: the service default (--mode / RATELIMIT_MODE) decides.
PLAIN_RULES = """\
domain: plain
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 2}
"""


def cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ratelimit_service", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**BASE_ENV, **(env or {})},
        cwd=REPO,
    )


@dataclass
class Served:
    process: subprocess.Popen[bytes]
    grpc_addr: str
    admin_url: str
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def wait_healthy(served: Served, timeout: float = 15.0) -> None:
    def healthy() -> bool:
        if served.process.poll() is not None:
            pytest.fail(f"serve exited {served.process.returncode}:\n{served.output()}")
        return http_get(served.admin_url + "/healthcheck")[0] == 200

    eventually(healthy, timeout=timeout, what="serve healthy", context=served.output)


@contextlib.contextmanager
def serve(
    log_dir: Path, *args: str, env: dict[str, str] | None = None, ports_by_env: bool = False
) -> Iterator[Served]:
    grpc_addr, admin_addr = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    extra_env = dict(env or {})
    if ports_by_env:
        extra_env |= {"RATELIMIT_GRPC_ADDR": grpc_addr, "RATELIMIT_ADMIN_ADDR": admin_addr}
        flags: list[str] = []
    else:
        flags = ["--grpc-addr", grpc_addr, "--admin-addr", admin_addr]
    log = log_dir / f"serve-{time.monotonic_ns()}.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "ratelimit_service", "serve", *args, *flags],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**BASE_ENV, **extra_env},
            cwd=REPO,
        )
    served = Served(process, grpc_addr, f"http://{admin_addr}", log)
    try:
        wait_healthy(served)
        yield served
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def rls_call(addr: str, domain: str, *descriptors: list[tuple[str, str]]) -> Any:
    with grpc.insecure_channel(addr) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        return stub.ShouldRateLimit(make_request(domain, *descriptors), timeout=5)


def refused(addr: str) -> bool:
    host, _, port = addr.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return False
    except OSError:
        return True


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One serve process on a copy of the example config plus a small exact rule."""
    directory = tmp_path_factory.mktemp("cli-config")
    shutil.copy(REPO / "config" / "edge.yaml", directory / "edge.yaml")
    (directory / "cli.yaml").write_text(CLI_RULES)
    with serve(directory, "--config", str(directory)) as served:
        yield served


# -- client -------------------------------------------------------------------------------


def test_client_prints_overall_and_limit(server: Served) -> None:
    result = cli(
        "client", "--addr", server.grpc_addr, "--domain", "edge",
        "--descriptor", "remote_address=1.2.3.4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "overall: OK"
    assert len(lines) == 2
    # probabilistic (the default): a fresh 50/s key has its whole limit, less this hit
    assert lines[1].strip().startswith("[remote_address=1.2.3.4] OK limit=50/SECOND remaining=49")
    assert "reset=" in lines[1]


def test_client_several_descriptors(server: Served) -> None:
    result = cli(
        "client", "--addr", server.grpc_addr, "--domain", "edge",
        "--descriptor", "remote_address=5.6.7.8",
        "--descriptor", "tenant=acme,path=/api/write/x",
        "--descriptor", "path=/healthz",
        "--descriptor", "nothing=here",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [line.strip() for line in result.stdout.splitlines()]
    assert lines[0] == "overall: OK"
    assert lines[1].startswith("[remote_address=5.6.7.8] OK limit=50/SECOND")
    assert lines[2].startswith("[tenant=acme,path=/api/write/x] OK limit=5/SECOND remaining=4")
    assert lines[3] == "[path=/healthz] OK unlimited"
    assert lines[4] == "[nothing=here] OK no limit"


def test_client_shows_over_limit(server: Served) -> None:
    outputs = []
    for _ in range(3):
        result = cli(
            "client", "--addr", server.grpc_addr, "--domain", "cli", "--descriptor", "user=u1"
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout.splitlines())
    assert [lines[0] for lines in outputs] == ["overall: OK", "overall: OK", "overall: OVER_LIMIT"]
    assert "OK limit=2/HOUR remaining=1" in outputs[0][1]
    assert "OK limit=2/HOUR remaining=0" in outputs[1][1]
    assert "OVER_LIMIT limit=2/HOUR remaining=0" in outputs[2][1]
    blocked = cli(
        "client", "--addr", server.grpc_addr, "--domain", "edge", "--descriptor", "tenant=blocked"
    )  # fmt: skip
    assert blocked.stdout.splitlines()[0] == "overall: OVER_LIMIT"


def test_client_marks_a_shadow_rule_over_its_limit(server: Served) -> None:
    args = ["client", "--addr", server.grpc_addr, "--domain", "cli", "--descriptor", "trial=t1"]
    first, second = cli(*args), cli(*args)
    assert first.returncode == second.returncode == 0, (first.stderr, second.stderr)
    assert first.stdout.splitlines()[0] == second.stdout.splitlines()[0] == "overall: OK"
    assert "] OK limit=1/HOUR remaining=0" in first.stdout  # admitted: the last hit
    assert "] OK (shadow: OVER_LIMIT) limit=1/HOUR remaining=0" in second.stdout


def test_client_hits_addend(server: Served) -> None:
    args = ["client", "--addr", server.grpc_addr, "--domain", "cli", "--descriptor", "user=u2"]
    first = cli(*args, "--hits-addend", "2")
    assert first.returncode == 0, first.stderr
    assert "OK limit=2/HOUR remaining=0" in first.stdout
    second = cli(*args, env={"RATELIMIT_HITS_ADDEND": "1"})
    assert second.stdout.startswith("overall: OVER_LIMIT")


@pytest.mark.parametrize("descriptor", ["novalue", "=v", "a=b,c", "a=b,,c=d"])
def test_client_malformed_descriptor_is_usage_error(descriptor: str) -> None:
    result = cli("client", "--addr", "127.0.0.1:1", "--domain", "d", "--descriptor", descriptor)
    assert result.returncode == 2
    assert "descriptor" in result.stderr
    assert "k=v" in result.stderr
    assert result.stdout == ""


def test_client_against_closed_port_is_unavailable() -> None:
    port = free_port()
    result = cli(
        "client", "--addr", f"127.0.0.1:{port}", "--domain", "d", "--descriptor", "k=v",
        "--timeout", "3",
    )  # fmt: skip
    assert result.returncode == 1
    assert "UNAVAILABLE" in result.stderr
    assert result.stdout == ""


# -- serve --------------------------------------------------------------------------------------


def test_quickstart_config_serves_and_answers(tmp_path: Path) -> None:
    """README quick start: `serve --config config/`, then the README's client call."""
    with serve(tmp_path, "--config", "config/") as served:
        result = cli(
            "client", "--addr", served.grpc_addr, "--domain", "edge",
            "--descriptor", "remote_address=10.0.0.1",
            "--descriptor", "tenant=acme,path=/api/write/x",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        lines = [line.strip() for line in result.stdout.splitlines()]
        assert lines[0] == "overall: OK"
        assert lines[1].startswith("[remote_address=10.0.0.1] OK limit=50/SECOND")
        assert lines[2].startswith("[tenant=acme,path=/api/write/x] OK limit=5/SECOND")
        status, body = http_get(served.admin_url + "/rlconfig")
        assert status == 200
        assert "edge.remote_address: unit=SECOND requests_per_unit=50" in body
        assert "edge.tenant_blocked: unit=SECOND requests_per_unit=0" in body
        status, body = http_get(served.admin_url + "/metrics")
        assert status == 200
        assert (
            'ratelimit_service_rate_limit_total_hits_total{key="edge.remote_address"} 1.0' in body
        )
        premium = rls_call(served.grpc_addr, "edge", [("tenant", "premium")])
        # Two limits (rate_limits): the status is the tighter one's, the burst (199 left).
        assert premium.statuses[0].current_limit.requests_per_unit == 200
        assert premium.statuses[0].limit_remaining == 199
        blocked = rls_call(served.grpc_addr, "edge", [("tenant", "blocked")])
        assert blocked.overall_code == OVER


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_signal_stops_serve_cleanly(tmp_path: Path, sig: signal.Signals) -> None:
    with serve(tmp_path, "--config", "config/") as served:
        assert (
            rls_call(served.grpc_addr, "edge", [("remote_address", "1.1.1.1")]).overall_code == OK
        )
        served.process.send_signal(sig)
        assert served.process.wait(10) == 0, served.output()
        assert "Traceback" not in served.output()
        assert refused(served.admin_url.removeprefix("http://"))
        assert refused(served.grpc_addr)


def test_serve_freezes_start_up_objects(tmp_path: Path) -> None:
    """A full garbage collection under traffic would scan everything built at start-up
    (about 10 ms, stalling every request in flight); serve freezes it once it is up."""
    with serve(tmp_path, "--config", "config/", "--log-level", "DEBUG") as served:
        found = eventually(
            lambda: re.search(r"objects tenured at start: (\d+)", served.output()),
            timeout=10,
            what="the freeze logged",
            context=served.output,
        )
        assert int(found.group(1)) > 10_000  # modules, config, listeners


def test_flags_from_environment(tmp_path: Path) -> None:
    directory = tmp_path / "rules"
    directory.mkdir()
    (directory / "plain.yaml").write_text(PLAIN_RULES)
    env = {"RATELIMIT_CONFIG": str(directory), "RATELIMIT_MODE": "exact"}
    with serve(tmp_path, env=env, ports_by_env=True) as served:
        status, body = http_get(served.admin_url + "/rlconfig")
        assert status == 200
        assert "plain.user: unit=HOUR requests_per_unit=2, mode=exact" in body
        codes = [
            rls_call(served.grpc_addr, "plain", [("user", "e")]).overall_code for _ in range(3)
        ]
        assert codes == [OK, OK, OVER]


def test_flag_wins_over_environment(tmp_path: Path) -> None:
    directory = tmp_path / "rules"
    directory.mkdir()
    (directory / "plain.yaml").write_text(PLAIN_RULES)
    env = {"RATELIMIT_CONFIG": str(tmp_path / "missing"), "RATELIMIT_MODE": "exact"}
    with serve(tmp_path, "--config", str(directory), "--mode", "probabilistic", env=env) as served:
        status, body = http_get(served.admin_url + "/rlconfig")
        assert status == 200
        assert "plain.user: unit=HOUR requests_per_unit=2, mode=probabilistic" in body


def test_bad_config_exits_1_with_file_and_line(tmp_path: Path) -> None:
    directory = tmp_path / "rules"
    directory.mkdir()
    bad = directory / "bad.yaml"
    bad.write_text(
        textwrap.dedent(
            """\
            domain: d
            descriptors:
              - key: a
                ratelimit:
                  unit: second
              - key: b
                rate_limit: {unit: fortnight, requests_per_unit: 1}
            """
        )
    )
    admin_port = free_port()
    result = cli(
        "serve", "--config", str(directory), "--grpc-addr", f"127.0.0.1:{free_port()}",
        "--admin-addr", f"127.0.0.1:{admin_port}", timeout=15,
    )  # fmt: skip
    assert result.returncode == 1
    errors = result.stderr.splitlines()
    assert f"{bad}:4: config error, unknown key 'ratelimit'; did you mean 'rate_limit'?" in errors
    assert f"{bad}:7: invalid rate limit unit 'fortnight'" + VALID_UNITS in errors
    assert "Traceback" not in result.stderr
    checked = cli("check-config", str(directory))
    assert checked.returncode == 1
    assert (
        f"{bad}:4: config error, unknown key 'ratelimit'; did you mean 'rate_limit'?"
        in checked.stdout.splitlines()
    )


def test_missing_config_exits_1(tmp_path: Path) -> None:
    result = cli("serve", "--config", str(tmp_path / "nowhere"), timeout=15)
    assert result.returncode == 1
    assert f"{tmp_path / 'nowhere'}: no such file or directory" in result.stderr


@pytest.mark.parametrize(
    ("args", "env", "hint"),
    [
        (["--sync-interval", "0"], {}, "--sync-interval"),
        (["--sync-interval", "-1"], {}, "--sync-interval"),
        (["--sync-interval", "soon"], {}, "--sync-interval"),
        ([], {"RATELIMIT_SYNC_INTERVAL": "0"}, "--sync-interval"),
        (["--max-buckets", "0"], {}, "--max-buckets"),
        (["--mode", "fast"], {}, "--mode"),
        ([], {"RATELIMIT_MODE": "fast"}, "--mode"),
        (["--log-level", "chatty"], {}, "--log-level"),
        (["--exact-batch-hold", "-0.001"], {}, "--exact-batch-hold"),
        (["--exact-batch-hold", "nan"], {}, "--exact-batch-hold"),
        ([], {"RATELIMIT_EXACT_BATCH_HOLD": "inf"}, "--exact-batch-hold"),
        (["--zone", "eu west"], {}, "--zone"),
    ],
    ids=[
        "sync-0", "sync-negative", "sync-text", "env-sync-0", "max-buckets-0", "mode",
        "env-mode", "log-level", "hold-negative", "hold-nan", "env-hold-inf", "zone-name",
    ],
)  # fmt: skip
def test_invalid_serve_flags_are_usage_errors(
    args: list[str], env: dict[str, str], hint: str
) -> None:
    result = cli(
        "serve", "--config", "config/", "--grpc-addr", f"127.0.0.1:{free_port()}",
        "--admin-addr", f"127.0.0.1:{free_port()}", *args, env=env, timeout=15,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr  # the wrong thing only, not the whole usage
    assert hint in lines[0] and "--help" in lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--zone", "a"], "--zone needs --redis-url"),
        (["--zone", "a", "--redis-url", "127.0.0.1:1"], "--global-redis-url"),
        (["--global-redis-url", "127.0.0.1:1"], "give --zone too"),
        (
            [
                "--zone",
                "a",
                "--redis-url",
                "redis+cluster://127.0.0.1:1",
                "--global-redis-url",
                "127.0.0.1:2",
            ],
            "not Cluster",
        ),
    ],
)
def test_zone_settings_come_together(args: list[str], says: str) -> None:
    result = cli(
        "serve", "--config", "config/", "--grpc-addr", f"127.0.0.1:{free_port()}",
        "--admin-addr", f"127.0.0.1:{free_port()}", *args, timeout=15,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("busy", ["grpc", "admin"])
def test_busy_port_exits_1_with_a_message(busy: str) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        grpc_addr = taken if busy == "grpc" else f"127.0.0.1:{free_port()}"
        admin_addr = taken if busy == "admin" else f"127.0.0.1:{free_port()}"
        result = cli(
            "serve", "--config", "config/", "--grpc-addr", grpc_addr, "--admin-addr", admin_addr,
            timeout=15,
        )  # fmt: skip
    assert result.returncode == 1
    assert taken in result.stderr
    assert "Traceback" not in result.stderr


# -- check-config -----------------------------------------------------------------------------


def test_check_config_on_the_example_config() -> None:
    result = cli("check-config", "config/")
    assert result.returncode == 0, result.stdout
    assert result.stdout.strip() == "config/: OK (1 file)"
    from_env = cli("check-config", env={"RATELIMIT_CONFIG": "config/edge.yaml"})
    assert from_env.returncode == 0, from_env.stdout
    assert from_env.stdout.strip() == "config/edge.yaml: OK (1 file)"


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_serve_on_either_event_loop(tmp_path: Path, loop: str) -> None:
    """uvloop is the default when installed; asyncio's own loop stays available."""
    from ratelimit_harness.fleet import wait_healthy
    from ratelimit_harness.redis import free_port

    config = tmp_path / "rules.yaml"
    config.write_text(
        "domain: d\ndescriptors:\n  - key: a\n"
        "    rate_limit: {unit: minute, requests_per_unit: 1}\n"
    )
    grpc_port, admin_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(config),
         "--grpc-addr", f"127.0.0.1:{grpc_port}", "--admin-addr", f"127.0.0.1:{admin_port}",
         "--event-loop", loop],
    )  # fmt: skip
    try:
        wait_healthy(admin_port)
        calls = [
            subprocess.run(
                [sys.executable, "-m", "ratelimit_service", "client", "--addr",
                 f"127.0.0.1:{grpc_port}", "--domain", "d", "--descriptor", "a=1"],
                capture_output=True, text=True, timeout=30,
            ).stdout.splitlines()[0]
            for _ in range(2)
        ]  # fmt: skip
    finally:
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    assert calls == ["overall: OK", "overall: OVER_LIMIT"]
