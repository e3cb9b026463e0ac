"""envoyproxy/ratelimit's environment settings (``REDIS_URL``, ``PORT``, ``RUNTIME_ROOT``, …)
as values for our ``serve`` flags (their weakest source, cli/parser.py), so a Go
deployment's environment runs this service unchanged.

A Go variable that sets one flag is named in that flag's declaration (``go`` in
core/settings_table.py) and read by the syntax of the flag's kind (:func:`_read`); the
rules below read the others (composed from several variables, or read their own way).

Each Go setting is *supported* (mapped onto a flag with the Go semantics), *accepted*
(changes nothing here; a startup warning when set to other than what we do anyway) or
*refused* (``BACKEND_TYPE=memcache``: the start stops, with the reason); docs/settings.md
has the table. A value that does not parse raises :class:`GoSettingError` (exit status 2).

*Go mode* (``/bin/ratelimit``, or ``serve`` given no ``--config`` and no
``RATELIMIT_CONFIG``) applies the Go service's defaults where ours differ (docs/settings.md).
"""

from __future__ import annotations

import math
import posixpath
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from urllib.parse import quote

from ratelimit_service.config.xds_settings import GO_SERVER_URL, MIN_MESSAGE_SIZE
from ratelimit_service.core.address import split_host_port
from ratelimit_service.core.settings_table import SETTINGS, Setting, not_negative

GO_LOG_LEVELS = {
    "trace": "DEBUG",
    "debug": "DEBUG",
    "info": "INFO",
    "warn": "WARNING",
    "warning": "WARNING",
    "error": "ERROR",
    "fatal": "CRITICAL",
    "panic": "CRITICAL",
}
"""logrus level names (what the Go service's LOG_LEVEL takes) → ours."""

_TRUE = ("1", "t", "T", "true", "TRUE", "True")
_FALSE = ("0", "f", "F", "false", "FALSE", "False")
"""What Go's strconv.ParseBool takes."""

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

_NO_REDIS_YET = "the service starts without Redis and uses failure_mode until it answers"
ACCEPTED = {
    "RUNTIME_WATCH_ROOT": "rules are polled by content, which sees both a changed file and a"
    " swapped directory: nothing to choose",
    "EXTRA_TAGS": "statsd stats carry no tags",
    "USE_DOG_STATSD": "stats go out as plain statsd",
    "USE_DOG_STATSD_MOGRIFIERS": "stats go out as plain statsd",
    "PROMETHEUS_MAPPER_YAML": "/metrics has its own fixed names (docs/settings.md);"
    " no statsd_exporter mapping is read",
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS": "/metrics has its own fixed names",
    "EXPIRATION_JITTER_MAX_SECONDS": "Redis keys expire with their own window",
    "LOCAL_CACHE_SIZE_IN_BYTES": "no over-limit cache: probabilistic rules decide in the"
    " process instead",
    "REDIS_PIPELINE_WINDOW": "concurrent decisions share Redis calls by themselves",
    "REDIS_PIPELINE_LIMIT": "concurrent decisions share Redis calls by themselves",
    "REDIS_CLUSTER_PIPELINE_PARALLELISM": "concurrent decisions share Redis calls by themselves",
    "REDIS_POOL_ON_EMPTY_BEHAVIOR": "a call waits for a free connection within its deadline",
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION": "a circuit breaker watches Redis instead",
    "REDIS_STARTUP_INITIAL_INTERVAL": _NO_REDIS_YET,
    "REDIS_STARTUP_MAX_INTERVAL": _NO_REDIS_YET,
    "REDIS_STARTUP_MAX_ELAPSED_TIME": _NO_REDIS_YET,
    "MEMCACHE_HOST_PORT": "there is no memcache backend",
    "MEMCACHE_SRV": "there is no memcache backend",
    "MEMCACHE_SRV_REFRESH": "there is no memcache backend",
    "MEMCACHE_MAX_IDLE_CONNS": "there is no memcache backend",
    "MEMCACHE_TLS": "there is no memcache backend",
    "GRPC_UDS_MODE": "the socket keeps the process's umask",
    "CONFIG_GRPC_XDS_SERVER_CONNECT_RETRY_INTERVAL": "reconnects follow the"
    " XDS_CLIENT_BACKOFF_* intervals",
    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR": "the backoff's random factor is 0.5",
    "XDS_CLIENT_BACKOFF_JITTER": "the backoff always has jitter",
}
"""Go settings that change nothing here, and why; a warning names each one that is set."""

