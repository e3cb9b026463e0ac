"""Settings of the xDS rule client, and the reconnect backoff it waits by.

The defaults are the Go service's (CONFIG_GRPC_XDS_* and XDS_CLIENT_*, those with a flag
through the --xds-* flags of core/settings_table.py), so a deployment written for
envoyproxy/ratelimit, Envoy Gateway's in particular, behaves the same.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ratelimit_service.core.settings_table import default

GO_SERVER_URL = "localhost:18000"
"""The Go service's CONFIG_GRPC_XDS_SERVER_URL when unset."""
MIN_MESSAGE_SIZE = 1024
"""The smallest ``max_message_size`` taken: below it no response would fit."""


@dataclass(frozen=True)
class XdsSettings:
    server_url: str = GO_SERVER_URL
    """host:port of the ADS server (CONFIG_GRPC_XDS_SERVER_URL)."""
    node_id: str = default("--xds-node-id")
    node_metadata: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)
    """Metadata sent on the stream (CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS)."""
    use_tls: bool = False
    client_cert: str | None = None
    client_key: str | None = None
    server_ca: str | None = None
    """CA bundle the server's certificate must chain to; None: the system roots."""
    server_san: str | None = None
    """The name to check the server's certificate for, when it is not server_url's host."""
    backoff_initial: float = default("--xds-backoff-initial")
    backoff_max: float = default("--xds-backoff-max")
    backoff_random_factor: float = 0.5
    backoff_jitter: bool = True
    max_message_size: int = default("--xds-max-message-size")
    keepalive_time: float = 300.0
    """Seconds between HTTP/2 pings on a quiet stream, so a server that vanished without
    closing the connection (a node lost, a partition) is noticed and the client
    reconnects. Five minutes is what default Go gRPC servers tolerate."""
    keepalive_timeout: float = 20.0

    def __post_init__(self) -> None:
        if ":" not in self.server_url.rsplit("]", 1)[-1]:
            raise ValueError(f"xDS server_url must be host:port, found {self.server_url!r}")
        if not self.node_id:
            raise ValueError("xDS node_id must not be empty")
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("xDS client_cert and client_key go together")
        tls_files = (self.client_cert, self.client_key, self.server_ca, self.server_san)
        if not self.use_tls and any(tls_files):
            raise ValueError("xDS TLS files or server_san are set but use_tls is false")
        if not 0 < self.backoff_initial <= self.backoff_max:
            raise ValueError("xDS backoff needs 0 < backoff_initial <= backoff_max")
        if not 0 <= self.backoff_random_factor < 1:
            raise ValueError("xDS backoff_random_factor must be in [0, 1)")
        if self.max_message_size < MIN_MESSAGE_SIZE:
            raise ValueError("xDS max_message_size is below 1 KiB")
        if self.keepalive_time <= 0 or self.keepalive_timeout <= 0:
            raise ValueError("xDS keepalive_time and keepalive_timeout must be positive")


def parse_key_values(text: str, separator: str = "=") -> dict[str, str]:
    """``"k=v,k2=v2"`` (the Go service's CONFIG_GRPC_XDS_NODE_METADATA form) as a dict;
    ``separator=":"`` reads CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS."""
    out: dict[str, str] = {}
    for item in text.split(","):
        if not item.strip():
            continue
        key, found, value = item.partition(separator)
        if not found or not key.strip():
            raise ValueError(f"expected key{separator}value, found {item!r}")
        out[key.strip()] = value.strip()
    return out


class Backoff:
    """cenkalti/backoff's exponential backoff: each wait 1.5 times the last, capped at
    ``maximum``, then spread by ±``random_factor`` when ``jitter`` is on, so a fleet of
    replicas that lost the same control plane does not come back at the same instant."""

    MULTIPLIER = 1.5

    def __init__(
        self,
        initial: float,
        maximum: float,
        random_factor: float = 0.5,
        jitter: bool = True,
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.initial, self.maximum = initial, maximum
        self.random_factor = random_factor if jitter else 0.0
        self._draw = draw
        self._current = initial

    def reset(self) -> None:
        self._current = self.initial

    def next(self) -> float:
        """Seconds to wait before the next try."""
        base = self._current
        self._current = min(self._current * self.MULTIPLIER, self.maximum)
        spread = self.random_factor * base
        return base - spread + self._draw() * 2 * spread
