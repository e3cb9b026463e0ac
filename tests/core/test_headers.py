"""Response headers (opt-in) and JSON logs."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_service.core.config_model import RateLimit
from ratelimit_service.core.headers import (
    HeaderNames,
    HeaderStyle,
    most_restrictive,
    rate_limit_headers,
)
from ratelimit_service.core.request import Code, DescriptorStatus
from ratelimit_service.core.units import Unit
from ratelimit_service.server.logs import LATE_ANSWERS, configure_logging
from ratelimit_service.testing.fleet import wait_healthy
from ratelimit_service.testing.redis import free_port

OVER = rls_pb2.RateLimitResponse.OVER_LIMIT


def status(code: Code, count: int, remaining: int, quota: bool = False) -> DescriptorStatus:
    limit = RateLimit(count, Unit.MINUTE, quota_mode=quota)
    return DescriptorStatus(code, limit, remaining, reset_after=12.2)


def test_smallest_remaining_is_chosen() -> None:
    statuses = [status(Code.OK, 10, 7), status(Code.OK, 5, 2), DescriptorStatus(Code.OK)]
    assert most_restrictive(statuses) is statuses[1]


def test_over_limit_wins_unless_quota_and_last_wins() -> None:
    first_over, second_over = status(Code.OVER_LIMIT, 10, 0), status(Code.OVER_LIMIT, 20, 0)
    quota_over = status(Code.OVER_LIMIT, 1, 0, quota=True)
    statuses = [first_over, status(Code.OK, 5, 0), second_over, quota_over]
    assert most_restrictive(statuses) is second_over


def test_no_limit_no_headers() -> None:
    none = [DescriptorStatus(Code.OK), DescriptorStatus(Code.OK, remaining=2**32 - 1)]
    assert rate_limit_headers(none, HeaderStyle.RATELIMIT, HeaderNames()) == []
    assert rate_limit_headers([status(Code.OK, 1, 1)], HeaderStyle.OFF, HeaderNames()) == []


def test_header_values_and_styles() -> None:
    statuses = [status(Code.OK, 10, 4)]
    assert rate_limit_headers(statuses, HeaderStyle.RATELIMIT, HeaderNames()) == [
        ("RateLimit-Limit", "10"),
        ("RateLimit-Remaining", "4"),
        ("RateLimit-Reset", "13"),
    ]
    names = HeaderNames("X-Quota", "X-Left", "X-Retry")
    assert [n for n, _ in rate_limit_headers(statuses, HeaderStyle.RATELIMIT, names)] == [
        "X-Quota",
        "X-Left",
        "X-Retry",
    ]
    assert rate_limit_headers(statuses, HeaderStyle.DRAFT03, names) == [
        ("X-RateLimit-Limit", "10, 10;w=60"),
        ("X-RateLimit-Remaining", "4"),
        ("X-RateLimit-Reset", "13"),
    ]


async def test_headers_over_grpc(write_config, start_service) -> None:
    config = write_config(
        """
        domain: d
        descriptors:
          - key: a
            mode: exact
            rate_limit: {unit: minute, requests_per_unit: 2}
          - key: b
            mode: exact
            rate_limit: {unit: hour, requests_per_unit: 100}
        """
    )
    svc = await start_service(
        config,
        response_headers=HeaderStyle.RATELIMIT,
        header_names=HeaderNames("X-Limit", "X-Remaining", "X-Reset"),
    )
    response = await svc.call("d", [("a", "1")], [("b", "1")])
    headers = {h.key: h.value for h in response.response_headers_to_add}
    assert headers["X-Limit"] == "2" and headers["X-Remaining"] == "1"
    assert 1 <= int(headers["X-Reset"]) <= 62
    await svc.call("d", [("a", "1")])
    denied = await svc.call("d", [("b", "1")], [("a", "1")])
    assert denied.overall_code == OVER
    headers = {h.key: h.value for h in denied.response_headers_to_add}
    assert (headers["X-Limit"], headers["X-Remaining"]) == ("2", "0")


async def test_no_headers_by_default(write_config, start_service) -> None:
    config = write_config(
        "domain: d\ndescriptors:\n  - key: a\n"
        "    rate_limit: {unit: minute, requests_per_unit: 2}\n"
    )
    svc = await start_service(config)
    response = await svc.call("d", [("a", "1")])
    assert list(response.response_headers_to_add) == []


def test_json_logs(tmp_path) -> None:
    config = tmp_path / "rules.yaml"
    config.write_text("domain: d\ndescriptors:\n  - key: a\n")
    grpc_port, admin_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(config),
         "--grpc-addr", f"127.0.0.1:{grpc_port}", "--admin-addr", f"127.0.0.1:{admin_port}",
         "--log-format", "json"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_healthy(admin_port)
    finally:
        process.terminate()
        _, stderr = process.communicate(timeout=10)
    entries = [json.loads(line) for line in stderr.splitlines() if line.strip()]
    start = next(e for e in entries if e["@message"].startswith("serving RLS"))
    assert start["level"] == "info"
    assert "store=embedded" in start["@message"] and "domains=d" in start["@message"]
    assert start["@timestamp"].endswith("Z")


def test_grpc_error_for_an_answer_after_its_call_ended_is_dropped(capsys) -> None:
    """grpc logs ExecuteBatchError with a traceback when an answer comes after its call
    ended (the caller's deadline passed): dropped and counted, while grpc's other
    errors still reach the log."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    configure_logging()
    grpc_log = logging.getLogger("grpc._cython.cygrpc")

    class ExecuteBatchError(Exception):  # grpc's class of that name, as grpc raises it
        pass

    before = LATE_ANSWERS.dropped
    try:
        raise ExecuteBatchError('Failed "execute_batch"')
    except ExecuteBatchError:
        grpc_log.exception("ExecuteBatchError raised in core by servicer method [%s]", "/m")
    grpc_log.error("something else")
    root.handlers[:], level = saved
    root.setLevel(level)
    err = capsys.readouterr().err
    assert "ExecuteBatchError" not in err and "Traceback" not in err
    assert "something else" in err
    assert LATE_ANSWERS.dropped == before + 1
