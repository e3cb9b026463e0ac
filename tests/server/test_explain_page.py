"""The admin page /explain of a real service, and ``ratelimit-service explain`` (a real
subprocess) asking it and reading rule files alone: which rule each descriptor
matches, with its count, and that asking records nothing."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_harness.fixtures import RunningService
from ratelimit_service.core.config_model import Mode

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT

RULES = """
domain: d
descriptors:
  - key: ex
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 3, name: ex-rule}
  - key: tenant
    rate_limit: {unit: hour, requests_per_unit: 50}
    descriptors:
      - key: path
        value: /api/*
        rate_limit: {unit: second, requests_per_unit: 5}
"""

Starter = Callable[..., Awaitable[RunningService]]


@pytest.fixture
def start(write_config: Callable[..., Path], start_service: Starter) -> Starter:
    async def run(**settings: Any) -> RunningService:
        settings.setdefault("sync_interval", 30.0)  # no sync during a test
        settings.setdefault("stale_after", 300.0)
        return await start_service(write_config(RULES), mode=Mode.PROBABILISTIC, **settings)

    return run


async def get(svc: RunningService, target: str) -> tuple[int, str]:
    """One GET on a fresh connection over the test's own loop (the service shares it)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", svc.service.admin.port)
    try:
        writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


async def cli(*args: str) -> tuple[int, str, str]:
    """``ratelimit-service`` as a subprocess, awaited without blocking the service's loop."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "ratelimit_service", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def test_the_page_counts_without_consuming(start: Starter) -> None:
    svc = await start()
    for _ in range(2):
        assert (await svc.call("d", [("ex", "a")])).overall_code == OK
    target = "/explain?domain=d&descriptor=ex=a&descriptor=" + quote("tenant=acme,path=/api/x")
    for _ in range(3):
        status, body = await get(svc, target)
        assert status == 200, body
        assert "ex=a: rule ex-rule (d.ex): 3 per minute, exact, count 2 of 3" in body
        assert "tenant=acme,path=/api/x: rule d.tenant.path_/api/*: 5 per second" in body
    status, body = await get(svc, target + "&format=json")
    answer = json.loads(body)
    assert answer["domain_found"] and answer["descriptors"][0]["rules"][0]["count"] == 2
    # One hit left: the page took none.
    assert (await svc.call("d", [("ex", "a")])).overall_code == OK
    assert (await svc.call("d", [("ex", "a")])).overall_code == OVER
    assert svc.service.stats.rules["d.ex"].total_hits == 4


@pytest.mark.parametrize(
    ("query", "error"),
    [
        ("", "one domain=D is required"),
        ("domain=d", "at least one descriptor=k=v[,k2=v2] is required"),
        ("domain=d&descriptor=novalue", "bad descriptor 'novalue': expected k=v[,k2=v2]"),
        ("domain=d&descriptor=a=b&colour=red", "unknown parameter 'colour'"),
        ("domain=d&descriptor==b", "bad descriptor '=b'"),
        ("domain=d&descriptor=a=b&format=xml", "format is text (the default) or json"),
        ("domain=d&domain=e&descriptor=a=b", "one domain=D is required"),
    ],
)
async def test_bad_input_is_one_line(start: Starter, query: str, error: str) -> None:
    svc = await start()
    status, body = await get(svc, f"/explain?{query}")
    assert status == 400
    assert body.startswith(f"Bad Request: {error}") and body.count("\n") == 1
    assert (await get(svc, "/healthcheck"))[0] == 200  # still serving


@pytest.mark.slow  # starts processes
async def test_the_command_asks_the_admin_port(start: Starter) -> None:
    svc = await start()
    assert (await svc.call("d", [("ex", "a")])).overall_code == OK
    admin = f"127.0.0.1:{svc.service.admin.port}"
    code, out, err = await cli(
        "explain", "--admin-addr", admin, "--domain", "d",
        "--descriptor", "ex=a", "--descriptor", "tenant=acme,path=/api/x", "--descriptor", "x=y",
    )  # fmt: skip
    assert (code, err) == (0, "")
    assert out.splitlines() == [
        "domain d",
        "  ex=a: rule ex-rule (d.ex): 3 per minute, exact, count 1 of 3",
        "  tenant=acme,path=/api/x: rule d.tenant.path_/api/*: 5 per second, probabilistic,"
        " count 0 of 5",
        "  x=y: no rule matches",
    ]
    code, out, err = await cli(
        "explain", "--admin-addr", admin, "--domain", "d", "--descriptor", "x=", "--json"
    )
    assert code == 0 and json.loads(out)["descriptors"][0]["rules"] == []
    code, out, err = await cli(
        "explain", "--admin-addr", admin, "--domain", "d", "--descriptor", "=v"
    )
    assert (code, out) == (2, "")
    assert err == "explain: bad descriptor '=v': expected k=v[,k2=v2]\n"
    assert svc.service.stats.rules["d.ex"].total_hits == 1


@pytest.mark.slow  # starts processes
async def test_the_command_reads_rule_files_alone(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    code, out, err = await cli(
        "explain", "--config", str(rules), "--domain", "d", "--descriptor", "ex=a"
    )
    assert (code, err) == (0, "")
    assert out == "domain d\n  ex=a: rule ex-rule (d.ex): 3 per minute, exact, count unknown\n"
    code, out, err = await cli("explain", "--domain", "d", "--descriptor", "ex=a",
                               "--admin-addr", "127.0.0.1:1")  # fmt: skip
    assert code == 1 and err.startswith("explain: no admin port answering at 127.0.0.1:1")
    assert err.count("\n") == 1
    rules.write_text("domain: d\ndescriptors: [{key: k, rate_limit: {unit: fortnight}}]\n")
    code, out, err = await cli("explain", "--config", str(rules), "--domain", "d",
                               "--descriptor", "k=v")  # fmt: skip
    assert code == 1 and "fortnight" in err
