"""The gRPC port's count of the calls this process took: started, succeeded and failed,
the native front door's (server/native_grpc.py) and grpcio's from channelz (on by
default in gRPC core, read at scrape time).

With grpcio serving a call, a call whose deadline passes while it waits in the runtime
(a process past its capacity: the calls queue in gRPC's C core before Python sees
them) is ended with
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

from prometheus_client.core import CounterMetricFamily

from ratelimit_service.server.native_grpc import CallCounts

log = logging.getLogger(__name__)


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
_COUNTS = (("started", "callsStarted"), ("succeeded", "callsSucceeded"), ("failed", "callsFailed"))
"""Each ``result`` label and the channelz server field that counts it."""


def grpc_call_metrics(native: CallCounts | None = None) -> Iterator[CounterMetricFamily]:
    """``ratelimit_grpc_server_calls_total{result}``: started, succeeded and failed over every
    gRPC server in the process, and the native front door's calls (``native``); nothing
    when the runtime cannot say (no channelz)."""
    if _READ is None:
        return
    try:
        servers = json.loads(_READ(0)).get("server", [])
    except (ValueError, RuntimeError) as exc:  # channelz disabled, or an unreadable answer
        log.debug("channelz gave no server counts: %s", exc)
        return
    if native is not None:
        servers.append(
            {
                "data": {
                    "callsStarted": native.started,
                    "callsSucceeded": native.succeeded,
                    "callsFailed": native.failed,
                }
            }
        )
    family = CounterMetricFamily(
        "ratelimit_grpc_server_calls",
        "gRPC calls as the gRPC runtime counts them (channelz): failed includes calls"
        " whose deadline passed before an answer, those that never reached a handler too",
        labels=["result"],
    )
    for result, name in _COUNTS:  # proto3 JSON leaves out zeros
        family.add_metric([result], sum(int(s.get("data", {}).get(name, 0)) for s in servers))
    yield family
