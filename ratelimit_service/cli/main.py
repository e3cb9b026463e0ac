"""``ratelimit-service`` command line: serve, check-config, client, envoy-config.

Every flag can also come from the environment as ``RATELIMIT_<FLAG_NAME>``
(``--redis-url`` ↔ ``RATELIMIT_REDIS_URL``); a flag given on the command line wins.
``serve`` also reads envoyproxy/ratelimit's own variables (``REDIS_URL``, ``PORT``, …,
see cli/go_env.py), below ours: flag, then ``RATELIMIT_*``, then the Go name.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from ratelimit_service.cli.go_env import (
    GoEnvironment,
    GoSettingError,
    GoValue,
    read_go_environment,
)
from ratelimit_service.cli.tune import add_tune_parser, cmd_tune
from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_loader import check_config
from ratelimit_service.core.config_model import Mode
from ratelimit_service.core.headers import HeaderNames, HeaderStyle
from ratelimit_service.server.logs import DEFAULT_LEVEL, configure_logging

if TYPE_CHECKING:
    from ratelimit_service.config.xds_settings import XdsSettings
    from ratelimit_service.server.app import Settings

log = logging.getLogger("ratelimit_service")

DEFAULT_SYNC_INTERVAL = 0.25


def _env(flag: str, default: Any) -> Any:
    return os.environ.get(_env_name(flag), default)


def _env_flag(flag: str, go: GoValue | None = None) -> bool:
    value = _env(flag, None)
    if value is None and go is not None:
        value = go.value
    return str(value or "").lower() in ("1", "true", "yes", "on")


def _positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    return parse


def _redis_url(text: str) -> str:
    from ratelimit_service.storage.redis_connect import normalize_url

    try:
        return normalize_url(text, os.environ.get("REDIS_SOCKET_TYPE", "tcp").lower())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def _not_negative(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a number, 0 or more, got {text}")
    return value


def _ratio(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {text}")
    return value


def _host_port(text: str) -> str:
    """HOST:PORT (the host may be empty: every address; IPv6 in brackets)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") != host.endswith("]"):
        raise argparse.ArgumentTypeError(f"unbalanced brackets in {text!r}")
    return text


def _add(
    parser: argparse.ArgumentParser, flag: str, go: GoEnvironment | None = None, **kwargs: Any
) -> None:
    """Add a flag whose default comes from RATELIMIT_<FLAG>, else from the Go service's
    setting for it (``go``); required flags become optional when the environment
    supplies them. Values from the environment are checked like values on the command
    line (argparse does not check defaults). The help text ends with the built-in
    default and the environment name (and its value, when set)."""
    go_value = go.get(flag) if go is not None else None
    env_value, source = _env(flag, None), _env_name(flag)
    if env_value is None and go_value is not None:
        env_value, source = go_value.value, go_value.source
    kwargs["help"] = _help_with_sources(flag, kwargs)
    if kwargs.get("action") == "store_true":
        kwargs["default"] = _env_flag(flag, go_value)
    elif env_value is not None:
        convert = kwargs.get("type", str)
        try:
            value = convert(env_value)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"{flag} from {source}={env_value!r}: {exc}")
        choices = kwargs.get("choices")
        if choices is not None and value not in choices:
            parser.error(f"{flag} from {source}={env_value!r}: choose from {', '.join(choices)}")
        kwargs["default"] = value
        kwargs.pop("required", None)
    parser.add_argument(flag, **kwargs)


def _add_xds_flags(add: Callable[..., None]) -> None:
    """serve's flags for rules by xDS (the Go service's CONFIG_TYPE=GRPC_XDS_SOTW)."""
    add(
        "--xds-server",
        type=_host_port,
        default=None,
        help="HOST:PORT of an xDS (ADS) server: rules from it, as RateLimitConfig resources,"
        " instead of --config",
    )
    add("--xds-node-id", default="default", help="this service's node id to the xDS server")
    add("--xds-node-metadata", default="", help="k=v,k2=v2: node metadata for the xDS server")
    add("--xds-headers", default="", help="k:v,k2:v2: gRPC metadata on the xDS stream")
    add("--xds-tls", action="store_true", help="connect to the xDS server over TLS")
    add("--xds-client-cert", default=None, help="PEM client certificate for the xDS server")
    add("--xds-client-key", default=None, help="PEM key of --xds-client-cert")
    add("--xds-server-ca", default=None, help="PEM CA bundle that signed the xDS server")
    add("--xds-server-san", default=None, help="name the xDS server's certificate must hold")
    add(
        "--xds-backoff-initial",
        type=_positive(float),
        default=10.0,
        help="seconds before the first reconnect to the xDS server (growing x1.5 per try)",
    )
    add(
        "--xds-backoff-max",
        type=_positive(float),
        default=60.0,
        help="most seconds between two reconnects",
    )
    add(
        "--xds-max-message-size",
        type=_positive(int),
        default=4 << 20,
        help="largest xDS response accepted, in bytes",
    )


