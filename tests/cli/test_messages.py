"""What the service and its commands tell people: log lines, --help, config errors,
check-config's output, the compat suite's skip reason, and a closed output pipe."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from envoy.service.ratelimit.v3 import rls_pb2_grpc

from ratelimit_harness.fixtures import COMPAT_ENV, REPO, free_port, make_request
from ratelimit_harness.waiting import eventually
from ratelimit_service.cli.main import main as cli_main
from ratelimit_service.cli.parser import build_parser
from ratelimit_service.core.config_loader import ConfigFile, check_config

BASE_ENV = {k: v for k, v in os.environ.items() if not k.startswith("RATELIMIT_")}
BASE_ENV["PYTHONUNBUFFERED"] = "1"
RULES = """\
domain: msg
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 5}
"""


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RATELIMIT_"):
            monkeypatch.delenv(name)


def subcommand(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    chosen: argparse.ArgumentParser = commands.choices[name]
    return chosen


# -- serve --help ---------------------------------------------------------------------


@pytest.mark.usefixtures("clean_env")
def test_every_serve_flag_shows_its_default_and_environment_name() -> None:
    flags = [
        action
        for action in subcommand("serve")._actions
        if action.option_strings
        and action.help != argparse.SUPPRESS
        and not isinstance(action, argparse._HelpAction)
    ]
    assert len(flags) > 25
    for action in flags:
        flag = action.option_strings[0]
        env = "RATELIMIT_" + flag.lstrip("-").replace("-", "_").upper()
        assert action.help is not None
        if isinstance(action, argparse._StoreTrueAction):
            assert f"(env: {env}=1)" in action.help, flag
        elif action.required:
            assert f"(required unless {env} is set; env: {env})" in action.help, flag
        elif action.default in (None, ""):
            assert action.help.endswith(f"(env: {env})"), flag
        else:
            assert f"(default: {action.default}; env: {env})" in action.help, flag


@pytest.mark.slow  # starts a process
def test_serve_help_text(tmp_path: Path) -> None:
    env = {**BASE_ENV, "RATELIMIT_STALE_AFTER": "7.5", "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "serve", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "probabilistic syncs (default: 0.25; env: RATELIMIT_SYNC_INTERVAL)" in text
    assert "(default: INFO; env: RATELIMIT_LOG_LEVEL)" in text
    assert "(default: 100000; env: RATELIMIT_MAX_BUCKETS)" in text
    assert "(env: RATELIMIT_SHADOW_MODE=1)" in text
    assert "with --xds-server, rules come from xDS instead) (env: RATELIMIT_CONFIG)" in text
    assert "usage: ratelimit-service serve [--config PATH | --xds-server HOST:PORT]" in text
    # A value taken from the environment is named, beside the built-in default.
    assert "(default: 3.0; env: RATELIMIT_STALE_AFTER; now '7.5' from the environment)" in text


def test_check_config_help_names_the_environment() -> None:
    help_text = " ".join(subcommand("check-config").format_help().split())
    assert "rule file, or directory of *.yaml/*.yml (env: RATELIMIT_CONFIG)" in help_text
    assert "(env: RATELIMIT_MERGE_DOMAIN_CONFIG=1)" in help_text


@pytest.mark.usefixtures("clean_env")
def test_default_log_level_is_info() -> None:
    args = build_parser().parse_args(["serve", "--config", "config/"])
    assert args.log_level == "INFO"


# -- log lines of a serving process ------------------------------------------------------


@contextlib.contextmanager
def serving(tmp_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    config = tmp_path / "rules.yaml"
    config.write_text(RULES)
    grpc_addr, admin = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log = tmp_path / "serve.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(config),
             "--grpc-addr", grpc_addr, "--admin-addr", admin, *flags],
            stdout=sink, stderr=subprocess.STDOUT, env=BASE_ENV, cwd=REPO,
        )  # fmt: skip
    try:

        def healthy() -> bool:
            assert process.poll() is None, log.read_text()
            with urllib.request.urlopen(f"http://{admin}/healthcheck", timeout=2) as page:
                return bool(page.status == 200)

        eventually(healthy, timeout=15, what="serve healthy", context=log.read_text)
        yield process, grpc_addr, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_for(log: Path, text: str, timeout: float = 10) -> None:
    eventually(
        lambda: text in log.read_text(), timeout=timeout, what=repr(text), context=log.read_text
    )


@pytest.mark.slow  # starts a process
def test_start_reload_and_shutdown_at_info_and_nothing_per_request(tmp_path: Path) -> None:
    with serving(tmp_path) as (process, grpc_addr, log):
        wait_for(log, "serving RLS")
        with grpc.insecure_channel(grpc_addr) as channel:
            stub = rls_pb2_grpc.RateLimitServiceStub(channel)
            for _ in range(20):  # over the limit after 5: still nothing logged
                stub.ShouldRateLimit(make_request("msg", [("user", "u")]), timeout=5)
            for _ in range(3):  # an unknown domain: said once, not per request
                stub.ShouldRateLimit(make_request("unknown-domain", [("user", "u")]), timeout=5)
        process.send_signal(signal.SIGHUP)
        wait_for(log, "config reloaded")
        process.send_signal(signal.SIGTERM)
        assert process.wait(15) == 0, log.read_text()
    lines = log.read_text().splitlines()
    fields = [line.split(" ", 4)[2:] for line in lines]  # date, time, LEVEL, logger, message
    assert [(level, message.split(":")[0].split(",")[0]) for level, _, message in fields] == [
        ("INFO", f"serving RLS on port {grpc_addr.rpartition(':')[2]}"),
        ("WARNING", "request for domain 'unknown-domain'"),
        ("INFO", "config reloaded"),
        ("INFO", "shutting down"),
        ("INFO", "drained"),  # SIGTERM with no traffic: after one quiet second
        ("INFO", "stopped"),
    ], lines
    assert "domains=msg" in lines[0] and "store=embedded" in lines[0]


# -- config errors -------------------------------------------------------------------------

MISINDENTED = """\
domain: d
descriptors:
  - key: k
    rate_limit:
      unit: second
     requests_per_unit: 1
