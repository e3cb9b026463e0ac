"""The gRPC runtime's own count of the calls this process's server took: started,
succeeded and failed, from channelz (on by default in gRPC core, read at scrape time).

A call whose deadline passes while it waits in the runtime (a process past its
capacity: the calls queue in gRPC's C core before Python sees them) is ended with
DEADLINE_EXCEEDED by the runtime, often without reaching a handler, so the service's
own counters never see it; Envoy then answers by its own failure mode. Those calls
show here as failed: failed calls beyond the service's own refusals (an
INVALID_ARGUMENT or RESOURCE_EXHAUSTED answer, counted on /metrics too) are calls
that Envoy gave up on (docs/operations.md).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GrpcCalls:
    """The runtime's counts over every gRPC server in the process."""

    started: int
    succeeded: int
    failed: int


def _channelz_servers() -> Callable[[int], bytes] | None:
    """gRPC's channelz read-out of servers (JSON), or None where this grpcio has none:
    the grpcio-channelz package serves the same function over gRPC."""
    try:
        from grpc._cython import cygrpc
    except ImportError:  # pragma: no cover - grpcio always ships it
        return None
    read: Callable[[int], bytes] | None = getattr(cygrpc, "channelz_get_servers", None)
    return read


_READ = _channelz_servers()


def grpc_calls() -> GrpcCalls | None:
    """The counts now, or None when the runtime cannot say (no channelz)."""
    if _READ is None:
        return None
    try:
        servers = json.loads(_READ(0)).get("server", [])
    except (ValueError, RuntimeError) as exc:  # channelz disabled, or an unreadable answer
        log.debug("channelz gave no server counts: %s", exc)
        return None
    totals = {"callsStarted": 0, "callsSucceeded": 0, "callsFailed": 0}
    for server in servers:
        data = server.get("data", {})
        for name in totals:
            totals[name] += int(data.get(name, 0))  # proto3 JSON leaves out zeros
    return GrpcCalls(totals["callsStarted"], totals["callsSucceeded"], totals["callsFailed"])


def grpc_call_metrics() -> Iterator[CounterMetricFamily]:
    """``ratelimit_grpc_server_calls_total{result}``: started, succeeded, failed."""
    calls = grpc_calls()
    if calls is None:
        return
    family = CounterMetricFamily(
        "ratelimit_grpc_server_calls",
        "gRPC calls as the gRPC runtime counts them (channelz): failed includes calls"
        " whose deadline passed before an answer, those that never reached a handler too",
        labels=["result"],
    )
    family.add_metric(["started"], calls.started)
    family.add_metric(["succeeded"], calls.succeeded)
    family.add_metric(["failed"], calls.failed)
    yield family