def xds_settings_from(args: argparse.Namespace) -> XdsSettings | None:
    """The xDS client's settings from serve's flags (None without --xds-server)."""
    from ratelimit_service.config.xds_settings import XdsSettings, parse_key_values

    if not args.xds_server:
        return None
    tls = bool(args.xds_tls)
    return XdsSettings(
        server_url=args.xds_server,
        node_id=args.xds_node_id,
        node_metadata=parse_key_values(args.xds_node_metadata),
        headers=parse_key_values(args.xds_headers, ":"),
        use_tls=tls,
        client_cert=args.xds_client_cert if tls else None,
        client_key=args.xds_client_key if tls else None,
        server_ca=args.xds_server_ca if tls else None,
        server_san=args.xds_server_san if tls else None,
        backoff_initial=float(args.xds_backoff_initial),
        backoff_max=max(float(args.xds_backoff_max), float(args.xds_backoff_initial)),
        max_message_size=int(args.xds_max_message_size),
    )


def _help_with_sources(flag: str, kwargs: dict[str, Any]) -> str:
    """``help`` followed by ``(default: X; env: RATELIMIT_FLAG)``, as ``--help`` shows it."""
    name = _env_name(flag)
    sources = []
    if kwargs.get("action") == "store_true":
        sources.append(f"env: {name}=1")
    else:
        if kwargs.get("required"):
            sources.append(f"required unless {name} is set")
        elif kwargs.get("default") is not None:
            sources.append(f"default: {kwargs['default']}")
        sources.append(f"env: {name}")
    env_value = os.environ.get(name)
    if env_value is not None:
        sources.append(f"now {env_value!r} from the environment")
    text = f"{kwargs.get('help') or ''} ({'; '.join(sources)})".strip()
    return text.replace("%", "%%")


def _env_name(flag: str) -> str:
    return "RATELIMIT_" + flag.lstrip("-").replace("-", "_").upper()


