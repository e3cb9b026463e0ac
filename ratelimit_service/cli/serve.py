"""The ``serve`` command: Settings from the parsed flags, checked together, then one
service on the event loop, or the supervisor of ``--workers`` processes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.redis_url import Topology, parse_target
from ratelimit_service.engine.tracing import TracingUnavailable
from ratelimit_service.server.logs import configure_logging
from ratelimit_service.server.settings import Settings, fields_from

if TYPE_CHECKING:
    from ratelimit_service.config.xds_settings import XdsSettings

log = logging.getLogger("ratelimit_service")


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
        print(*exc.errors, sep="\n", file=sys.stderr)
        _hint_config_source(args)
        return 1
    except TracingUnavailable as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    try:
        run_loop(service.run_until_signal(), str(args.event_loop))
    except OSError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    return 0


def settings_from(args: argparse.Namespace) -> Settings:
    """The service's Settings from the parsed ``serve`` flags (server/settings.py)."""
    xds = xds_settings_from(args)
    if not args.config and xds is None:
        raise ValueError("--config (or RATELIMIT_CONFIG) is required, or --xds-server")
    if args.zone and not (args.redis_url and args.global_redis_url):
        raise ValueError(
            "--zone needs --redis-url (the zone's store) and --global-redis-url (the store"
            " above the zones)"
        )
    if args.global_redis_url and not args.zone:
        raise ValueError("--global-redis-url is the store above the zones: give --zone too")
    if args.zone and parse_target(args.redis_url).kind is Topology.CLUSTER:
        raise ValueError(
            "--redis-url with --zone is the zone's store: one Redis or Sentinel, not Cluster"
            " (the global store, --global-redis-url, may be a Cluster)"
        )
    return Settings(xds=xds, **fields_from(vars(args)))


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
        print(*exc.errors, sep="\n", file=sys.stderr)
        return 1
    return asyncio.run(Supervisor(args.argv, int(args.workers), args.admin_addr).run())


def run_loop(main: Coroutine[Any, Any, None], choice: str) -> None:
    """uvloop when available (more requests per second than asyncio's loop), else asyncio's."""
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