"""


@pytest.mark.usefixtures("clean_env")
def test_yaml_syntax_error_in_plain_words_with_line_and_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(MISINDENTED)
    assert cli_main(["check-config", str(path)]) == 1
    out = capsys.readouterr().out
    assert out == (
        f"{path}:6:6: error loading config file: invalid YAML: this line's indentation does"
        " not match the block that starts at line 3, column 5; keys of one mapping, and"
        " items of one list, must line up\n"
    )
    assert "<block" not in out and "expected" not in out


@pytest.mark.parametrize(
    ("text", "where", "plain"),
    [
        ("domain: d\nx: {a: 1\n", "3:1", "the mapping opened with '{' at line 2, column 4"),
        ("domain: *x\n", "1:9", "'*x' refers to an anchor '&x' that is not defined"),
        ("domain: @d\n", "1:9", "'@' cannot start a value; put the value in quotes"),
        ("domain: d\ndescriptors:\n  - key: k\n    rate_limit\n    value: v\n", "5:5",
         "the key that starts at line 4, column 5 has no ':' after it"),
        ('domain: "a\\qb"\n', "1:12", "unknown escape '\\q' in a double-quoted string"),
        ("a: &x 1\nb: &x 2\n", "2:4", "'&x' is defined twice (first at line 1, column 4)"),
    ],
)  # fmt: skip
def test_other_yaml_errors(text: str, where: str, plain: str) -> None:
    (error,) = check_config([ConfigFile("f.yaml", text)])
    assert str(error).startswith(f"f.yaml:{where}: error loading config file: invalid YAML: ")
    assert plain in error.message


@pytest.mark.usefixtures("clean_env")
def test_duplicate_domain_names_both_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = tmp_path / "a-team.yaml"
    second = tmp_path / "b-team.yaml"
    first.write_text("# team A\ndomain: shared\n")
    second.write_text("domain: shared\n")
    assert cli_main(["check-config", str(tmp_path)]) == 1
    assert capsys.readouterr().out == (
        f"{second}:1: duplicate domain 'shared' in config file; first defined in {first}:2\n"
    )


@pytest.mark.usefixtures("clean_env")
def test_check_config_output_is_what_the_docs_show(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = (REPO / "docs" / "operations.md").read_text()
    shown = re.search(r"\$ ratelimit-service check-config (\S+)\n\s*(.+)\n", docs)
    assert shown is not None, "docs/operations.md shows no check-config run"
    monkeypatch.chdir(REPO)
    assert cli_main(["check-config", shown.group(1)]) == 0
    assert capsys.readouterr().out == shown.group(2) + "\n"


# -- the compat suite's skip -------------------------------------------------------------------


@pytest.mark.slow  # starts a process
def test_compat_suite_says_where_it_looked(tmp_path: Path) -> None:
    absent = tmp_path / "no-compat-here"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/test_compat_envoy_ratelimit.py"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
        env={**os.environ, COMPAT_ENV: str(absent)},
    )  # fmt: skip
    assert result.returncode in (0, 5), result.stdout + result.stderr  # 5: nothing ran
    assert "1 skipped" in result.stdout
    assert f"compat suite not found at {absent.resolve()}" in result.stdout
    assert COMPAT_ENV in result.stdout


# -- output closed early ------------------------------------------------------------------------


def run_with_closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with its stdout a pipe whose reader is gone (like ``| head -0``)."""
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "ratelimit_service", *args],
            stdout=write, stderr=subprocess.PIPE, text=True, env=BASE_ENV, cwd=REPO, timeout=60,
        )  # fmt: skip
    finally:
        os.close(write)