class _Parser(argparse.ArgumentParser):
    """A usage error is one line: the wrong thing, and where the flags are listed (the
    whole usage of ``serve`` would bury it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(go: GoEnvironment | None = None) -> argparse.ArgumentParser:
    """``go``: envoyproxy/ratelimit's settings, read from the environment for ``serve``."""
    parser = _Parser(prog="ratelimit-service", description="Envoy external rate-limit service")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the service")

    def add(flag: str, **kwargs: Any) -> None:
        _add(serve, flag, go, **kwargs)

    add(
        "--config",
        help="rule file, or directory of *.yaml/*.yml (required unless --xds-server is given)",
    )
    add("--grpc-addr", default="0.0.0.0:8081", help="gRPC listen address")
    add(
        "--admin-addr",
        default=None if go is not None and go.go_mode else "127.0.0.1:6070",
        help="admin HTTP listen address: /healthcheck, /metrics, /rlconfig (off by default"
        " when started from envoyproxy/ratelimit's settings: the debug port serves them)",
    )
    add(
        "--mode",
        default="probabilistic",
        choices=[m.value for m in Mode],
        help="mode of rules that declare none",
    )
    add(
        "--sync-interval",
        type=_positive(float),
        default=DEFAULT_SYNC_INTERVAL,
        help="seconds between probabilistic syncs",
    )
    add(
        "--redis-url",
        type=_redis_url,
        default=None,
        help="Redis: redis://, rediss://, unix://, redis+sentinel://, redis+cluster:// URL,"
        " or HOST:PORT as the Go service writes it; without it, the embedded store",
    )
    add(
        "--redis-timeout",
        type=_positive(float),
        default=1.0,
        help="the longest an exact decision waits for Redis before its failure_mode applies:"
        " the bound for callers with no deadline; a gRPC deadline (less --deadline-margin)"
        " shortens it",
    )
    add(
        "--deadline-margin",
        type=_not_negative,
        default=0.002,
        help="seconds before the caller's gRPC deadline at which an exact decision stops"
        " waiting for Redis and answers by failure_mode",
    )
    add(
        "--redis-silence",
        type=_positive(float),
        default=1.0,
        help="seconds with calls outstanding and no byte from Redis after which Redis counts"
        " as down (the circuit breaker opens); a slow reply never opens it",
    )
    add(
        "--exact-batch-hold",
        type=_not_negative,
        default=0.001,
        help="while the event loop is saturated, seconds exact decisions wait to share one"
        " Redis call (0: never wait; at most a quarter of --redis-timeout)",
    )
    add(
        "--exact-max-pending",
        type=_positive(int),
        default=2048,
        help="exact requests that may wait for Redis at once; one more is refused"
        " (gRPC RESOURCE_EXHAUSTED, or denied by failure_mode: closed rules)",
    )
    add(
        "--stale-after",
        type=_positive(float),
        default=3.0,
        help="seconds without a successful sync before probabilistic rules use failure_mode",
    )
    add(
        "--log-level",
        default=DEFAULT_LEVEL,
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="log level",
    )
    add(
        "--max-buckets",
        type=_positive(int),
        default=100_000,
        help="bound on per-descriptor-value state (LRU beyond it)",
    )
    add(
        "--max-stats-keys",
        type=_positive(int),
        default=10_000,
        help="bound on distinct per-rule stats keys",
    )
    add(
        "--merge-domain-config",
        action="store_true",
        help="merge files with the same domain instead of rejecting them",
    )
    add(
        "--shadow-mode",
        action="store_true",
        help="global shadow mode: report OVER_LIMIT per descriptor, never deny",
    )
    add(
        "--max-descriptors",
        type=_positive(int),
        default=64,
        help="most descriptors one request may carry (more: INVALID_ARGUMENT)",
    )
    add(
        "--max-entries",
        type=_positive(int),
        default=32,
        help="most entries one descriptor may carry (more: INVALID_ARGUMENT)",
    )
    add(
        "--max-request-bytes",
        type=_positive(int),
        default=1 << 20,
        help="largest request accepted (gRPC answers RESOURCE_EXHAUSTED beyond)",
    )
    add(
        "--response-headers",
        default="off",
        choices=[s.value for s in HeaderStyle],
        help="add rate-limit headers to responses: RateLimit-* or draft-03 X-RateLimit-*",
    )
    add("--header-limit", default="RateLimit-Limit", help="name of the limit header")
    add(
        "--header-remaining",
        default="RateLimit-Remaining",
        help="name of the remaining header",
    )
    add("--header-reset", default="RateLimit-Reset", help="name of the reset header")
    add(
        "--event-loop",
        default="auto",
        choices=["auto", "asyncio", "uvloop"],
        help="event loop: uvloop when installed (auto), or asyncio's own",
    )
    add("--log-format", default="text", choices=["text", "json"], help="log format")
    add("--tls-cert", default=None, help="PEM certificate: serve gRPC over TLS")
    add("--tls-key", default=None, help="PEM private key of --tls-cert")
    add(
        "--tls-client-ca",
        default=None,
        help="PEM CA bundle: require client certificates signed by it (mTLS)",
    )
    add(
        "--workers",
        type=_positive(int),
        default=1,
        help="worker processes on one gRPC port (SO_REUSEPORT); more than 1 needs Redis",
    )
    serve.add_argument("--reuse-port", action="store_true", help=argparse.SUPPRESS)
    add(
        "--drain-timeout",
        type=_not_negative,
        default=15.0,
        help="on SIGTERM, seconds the service keeps answering while its health reports"
        " NOT_SERVING, so a health-checking Envoy moves away first (0: stop at once;"
        " SIGINT always stops at once)",
    )
    add(
        "--drain-quiet",
        type=_positive(float),
        default=1.0,
        help="draining ends once no call came for this many seconds",
    )
    add(
        "--http-addr",
        type=_host_port,
        default=None,
        help="envoyproxy/ratelimit's HTTP port: GET /healthcheck and POST /json (off unless given)",
    )
    add(
        "--debug-addr",
        type=_host_port,
        default=None,
        help="envoyproxy/ratelimit's debug port: /rlconfig and /metrics (off unless given)",
    )
    add(
        "--statsd-addr",
        type=_host_port,
        default=None,
        help="HOST:PORT of a statsd agent: envoyproxy/ratelimit's stats over UDP"
        " (off unless given)",
    )
    add(
        "--statsd-flush-interval",
        type=_positive(float),
        default=10.0,
        help="seconds between two statsd flushes",
    )
    add(
        "--watch-interval",
        type=float,
        default=1.0,
        help="seconds between checks of the config files for changes (0: never; SIGHUP "
        "always reloads)",
    )
    add(
        "--force-start-without-initial-config",
        action="store_true",
        help="start (and keep watching) even when the rules do not load at start; until"
        " they do, no domain is known",
    )
    add(
        "--healthy-with-at-least-one-config-loaded",
        action="store_true",
        help="health checks fail until rules with at least one domain are loaded",
    )
    add(
        "--near-limit-ratio",
        type=_ratio,
        default=0.8,
        help="share of a limit past which admitted hits count as near_limit",
    )
    add(
        "--redis-pool-size",
        type=_positive(int),
        default=64,
        help="most connections to Redis (the request path adds one of its own)",
    )
    add(
        "--redis-key-prefix",
        default="rl:",
        help="prefix of every key this service writes to Redis",
    )
    add(
        "--prometheus-addr",
        type=_host_port,
        default=None,
        help="HOST:PORT of a listener serving only the metrics (off unless given)",
    )
    add("--prometheus-path", default="/metrics", help="path of the metrics there")
    _add_xds_flags(add)
    add(
        "--grpc-max-connection-age",
        type=_positive(float),
        default=None,
        help="seconds after which a gRPC connection is asked to go away (spreads clients"
        " over new replicas; off unless given)",
    )
    add(
        "--grpc-max-connection-age-grace",
        type=_not_negative,
        default=None,
        help="seconds calls may take to finish on a connection asked to go away",
    )

    check = commands.add_parser("check-config", help="validate rule files")
    check.add_argument(
        "path",
        nargs="?",
        default=_env("--config", None),
        help="rule file, or directory of *.yaml/*.yml (env: RATELIMIT_CONFIG)",
    )
    _add(check, "--merge-domain-config", action="store_true")

    envoy = commands.add_parser(
        "envoy-config",
        help="print the Envoy filter, cluster and route rate_limits for the rules"
        " (--bootstrap: a whole runnable Envoy bootstrap)",
    )
    _add(envoy, "--config", required=True, help="rule file, or directory of *.yaml/*.yml")
    _add(envoy, "--domain", default=None, help="the domain to render (needed if several)")
    envoy.add_argument("--cluster", default="ratelimit", help="Envoy cluster name")
    envoy.add_argument("--timeout", default="0.02s", help="the filter's timeout")
    envoy.add_argument("--service-address", default="ratelimit:8081", help="HOST:PORT")
    _add(envoy, "--merge-domain-config", action="store_true")
    envoy.add_argument(
        "--bootstrap",
        action="store_true",
        help="print a complete bootstrap (admin, listener, routes, clusters) for envoy -c",
    )
    envoy.add_argument(
        "--listen", default="0.0.0.0:8080", help="with --bootstrap: the listener's HOST:PORT"
    )
    envoy.add_argument(
        "--admin-address", default="127.0.0.1:9901", help="with --bootstrap: Envoy's admin"
    )
    envoy.add_argument(
        "--upstream-address",
        default="upstream:8080",
        help="with --bootstrap: HOST:PORT of the placeholder upstream cluster",
    )
    envoy.add_argument(
        "--rlqs",
        action="store_true",
        help="the rate_limit_quota filter instead (RLQS: Envoy enforces token buckets the"
        " service assigns; no call per request); --cluster defaults to rlqs",
    )
    envoy.add_argument(
        "--node-id",
        default=None,
        help="with --rlqs: this Envoy's name to the service (x-envoy-node-id metadata)",
    )

    client = commands.add_parser("client", help="call ShouldRateLimit once")
    _add(client, "--addr", default="127.0.0.1:8081", help="service address HOST:PORT")
    _add(client, "--domain", required=True)
    client.add_argument(
        "--descriptor",
        action="append",
        required=True,
        help="k=v[,k2=v2]; repeat for several descriptors",
    )
    _add(client, "--hits-addend", type=int, default=0)
    _add(client, "--timeout", type=_positive(float), default=5.0)
    _add(client, "--tls-ca", default=None, help="PEM CA bundle: connect over TLS")
    _add(client, "--tls-cert", default=None, help="PEM client certificate (mTLS)")
    _add(client, "--tls-key", default=None, help="PEM key of --tls-cert")
    add_tune_parser(commands)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from ratelimit_service.server.app import RateLimitService

    configure_logging(str(args.log_level), str(args.log_format))
    for warning in args.go.warnings if args.go is not None else ():
        log.warning("%s", warning)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    if int(args.workers) > 1:
        return _serve_workers(args, settings)
    try:
        service = RateLimitService(settings)
    except ConfigLoadError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        _hint_config_source(args)
        return 1
    try:
        run_loop(service.run_until_signal(), str(args.event_loop))
    except OSError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    return 0


