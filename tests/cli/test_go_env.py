"""envoyproxy/ratelimit's environment settings: their mapping onto our flags, the order of
the three sources, bad values, and `ratelimit` (the image's /bin/ratelimit) run from a
Go service's environment alone against real Redis, statsd and HTTP sockets."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ratelimit_harness.fixtures import make_request, ratelimit_command, settings_free_env
from ratelimit_harness.redis import RedisServer, free_port
from ratelimit_harness.waiting import eventually
from ratelimit_service.cli.go_env import GoSettingError, parse_go_duration, read_go_environment
from ratelimit_service.cli.main import _go_environment
from ratelimit_service.cli.parser import build_parser
from ratelimit_service.core.settings_table import SETTINGS, Setting

pytestmark = pytest.mark.slow  # starts processes

REPO = Path(__file__).resolve().parents[2]
OK, OVER = 1, 2

RULES = """\
domain: go
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 4}
    mode: exact
"""


def values(env: dict[str, str], go_mode: bool = False) -> dict[str, str]:
    return {flag: v.value for flag, v in read_go_environment(env, go_mode=go_mode).values.items()}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"PORT": "9000"}, {"--http-addr": "0.0.0.0:9000"}),
        ({"HOST": "myhost"}, {}),  # shells set HOST: alone, outside Go mode, it is no listener
        ({"DEBUG_HOST": "::1", "DEBUG_PORT": "7000"}, {"--debug-addr": "[::1]:7000"}),
        ({"GRPC_PORT": "9001"}, {"--grpc-addr": "0.0.0.0:9001"}),
        ({"GRPC_UDS": "/run/rl.sock"}, {"--grpc-addr": "unix:/run/rl.sock"}),
        (
            {"RUNTIME_ROOT": "/data", "RUNTIME_SUBDIRECTORY": "ratelimit"},
            {"--config": "/data/ratelimit/config"},
        ),
        ({"RUNTIME_ROOT": "/d/", "RUNTIME_APPDIRECTORY": "rules"}, {"--config": "/d/rules"}),
        (
            {"LOG_LEVEL": "warn", "LOG_FORMAT": "JSON"},
            {"--log-level": "WARNING", "--log-format": "json"},
        ),
        ({"LOG_LEVEL": "Trace"}, {"--log-level": "DEBUG"}),
        ({"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "r:6379"}, {"--redis-url": "redis://r:6379"}),
        ({"REDIS_URL": "/var/run/redis.sock"}, {"--redis-url": "unix:///var/run/redis.sock"}),
        (
            {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "r:6379", "REDIS_AUTH": "u:p@ss"},
            {"--redis-url": "redis://u:p%40ss@r:6379"},
        ),
        (
            {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "r:6379", "REDIS_AUTH": "secret"},
            {"--redis-url": "redis://:secret@r:6379"},
        ),
        (
            {
                "REDIS_SOCKET_TYPE": "tcp",
                "REDIS_URL": "r:6380",
                "REDIS_TLS": "true",
                "REDIS_TLS_CLIENT_CERT": "/c/tls.crt",
                "REDIS_TLS_CLIENT_KEY": "/c/tls.key",
                "REDIS_TLS_CACERT": "/c/ca.crt",
                "REDIS_TLS_SKIP_HOSTNAME_VERIFICATION": "true",
            },
            {
                "--redis-url": "rediss://r:6380?ssl_certfile=/c/tls.crt&ssl_keyfile=/c/tls.key"
                "&ssl_ca_certs=/c/ca.crt&ssl_check_hostname=false"
            },
        ),
        (
            {
                "REDIS_TYPE": "SENTINEL",
                "REDIS_URL": "mymaster,s1:26379,s2:26379",
                "REDIS_SENTINEL_AUTH": "sp",
            },
            {"--redis-url": "redis+sentinel://s1:26379,s2:26379/mymaster?sentinel_password=sp"},
        ),
        (
            {"REDIS_TYPE": "cluster", "REDIS_URL": "n1:7000, n2:7001"},
            {"--redis-url": "redis+cluster://n1:7000,n2:7001"},
        ),
        ({"REDIS_URL": "redis://kept:1/2"}, {"--redis-url": "redis://kept:1/2"}),
        (
            {"REDIS_POOL_SIZE": "7", "REDIS_TIMEOUT": "250ms", "CACHE_KEY_PREFIX": "p_"},
            {"--redis-pool-size": "7", "--redis-timeout": "0.25", "--redis-key-prefix": "p_"},
        ),
        (
            {
                "GRPC_SERVER_USE_TLS": "true",
                "GRPC_SERVER_TLS_CERT": "/certs/tls.crt",
                "GRPC_SERVER_TLS_KEY": "/certs/tls.key",
                "GRPC_SERVER_TLS_CA_CERT": "/certs/ca.crt",  # as Envoy Gateway writes it
            },
            {
                "--tls-cert": "/certs/tls.crt",
                "--tls-key": "/certs/tls.key",
                "--tls-client-ca": "/certs/ca.crt",
            },
        ),
        ({"GRPC_SERVER_TLS_CERT": "/x"}, {}),  # without GRPC_SERVER_USE_TLS: plain
        (
            {"GRPC_MAX_CONNECTION_AGE": "24h", "GRPC_MAX_CONNECTION_AGE_GRACE": "1h30m"},
            {"--grpc-max-connection-age": "86400.0", "--grpc-max-connection-age-grace": "5400.0"},
        ),
        (
            {"LIMIT_RESPONSE_HEADERS_ENABLED": "true", "LIMIT_RESET_HEADER": "X-Reset"},
            {"--response-headers": "ratelimit", "--header-reset": "X-Reset"},
        ),
        ({"RESPONSE_DYNAMIC_METADATA": "true"}, {"--go-dynamic-metadata": "1"}),
        ({"RESPONSE_DYNAMIC_METADATA": "false"}, {"--go-dynamic-metadata": ""}),
        (
            {"SHADOW_MODE": "true", "MERGE_DOMAIN_CONFIG": "false", "NEAR_LIMIT_RATIO": "0.5"},
            {"--shadow-mode": "1", "--merge-domain-config": "", "--near-limit-ratio": "0.5"},
        ),
        ({"STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": "true"}, {"--count-denied-costs": "false"}),
        ({"STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT": "false"}, {}),
        (
            {"USE_STATSD": "true", "STATSD_HOST": "agent", "STATS_FLUSH_INTERVAL": "2s"},
            {"--statsd-addr": "agent:8125", "--statsd-flush-interval": "2.0"},
        ),
        ({"USE_STATSD": "true", "DISABLE_STATS": "true"}, {}),
        (
            {"USE_PROMETHEUS": "true", "PROMETHEUS_ADDR": ":19001"},
            {"--prometheus-addr": "0.0.0.0:19001", "--prometheus-path": "/metrics"},
        ),
    ],
)
def test_go_settings_map_onto_our_flags(env: dict[str, str], expected: dict[str, str]) -> None:
    assert values(env) == expected


def _go_sample(setting: Setting) -> tuple[str, str]:
    """A value of ``setting``'s Go variable in Go's syntax, and the flag's value it means."""
    if setting.kind == "switch":
        return "true", "1"
    if setting.choices is not None:
        return setting.choices[-1].upper(), setting.choices[-1]
    if setting.kind == "share":
        return "0.5", "0.5"
    if setting.kind == "seconds":
        return "1m30s", "90.0"
    if setting.kind == "count":
        return "7", "7"
    sample = {"--xds-node-metadata": "k=v", "--xds-headers": "k:v"}.get(setting.flag, "x-name")
    return sample, sample


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.go], ids=lambda s: s.go)
def test_each_go_name_of_the_table_sets_its_flag(
    setting: Setting, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The table's Go name of a setting, in Go's syntax, sets that flag and no other, as
    if the flag were given its value (xDS ones when rules come by xDS)."""
    go_text, flag_text = _go_sample(setting)
    env = {setting.go: go_text}
    expected = {setting.flag: flag_text}
    if setting.flag.startswith("--xds-"):
        env["CONFIG_TYPE"] = "GRPC_XDS_SOTW"
        expected["--xds-server"] = "localhost:18000"
    assert values(env) == expected
    for name in [n for n in os.environ if n.startswith("RATELIMIT_")]:
        monkeypatch.delenv(name)
    go = read_go_environment(env, go_mode=False)
    from_go = build_parser(go).parse_args(["serve", "--config", "c"])
    base = ["serve", "--config", "c"]
    given = [*base, setting.flag] if setting.switch else [*base, setting.flag, flag_text]
    from_flag = build_parser().parse_args(given)
    assert getattr(from_go, setting.dest) == getattr(from_flag, setting.dest)


def test_go_mode_takes_the_go_services_defaults() -> None:
    assert values({}, go_mode=True) == {
        "--config": "/srv/runtime_data/current/config",
        "--http-addr": "0.0.0.0:8080",
        "--debug-addr": "0.0.0.0:6070",
        "--statsd-addr": "localhost:8125",
    }
    assert values({"USE_STATSD": "false", "HOST": "127.0.0.1"}, go_mode=True)["--http-addr"] == (
        "127.0.0.1:8080"
    )
    assert "--statsd-addr" not in values({"USE_STATSD": "false"}, go_mode=True)


def test_go_mode_is_serve_without_config_from_us(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RATELIMIT_CONFIG", raising=False)
    go = _go_environment(["serve"], go_mode=False)
    assert go is not None and go.go_mode
    go = _go_environment(["serve", "--config=x"], go_mode=False)
    assert go is not None and not go.go_mode
    assert _go_environment(["check-config", "x"], go_mode=True) is None
    monkeypatch.setenv("RATELIMIT_CONFIG", "x")
    go = _go_environment(["serve"], go_mode=False)
    assert go is not None and not go.go_mode
    go = _go_environment(["serve"], go_mode=True)  # /bin/ratelimit
    assert go is not None and go.go_mode


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PORT": "http"}, "PORT='http': not a port number"),
        ({"DEBUG_PORT": "70000"}, "DEBUG_PORT='70000': not a port number"),
        ({"REDIS_SOCKET_TYPE": "udp", "REDIS_URL": "r:1"}, "REDIS_SOCKET_TYPE='udp': choose tcp"),
        (
            {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "nohost"},
            "REDIS_URL='nohost': expected host:port",
        ),
        (
            {"REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "r:abc"},
            "REDIS_URL='r:abc': expected host:port",
        ),
        ({"REDIS_TYPE": "ring", "REDIS_URL": "r:1"}, "REDIS_TYPE='ring': choose SINGLE"),
        ({"REDIS_TYPE": "sentinel", "REDIS_URL": "onlymaster"}, "REDIS_URL='onlymaster': SENTINEL"),
        ({"LOG_LEVEL": "loud"}, "LOG_LEVEL='loud': unknown level"),
        ({"SHADOW_MODE": "yes please"}, "SHADOW_MODE='yes please': expected true or false"),
        ({"REDIS_TIMEOUT": "10 seconds"}, "REDIS_TIMEOUT='10 seconds': expected a duration"),
        ({"NEAR_LIMIT_RATIO": "2"}, "NEAR_LIMIT_RATIO='2': expected a number from 0 to 1"),
        ({"BACKEND_TYPE": "memcache"}, "BACKEND_TYPE='memcache': only redis is supported"),
        ({"GRPC_CLIENT_TLS_SAN": "envoy"}, "GRPC_CLIENT_TLS_SAN='envoy': not supported"),
        ({"GRPC_SERVER_USE_TLS": "true"}, "GRPC_SERVER_USE_TLS='true': needs GRPC_SERVER_TLS_CERT"),
    ],
)
def test_bad_values_stop_the_start_with_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(GoSettingError) as caught:
        read_go_environment(env, go_mode=False)
    assert str(caught.value).startswith(message)


def test_a_bad_value_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "serve"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**settings_free_env(), "REDIS_SOCKET_TYPE": "tcp", "REDIS_URL": "localhost"},
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "serve: REDIS_URL='localhost': expected host:port, got 'localhost'"
    ]


def test_durations_read_as_go_writes_them() -> None:
    assert parse_go_duration("X", "1m30s") == 90
    assert parse_go_duration("X", "250ms") == 0.25
    assert parse_go_duration("X", "2") == 2
    with pytest.raises(GoSettingError):
        parse_go_duration("X", "1d")


def test_accepted_settings_warn_only_when_they_ask_for_something() -> None:
    go = read_go_environment(
        {"USE_DOG_STATSD": "true", "RESPONSE_DYNAMIC_METADATA": "false", "REDIS_PERSECOND": "1"},
        go_mode=False,
    )
    assert len(go.warnings) == 2
    assert go.warnings[1].startswith("USE_DOG_STATSD='true' is accepted and ignored")
    assert go.warnings[0].startswith("REDIS_PERSECOND=true: one Redis")


def test_a_flag_wins_then_ours_then_the_go_name(monkeypatch: pytest.MonkeyPatch) -> None:
    def redis_url(argv: list[str]) -> str:
        go = _go_environment(argv, go_mode=False)
        return str(build_parser(go).parse_args(argv).redis_url)

    monkeypatch.setenv("REDIS_SOCKET_TYPE", "tcp")
    monkeypatch.setenv("REDIS_URL", "go:1")
    monkeypatch.delenv("RATELIMIT_REDIS_URL", raising=False)
    base = ["serve", "--config", "c"]
    assert redis_url(base) == "redis://go:1"
    monkeypatch.setenv("RATELIMIT_REDIS_URL", "redis://ours:2")
    assert redis_url(base) == "redis://ours:2"
    assert redis_url([*base, "--redis-url", "redis://flag:3"]) == "redis://flag:3"


# -- `ratelimit` from a Go deployment's environment alone --------------------------------


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _wait_for(url: str, status: int, process: subprocess.Popen[bytes], log: Path) -> str:
    def answered() -> str | None:
        if process.poll() is not None:
            pytest.fail(f"exited {process.returncode}:\n{log.read_text()}")
        code, body = _get(url)
        return body if code == status else None

    return eventually(answered, what=f"{url} answering {status}", context=log.read_text)


def _go_ports() -> dict[str, str]:
    return {
        "HOST": "127.0.0.1",
        "PORT": str(free_port()),
        "GRPC_HOST": "127.0.0.1",
        "GRPC_PORT": str(free_port()),
        "DEBUG_HOST": "127.0.0.1",
        "DEBUG_PORT": str(free_port()),
    }


def test_ratelimit_runs_from_a_go_deployments_environment(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    rules = tmp_path / "data" / "ratelimit" / "config"
    rules.mkdir(parents=True)
    (rules / "go.yaml").write_text(RULES)
    statsd = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    statsd.bind(("127.0.0.1", 0))
    statsd.settimeout(10)
    prometheus_port = free_port()
    env = {
        **_go_ports(),
        "RUNTIME_ROOT": str(tmp_path / "data"),
        "RUNTIME_SUBDIRECTORY": "ratelimit",
        "RUNTIME_IGNOREDOTFILES": "true",
        "RUNTIME_WATCH_ROOT": "false",
        "LOG_LEVEL": "info",
        "REDIS_SOCKET_TYPE": "tcp",
        "REDIS_URL": f"127.0.0.1:{redis_server.port}",
        "CACHE_KEY_PREFIX": "goprefix_",
        "NEAR_LIMIT_RATIO": "0.5",
        "USE_STATSD": "true",
        "STATSD_HOST": "127.0.0.1",
        "STATSD_PORT": str(statsd.getsockname()[1]),
        "STATS_FLUSH_INTERVAL": "200ms",
        "USE_PROMETHEUS": "true",
        "PROMETHEUS_ADDR": f"127.0.0.1:{prometheus_port}",
        "PROMETHEUS_PATH": "/prom",
        "USE_DOG_STATSD": "true",
    }
    log = tmp_path / "ratelimit.log"
    with ratelimit_command(env, log) as process:
        assert _wait_for(f"http://127.0.0.1:{env['PORT']}/healthcheck", 200, process, log) == "OK"
        with grpc.insecure_channel(f"127.0.0.1:{env['GRPC_PORT']}") as channel:
            stub = channel.unary_unary(
                "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=_response,
            )
            codes = [stub(make_request("go", [("user", "a")]), timeout=5) for _ in range(6)]
        assert codes == [OK, OK, OK, OK, OVER, OVER]
        status, dump = _get(f"http://127.0.0.1:{env['DEBUG_PORT']}/rlconfig")
        assert status == 200 and "go.user: unit=HOUR requests_per_unit=4" in dump
        status, metrics = _get(f"http://127.0.0.1:{prometheus_port}/prom")
        assert status == 200
        # NEAR_LIMIT_RATIO 0.5 of 4: the 3rd and 4th admitted hits are near the limit.
        assert _counter(metrics, "near_limit", "go.user") == 2
        assert _counter(metrics, "over_limit", "go.user") == 2
        keys = redis.Redis(port=redis_server.port).keys("*")
        assert keys and all(key.startswith(b"goprefix_") for key in keys)
        received = _statsd_lines(statsd, "ratelimit.service.rate_limit.go.user.total_hits")
        assert received == 6
    output = log.read_text()
    assert "USE_DOG_STATSD='true' is accepted and ignored: stats go out as plain statsd" in output
    assert "Traceback" not in output


def _response(data: bytes) -> int:
    from envoy.service.ratelimit.v3 import rls_pb2

    return int(rls_pb2.RateLimitResponse.FromString(data).overall_code)


def _counter(metrics: str, name: str, key: str) -> float:
    pattern = rf'^ratelimit_service_rate_limit_{name}_total\{{key="{re.escape(key)}"\}} (\S+)$'
    found = re.search(pattern, metrics, re.MULTILINE)
    assert found is not None, metrics
    return float(found.group(1))


def _statsd_lines(sock: socket.socket, name: str) -> int:
    """The sum of ``name``'s counts received until it reaches a steady value."""
    total, deadline = 0, time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            datagram = sock.recv(65536).decode()
        except TimeoutError:
            break
        for line in datagram.splitlines():
            metric, _, rest = line.partition(":")
            if metric == name:
                total += int(rest.split("|")[0])
        if total >= 6:
            break
    return total


def test_force_start_and_health_wait_for_a_first_config(tmp_path: Path) -> None:
    root = tmp_path / "runtime"
    env = {
        **_go_ports(),
        "RUNTIME_ROOT": str(root),
        "USE_STATSD": "false",
        "FORCE_START_WITHOUT_INITIAL_CONFIG": "true",
        "HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED": "true",
        "RATELIMIT_WATCH_INTERVAL": "0.2",
    }
    health_url = f"http://127.0.0.1:{env['PORT']}/healthcheck"
    log = tmp_path / "ratelimit.log"
    with ratelimit_command(env, log) as process:
        _wait_for(health_url, 500, process, log)  # serving, but no rules yet
        with grpc.insecure_channel(f"127.0.0.1:{env['GRPC_PORT']}") as channel:
            check = health_pb2_grpc.HealthStub(channel).Check
            serving = health_pb2.HealthCheckResponse.SERVING
            assert check(health_pb2.HealthCheckRequest(service="ratelimit"), timeout=5).status != (
                serving
            )
            (root / "config").mkdir(parents=True)
            (root / "config" / "go.yaml").write_text(RULES)
            assert _wait_for(health_url, 200, process, log) == "OK"
            request = health_pb2.HealthCheckRequest(service="ratelimit")
            eventually(
                lambda: check(request, timeout=5).status == serving,
                timeout=5,
                what="gRPC health SERVING with rules loaded",
            )
    assert "config not loaded, starting without it" in log.read_text()


def test_without_force_start_missing_rules_stop_the_start(tmp_path: Path) -> None:
    result = subprocess.run(
        [str(Path(sys.executable).with_name("ratelimit"))],
        capture_output=True,
        text=True,
        timeout=30,
        env={**settings_free_env(), **_go_ports(), "RUNTIME_ROOT": str(tmp_path / "none")},
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert f"{tmp_path}/none/config: no such file or directory" in lines[-2]
    assert lines[-1].startswith(f"serve: rules read from {tmp_path}/none/config (RUNTIME_ROOT")


def test_docs_settings_table_names_every_go_setting_read_and_only_those() -> None:
    """docs/settings.md's table names the Go settings read: those the settings table
    maps one to one, and those cli/go_env.py reads itself."""
    source = (REPO / "ratelimit_service" / "cli" / "go_env.py").read_text()
    values_not_names = {"FILE", "GRPC_XDS_SOTW", "SINGLE", "SENTINEL", "CLUSTER", "TRUE", "FALSE"}
    values_not_names |= {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}
    read = set(re.findall(r'"([A-Z][A-Z0-9_]{2,})"', source)) - values_not_names
    read |= {setting.go for setting in SETTINGS if setting.go}
    table = (REPO / "docs" / "settings.md").read_text().split("### The table", 1)[1]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`([A-Z][A-Z0-9_]+)`", row)}
    assert sorted(read - documented) == []
    # Documented without being read: only families no code names one by one.
    assert sorted(documented - read) == []
