"""A replica SIGKILLed behind a real Envoy running the shipped bootstrap: how long Envoy
keeps sending calls to the dead replica, and so answers requests by its rate-limit
filter's failure mode (``failure_mode_deny: false``: let the request through undecided).

Two real service processes, a real Envoy 1.40 on envoy/envoy.yaml with only its addresses
made loopback, and, as the upstream, a second Envoy answering 200 from a
``direct_response`` (a Python upstream would cap the rate it serves, not Envoy). h2load
sends 400 requests a second with ``x-tenant: blocked``, whose rule (config/edge.yaml) is a
limit of 0: every request the service decides is a 429, so every 200 is a request the
filter let through undecided. h2load logs each request's start, status and duration, so
the test knows when each answer came, measured against the moment of the kill.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from ratelimit_harness.envoy import Envoy, ServiceProcess, load_yaml, substitute_addresses
from ratelimit_harness.envoy_fixtures import (
    CONFIG_DIR,
    LOOPBACK_ANY,
    SHIPPED_BOOTSTRAP,
    Load,
)

pytestmark = [pytest.mark.slow, pytest.mark.serial]

RATE = 400
"""Requests a second through Envoy."""
SECONDS = 6.0
"""How long the load runs; the kill comes after about one second of it."""
OUT_WITHIN = 1.0
"""Seconds from the kill within which Envoy must stop calling the dead replica, and so
stop answering requests by its failure mode on the dead replica's account."""
SHOWN_STATS = (
    "cluster.upstream.ratelimit.",  # the filter: ok, over_limit, error, failure_mode_allowed
    "cluster.ratelimit.outlier_detection.",
    "cluster.ratelimit.upstream_rq_retry",
    "cluster.ratelimit.upstream_cx_connect_fail",
)
"""Envoy's counters printed with the figures."""
BOOTSTRAP = SHIPPED_BOOTSTRAP
"""The bootstrap under test: envoy/envoy.yaml."""
DECIDED = "429"
UNDECIDED = "200"