_QUIET_WHEN = {
    "RUNTIME_WATCH_ROOT": None,  # never worth a warning
    "USE_DOG_STATSD": _FALSE,
    "USE_DOG_STATSD_MOGRIFIERS": ("",),
    "PROMETHEUS_RESPONSE_TIME_AS_MILLISECONDS": _FALSE,
    "REDIS_HEALTH_CHECK_ACTIVE_CONNECTION": _FALSE,
    "REDIS_PIPELINE_WINDOW": ("0", "0s"),
    "REDIS_PIPELINE_LIMIT": ("0",),
    "XDS_CLIENT_BACKOFF_RANDOM_FACTOR": ("0.5",),
    "XDS_CLIENT_BACKOFF_JITTER": _TRUE,
}
"""Values of accepted settings that ask for what we do anyway: no warning for those."""


class GoSettingError(ValueError):
    """A Go setting whose value cannot be used; the message names it and its value."""

    def __init__(self, name: str, value: str, reason: str) -> None:
        super().__init__(f"{name}={value!r}: {reason}")


@dataclass(frozen=True, slots=True)
class GoValue:
    """A value for one of our flags, in that flag's syntax, and the Go names it came from."""

    value: str
    source: str


@dataclass
class GoEnvironment:
    values: dict[str, GoValue] = field(default_factory=dict)
    """Our flag (``--http-addr``) → its value from the Go settings."""
    warnings: list[str] = field(default_factory=list)
    go_mode: bool = False

    def get(self, flag: str) -> GoValue | None:
        return self.values.get(flag)


def read_go_environment(environ: Mapping[str, str], *, go_mode: bool) -> GoEnvironment:
    """Our flags' values from the Go service's environment; raises GoSettingError."""
    reader = _Reader(environ, GoEnvironment(go_mode=go_mode))
    for rule in _RULES:
        rule(reader)
    return reader.out


class _Reader:
    def __init__(self, environ: Mapping[str, str], out: GoEnvironment) -> None:
        self.env = environ
        self.out = out
        self.go_mode = out.go_mode

    def has(self, name: str) -> bool:
        return name in self.env

    def text(self, name: str, default: str = "") -> str:
        return self.env.get(name, default)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.env.get(name)
        if not value:
            return default
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise GoSettingError(name, value, "expected true or false")

    def port(self, name: str, default: int) -> int:
        value = self.env.get(name)
        if not value:
            return default
        if not value.isdigit() or not 0 <= int(value) <= 65535:
            raise GoSettingError(name, value, "not a port number (0-65535)")
        return int(value)

    def error(self, name: str, reason: str) -> GoSettingError:
        """``name``'s value refused for ``reason``."""
        return GoSettingError(name, self.text(name), reason)

    def set(self, flag: str, value: object, source: str) -> None:
        self.out.values[flag] = GoValue(str(value), source)

    def warn(self, message: str) -> None:
        self.out.warnings.append(message)