def settings_from(args: argparse.Namespace) -> Settings:
    """The service's Settings from the parsed ``serve`` flags."""
    from ratelimit_service.server.app import Settings

    xds = xds_settings_from(args)
    if not args.config and xds is None:
        raise ValueError("--config (or RATELIMIT_CONFIG) is required, or --xds-server")
    return Settings(
        config_path=args.config or "",
        xds=xds,
        grpc_addr=args.grpc_addr,
        admin_addr=args.admin_addr or None,
        mode=Mode(args.mode),
        sync_interval=float(args.sync_interval),
        redis_url=args.redis_url or None,
        redis_timeout=float(args.redis_timeout),
        redis_silence=float(args.redis_silence),
        deadline_margin=float(args.deadline_margin),
        redis_pool_size=int(args.redis_pool_size),
        redis_key_prefix=str(args.redis_key_prefix),
        exact_batch_hold=float(args.exact_batch_hold),
        exact_max_pending=int(args.exact_max_pending),
        stale_after=float(args.stale_after),
        max_buckets=int(args.max_buckets),
        max_stats_keys=int(args.max_stats_keys),
        merge_domain_config=bool(args.merge_domain_config),
        shadow_mode=bool(args.shadow_mode),
        near_limit_ratio=float(args.near_limit_ratio),
        watch_interval=float(args.watch_interval),
        force_start_without_initial_config=bool(args.force_start_without_initial_config),
        healthy_with_at_least_one_config_loaded=bool(
            args.healthy_with_at_least_one_config_loaded
        ),
        drain_timeout=float(args.drain_timeout),
        drain_quiet=float(args.drain_quiet),
        max_descriptors=int(args.max_descriptors),
        max_entries=int(args.max_entries),
        max_request_bytes=int(args.max_request_bytes),
        response_headers=HeaderStyle(args.response_headers),
        header_names=HeaderNames(args.header_limit, args.header_remaining, args.header_reset),
        log_format=args.log_format,
        reuse_port=bool(args.reuse_port),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        grpc_max_connection_age=args.grpc_max_connection_age,
        grpc_max_connection_age_grace=args.grpc_max_connection_age_grace,
        http_addr=args.http_addr or None,
        debug_addr=args.debug_addr or None,
        statsd_addr=args.statsd_addr or None,
        statsd_flush_interval=float(args.statsd_flush_interval),
        prometheus_addr=args.prometheus_addr or None,
        prometheus_path=str(args.prometheus_path),
    )