def answering_upstream() -> dict[str, Any]:
    """A bootstrap whose one listener answers 200 ``ok`` to every request by itself."""
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
        },
    }
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "upstream",
        "http_filters": [router],
        "route_config": {
            "virtual_hosts": [
                {
                    "name": "all",
                    "domains": ["*"],
                    "routes": [
                        {
                            "match": {"prefix": "/"},
                            "direct_response": {"status": 200, "body": {"inline_string": "ok"}},
                        }
                    ],
                }
            ]
        },
    }
    loopback = {"socket_address": {"address": "127.0.0.1", "port_value": 0}}
    return {
        "admin": {"address": loopback},
        "static_resources": {
            "listeners": [
                {
                    "name": "upstream",
                    "address": loopback,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ]
        },
    }


def edge_bootstrap(replicas: list[ServiceProcess], upstream_port: int) -> dict[str, Any]:
    """BOOTSTRAP with its addresses, and nothing else, made loopback: the ``ratelimit``
    endpoint becomes every replica."""
    result: dict[str, Any] = substitute_addresses(
        load_yaml(BOOTSTRAP),
        {
            ("0.0.0.0", 9901): LOOPBACK_ANY,
            ("0.0.0.0", 8080): LOOPBACK_ANY,
            ("ratelimit", 8081): [replica.address for replica in replicas],
            ("upstream", 8080): ("127.0.0.1", upstream_port),
        },
    )
    return result


def answers(load: Load) -> list[tuple[float, str]]:
    """(when the answer came, in seconds since the epoch; its status) of every request of
    ``load``, from h2load's log: start (µs since the epoch), status, duration (µs)."""
    found = []
    for log in load.logs:
        for line in log.read_text().splitlines():
            start, status, duration = line.split("\t")[:3]
            found.append(((int(start) + int(duration)) / 1e6, status))
    return sorted(found)


def timeline(answered: list[tuple[float, str]], origin: float, step: float = 0.25) -> str:
    """Answers by status in windows of ``step`` seconds from ``origin`` (the kill): the
    figures a failure shows."""
    windows: dict[float, Counter[str]] = {}
    for when, status in answered:
        start = (when - origin) // step * step
        windows.setdefault(start, Counter())[status] += 1
    return "\n".join(
        f"  {start:+6.2f} s: " + " ".join(f"{s}={n}" for s, n in sorted(windows[start].items()))
        for start in sorted(windows)
    )


class HostCounters:
    """Envoy's per-host counters of the ``ratelimit`` cluster (admin /clusters), read every
    50 ms in a thread while the load runs, and once more at the end: when the dead
    replica last got a call, and how many calls failed on the live one."""

    INTERVAL = 0.05

    def __init__(self, envoy: Envoy) -> None:
        self.envoy = envoy
        self.rows: list[tuple[float, dict[str, dict[str, str]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._look()
            self._stop.wait(self.INTERVAL)

    def _look(self) -> None:
        # Timed once read: what a row shows happened before its time.
        hosts = self.envoy.hosts("ratelimit")
        self.rows.append((time.time(), hosts))

    def __enter__(self) -> HostCounters:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._look()

    def value(self, row: dict[str, dict[str, str]], host: str, *fields: str) -> int:
        return sum(int(row.get(host, {}).get(field, 0)) for field in fields)

    def settled(self, host: str, since: float, *fields: str) -> float:
        """The first time from ``since`` on at which ``fields`` of ``host`` had reached
        their final sum: after it, no look saw them change."""
        final = self.value(self.rows[-1][1], host, *fields)
        return min(
            t for t, row in self.rows if t >= since and self.value(row, host, *fields) == final
        )

    def first(self, host: str, since: float, flag: str) -> float | None:
        """The first time from ``since`` on at which ``host``'s health flags held ``flag``."""
        return next(
            (
                t
                for t, row in self.rows
                if t >= since and flag in row.get(host, {}).get("health_flags", "")
            ),
            None,
        )

    def at(self, when: float) -> tuple[float, dict[str, dict[str, str]]]:
        """The first look at or after ``when``."""
        return next((t, row) for t, row in self.rows if t >= when)


def test_a_killed_replica_is_out_of_envoy_within_a_second(
    start_envoy: Callable[..., Envoy],
    spawn_service: Callable[..., ServiceProcess],
    start_load: Callable[..., Load],
) -> None:
    """SIGKILL one of two replicas under 400 requests a second: within 1 s of the kill
    Envoy has ejected it (outlier detection) and sends it no more calls, so no request
    after that second is answered by the filter's failure mode on its account. A request
    the live replica does not answer in 20 ms (a busy machine) is let through too; each
    such one shows as an error on the live host in Envoy's counters, so the test counts
    them apart. The load keeps its rate, decided by the live replica."""
    replicas = [spawn_service(CONFIG_DIR) for _ in range(2)]
    upstream = start_envoy(answering_upstream())
    envoy = start_envoy(edge_bootstrap(replicas, upstream.listener_port("upstream")))
    dead, live = (f"127.0.0.1:{replica.grpc_port}" for replica in replicas)
    envoy.wait_for(
        "both replicas healthy", lambda: envoy.healthy_hosts("ratelimit") == {dead, live}
    )

    load = start_load(envoy, [(RATE, SECONDS)], "kill", {"x-tenant": "blocked"})
    with HostCounters(envoy) as counters:

        def both_answering() -> bool:
            calls = envoy.hosts("ratelimit")
            return all(int(calls[host].get("rq_success", 0)) >= RATE // 4 for host in (dead, live))

        envoy.wait_for("both replicas answering the load", both_answering, timeout=SECONDS / 2)
        killed_at = time.time()
        replicas[0].kill()
        load.wait(timeout=SECONDS + 30)

    # When the dead replica got its last call (connection attempts and streams), when
    # its ejection was first seen; and Envoy's failure-mode answers on its account.
    calls_stopped = counters.settled(dead, killed_at, "cx_total", "rq_total") - killed_at
    ejected = counters.first(dead, killed_at, "failed_outlier_check")
    answered = answers(load)
    after_kill = [(when, status) for when, status in answered if when >= killed_at]
    undecided = [when for when, status in after_kill if status == UNDECIDED]
    # From the first look 1 s after the kill: every failure-mode answer later than that
    # look (plus the 20 ms of a call and some slack) failed on the live replica, which
    # counted an error for it after the look.
    look, row = counters.at(killed_at + OUT_WITHIN)
    late = [when for when in undecided if when > look + 0.03]
    live_errors = counters.value(counters.rows[-1][1], live, "rq_error") - counters.value(
        row, live, "rq_error"
    )
    stats = envoy.stats()
    figures = (
        f"(looks every {HostCounters.INTERVAL * 1000:.0f} ms) calls to the dead replica "
        f"stopped {calls_stopped:.3f} s after the kill, ejected "
        f"{'never' if ejected is None else f'{ejected - killed_at:.3f} s after it'}; "
        f"failure-mode answers after the kill: {len(undecided)} of {len(after_kill)}, "
        f"{len(late)} later than {OUT_WITHIN} s (errors of the live replica meanwhile: "
        f"{live_errors}); "
        + json.dumps({k: v for k, v in sorted(stats.items()) if k.startswith(SHOWN_STATS)})
        + f"\nanswers by status, in 250 ms windows from the kill:\n{timeline(answered, killed_at)}"
    )
    print(figures)

    # Every answer is the service's 429 or the failure mode's 200: nothing else failed.
    assert {status for _, status in answered} <= {DECIDED, UNDECIDED}, figures
    assert calls_stopped <= OUT_WITHIN, figures
    assert ejected is not None and ejected - killed_at <= OUT_WITHIN, figures
    assert len(late) <= live_errors, figures
    # The live replica decided the rest: the load kept its rate, all of it 429.
    decided = sum(1 for when, status in after_kill if status == DECIDED and when > look)
    assert decided >= 0.5 * RATE * (SECONDS - 3), figures
    assert envoy.healthy_hosts("ratelimit") == {live}, figures