def parse_go_duration(name: str, value: str) -> float:
    """Seconds of a Go ``time.Duration`` string; a plain number is taken as seconds."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        parts = _DURATION_PART.findall(text)
        if parts and "".join(n + u for n, u in parts) == text:
            return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)
        seconds = math.nan
    if math.isfinite(seconds) and seconds >= 0:
        return seconds
    raise GoSettingError(name, value, "expected a duration such as 10s or 500ms")


def _address(host: str, port: int) -> str:
    host = host or "0.0.0.0"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


# -- the rules, one per group of Go settings ------------------------------------------


def _one_to_one(r: _Reader, *, xds: bool = False) -> None:
    """Every Go variable that sets one flag, the xDS client's (``xds``: read by _xds,
    only when rules come by xDS) or the others."""
    for setting in SETTINGS:
        if setting.go and setting.flag.startswith("--xds-") == xds:
            _read(r, setting)


def _read(r: _Reader, setting: Setting) -> None:
    """``setting``'s Go variable when set (a switch or a count even empty, the others not
    empty), in the Go syntax of the flag's kind: a switch is a Go bool, a choice any case
    of one, seconds a Go duration, a share a number from 0 to 1, a count a whole number."""
    name, kind, text = setting.go, setting.kind, r.text(setting.go)
    if not (r.has(name) if kind in ("switch", "count") else text):
        return
    value: object = text
    if kind == "switch":
        value = "1" if r.boolean(name) else ""
    elif kind == "choice":
        value = _choice(name, text, setting.choices or ())
    elif kind == "share":
        value = _share(name, text)
    elif kind == "seconds":
        value = _seconds(name, text, positive=setting.parse is not not_negative)
    elif kind == "count" and not (text.isdigit() and int(text) >= 1):
        raise GoSettingError(name, text, "expected a whole number, 1 or more")
    r.set(setting.flag, value, name)


def _choice(name: str, text: str, choices: tuple[str, ...]) -> str:
    if text.lower() not in choices:
        raise GoSettingError(name, text, f"choose {' or '.join(choices)}")
    return text.lower()


def _seconds(name: str, text: str, *, positive: bool) -> float:
    seconds = parse_go_duration(name, text)
    if positive and seconds <= 0:
        raise GoSettingError(name, text, "must be positive")
    return seconds


def _share(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value <= 1:
        raise GoSettingError(name, text, "expected a number from 0 to 1")
    return value


def _runtime(r: _Reader) -> None:
    names = ("RUNTIME_ROOT", "RUNTIME_SUBDIRECTORY", "RUNTIME_APPDIRECTORY")
    if not r.go_mode and not any(r.has(name) for name in names):
        return
    root = r.text("RUNTIME_ROOT") or "/srv/runtime_data/current"
    below = (r.text("RUNTIME_SUBDIRECTORY"), r.text("RUNTIME_APPDIRECTORY", "config"))
    path = posixpath.join(root, *(part.strip("/") for part in below if part.strip("/")))
    r.set("--config", path, "RUNTIME_ROOT/RUNTIME_SUBDIRECTORY/RUNTIME_APPDIRECTORY")
    if not r.boolean("RUNTIME_IGNOREDOTFILES", False) and r.has("RUNTIME_IGNOREDOTFILES"):
        r.warn(
            "RUNTIME_IGNOREDOTFILES=false: files and directories whose name starts with a dot"
            " are always skipped (Kubernetes ConfigMap volumes hold their data twice)"
        )


def _ports(r: _Reader) -> None:
    # Outside Go mode a port turns its listener on; HOST alone does not (shells set it).
    if r.go_mode or r.has("PORT"):
        r.set("--http-addr", _address(r.text("HOST"), r.port("PORT", 8080)), "HOST/PORT")
    if r.go_mode or r.has("DEBUG_PORT"):
        address = _address(r.text("DEBUG_HOST"), r.port("DEBUG_PORT", 6070))
        r.set("--debug-addr", address, "DEBUG_HOST/DEBUG_PORT")
    if r.text("GRPC_UDS"):
        r.set("--grpc-addr", "unix:" + r.text("GRPC_UDS"), "GRPC_UDS")
    elif r.has("GRPC_PORT") or (r.go_mode and r.has("GRPC_HOST")):
        address = _address(r.text("GRPC_HOST"), r.port("GRPC_PORT", 8081))
        r.set("--grpc-addr", address, "GRPC_HOST/GRPC_PORT")


def _grpc_tls(r: _Reader) -> None:
    if r.text("GRPC_CLIENT_TLS_SAN"):
        raise r.error(
            "GRPC_CLIENT_TLS_SAN",
            "not supported: client certificates are checked against the CA only; unset it",
        )
    if not r.boolean("GRPC_SERVER_USE_TLS"):
        return
    for name in ("GRPC_SERVER_TLS_CERT", "GRPC_SERVER_TLS_KEY"):
        if not r.text(name):
            raise GoSettingError("GRPC_SERVER_USE_TLS", "true", f"needs {name}")
    r.set("--tls-cert", r.text("GRPC_SERVER_TLS_CERT"), "GRPC_SERVER_TLS_CERT")
    r.set("--tls-key", r.text("GRPC_SERVER_TLS_KEY"), "GRPC_SERVER_TLS_KEY")
    # The Go service reads GRPC_CLIENT_TLS_CACERT; Envoy Gateway writes GRPC_SERVER_TLS_CA_CERT.
    for name in ("GRPC_CLIENT_TLS_CACERT", "GRPC_SERVER_TLS_CA_CERT"):
        if r.text(name):
            r.set("--tls-client-ca", r.text(name), name)
            break


def _log_level(r: _Reader) -> None:
    level = r.text("LOG_LEVEL")
    if level:
        if level.lower() not in GO_LOG_LEVELS:
            raise r.error("LOG_LEVEL", f"unknown level; choose from {', '.join(GO_LOG_LEVELS)}")
        r.set("--log-level", GO_LOG_LEVELS[level.lower()], "LOG_LEVEL")


def _backend(r: _Reader) -> None:
    backend = r.text("BACKEND_TYPE")
    if backend and backend.lower() != "redis":
        raise r.error(
            "BACKEND_TYPE", "only redis is supported (or no REDIS_URL: the embedded store)"
        )
    if r.boolean("QUOTA_MODE"):
        raise r.error("QUOTA_MODE", "not supported globally: set quota_mode per rule")
    if r.boolean("REDIS_PERSECOND"):
        r.warn(
            "REDIS_PERSECOND=true: one Redis (REDIS_URL) holds every unit's counters;"
            " the REDIS_PERSECOND_* settings are ignored"
        )


def _redis(r: _Reader) -> None:
    if r.text("REDIS_URL"):
        r.set("--redis-url", redis_url_from_go(r), "REDIS_URL")
    # Read when set, even empty: the Go service's default prefix is "".
    if r.has("CACHE_KEY_PREFIX"):
        r.set("--redis-key-prefix", r.text("CACHE_KEY_PREFIX"), "CACHE_KEY_PREFIX")


def redis_url_from_go(r: _Reader) -> str:
    """A Redis URL of ours from REDIS_SOCKET_TYPE, REDIS_TYPE, REDIS_URL, REDIS_AUTH,
    REDIS_TLS*, REDIS_SENTINEL_AUTH. A REDIS_URL that already has a scheme is kept."""
    url = r.text("REDIS_URL").strip()
    if "://" in url:
        return url
    socket_type = r.text("REDIS_SOCKET_TYPE", "unix").lower() or "unix"
    if socket_type not in ("tcp", "unix"):
        raise r.error("REDIS_SOCKET_TYPE", "choose tcp or unix")
    kind = r.text("REDIS_TYPE", "single").lower() or "single"
    if kind not in ("single", "sentinel", "cluster"):
        raise r.error("REDIS_TYPE", "choose SINGLE, SENTINEL or CLUSTER")
    tls = r.boolean("REDIS_TLS")
    auth = _userinfo(r.text("REDIS_AUTH"))
    if kind == "single" and socket_type == "unix" and ":" not in url:
        return f"unix://{auth}{url}"
    if kind == "single":
        _check_host_port("REDIS_URL", url, url)
        query = _tls_query(r) if tls else ""
        return f"{'rediss' if tls else 'redis'}://{auth}{url}{query}"
    if tls:
        raise r.error("REDIS_TLS", f"not supported with REDIS_TYPE={kind}")
    hosts = [part.strip() for part in url.split(",") if part.strip()]
    if kind == "sentinel" and len(hosts) < 2:
        raise GoSettingError(
            "REDIS_URL", url, "SENTINEL needs master-name,host:port[,host:port...]"
        )
    master, hosts = (hosts[0], hosts[1:]) if kind == "sentinel" else ("", hosts)
    for host in hosts:
        _check_host_port("REDIS_URL", url, host)
    if kind == "cluster":
        return f"redis+cluster://{auth}{','.join(hosts)}"
    query = ""
    if r.text("REDIS_SENTINEL_AUTH"):
        query = "?sentinel_password=" + quote(r.text("REDIS_SENTINEL_AUTH"), safe="")
    return f"redis+sentinel://{auth}{','.join(hosts)}/{quote(master, safe='')}{query}"


def _userinfo(auth: str) -> str:
    """REDIS_AUTH is ``password`` or ``user:password``."""
    if not auth:
        return ""
    user, sep, password = auth.partition(":")
    if not sep:
        return f":{quote(auth, safe='')}@"
    return f"{quote(user, safe='')}:{quote(password, safe='')}@"


def _check_host_port(name: str, value: str, part: str) -> None:
    try:
        split_host_port(part, need_host=True)
    except ValueError:
        raise GoSettingError(name, value, f"expected host:port, got {part!r}") from None


def _tls_query(r: _Reader) -> str:
    options = []
    for name, option in (
        ("REDIS_TLS_CLIENT_CERT", "ssl_certfile"),
        ("REDIS_TLS_CLIENT_KEY", "ssl_keyfile"),
        ("REDIS_TLS_CACERT", "ssl_ca_certs"),
    ):
        if r.text(name):
            options.append(f"{option}={quote(r.text(name), safe='/')}")
    if r.boolean("REDIS_TLS_SKIP_HOSTNAME_VERIFICATION"):
        options.append("ssl_check_hostname=false")
    return "?" + "&".join(options) if options else ""


def _stop_increment(r: _Reader) -> None:
    """STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT: true, a denied call counts nothing
    (--count-denied-costs false); false (Go counts every hit), costs count when denied
    (the default) and a denied request's other hits do not."""
    name = "STOP_CACHE_KEY_INCREMENT_WHEN_OVERLIMIT"
    if not r.has(name):
        return
    if r.boolean(name):
        r.set("--count-denied-costs", "false", name)
    else:
        r.warn(
            f"{name}=false: a denied request's costs (hits_addend) are counted, its other"
            " hits are not (as =true does for them)"
        )


