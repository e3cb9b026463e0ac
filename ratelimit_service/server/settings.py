"""What a running service needs: :class:`Settings`, a field per setting of
core/settings_table.py that fills one, and a few no flag fills; built by :func:`fields_from`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ratelimit_service.config.xds_settings import XdsSettings
from ratelimit_service.core.config_model import HeaderStyle, Mode
from ratelimit_service.core.headers import HeaderNames
from ratelimit_service.core.settings_table import SETTINGS, default


@dataclass(frozen=True, slots=True)
class Settings:
    """The service's settings; a field named like a flag (``redis_timeout``) is that flag's."""

    config_path: str = default("--config")
    grpc_addr: str = default("--grpc-addr")
    admin_addr: str | None = default("--admin-addr")
    mode: Mode = default("--mode")
    sync_interval: float = default("--sync-interval")
    sync_stretch: int = default("--sync-stretch")
    redis_url: str | None = default("--redis-url")
    redis_timeout: float = default("--redis-timeout")
    redis_silence: float = default("--redis-silence")
    deadline_margin: float = default("--deadline-margin")
    redis_pool_size: int = default("--redis-pool-size")
    redis_key_prefix: str = default("--redis-key-prefix")
    exact_batch_hold: float = default("--exact-batch-hold")
    exact_max_pending: int = default("--exact-max-pending")
    stale_after: float = default("--stale-after")
    zone: str | None = default("--zone")
    global_redis_url: str | None = default("--global-redis-url")
    zone_interval: float = default("--zone-interval")
    rlqs_publish_interval: float = default("--rlqs-publish-interval")
    max_buckets: int = default("--max-buckets")
    max_stats_keys: int = default("--max-stats-keys")
    merge_domain_config: bool = default("--merge-domain-config")
    shadow_mode: bool = default("--shadow-mode")
    near_limit_ratio: float = default("--near-limit-ratio")
    count_denied_costs: bool = default("--count-denied-costs")
    force_start_without_initial_config: bool = default("--force-start-without-initial-config")
    healthy_with_at_least_one_config_loaded: bool = default(
        "--healthy-with-at-least-one-config-loaded"
    )
    drain_timeout: float = default("--drain-timeout")
    drain_quiet: float = default("--drain-quiet")
    max_descriptors: int = default("--max-descriptors")
    max_entries: int = default("--max-entries")
    max_request_bytes: int = default("--max-request-bytes")
    response_headers: HeaderStyle = default("--response-headers")
    go_dynamic_metadata: bool = default("--go-dynamic-metadata")
    log_format: str = default("--log-format")
    watch_interval: float = default("--watch-interval")
    reuse_port: bool = default("--reuse-port")
    grpc_engine: str = default("--grpc-engine")
    tls_cert: str | None = default("--tls-cert")
    tls_key: str | None = default("--tls-key")
    tls_client_ca: str | None = default("--tls-client-ca")
    http_addr: str | None = default("--http-addr")
    debug_addr: str | None = default("--debug-addr")
    statsd_addr: str | None = default("--statsd-addr")
    statsd_flush_interval: float = default("--statsd-flush-interval")
    prometheus_addr: str | None = default("--prometheus-addr")
    prometheus_path: str = default("--prometheus-path")
    tracing: bool = default("--tracing")
    tracing_endpoint: str | None = default("--tracing-endpoint")
    tracing_protocol: str = default("--tracing-protocol")
    tracing_sampling_rate: float = default("--tracing-sampling-rate")
    tracing_service_name: str = default("--tracing-service-name")
    tracing_service_namespace: str = default("--tracing-service-namespace")
    tracing_service_instance_id: str = default("--tracing-service-instance-id")
    grpc_max_connection_age: float | None = default("--grpc-max-connection-age")
    grpc_max_connection_age_grace: float | None = default("--grpc-max-connection-age-grace")
    header_names: HeaderNames = field(default_factory=HeaderNames)
    """The four --header-* flags."""
    shutdown_grace: float = 5.0
    """Seconds calls in flight may take to finish once draining is over (no flag)."""
    xds: XdsSettings | None = None
    """Rules from an xDS server (--xds-*; CONFIG_TYPE=GRPC_XDS_SOTW) instead of files."""


def fields_from(values: dict[str, Any]) -> dict[str, Any]:
    """Settings fields from parsed values by flag ``dest``, the four header flags as one."""
    fields = {s.fills: s.field(values[s.dest]) for s in SETTINGS if s.fills is not None}
    headers = (values[f"header_{part}"] for part in ("limit", "remaining", "reset", "rule"))
    fields["header_names"] = HeaderNames(*headers)
    return fields