def _hint_config_source(args: argparse.Namespace) -> None:
    """Rules that did not load came from the Go settings' path: say where that came from."""
    go_value = args.go.get("--config") if args.go is not None else None
    if go_value is not None and go_value.value == args.config:
        print(
            f"serve: rules read from {args.config} ({go_value.source});"
            " give --config or RATELIMIT_CONFIG to read them elsewhere",
            file=sys.stderr,
        )


def _serve_workers(args: argparse.Namespace, settings: Settings) -> int:
    """Check what can be checked once, then hand over to the supervisor."""
    from ratelimit_service.server.app import load_rules
    from ratelimit_service.server.supervisor import Supervisor

    if not args.redis_url:
        print(
            "serve: --workers > 1 needs --redis-url: with the embedded store every worker "
            "would keep its own counts and the fleet would admit N times the limit",
            file=sys.stderr,
        )
        return 2
    if not args.admin_addr or settings.xds is not None:
        print(
            "serve: --workers > 1 needs --admin-addr (the workers' merged /metrics) and rule"
            " files (--config): each worker would keep its own xDS stream",
            file=sys.stderr,
        )
        return 2
    if args.debug_addr:
        print(
            "serve: --debug-addr with --workers > 1: each worker would need the port; read"
            " /metrics and /rlconfig on --admin-addr, where the workers' counters are merged",
            file=sys.stderr,
        )
        return 2
    try:
        load_rules(settings)
    except ConfigLoadError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        return 1
    return asyncio.run(Supervisor(args.argv, int(args.workers), args.admin_addr).run())


