"""One short live run: a real Prometheus scrapes a real service (every second) while
a shadow rule takes 25 hits per burst against its limit of 10, then ``tune`` reads
what it saw: the measured scrape interval, the demand, the would-deny share."""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ratelimit_harness.prometheus import Prometheus, prometheus_missing
from ratelimit_harness.waiting import eventually_async
from ratelimit_service.cli.main import main
from ratelimit_service.tune.prometheus import PrometheusClient, PrometheusError

pytestmark = pytest.mark.slow  # starts processes

RULES = """\
domain: live
descriptors:
  - key: api
    value: probe
    mode: exact
    shadow_mode: true
    rate_limit:
      unit: second
      requests_per_unit: 10
"""


async def scraped(prometheus: Prometheus, hits: int) -> None:
    """Return once Prometheus holds a scrape of at least ``hits`` hits (queried off the
    loop: the service on this loop answers the scrapes)."""
    client = PrometheusClient(prometheus.url, timeout=5)
    query = "sum(ratelimit_service_rate_limit_total_hits_total)"

    async def seen() -> bool:
        series = await asyncio.to_thread(client.query, query, time.time())
        return bool(series) and series[0].points[-1][1] >= hits

    await eventually_async(seen, timeout=30, what=f"{hits} hits scraped", ignore=(PrometheusError,))


@pytest.mark.slow
async def test_tune_reads_what_prometheus_scraped_from_a_service_under_load(
    tmp_path: Path,
    write_config: Callable[..., Path],
    start_service: Callable[..., Any],
    capsys: pytest.CaptureFixture[str],
) -> None:
    if (missing := prometheus_missing()) is not None:
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    config = write_config(RULES)
    service = await start_service(config)
    target = service.admin_url.removeprefix("http://")
    prometheus = Prometheus(tmp_path / "prometheus", scrape_targets=[target], scrape_interval="1s")
    await asyncio.to_thread(prometheus.start)  # the service must answer its scrapes
    try:
        probe = [("api", "probe")]
        await service.call("live", probe)  # the series exist before the load
        await scraped(prometheus, 1)
        for _ in range(6):  # bursts of 25, 1.2 s apart: 10 within the limit, 15 over
            await asyncio.gather(*(service.call("live", probe) for _ in range(25)))
            await asyncio.sleep(1.2)  # pacing: one burst a scrape or so is the subject
        await scraped(prometheus, 1 + 6 * 25)  # the last burst scraped
        flags = ["--window", "1m", "--min-samples", "3"]
        code = await asyncio.to_thread(
            main, ["tune", "--prometheus", prometheus.url, "--config", str(config), *flags]
        )
    finally:
        prometheus.stop()
    out, err = capsys.readouterr()
    assert (code, err) == (0, ""), out
    row = re.search(
        r"^live\.api_probe\s+exact shadow\s+10/second\s+(\S+)\s+(\d+)\s+(\S+) %", out, re.M
    )
    assert row is not None, out
    observed, proposed, share = float(row[1]), int(row[2]), float(row[3])
    # 25 hits per 1.2 s is 20.8/s; 2 s rate windows see one or two bursts.
    assert 12 <= observed <= 40, out
    assert proposed == max(10, math.ceil(observed * 1.3))
    assert 50 <= share <= 70, out  # 15 of every 25 would have been denied
    assert (
        "resolution: per-second demand from rates over 2 s windows every 1 s (scrape"
        " interval 1 s); bursts shorter than 2 s are averaged out: live.api_probe\n" in out
    )
    assert "shadow live.api_probe: the written limit 10/second would have denied " in out