def _headers(r: _Reader) -> None:
    if r.boolean("LIMIT_RESPONSE_HEADERS_ENABLED"):
        r.set("--response-headers", "ratelimit", "LIMIT_RESPONSE_HEADERS_ENABLED")


def _stats(r: _Reader) -> None:
    disabled = r.boolean("DISABLE_STATS")
    if r.boolean("USE_STATSD", default=r.go_mode) and not disabled:
        address = _address(r.text("STATSD_HOST", "localhost"), r.port("STATSD_PORT", 8125))
        r.set("--statsd-addr", address, "USE_STATSD/STATSD_HOST/STATSD_PORT")
    if r.boolean("USE_PROMETHEUS") and not disabled:
        address = r.text("PROMETHEUS_ADDR", ":9090") or ":9090"
        try:
            host, port = split_host_port(address, any_port=True)
        except ValueError:
            raise GoSettingError("PROMETHEUS_ADDR", address, "expected [host]:port") from None
        r.set("--prometheus-addr", _address(host, port), "PROMETHEUS_ADDR")
        path = r.text("PROMETHEUS_PATH", "/metrics") or "/metrics"
        if not path.startswith("/"):
            raise GoSettingError("PROMETHEUS_PATH", path, "must start with /")
        r.set("--prometheus-path", path, "PROMETHEUS_PATH")


