"""A real Prometheus child process for tests and docs: its own storage directory, a
free loopback port, history backfilled with ``promtool`` before it starts, and
optionally scrape targets and rule files (evaluated as often as it scrapes)."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from ratelimit_harness.redis import free_port
from ratelimit_harness.waiting import stop_process


def prometheus_missing() -> str | None:
    """Why no Prometheus can run here, or None."""
    for tool in ("prometheus", "promtool"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian package prometheus)"
    return None


def backfill(openmetrics: str, storage: Path, work: Path) -> None:
    """Turn OpenMetrics text (ending in ``# EOF``) into TSDB blocks in ``storage``."""
    storage.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    source = work / "history.om"
    source.write_text(openmetrics)
    result = subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(source), str(storage)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0:
        raise RuntimeError(f"promtool failed: {result.stderr.strip() or result.stdout.strip()}")


class Prometheus:
    """start/stop one prometheus server on loopback."""

    def __init__(
        self,
        directory: Path,
        *,
        scrape_targets: list[str] | None = None,
        scrape_interval: str = "1s",
        rule_files: list[Path] | None = None,
    ) -> None:
        self.directory = directory
        self.storage = directory / "data"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._targets = scrape_targets or []
        self._interval = scrape_interval
        self._rule_files = [str(path) for path in rule_files or []]
        self.process: subprocess.Popen[bytes] | None = None

    def backfill(self, openmetrics: str) -> None:
        backfill(openmetrics, self.storage, self.directory / "backfill")

    def start(self, timeout: float = 30.0) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        config = self.directory / "prometheus.yml"
        scrape = {
            "job_name": "ratelimit",
            "scrape_interval": self._interval,
            "static_configs": [{"targets": self._targets}],
        }
        # JSON is YAML: no dumper needed for this small file.
        config.write_text(
            json.dumps(
                {
                    "global": {
                        "scrape_interval": self._interval,
                        "scrape_timeout": self._interval,
                        "evaluation_interval": self._interval,
                    },
                    "rule_files": self._rule_files,
                    "scrape_configs": [scrape] if self._targets else [],
                }
            )
        )
        log = (self.directory / "prometheus.log").open("wb")
        command = [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={self.storage}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            # Backfilled weeks must outlive the default 15 days' retention.
            "--storage.tsdb.retention.time=400d",
        ]
        self.process = subprocess.Popen(command, stdout=log, stderr=log)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                text = (self.directory / "prometheus.log").read_text()[-2000:]
                raise RuntimeError(f"prometheus exited: {text}")
            if self._ready():
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"prometheus on port {self.port} not ready after {timeout} s")
        while self._targets and not self._scraped():
            # Discovery hands targets to the scrape loop about 5 s after start.
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus has not scraped {self._targets} in {timeout} s")
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as answer:
                return bool(answer.status == 200)
        except OSError:
            return False

    def _scraped(self) -> bool:
        """Every target has been scraped successfully at least once."""
        query = urllib.parse.urlencode({"query": 'up{job="ratelimit"} == 1'})
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=1) as answer:
                result = json.load(answer)["data"]["result"]
        except (OSError, ValueError, KeyError):
            return False
        return len(result) == len(self._targets)

    def api(self, path: str, **params: str) -> Any:
        """The ``data`` of one HTTP API call (``query``, ``rules``, ...); raises on an
        error status."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=5) as answer:
            body = json.load(answer)
        if body.get("status") != "success":
            raise RuntimeError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None