def run_loop(main: Coroutine[Any, Any, None], choice: str) -> None:
    """uvloop when available (it serves more requests per second than asyncio's own
    loop for the same service), else asyncio's own loop."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise SystemExit(
                    "serve: --event-loop uvloop, but uvloop is not installed"
                ) from None
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def cmd_check_config(args: argparse.Namespace) -> int:
    from ratelimit_service.config.files import read_config_files

    if not args.path:
        print("check-config: a PATH (or RATELIMIT_CONFIG) is required", file=sys.stderr)
        return 2
    try:
        files = read_config_files(args.path)
    except ConfigLoadError as exc:
        errors = list(exc.errors)
    else:
        errors = check_config(files, merge_domains=bool(args.merge_domain_config))
    for error in errors:
        print(error)
    if errors:
        return 1
    print(f"{args.path}: OK ({len(files)} file{'s' if len(files) != 1 else ''})")
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    from ratelimit_service.cli.envoy_config import render, render_bootstrap
    from ratelimit_service.cli.envoy_rlqs import render_rlqs

    try:
        if args.rlqs:
            text = render_rlqs(
                args.config,
                bootstrap=bool(args.bootstrap),
                domain=args.domain,
                cluster="rlqs" if args.cluster == "ratelimit" else args.cluster,
                service_address=args.service_address,
                node_id=args.node_id,
                merge_domains=bool(args.merge_domain_config),
                listen=args.listen,
                admin=args.admin_address,
                upstream_address=args.upstream_address,
            )
        elif args.bootstrap:
            text = render_bootstrap(
                args.config,
                domain=args.domain,
                cluster=args.cluster,
                timeout=args.timeout,
                service_address=args.service_address,
                merge_domains=bool(args.merge_domain_config),
                listen=args.listen,
                admin=args.admin_address,
                upstream_address=args.upstream_address,
            )
        else:
            text = render(
                args.config,
                domain=args.domain,
                cluster=args.cluster,
                timeout=args.timeout,
                service_address=args.service_address,
                merge_domains=bool(args.merge_domain_config),
            )
    except ConfigLoadError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"envoy-config: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def cmd_client(args: argparse.Namespace) -> int:
    from ratelimit_service.cli.client import call_and_print

    tls = (args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
    return call_and_print(
        args.addr, args.domain, args.descriptor, int(args.hits_addend), float(args.timeout), tls
    )


def main(argv: Sequence[str] | None = None, *, go_mode: bool = False) -> int:
    """``go_mode``: the Go service's defaults apply (see cli/go_env.py); also on for
    ``serve`` given no ``--config`` and no ``RATELIMIT_CONFIG``."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        go = _go_environment(arguments, go_mode)
    except GoSettingError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    args = build_parser(go).parse_args(arguments)
    args.argv = arguments
    args.go = go
    handlers = {
        "serve": cmd_serve,
        "check-config": cmd_check_config,
        "client": cmd_client,
        "envoy-config": cmd_envoy_config,
        "tune": cmd_tune,
    }
    stdout = sys.stdout
    sys.stdout = _ClosedPipeTolerant(stdout)
    try:
        code = handlers[args.command](args)
        sys.stdout.flush()
    finally:
        sys.stdout = stdout
    return code


def go_main(argv: Sequence[str] | None = None) -> int:
    """``ratelimit`` (the image's ``/bin/ratelimit``): envoyproxy/ratelimit's command,
    configured by its environment alone, as Envoy Gateway runs it."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    return main(["serve", *arguments], go_mode=True)


def _go_environment(arguments: list[str], go_mode: bool) -> GoEnvironment | None:
    """The Go settings for ``serve`` (None for the other commands, which ignore them)."""
    command = next((a for a in arguments if not a.startswith("-")), None)
    if command != "serve":
        return None
    given = any(a == "--config" or a.startswith("--config=") for a in arguments)
    go_mode = go_mode or not (given or "RATELIMIT_CONFIG" in os.environ)
    return read_go_environment(os.environ, go_mode=go_mode)


class _ClosedPipeTolerant:
    """stdout that stops writing, quietly, once its reader has gone (``| head -1``): the
    command still runs to the end and exits with its own status, without a traceback."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            self._discard()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()

    def _discard(self) -> None:
        # Point the descriptor at /dev/null: what is still buffered, and the
        # interpreter's last flush at exit, then go nowhere instead of failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
