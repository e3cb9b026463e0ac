"""Store settings and a store that is not there yet, with real processes: a bad
``--redis-url`` is refused in one line (exit 2); ``HOST:PORT`` is accepted as the Go
service writes it; a store that is down at start-up (single or Cluster) never stops
the service: it serves by failure_mode, says why, and connects once the store is up."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from ratelimit_harness.fleet import (
    python_burst,
    redis_server,
    scrape,
    service_fleet,
)
from ratelimit_harness.redis import RedisCluster, free_port
from ratelimit_harness.waiting import eventually

pytestmark = [
    pytest.mark.slow,  # starts processes
    pytest.mark.skipif(shutil.which("redis-server") is None, reason="no redis-server"),
]

RULES = """\
domain: load
descriptors:
  - key: slow
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 2}
"""


def rules(tmp_path: Path) -> Path:
    config = tmp_path / "config"
    config.mkdir(exist_ok=True)
    (config / "load.yaml").write_text(RULES)
    return config


def serve(tmp_path: Path, redis_url: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "ratelimit_service", "serve", "--config", str(rules(tmp_path))),
            *("--grpc-addr", f"127.0.0.1:{free_port()}", "--redis-url", redis_url),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


@pytest.mark.parametrize(
    "url",
    ["redis://127.0.0.1:notaport", "ftp://127.0.0.1:6379", "127.0.0.1:", "redis+cluster://"],
)
def test_a_bad_redis_url_is_refused_in_one_line(tmp_path: Path, url: str) -> None:
    result = serve(tmp_path, url)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "--redis-url" in lines[0] and repr(url) in lines[0]


def test_host_port_as_the_go_service_writes_it(tmp_path: Path) -> None:
    with redis_server(tmp_path) as redis:
        host_port = f"127.0.0.1:{redis.port}"
        with service_fleet(1, rules(tmp_path), host_port) as nodes:
            outcomes = asyncio.run(python_burst([nodes[0].grpc_port], "load", "slow=a", 3, 1))
            metrics = scrape(nodes[0].admin_port)
    assert outcomes == Counter({"OK": 2, "OVER_LIMIT": 1})  # decided by Redis
    assert metrics['ratelimit_store{name="calls",store="redis"}'] >= 3


def _health(admin_port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/healthcheck") as response:
            return str(response.read().decode())
    except urllib.error.HTTPError as exc:
        return str(exc.read().decode())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-cli") is None, reason="no redis-cli")
def test_a_cluster_started_after_the_service_is_used_once_up(tmp_path: Path) -> None:
    cluster = RedisCluster(tmp_path)
    try:
        with service_fleet(1, rules(tmp_path), cluster.url) as nodes:
            port, admin = nodes[0].grpc_port, nodes[0].admin_port
            assert "store: redis unavailable" in _health(admin)
            # failure_mode (open): every request admitted while the cluster is away.
            away = asyncio.run(python_burst([port], "load", "slow=a", 4, 1))
            assert away == Counter({"OK": 4})
            cluster.start()
            keys = iter(range(1000))

            def decided_by_redis() -> bool:
                key = f"slow=k{next(keys)}"
                outcomes = asyncio.run(python_burst([port], "load", key, 3, 1))
                return outcomes == Counter({"OK": 2, "OVER_LIMIT": 1})

            eventually(decided_by_redis, timeout=30, what="the service uses the cluster")
            assert "store: redis healthy" in _health(admin)
    finally:
        cluster.stop()


ZERO_RULES = """\
domain: load
descriptors:
  - key: slow
    mode: exact
    rate_limit: {unit: minute, requests_per_unit: 2}
  - key: tenant
    value: blocked
    mode: exact
    rate_limit: {unit: second, requests_per_unit: 0}
  - key: closed
    mode: exact
    failure_mode: closed
    rate_limit: {unit: minute, requests_per_unit: 2}
"""


@pytest.mark.parametrize("kind", ["single", "sentinel"])
def test_a_redis_that_is_not_there_at_start_up(tmp_path: Path, kind: str) -> None:
    """Nothing listens at the Redis (or Sentinel) ports: the service starts, says why
    in its health, answers each rule by its failure_mode, and a limit of 0 denies."""
    config = tmp_path / "zero"
    config.mkdir()
    (config / "load.yaml").write_text(ZERO_RULES)
    url = f"redis://127.0.0.1:{free_port()}/0"
    if kind == "sentinel":
        url = f"redis+sentinel://127.0.0.1:{free_port()},127.0.0.1:{free_port()}/main"
    with service_fleet(1, config, url) as nodes:
        port, admin = nodes[0].grpc_port, nodes[0].admin_port
        assert "store: redis unavailable" in _health(admin)
        assert asyncio.run(python_burst([port], "load", "slow=a", 4, 2)) == Counter({"OK": 4})
        blocked = asyncio.run(python_burst([port], "load", "tenant=blocked", 4, 2))
        assert blocked == Counter({"OVER_LIMIT": 4})
        closed = asyncio.run(python_burst([port], "load", "closed=a", 4, 2))
        assert closed == Counter({"OVER_LIMIT": 4})
        metrics = scrape(admin)
    assert metrics['ratelimit_service_rate_limit_failure_mode_allowed_total{key="load.slow"}'] == 4
    assert metrics['ratelimit_service_rate_limit_failure_mode_denied_total{key="load.closed"}'] == 4
    assert metrics['ratelimit_store{name="healthy",store="redis"}'] == 0
