"""``serve --workers N``: N service processes sharing one gRPC port, behind one admin port.

Python serves one core per process, so N processes bind the same gRPC address with
SO_REUSEPORT and the kernel spreads connections over them. They share their state
through Redis (with the embedded store each would allow the full limit: refused).

This parent runs no limiter. It starts the workers (each with a private admin port on
loopback), restarts one that dies, forwards SIGHUP and SIGTERM, and serves the public
admin port: ``/healthcheck`` is 200 only while every worker is, ``/metrics`` adds the
workers' counters and histograms up (gauges keep a ``worker`` label), ``/rlconfig`` is
the first worker's, ``/status.json`` holds every worker's snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

from ratelimit_service.core.address import listen_host, split_host_port
from ratelimit_service.server.http_server import INDEX, HttpServer, Page, pages, query_page
from ratelimit_service.server.status_page import HTML, JSON, PAGE, workers_json

log = logging.getLogger(__name__)

RESTART_DELAY = 1.0
"""Seconds before a worker that died is started again."""
STOP_TIMEOUT = 30.0
"""Seconds the workers get to stop (their --drain-timeout and grace) before they are killed."""
FETCH_TIMEOUT = 2.0
METRICS_FETCH_TIMEOUT = 8.0
"""A worker's /metrics at the stats keys' cap takes longer (under Prometheus's 10 s timeout)."""
SUMMED_TYPES = ("counter", "histogram", "summary")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Worker:
    def __init__(self, index: int, argv: list[str]) -> None:
        self.index = index
        self.admin_port = free_port()
        self.argv = argv
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "ratelimit_service", *self.argv,
            "--workers", "1", "--reuse-port", "--admin-addr", f"127.0.0.1:{self.admin_port}",
        )  # fmt: skip

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


async def fetch(port: int, path: str, timeout: float = FETCH_TIMEOUT) -> tuple[int, bytes]:
    """GET a worker's admin page; (0, b"") when it does not answer in ``timeout``."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.0\r\nHost: worker\r\n\r\n".encode())
            await writer.drain()
            raw = await reader.read()
            writer.close()
    except (OSError, TimeoutError):
        return 0, b""
    head, _, body = raw.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    return (int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0), body


def merge_metrics(texts: Sequence[str]) -> str:
    """One exposition from several: counters and histograms summed, gauges per worker."""
    families: dict[str, tuple[str, str]] = {}
    samples: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for worker, text in enumerate(texts):
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, (family.type, family.documentation))
            merged = samples.setdefault(family.name, {})
            summed = family.type in SUMMED_TYPES
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue  # per-process creation times do not add up
                labels = dict(sample.labels)
                if not summed:
                    labels["worker"] = str(worker)
                key = (sample.name, tuple(sorted(labels.items())))
                merged[key] = merged.get(key, 0.0) + sample.value
    lines: list[str] = []
    for name, (kind, documentation) in families.items():
        lines.append(f"# HELP {name} {documentation}")
        lines.append(f"# TYPE {name} {kind}")
        for (sample_name, label_pairs), value in samples[name].items():
            lines.append(f"{sample_name}{_labels(label_pairs)} {value!r}")
    return "\n".join(lines) + "\n"


def _merged_page(pages: Sequence[bytes]) -> bytes:
    """The merged exposition and how many workers answered."""
    merged = merge_metrics([page.decode() for page in pages]) + (
        "# HELP ratelimit_workers_serving Worker processes answering their admin port\n"
        f"# TYPE ratelimit_workers_serving gauge\nratelimit_workers_serving {len(pages)}\n"
    )
    return merged.encode()


def _labels(labels: tuple[tuple[str, str], ...]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in labels) + "}"


def _escape(value: str) -> str:
    """Label value escaping of the Prometheus text format."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Supervisor:
    def __init__(self, argv: list[str], workers: int, admin_addr: str) -> None:
        self.workers = [Worker(i, argv) for i in range(workers)]
        self.admin_addr = admin_addr
        self.stopping = False
        routes: dict[str, Page] = {
            "/healthcheck": self._health,
            "/metrics": self._metrics,
            "/rlconfig": self._rlconfig,
            "/status": lambda: (200, HTML, PAGE),
            "/status.json": self._status,
            "/": lambda: (200, "text/plain", INDEX),
        }
        self.admin = HttpServer(pages(routes) | {"/explain": query_page(self._explain)})

    async def _health(self) -> tuple[int, str, bytes]:
        results = await asyncio.gather(*(fetch(w.admin_port, "/healthcheck") for w in self.workers))
        up = sum(1 for status, _ in results if status == 200)
        body = f"workers: {up}/{len(self.workers)} serving\n".encode()
        if up == len(self.workers) and not self.stopping:
            return 200, "text/plain", b"OK\n" + body
        return 503, "text/plain", b"NOT SERVING\n" + body

    async def _metrics(self) -> tuple[int, str, bytes]:
        """The workers' pages merged in a thread (seconds of CPU), leaving this loop free."""
        results = await asyncio.gather(
            *(fetch(w.admin_port, "/metrics", METRICS_FETCH_TIMEOUT) for w in self.workers)
        )
        pages = [body for status, body in results if status == 200]
        merged = await asyncio.to_thread(_merged_page, pages)
        return 200, "text/plain; version=0.0.4; charset=utf-8", merged

    async def _rlconfig(self) -> tuple[int, str, bytes]:
        status, body = await fetch(self.workers[0].admin_port, "/rlconfig")
        if status != 200:
            return 503, "text/plain", b"worker 0 is not answering\n"
        return 200, "text/plain; charset=utf-8", body

    async def _status(self) -> tuple[int, str, bytes]:
        results = await asyncio.gather(*(fetch(w.admin_port, "/status.json") for w in self.workers))
        answered = [body if status == 200 else None for status, body in results]
        return 200, JSON, workers_json(answered)

    async def _explain(self, query: str) -> tuple[int, str, bytes]:
        """Worker 0's page: the same rules and store, its own view of the fleet."""
        status, body = await fetch(self.workers[0].admin_port, f"/explain?{query}")
        if status == 0:
            return 503, "text/plain", b"worker 0 is not answering\n"
        kind = "application/json" if body.startswith(b"{") else "text/plain; charset=utf-8"
        return status, kind, body

    def _forward(self, sig: int) -> None:
        for worker in self.workers:
            worker.signal(sig)

    async def _keep_alive(self, worker: Worker) -> None:
        while not self.stopping:
            await worker.start()
            assert worker.process is not None
            code = await worker.process.wait()
            if self.stopping:
                return
            log.error("worker %d exited with %s; restarting", worker.index, code)
            await asyncio.sleep(RESTART_DELAY)

    async def run(self) -> int:
        host, port = split_host_port(self.admin_addr, any_port=True)
        await self.admin.start(listen_host(host), port)
        stop = asyncio.Event()
        received: list[int] = []

        def on_signal(sig: int) -> None:
            received.append(sig)
            stop.set()

        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal, sig)
        loop.add_signal_handler(signal.SIGHUP, self._forward, signal.SIGHUP)
        keepers = [asyncio.create_task(self._keep_alive(w)) for w in self.workers]
        log.info("supervising %d workers, admin on %s", len(self.workers), self.admin_addr)
        await stop.wait()
        self.stopping = True
        for worker in self.workers:  # SIGTERM: the workers drain first; SIGINT: they don't
            worker.signal(received[0])
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT):
                await asyncio.gather(*keepers)
        for worker in self.workers:
            worker.signal(signal.SIGKILL)
        await self.admin.stop()
        return 0