@pytest.mark.slow  # starts a process
def test_client_output_closed_early_is_no_traceback(tmp_path: Path) -> None:
    with serving(tmp_path) as (_, grpc_addr, _log):
        result = run_with_closed_stdout(
            "client", "--addr", grpc_addr, "--domain", "msg", "--descriptor", "user=a"
        )
    assert result.stderr == ""
    assert result.returncode == 0


@pytest.mark.slow  # starts a process
def test_check_config_output_closed_early_is_no_traceback() -> None:
    result = run_with_closed_stdout("check-config", "config/")
    assert result.stderr == ""
    assert result.returncode == 0


def test_errors_suggest_the_key_list_the_units_and_come_in_file_and_line_order(
    tmp_path: Path,
) -> None:
    from ratelimit_service.core.config_errors import ConfigError
    from ratelimit_service.core.config_loader import in_file_order

    text = (
        "domain: d\ndescriptors:\n  - key: a\n"
        "    rate_limit: {unit: minutes, requests_per_unit: 5}\n"
        "  - key: b\n    rate_limit: {unit: minute, request_per_unit: 5}\n"
    )
    errors = [str(e) for e in check_config([ConfigFile("a.yaml", text)])]
    assert errors == [
        "a.yaml:4: invalid rate limit unit 'minutes'; valid units: second, minute, hour, day,"
        " week, month, year",
        "a.yaml:6: config error, unknown key 'request_per_unit'; did you mean 'requests_per_unit'?",
    ]
    files = [ConfigFile("b.yaml", ""), ConfigFile("a.yaml", "")]
    shuffled = [ConfigError("a.yaml", 2, "x"), ConfigError("a.yaml", None, "y"),
                ConfigError("b.yaml", 9, "z"), ConfigError("b.yaml", 3, "w")]  # fmt: skip
    assert [(e.file, e.line) for e in in_file_order(shuffled, files)] == [
        ("b.yaml", 3), ("b.yaml", 9), ("a.yaml", None), ("a.yaml", 2),
    ]  # fmt: skip


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ratelimit_service", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**BASE_ENV, **(env or {})},
        cwd=REPO,
    )


@pytest.mark.slow  # starts a process
def test_no_rule_file_is_an_error_for_check_config_and_a_warning_for_serve(
    tmp_path: Path,
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    checked = cli("check-config", str(empty))
    assert checked.returncode == 1
    assert checked.stdout.strip() == f"{empty}: no rule file (*.yaml, *.yml) found"
    admin = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(empty),
             "--grpc-addr", f"127.0.0.1:{free_port()}", "--admin-addr", f"127.0.0.1:{admin}"],
            stdout=out, stderr=subprocess.STDOUT, env=BASE_ENV, cwd=REPO,
        )  # fmt: skip
        try:
            wait_for(log, "serving RLS", 20)
        finally:
            process.send_signal(signal.SIGINT)
            process.wait(10)
    text = log.read_text()
    assert f"no rule file (*.yaml, *.yml) in {empty}" in text


@pytest.mark.slow  # starts a process
def test_a_busy_port_is_one_line_of_ours(tmp_path: Path) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        result = cli(
            "serve", "--config", "config/", "--grpc-addr", taken,
            "--admin-addr", f"127.0.0.1:{free_port()}", env={"RATELIMIT_LOG_LEVEL": "ERROR"},
        )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"serve: cannot listen on {taken} (gRPC): Address already in use"
    ]


async def test_an_unknown_domain_is_said_once_and_counted(caplog) -> None:
    from ratelimit_service.engine.stats import Stats

    stats = Stats()
    with caplog.at_level("WARNING"):
        for _ in range(5):
            stats.count_domain_not_found("nope")
        stats.count_domain_not_found("other")
    lines = [r.getMessage() for r in caplog.records if "which no rule declares" in r.getMessage()]
    assert len(lines) == 2 and "'nope'" in lines[0] and "'other'" in lines[1]
    assert stats.domain_not_found == {"nope": 5, "other": 1}