def _xds(r: _Reader) -> None:
    config_type = r.text("CONFIG_TYPE", "FILE").upper() or "FILE"
    if config_type not in ("FILE", "GRPC_XDS_SOTW"):
        raise r.error("CONFIG_TYPE", "choose FILE or GRPC_XDS_SOTW")
    if config_type == "FILE":
        return
    server = r.text("CONFIG_GRPC_XDS_SERVER_URL") or GO_SERVER_URL
    _check_host_port("CONFIG_GRPC_XDS_SERVER_URL", server, server)
    r.set("--xds-server", server, "CONFIG_TYPE/CONFIG_GRPC_XDS_SERVER_URL")
    _one_to_one(r, xds=True)
    # Read with the xDS client's own bound (config/xds_settings.py), not --xds-max-message-size's.
    size = r.text("XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES")
    if size:
        if not size.isdigit() or int(size) < MIN_MESSAGE_SIZE:
            raise r.error(
                "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES",
                f"expected a whole number, {MIN_MESSAGE_SIZE} or more",
            )
        r.set("--xds-max-message-size", size, "XDS_CLIENT_MAX_MSG_SIZE_IN_BYTES")


def _accepted(r: _Reader) -> None:
    for name, why in ACCEPTED.items():
        if not r.has(name):
            continue
        quiet = _QUIET_WHEN.get(name, ("",))
        if quiet is None or r.text(name) in quiet:
            continue
        r.warn(f"{name}={r.text(name)!r} is accepted and ignored: {why}")


_RULES: tuple[Callable[[_Reader], None], ...] = (
    _runtime,
    _ports,
    _grpc_tls,
    _log_level,
    _backend,
    _redis,
    _stop_increment,
    _headers,
    _stats,
    _xds,
    _one_to_one,
    _accepted,
)
