"""Every setting of ``serve``, declared once: flag, group, default, help, the value's
parser, the Settings field it fills and the Go service's name for it. Everything else
reads it here:

- the command line (cli/parser.py) builds ``serve``'s flags and ``--help`` from SETTINGS
  and reads ``RATELIMIT_<FLAG>`` for each;
- cli/go_env.py reads each setting's Go variable (``go``) in the Go service's syntax;
- server/settings.py's ``Settings`` and every module with a keyword default for a
  setting (the stores, the limiter, the RLS servicer, the xDS client…) take
  :func:`default`;
- ``docs/settings.md``'s table of flags is :func:`markdown_table`.

Parsers raise ValueError with the cause: the command line turns it into a one-line
usage error naming the flag (or the environment variable) and the value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ratelimit_service.core.address import split_host_port
from ratelimit_service.core.config_model import HeaderStyle, Mode
from ratelimit_service.core.redis_url import normalize_url
from ratelimit_service.core.stretch import STRETCH

# -- value parsers ---------------------------------------------------------------------


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser of numbers above 0 of ``kind`` (int or float)."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"must be positive, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def not_negative(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"must be a number, 0 or more, got {text}")
    return value


def ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise ValueError(f"must be a number from 0 to 1, got {text}")
    return value


def true_or_false(text: str) -> bool:
    """``true`` or ``false`` (also 1/0, yes/no, on/off), for a setting on by default."""
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"must be true or false, got {text!r}")


def listen_addr(text: str) -> str:
    """``HOST:PORT``, or a ``unix:`` path (gRPC's form)."""
    return text if text.startswith("unix:") else host_port(text)


def host_port(text: str) -> str:
    """``HOST:PORT`` (the host may be empty: every address; IPv6 in brackets; port 0:
    any free one)."""
    split_host_port(text, any_port=True)
    return text


def redis_url(text: str) -> str:
    """A store URL, or ``HOST:PORT`` as the Go service writes REDIS_URL (see
    core/redis_url.py normalize_url)."""
    try:
        return normalize_url(text)
    except ValueError as exc:
        raise ValueError(f"{text!r}: {exc}") from None


def zone_name(text: str) -> str:
    """A zone's name: letters, digits, ``-``, ``_`` and ``.`` (it names Redis keys)."""
    if not text or not all(c.isalnum() or c in "-_." for c in text):
        raise ValueError(f"letters, digits, '-', '_' and '.' only, got {text!r}")
    return text


def log_level(text: str) -> str:
    level = text.upper()
    if level not in LOG_LEVELS:
        raise ValueError(f"choose from {', '.join(LOG_LEVELS)}, got {text!r}")
    return level


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# -- the declarations ------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    flag: str
    group: str
    help: str
    default: Any = None
    parse: Callable[[str], Any] = str
    choices: tuple[str, ...] | None = None
    switch: bool = False
    """A flag without a value (on when given, or when its variable is 1/true)."""
    fills: str | None = None
    """The Settings field it fills (None: the command line uses it itself)."""
    to_field: Callable[[Any], Any] | None = None
    """Turns the parsed value into the field's (an enum, None for an empty text)."""
    go_default: Any = "same"
    """The default when started from the Go service's settings, if it differs."""
    hidden: bool = False
    go: str = ""
    """The Go service's variable read one to one into this flag, in its own syntax
    (cli/go_env.py; the settings the Go service composes from several are read there)."""

    def field(self, value: Any) -> Any:
        """The Settings field's value for a parsed ``value``."""
        return self.to_field(value) if self.to_field is not None else value

    @property
    def metavar(self) -> str:
        """What ``--help`` shows for the value."""
        names = {
            host_port: "HOST:PORT",
            listen_addr: "ADDR",
            redis_url: "URL",
            true_or_false: "true|false",
        }
        if self.parse in names:
            return names[self.parse]
        if self.kind == "count":
            return "N"
        if self.kind in ("seconds", "share"):
            return "NUMBER"
        return "PATH" if self.flag.endswith(("-cert", "-key", "-ca", "--config")) else "TEXT"

    @property
    def kind(self) -> str:
        """What the value is: a switch, a choice, a share (0 to 1), seconds (every other number with
        a fraction), a count, or a text; the Go environment reads each kind in Go's syntax."""
        if self.switch:
            return "switch"
        if self.choices is not None:
            return "choice"
        if self.parse is ratio:
            return "share"
        name = getattr(self.parse, "__name__", "")
        if "int" in name:
            return "count"
        if "float" in name or self.parse is not_negative:
            return "seconds"
        return "text"

    @property
    def dest(self) -> str:
        return _dest(self.flag)

    @property
    def env(self) -> str:
        return env_name(self.flag)


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def env_name(flag: str) -> str:
    """The environment variable of a flag, any command's: ``--redis-url`` is
    ``RATELIMIT_REDIS_URL``."""
    return "RATELIMIT_" + _dest(flag).upper()


def _none_if_empty(value: Any) -> Any:
    return value or None


SETTINGS: tuple[Setting, ...] = (
    Setting("--grpc-addr", "listening", "gRPC listen address (HOST:PORT or unix:PATH)",
            "0.0.0.0:8081", listen_addr, fills="grpc_addr"),
    Setting("--admin-addr", "listening", "admin HTTP listen address: /healthcheck, /metrics,"
            " /rlconfig (off by default when started from envoyproxy/ratelimit's settings: the"
            " debug port serves them)", "127.0.0.1:6070", host_port, fills="admin_addr",
            to_field=_none_if_empty, go_default=None),
    Setting("--workers", "listening", "worker processes on one gRPC port (SO_REUSEPORT); more than"
            " 1 needs Redis", 1, positive(int)),
    Setting("--reuse-port", "listening", "share the gRPC port (set by --workers)", switch=True,
            fills="reuse_port", hidden=True),
    Setting("--grpc-engine", "listening", "what serves the gRPC port: grpcio, or native (our"
            " HTTP/2 for ShouldRateLimit and health checks, several times grpcio's calls per core;"
            " the other methods served by grpcio behind it)",
            "native", choices=("grpcio", "native"), fills="grpc_engine"),
    Setting("--event-loop", "listening", "event loop: uvloop when installed (auto), or asyncio's",
            "auto", choices=("auto", "asyncio", "uvloop")),
    Setting("--max-request-bytes", "listening", "largest request accepted (gRPC answers"
            " RESOURCE_EXHAUSTED beyond)", 1 << 20, positive(int), fills="max_request_bytes"),
    Setting("--grpc-max-connection-age", "listening", "seconds after which a gRPC connection is"
            " asked to go away (spreads clients over new replicas; off unless given)", None,
            positive(float), fills="grpc_max_connection_age", go="GRPC_MAX_CONNECTION_AGE"),
    Setting("--grpc-max-connection-age-grace", "listening", "seconds calls may take to finish on a"
            " connection asked to go away", None, not_negative,
            fills="grpc_max_connection_age_grace", go="GRPC_MAX_CONNECTION_AGE_GRACE"),
    Setting("--config", "rules", "rule file, or directory of *.yaml/*.yml (unset:"
            " envoyproxy/ratelimit's RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY; with"
            " --xds-server, rules come from xDS instead)", None, fills="config_path",
            to_field=lambda v: v or ""),
    Setting("--watch-interval", "rules", "seconds between checks of the config files for changes"
            " (0: never; SIGHUP always reloads)", 1.0, not_negative, fills="watch_interval"),
    Setting("--merge-domain-config", "rules", "merge files with the same domain instead of"
            " rejecting them", switch=True, fills="merge_domain_config", go="MERGE_DOMAIN_CONFIG"),
    Setting("--force-start-without-initial-config", "rules", "start (and keep watching) even when"
            " the rules do not load at start; until they do, no domain is known", switch=True,
            fills="force_start_without_initial_config", go="FORCE_START_WITHOUT_INITIAL_CONFIG"),
    Setting("--xds-server", "rules", "HOST:PORT of an xDS (ADS) server: rules from it, as"
            " RateLimitConfig resources, instead of --config", None, host_port),
    Setting("--xds-node-id", "rules", "this service's node id to the xDS server", "default",
            go="CONFIG_GRPC_XDS_NODE_ID"),
    Setting("--xds-node-metadata", "rules", "k=v,k2=v2: node metadata for the xDS server", "",
            go="CONFIG_GRPC_XDS_NODE_METADATA"),
    Setting("--xds-headers", "rules", "k:v,k2:v2: gRPC metadata on the xDS stream", "",
            go="CONFIG_GRPC_XDS_CLIENT_ADDITIONAL_HEADERS"),
    Setting("--xds-tls", "rules", "connect to the xDS server over TLS", switch=True,
            go="CONFIG_GRPC_XDS_SERVER_USE_TLS"),
    Setting("--xds-client-cert", "rules", "PEM client certificate for the xDS server",
            go="CONFIG_GRPC_XDS_CLIENT_TLS_CERT"),
    Setting("--xds-client-key", "rules", "PEM key of --xds-client-cert",
            go="CONFIG_GRPC_XDS_CLIENT_TLS_KEY"),
    Setting("--xds-server-ca", "rules", "PEM CA bundle that signed the xDS server",
            go="CONFIG_GRPC_XDS_SERVER_TLS_CACERT"),
    Setting("--xds-server-san", "rules", "name the xDS server's certificate must hold",
            go="CONFIG_GRPC_XDS_SERVER_TLS_SAN"),
    Setting("--xds-backoff-initial", "rules", "seconds before the first reconnect to the xDS server"
            " (growing x1.5 per try)", 10.0, positive(float),
            go="XDS_CLIENT_BACKOFF_INITIAL_INTERVAL"),
    Setting("--xds-backoff-max", "rules", "most seconds between two reconnects", 60.0,
            positive(float), go="XDS_CLIENT_BACKOFF_MAX_INTERVAL"),
    # gRPC's own default; a large Envoy Gateway install may need more (every config of
    # every route comes in one response).
    Setting("--xds-max-message-size", "rules", "largest xDS response accepted, in bytes", 4 << 20,
            positive(int)),
    Setting("--redis-url", "store", "Redis: redis://, rediss://, unix://, redis+sentinel://,"
            " redis+cluster:// URL, or HOST:PORT as the Go service writes it; without it, the"
            " embedded store", None, redis_url, fills="redis_url", to_field=_none_if_empty),
    Setting("--redis-timeout", "store", "the longest an exact decision waits for Redis before its"
            " failure_mode applies: the bound for callers with no deadline; a gRPC deadline (less"
            " --deadline-margin) shortens it", 1.0, positive(float), fills="redis_timeout",
            go="REDIS_TIMEOUT"),
    # An answer given later than this often reaches its caller after it has stopped
    # waiting (the fault tests in tests/faults/ show it with answers 2 ms before).
    Setting("--deadline-margin", "store", "seconds before the caller's gRPC deadline at which an"
            " exact decision stops waiting for Redis and answers by failure_mode (time to send the"
            " answer)", 0.005, not_negative, fills="deadline_margin"),
    Setting("--redis-silence", "store", "seconds with calls outstanding and no byte from Redis"
            " after which Redis counts as down (the circuit breaker opens); a slow reply never"
            " opens it", 1.0, positive(float), fills="redis_silence"),
    Setting("--redis-pool-size", "store", "most connections to Redis (the request path adds one of"
            " its own)", 64, positive(int), fills="redis_pool_size", go="REDIS_POOL_SIZE"),
    Setting("--redis-key-prefix", "store", "prefix of every key this service writes to Redis",
            "rl:", fills="redis_key_prefix"),
    Setting("--exact-batch-hold", "store", "seconds from one exact Redis call to the next at least:"
            " decisions that come sooner wait to share one call (0: never wait)", 0.001,
            not_negative, fills="exact_batch_hold"),
    # At the few thousand exact decisions a second one process makes, 2048 is several
    # hundred milliseconds of queue: far past any caller's deadline, so nothing useful
    # is refused.
    Setting("--exact-max-pending", "store", "exact requests that may wait for Redis at once; one"
            " more is refused (gRPC RESOURCE_EXHAUSTED, or denied by failure_mode: closed rules)",
            2048, positive(int), fills="exact_max_pending"),
    Setting("--sync-interval", "store", "seconds between probabilistic syncs", 0.25,
            positive(float), fills="sync_interval"),
    Setting("--sync-stretch", "store", "intervals a probabilistic bucket far below its limit, or"
            " one or an RLQS counter steady well over it (the bucket's wait paid in advance),"
            " may wait between two reports (1: every interval); a zone's aggregator's passes"
            " alike for one steady well over it",
            STRETCH, positive(int), fills="sync_stretch"),
    Setting("--stale-after", "store", "seconds without a successful sync before probabilistic rules"
            " use failure_mode", 3.0, positive(float), fills="stale_after"),
    Setting("--zone", "store", "this replica's zone (unique per global store): RLQS and"
            " probabilistic totals go to the zone's store (--redis-url), and one replica per zone"
            " publishes the zone's to --global-redis-url (off: one tier)", parse=zone_name,
            fills="zone"),
    Setting("--global-redis-url", "store", "with --zone: the store above the zones (Redis, Sentinel"
            " or Cluster); exact rules are decided on it", parse=redis_url,
            fills="global_redis_url"),
    Setting("--zone-interval", "store", "with --zone: seconds between two publishes of the zone's"
            " totals to the global store", 1.0, positive(float), fills="zone_interval"),
    Setting("--rlqs-publish-interval", "store", "seconds between two publishes of this replica's"
            " RLQS totals to the store (how soon a replica learns the others' demand)", 1.0,
            positive(float), fills="rlqs_publish_interval"),
    Setting("--mode", "modes and limits", "mode of rules that declare none", "probabilistic",
            choices=tuple(m.value for m in Mode), fills="mode", to_field=Mode),
    Setting("--shadow-mode", "modes and limits", "global shadow mode: report OVER_LIMIT per"
            " descriptor, never deny", switch=True, fills="shadow_mode", go="SHADOW_MODE"),
    Setting("--near-limit-ratio", "modes and limits", "share of a limit past which admitted hits"
            " count as near_limit", 0.8, ratio, fills="near_limit_ratio", go="NEAR_LIMIT_RATIO"),
    Setting("--count-denied-costs", "modes and limits", "count a cost (a descriptor's explicit"
            " hits_addend of 1 or more: usage already spent) when denied too; false: a denied call"
            " counts nothing", True, true_or_false, fills="count_denied_costs"),
    Setting("--max-buckets", "modes and limits", "bound on per-descriptor-value state (LRU beyond"
            " it)", 100_000, positive(int), fills="max_buckets"),
    Setting("--max-stats-keys", "modes and limits", "bound on distinct per-rule stats keys", 10_000,
            positive(int), fills="max_stats_keys"),
    Setting("--max-descriptors", "modes and limits", "most descriptors one request may carry (more:"
            " INVALID_ARGUMENT)", 64, positive(int), fills="max_descriptors"),
    Setting("--max-entries", "modes and limits", "most entries one descriptor may carry (more:"
            " INVALID_ARGUMENT)", 32, positive(int), fills="max_entries"),
    Setting("--response-headers", "Envoy compatibility", "add rate-limit headers to responses:"
            " RateLimit-* or draft-03 X-RateLimit-*", "off",
            choices=tuple(s.value for s in HeaderStyle), fills="response_headers",
            to_field=HeaderStyle),
    Setting("--header-limit", "Envoy compatibility", "name of the limit header", "RateLimit-Limit",
            go="LIMIT_LIMIT_HEADER"),
    Setting("--header-remaining", "Envoy compatibility", "name of the remaining header",
            "RateLimit-Remaining", go="LIMIT_REMAINING_HEADER"),
    Setting("--header-reset", "Envoy compatibility", "name of the reset header", "RateLimit-Reset",
            go="LIMIT_RESET_HEADER"),
    Setting("--header-rule", "Envoy compatibility", "name of a response header naming the rule that"
            " decided (its name, else its stats key), with or without --response-headers (empty:"
            " not sent)", ""),
    Setting("--go-dynamic-metadata", "Envoy compatibility", "answers' dynamic metadata carries"
            " envoyproxy/ratelimit's keys too (domain, descriptors, hitsAddend, the passed rules'"
            " metadata); ours per descriptor move to limits", switch=True,
            fills="go_dynamic_metadata", go="RESPONSE_DYNAMIC_METADATA"),
    Setting("--http-addr", "Envoy compatibility", "envoyproxy/ratelimit's HTTP port: GET"
            " /healthcheck and POST /json (off unless given)", None, host_port, fills="http_addr",
            to_field=_none_if_empty),
    Setting("--debug-addr", "Envoy compatibility", "envoyproxy/ratelimit's debug port: /rlconfig"
            " and /metrics (off unless given)", None, host_port, fills="debug_addr",
            to_field=_none_if_empty),
    Setting("--healthy-with-at-least-one-config-loaded", "Envoy compatibility", "health checks fail"
            " until rules with at least one domain are loaded", switch=True,
            fills="healthy_with_at_least_one_config_loaded",
            go="HEALTHY_WITH_AT_LEAST_ONE_CONFIG_LOADED"),
    Setting("--tls-cert", "TLS", "PEM certificate: serve gRPC over TLS", fills="tls_cert"),
    Setting("--tls-key", "TLS", "PEM private key of --tls-cert", fills="tls_key"),
    Setting("--tls-client-ca", "TLS", "PEM CA bundle: require client certificates signed by it"
            " (mTLS)", fills="tls_client_ca"),
    Setting("--drain-timeout", "operations", "on SIGTERM, seconds the service keeps answering while"
            " its health reports NOT_SERVING, so a health-checking Envoy moves away first (0: stop"
            " at once; SIGINT always stops at once)", 15.0, not_negative, fills="drain_timeout"),
    Setting("--drain-quiet", "operations", "draining ends once no call came for this many seconds",
            1.0, positive(float), fills="drain_quiet"),
    Setting("--log-level", "observability", "log level", "INFO", log_level, choices=LOG_LEVELS),
    Setting("--log-format", "observability", "log format", "text", choices=("text", "json"),
            fills="log_format", go="LOG_FORMAT"),
    Setting("--statsd-addr", "observability", "HOST:PORT of a statsd agent: envoyproxy/ratelimit's"
            " stats over UDP (off unless given)", None, host_port, fills="statsd_addr",
            to_field=_none_if_empty),
    Setting("--statsd-flush-interval", "observability", "seconds between two statsd flushes", 10.0,
            positive(float), fills="statsd_flush_interval", go="STATS_FLUSH_INTERVAL"),
    Setting("--prometheus-addr", "observability", "HOST:PORT of a listener serving only the metrics"
            " (off unless given)", None, host_port, fills="prometheus_addr",
            to_field=_none_if_empty),
    Setting("--prometheus-path", "observability", "path of the metrics there", "/metrics",
            fills="prometheus_path"),
    Setting("--tracing", "observability", "OpenTelemetry spans per decision, children of the"
            " caller's (Envoy's), exported over OTLP (needs the tracing extra)", switch=True,
            fills="tracing", go="TRACING_ENABLED"),
    Setting("--tracing-endpoint", "observability", "the OTLP receiver's base URL (http://HOST:4317"
            " for grpc, :4318 for http); unset: OTEL_EXPORTER_OTLP_ENDPOINT, else localhost", None,
            fills="tracing_endpoint", to_field=_none_if_empty),
    Setting("--tracing-protocol", "observability", "OTLP over grpc or http (protobuf)", "http",
            choices=("grpc", "http"), fills="tracing_protocol", go="TRACING_EXPORTER_PROTOCOL"),
    Setting("--tracing-sampling-rate", "observability", "share of calls traced (those their caller"
            " sampled out never are)", 1.0, ratio, fills="tracing_sampling_rate",
            go="TRACING_SAMPLING_RATE"),
    Setting("--tracing-service-name", "observability", "service.name of the spans",
            "ratelimit-service", fills="tracing_service_name", go_default="RateLimit",
            go="TRACING_SERVICE_NAME"),
    Setting("--tracing-service-namespace", "observability", "service.namespace of the spans", "",
            fills="tracing_service_namespace", go="TRACING_SERVICE_NAMESPACE"),
    Setting("--tracing-service-instance-id", "observability", "service.instance.id of the spans"
            " (unset: a random UUID per process)", "", fills="tracing_service_instance_id",
            go="TRACING_SERVICE_INSTANCE_ID"),
)  # fmt: skip

BY_FLAG = {setting.flag: setting for setting in SETTINGS}
GROUPS = tuple(dict.fromkeys(setting.group for setting in SETTINGS))
"""``serve --help`` shows the flags in these groups, in this order (the table's)."""


def default(flag: str) -> Any:
    """The value ``flag`` stands for when it is not given, as its Settings field holds it (an enum,
    None for an empty address, False for a switch): what a keyword default for the setting reads."""
    setting = BY_FLAG[flag]
    return setting.field(False if setting.switch else setting.default)


def choices_of(flag: str) -> tuple[str, ...]:
    """The values ``flag`` takes (a flag with a fixed set of them)."""
    if (values := BY_FLAG[flag].choices) is None:
        raise KeyError(f"{flag} takes any value")
    return values


def markdown_table() -> str:
    """docs/settings.md's table of serve's flags, group by group."""
    lines = ["| flag | default | environment | what it does |", "|---|---|---|---|"]
    for group in GROUPS:
        lines.append(f"| **{group}** | | | |")
        for setting in SETTINGS:
            if setting.group != group or setting.hidden:
                continue
            shown = "off" if setting.switch else _shown(setting.default)
            lines.append(f"| `{setting.flag}` | {shown} | `{setting.env}` | {setting.help} |")
    return "\n".join(lines) + "\n"


def _shown(default: Any) -> str:
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    return "(none)" if default in (None, "") else f"`{default}`"
