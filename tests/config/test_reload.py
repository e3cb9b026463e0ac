"""Live reload: file changes and SIGHUP swap the config; bad changes keep the old one."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_harness.fleet import wait_healthy
from ratelimit_harness.redis import free_port
from ratelimit_harness.waiting import eventually, eventually_async
from ratelimit_service.core.config_model import Mode

pytestmark = pytest.mark.slow  # starts processes

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT

RULES = """
domain: d
descriptors:
  - key: a
    mode: exact
    rate_limit: {{unit: minute, requests_per_unit: {a}}}
  - key: b
    mode: {b_mode}
    rate_limit: {{unit: minute, requests_per_unit: {b}}}
"""


def rules(a: int = 3, b: int = 2, b_mode: str = "exact") -> str:
    return textwrap.dedent(RULES.format(a=a, b=b, b_mode=b_mode))


async def wait_for(predicate, timeout: float = 5.0) -> None:
    await eventually_async(predicate, timeout=timeout, what=predicate.__name__)


async def test_changed_limit_applies_and_unchanged_state_survives(tmp_path, start_service) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(rules())
    svc = await start_service(path, watch_interval=0.05)
    assert [(await svc.call("d", [("a", "x")])).overall_code for _ in range(2)] == [OK, OK]
    path.write_text(rules(b=5))

    async def reloaded() -> bool:
        return svc.service.stats.config_load_success == 2

    await wait_for(reloaded)
    # b's new limit is in force...
    status = (await svc.call("d", [("b", "x")])).statuses[0]
    assert status.current_limit.requests_per_unit == 5
    # ...and a's two hits before the reload still count: one left.
    codes = [(await svc.call("d", [("a", "x")])).overall_code for _ in range(2)]
    assert codes == [OK, OVER]


async def test_bad_change_keeps_the_old_config(tmp_path, start_service, caplog) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(rules(a=1))
    svc = await start_service(path, watch_interval=0.05)
    caplog.set_level(logging.ERROR)
    path.write_text(rules(a=1).replace("unit: minute", "unit: fortnight", 1))

    async def rejected() -> bool:
        return svc.service.stats.config_load_error == 1

    await wait_for(rejected)
    assert f"{path}:6: invalid rate limit unit 'fortnight'" in caplog.text
    assert [(await svc.call("d", [("a", "x")])).overall_code for _ in range(2)] == [OK, OVER]
    text = b"".join(svc.service.metrics.exposition()).decode()
    assert "ratelimit_service_config_load_error_total 1.0" in text
    # Fixing the file brings the next version in.
    path.write_text(rules(a=10))

    async def fixed() -> bool:
        return svc.service.stats.config_load_success == 2

    await wait_for(fixed)
    assert (await svc.call("d", [("a", "x")])).overall_code == OK


async def test_mode_flip_applies_live_without_failing_calls(tmp_path, start_service) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(rules(b=10**6))
    svc = await start_service(path, watch_interval=0.02, mode=Mode.EXACT)
    errors: list[BaseException] = []
    stop = asyncio.Event()

    async def hammer() -> None:
        while not stop.is_set():
            try:
                response = await svc.call("d", [("b", "x")])
                assert response.overall_code == OK
            except BaseException as exc:
                errors.append(exc)
                return

    workers = [asyncio.create_task(hammer()) for _ in range(8)]
    stats = svc.service.stats
    for mode in ("probabilistic", "exact", "probabilistic"):
        loaded = stats.config_load_success + 1
        path.write_text(rules(b=10**6, b_mode=mode))
        await eventually_async(
            lambda n=loaded: stats.config_load_success >= n, timeout=5, what=f"{mode} loaded"
        )
    stop.set()
    await asyncio.gather(*workers)
    assert errors == []
    assert svc.service.stats.config_load_success == 4
    assert "d.b: unit=MINUTE requests_per_unit=1000000, mode=probabilistic" in (
        svc.service.limiter.config.dump()
    )
    assert len(svc.service.local) == 1  # probabilistic decisions happened after the flip


async def test_configmap_symlink_swap_is_seen(tmp_path, start_service) -> None:
    """Kubernetes ConfigMap volume: files are links into ..data, itself a link that is
    swapped atomically to a new timestamped directory."""
    volume = tmp_path / "volume"
    volume.mkdir()
    first = volume / "..2026_01_01_00_00_00.000000001"
    first.mkdir()
    (first / "rules.yaml").write_text(rules(a=1))
    (volume / "..data").symlink_to(first.name)
    (volume / "rules.yaml").symlink_to("..data/rules.yaml")
    svc = await start_service(volume, watch_interval=0.05)
    assert (await svc.call("d", [("a", "x")])).statuses[0].current_limit.requests_per_unit == 1

    second = volume / "..2026_01_01_00_01_00.000000002"
    second.mkdir()
    (second / "rules.yaml").write_text(rules(a=7))
    (volume / "..data_tmp").symlink_to(second.name)
    os.replace(volume / "..data_tmp", volume / "..data")

    async def swapped() -> bool:
        response = await svc.call("d", [("b", "x")])
        return svc.service.stats.config_load_success == 2 and response.overall_code == OK

    await wait_for(swapped)
    status = (await svc.call("d", [("a", "y")])).statuses[0]
    assert status.current_limit.requests_per_unit == 7
    assert svc.service.stats.config_load_error == 0  # each file loaded once: no duplicates


def test_sighup_reloads_a_running_process(tmp_path: Path) -> None:
    path = tmp_path / "rules.yaml"
    path.write_text(rules(a=1))
    grpc_port, admin_port = free_port(), free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "ratelimit_service", "serve", "--config", str(path),
         "--grpc-addr", f"127.0.0.1:{grpc_port}", "--admin-addr", f"127.0.0.1:{admin_port}",
         "--watch-interval", "0"],
    )  # fmt: skip
    try:
        wait_healthy(admin_port)
        path.write_text(rules(a=4))
        time.sleep(0.3)  # an absence (no watching, no reload): nothing to await
        assert _limit_of(grpc_port, "a") == 1
        process.send_signal(signal.SIGHUP)
        eventually(lambda: _limit_of(grpc_port, "a") == 4, timeout=5, what="SIGHUP reloading")
    finally:
        process.terminate()
        process.wait(timeout=10)
    assert process.returncode == 0


def _limit_of(port: int, key: str) -> int:
    output = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "client", "--addr", f"127.0.0.1:{port}",
         "--domain", "d", "--descriptor", f"{key}=probe", "--hits-addend", "1"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(output.split("limit=")[1].split("/")[0])
