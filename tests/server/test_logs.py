"""The service's logs (server/logs.py): JSON lines from a real ``serve`` process, and
grpc's late-answer tracebacks dropped and counted."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from ratelimit_harness.fleet import wait_healthy
from ratelimit_harness.redis import free_port
from ratelimit_service.server.logs import LATE_ANSWERS, configure_logging


@pytest.mark.slow  # starts a service process
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
