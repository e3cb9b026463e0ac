"""Wiring and lifecycle: build the limiter, store, reconciler and listeners, start them (with
server/gc_policy.py's collector policy), stop them gracefully (NOT_SERVING, then drain)."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import tempfile
from collections.abc import Iterator
from typing import Any

import grpc
from envoy.service.rate_limit_quota.v3 import rlqs_pb2_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client.core import Metric

from ratelimit_service.config.files import read_config_files
from ratelimit_service.config.watcher import ConfigWatcher
from ratelimit_service.config.xds import XdsConfigSource
from ratelimit_service.core.address import listen_host, split_host_port
from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.config_model import RateLimitConfig
from ratelimit_service.core.local_buckets import LocalBuckets
from ratelimit_service.core.request import RequestBounds
from ratelimit_service.engine.background import BackgroundTask
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.engine.loop_lag import LoopLag
from ratelimit_service.engine.quota import FORGET_AFTER, QuotaCoordinator
from ratelimit_service.engine.reconciler import Reconciler
from ratelimit_service.engine.state_metrics import (
    bucket_metrics,
    quota_metrics,
    reconciler_metrics,
    rule_limit_metrics,
    store_metrics,
    zone_metrics,
)
from ratelimit_service.engine.stats import Stats, StatsCollector, histogram_family
from ratelimit_service.engine.statsd import StatsdSink
from ratelimit_service.engine.status import StatusBoard, StatusSources
from ratelimit_service.engine.tracing import Tracing
from ratelimit_service.engine.zone_aggregator import ZoneAggregator
from ratelimit_service.rlqs.servicer import RLQS_SERVICE, QuotaServicer
from ratelimit_service.rls.servicer import RLS_SERVICE, RateLimitServicer
from ratelimit_service.server.explain_page import explain_page
from ratelimit_service.server.gc_policy import Tenuring
from ratelimit_service.server.go_http import GoEndpoints
from ratelimit_service.server.grpc_calls import grpc_call_metrics
from ratelimit_service.server.http_server import INDEX, HttpServer, Page, pages, query_page
from ratelimit_service.server.native_grpc import BackendSocket, NativeGrpcServer
from ratelimit_service.server.native_wiring import native_routes
from ratelimit_service.server.settings import Settings
from ratelimit_service.server.status_page import status_routes
from ratelimit_service.server.tls import CertificateReloader
from ratelimit_service.storage.base import Store
from ratelimit_service.storage.embedded import EmbeddedStore
from ratelimit_service.storage.redis_store import RedisStore
from ratelimit_service.storage.zoned import ZonedStore, ZoneRedisStore

log = logging.getLogger(__name__)

HEALTH_NAMES = ("", RLS_SERVICE, RLQS_SERVICE, "ratelimit")
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def load_rules(settings: Settings) -> RateLimitConfig:
    """Read and load the rule files; raises ConfigLoadError listing every problem."""
    files = read_config_files(settings.config_path)
    if not files:
        log.warning(
            "no rule file (*.yaml, *.yml) in %s: no domain is limited until one appears",
            settings.config_path,
        )
    return load_files(settings, files)


def load_files(settings: Settings, files: list[ConfigFile]) -> RateLimitConfig:
    """Rule files (ours or a config source's) loaded with the service's settings."""
    return load_config(
        files, default_mode=settings.mode, merge_domains=settings.merge_domain_config
    )


def start_tracing(settings: Settings) -> Tracing | None:
    """The tracer (--tracing), or None; raises TracingUnavailable without the extra."""
    if not settings.tracing:
        return None
    return Tracing(
        protocol=settings.tracing_protocol,
        endpoint=settings.tracing_endpoint,
        sampling_rate=settings.tracing_sampling_rate,
        service_name=settings.tracing_service_name,
        service_namespace=settings.tracing_service_namespace,
        service_instance_id=settings.tracing_service_instance_id,
    )


def make_store(settings: Settings) -> tuple[Store, ZoneAggregator | None]:
    """The embedded store, one Redis, or (``--zone``) a zone's Redis and its aggregator."""
    if not settings.redis_url:
        return EmbeddedStore(max_keys=settings.max_buckets), None
    options: dict[str, Any] = {
        "request_timeout": settings.redis_timeout,
        "silence": settings.redis_silence,
        "batch_hold": settings.exact_batch_hold,
        "max_pending": settings.exact_max_pending,
        "node_ttl": max(2.0, 5 * settings.sync_interval),
        "max_connections": settings.redis_pool_size,
        "prefix": settings.redis_key_prefix,
    }
    if settings.zone and settings.global_redis_url:
        zone = ZoneRedisStore(settings.redis_url, settings.zone, **options)
        above = RedisStore(settings.global_redis_url, **options)
        aggregator = ZoneAggregator(
            zone,
            above,
            interval=settings.zone_interval,
            forget_after=FORGET_AFTER,
            stretch=settings.sync_stretch,
        )
        return ZonedStore(zone, above), aggregator
    return RedisStore(settings.redis_url, **options), None


class RateLimitService:
    """One service process: gRPC RLS + health + reflection, admin HTTP, reconciler."""

    def __init__(self, settings: Settings, store: Store | None = None) -> None:
        self.settings = settings
        self.tracing = start_tracing(settings)  # first: without its extra, nothing else starts
        self.stats = Stats(max_keys=settings.max_stats_keys)
        config = self._initial_rules()
        self.zone_aggregator: ZoneAggregator | None = None
        """With --zone: the zone's aggregator (its lease and its passes)."""
        if store is None:
            store, self.zone_aggregator = make_store(settings)
        self.store = store
        self.store_name = store.metrics().name
        """The store's kind (embedded, redis, zoned), for logs, spans and the health page."""
        # Never stale between two normal syncs, whatever the flags say.
        stale_after = max(settings.stale_after, 4 * settings.sync_interval)
        self.local = LocalBuckets(
            max_buckets=settings.max_buckets,
            stale_after=stale_after,
            turn=secrets.randbelow(1 << 16),
        )
        self.limiter = RateLimiter(
            config,
            self.store,
            stats=self.stats,
            local=self.local,
            bounds=RequestBounds(
                max_descriptors=settings.max_descriptors, max_entries=settings.max_entries
            ),
            default_mode=settings.mode,
            global_shadow=settings.shadow_mode,
            near_ratio=settings.near_limit_ratio,
            count_denied_costs=settings.count_denied_costs,
        )
        if self.tracing is not None:
            self.limiter.hit_store = self.tracing.traced_hit(self.store.hit, self.store_name)
        self.reconciler = Reconciler(
            self.local, self.store, settings.sync_interval, stretch=settings.sync_stretch
        )
        self.quota = QuotaCoordinator(
            lambda: self.limiter.config,
            self.stats,
            self.store,
            interval=settings.rlqs_publish_interval,
            stretch=settings.sync_stretch,
        )
        # Where the rules come from: files (watched) or an xDS server.
        self.watcher: ConfigWatcher | None = None
        self.xds: XdsConfigSource | None = None
        if settings.xds is not None:
            self.xds = XdsConfigSource(
                settings.xds,
                load=lambda files: load_files(settings, files),
                install=self.install_rules,
                stats=self.stats,
            )
        else:
            self.watcher = ConfigWatcher(
                settings.config_path,
                load=lambda: load_rules(settings),
                install=self.install_rules,
                stats=self.stats,
                interval=settings.watch_interval or 1.0,
            )
        self.loop_lag = LoopLag(calls=lambda: self.stats.total_requests)
        self._loop_lag_task = BackgroundTask("loop-lag", self.loop_lag.run)
        self.tenuring = Tenuring()
        self.health = health.aio.HealthServicer()
        self.status = StatusBoard(
            StatusSources(
                self.stats,
                lambda: self.limiter.config,
                self.local,
                self.store,
                self.reconciler,
                self.quota,
                self.zone_aggregator,
            )
        )
        admin: dict[str, Page] = {
            "/healthcheck": self._healthcheck_page,
            "/metrics": self._metrics_stream,
            "/rlconfig": self._rlconfig_page,
            **status_routes(self.status),
            "/": lambda: (200, "text/plain", INDEX),
        }
        explain = query_page(lambda query: explain_page(self.limiter, query))
        self.admin = HttpServer(pages(admin) | {"/explain": explain})
        # envoyproxy/ratelimit's own ports and its statsd stats, when asked for.
        self.http: HttpServer | None = None
        self.debug: HttpServer | None = None
        self.prometheus: HttpServer | None = None
        if settings.prometheus_addr:
            self.prometheus = HttpServer(pages({settings.prometheus_path: self._metrics_stream}))
        if settings.debug_addr:
            debug: dict[str, Page] = {
                "/rlconfig": self._rlconfig_page,
                "/metrics": self._metrics_stream,
            }
            index = (200, "text/plain", b"/rlconfig\n/metrics\n")
            self.debug = HttpServer(pages({**debug, "/": lambda: index}))
        self.statsd: StatsdSink | None = None
        if settings.statsd_addr:
            host, port = _split_addr(settings.statsd_addr)
            self.statsd = StatsdSink(self.stats, host, port, settings.statsd_flush_interval)
        self.metrics = StatsCollector(self.stats, self._gauges)
        self._server: grpc.aio.Server | None = None
        self.servicer: RateLimitServicer | None = None
        self.tls: CertificateReloader | None = None
        self._serving = False
        self._health_updates: set[asyncio.Task[None]] = set()
        self._health_status: dict[str, int] = {}
        """Each health service name's status, as published (the native front door answers
        Check from it)."""
        self.native: NativeGrpcServer | None = None
        self._backend_dir: str | None = None
        """--grpc-engine native: the directory of grpcio's private socket."""
        self.grpc_port = 0

    async def start(self) -> None:
        settings = self.settings
        if self.xds is not None:
            self.xds.start()
            if not settings.force_start_without_initial_config:
                server_url = self.xds.settings.server_url
                log.info("waiting for the first rules from xDS server %s", server_url)
                await self.xds.wait_first()
        native = settings.grpc_engine == "native"
        server = grpc.aio.server(options=self._grpc_options())
        servicer = self.servicer = RateLimitServicer(
            self.limiter,
            settings.response_headers,
            settings.header_names,
            settings.deadline_margin,
            self.loop_lag,
            self.tracing,
            settings.go_dynamic_metadata,
        )
        server.add_generic_rpc_handlers((servicer.handler(),))
        quota = QuotaServicer(self.quota, self.tracing)
        rlqs_pb2_grpc.add_RateLimitQuotaServiceServicer_to_server(quota, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (RLS_SERVICE, RLQS_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
        if native:
            backend, self._backend_dir = private_socket()
            server.add_insecure_port(backend.grpc_target)
            await server.start()
            self._server = server
            await self._start_native(servicer, backend)
        else:
            try:
                self.grpc_port = self._bind(server)
            except RuntimeError:
                self.grpc_port = 0
            if self.grpc_port == 0:
                why = _bind_error(settings.grpc_addr, bool(settings.reuse_port))
                raise OSError(f"cannot listen on {settings.grpc_addr} (gRPC): {why}")
            await server.start()
            self._server = server
        try:
            await self._start_admin()
            await self._start_go_ports(servicer)
        except OSError:
            await self._stop_listeners()
            if self.native is not None:
                await self.native.stop(0)
                self.native = None
            await server.stop(0)
            self._server = None
            self._remove_backend_dir()
            raise
        await self.store.start()
        if self.zone_aggregator is not None:
            self.zone_aggregator.start()
        self.reconciler.start()
        self.quota.start()
        self._loop_lag_task.start()
        if self.watcher is not None and settings.watch_interval > 0:
            self.watcher.start()
        if self.statsd is not None:
            self.statsd.start()
        self._serving = True
        await self._publish_health()
        grpc_at = settings.grpc_addr
        log.info(
            "serving RLS on %s, admin on %s, store=%s, default mode=%s, domains=%s",
            grpc_at if grpc_at.startswith("unix:") else f"port {self.grpc_port}",
            f"{settings.admin_addr} (port {self.admin.port})" if settings.admin_addr else "(off)",
            self.store_name,
            settings.mode.value,
            ",".join(sorted(self.limiter.config.domains)) or "(none)",
        )

    async def _start_native(self, servicer: RateLimitServicer, backend: BackendSocket) -> None:
        """The native front door on the gRPC address, grpcio behind it on ``backend``."""
        settings = self.settings
        self.native = NativeGrpcServer(
            native_routes(servicer, self._health_status),
            backend,
            settings.max_request_bytes,
            settings.grpc_max_connection_age,
            settings.grpc_max_connection_age_grace,
            self.loop_lag.waited,
        )
        try:
            tls = None
            if settings.tls_cert:
                if not settings.tls_key:
                    raise OSError("--tls-cert needs --tls-key")
                reloader = CertificateReloader(
                    settings.tls_cert, settings.tls_key, settings.tls_client_ca
                )
                tls, self.tls = reloader.ssl_context(), reloader
            self.grpc_port = await self.native.start(settings.grpc_addr, settings.reuse_port, tls)
        except (OSError, ValueError, ssl.SSLError) as exc:
            assert self._server is not None
            await self._server.stop(0)
            self._server, self.native = None, None
            self._remove_backend_dir()
            errno = exc.errno if isinstance(exc, OSError) else None
            why = os.strerror(errno) if errno else str(exc)  # uvloop's text names the call
            raise OSError(f"cannot listen on {settings.grpc_addr} (gRPC): {why}") from exc

    def _remove_backend_dir(self) -> None:
        """grpcio's private socket directory (--grpc-engine native), gone."""
        if self._backend_dir is not None:
            shutil.rmtree(self._backend_dir, ignore_errors=True)
            self._backend_dir = None

    def _grpc_options(self) -> list[tuple[str, int]]:
        settings = self.settings
        options = [
            # Port sharing only for --workers; else a second server on the port must fail.
            ("grpc.so_reuseport", 1 if settings.reuse_port else 0),
            ("grpc.max_receive_message_length", settings.max_request_bytes),
        ]
        for name, seconds in (
            ("grpc.max_connection_age_ms", settings.grpc_max_connection_age),
            ("grpc.max_connection_age_grace_ms", settings.grpc_max_connection_age_grace),
        ):
            if seconds is not None:
                options.append((name, int(seconds * 1000)))
        return options

    async def _start_admin(self) -> None:
        """Our admin listener and the metrics-only one, those that are asked for."""
        for server, addr, role in (
            (self.admin, self.settings.admin_addr, "admin"),
            (self.prometheus, self.settings.prometheus_addr, "prometheus"),
        ):
            if server is not None and addr:
                await _listen(server, addr, role)

    async def _start_go_ports(self, servicer: RateLimitServicer) -> None:
        """The Go service's HTTP and debug listeners, those that are asked for."""
        settings = self.settings
        if settings.http_addr:
            routes = GoEndpoints(servicer, self.healthy).routes()
            http = HttpServer(routes, max_body=settings.max_request_bytes)
            host = await _listen(http, settings.http_addr, "http", settings.reuse_port)
            self.http = http
            log.info("serving /healthcheck and /json on %s:%d", host, http.port)
        if self.debug is not None and settings.debug_addr:
            host = await _listen(self.debug, settings.debug_addr, "debug")
            log.info("serving /rlconfig and /metrics on %s:%d", host, self.debug.port)

    async def _stop_listeners(self) -> None:
        """Every HTTP listener that was started (each stop is safe on one that was not)."""
        for server in (self.admin, self.prometheus, self.debug, self.http):
            if server is not None:
                await server.stop()

    def _bind(self, server: grpc.aio.Server) -> int:
        settings = self.settings
        if not settings.tls_cert:
            return int(server.add_insecure_port(settings.grpc_addr))
        if not settings.tls_key:
            raise OSError("--tls-cert needs --tls-key")
        self.tls = CertificateReloader(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        return int(server.add_secure_port(settings.grpc_addr, self.tls.credentials()))

    async def stop(self, drain: bool = False) -> None:
        """Report NOT_SERVING, (``drain``: keep answering until callers have moved on), stop taking
        calls, let in-flight ones finish, release."""
        self._serving = False
        await self.health.enter_graceful_shutdown()
        for name in self._health_status:
            self._health_status[name] = health_pb2.HealthCheckResponse.NOT_SERVING
        if drain and self.settings.drain_timeout > 0:
            await self._drain()
        self.quota.close_streams()  # RLQS streams end with a status, not the grace's cancel
        if self.native is not None:
            await self.native.stop(self.settings.shutdown_grace)
        if self._server is not None:
            await self._server.stop(self.settings.shutdown_grace)
        self._remove_backend_dir()
        await self.reconciler.stop()
        await self.quota.stop()
        await self._loop_lag_task.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        if self.xds is not None:
            await self.xds.stop()
        await self._stop_listeners()
        if self.statsd is not None:
            await self.statsd.stop()  # the last counts go out too
        if self.zone_aggregator is not None:
            await self.zone_aggregator.stop()
        await self.store.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # the last spans go out

    async def _drain(self) -> None:
        """Answer while NOT_SERVING until no call came for drain_quiet s, or drain_timeout."""
        settings, stats = self.settings, self.stats
        loop = asyncio.get_running_loop()
        started = last_call = loop.time()
        seen = stats.total_requests
        while loop.time() - started < settings.drain_timeout:
            await asyncio.sleep(min(0.1, settings.drain_quiet))
            if stats.total_requests != seen:
                seen, last_call = stats.total_requests, loop.time()
            elif loop.time() - last_call >= settings.drain_quiet:
                break
        log.info("drained: refusing new calls after %.1fs", loop.time() - started)

    async def run_until_signal(self) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        drain = False

        def terminate() -> None:  # an orchestrator's stop: drain first
            nonlocal drain
            drain = True
            stop.set()

        loop.add_signal_handler(signal.SIGTERM, terminate)
        loop.add_signal_handler(signal.SIGINT, stop.set)  # Ctrl-C: at once
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        await self.start()
        self.tenuring.install()
        await stop.wait()
        settings = self.settings
        if drain and settings.drain_timeout > 0:
            log.info(
                "shutting down: health NOT_SERVING, answering until no call comes for %gs"
                " (at most %gs), then finishing calls in flight (up to %gs)",
                settings.drain_quiet,
                settings.drain_timeout,
                settings.shutdown_grace,
            )
        else:
            log.info(
                "shutting down: finishing calls in flight (up to %gs)", settings.shutdown_grace
            )
        await self.stop(drain=drain)
        await self.tenuring.uninstall()
        log.info("stopped")

    def healthy(self) -> bool:
        """Serving calls, store outage or not: every rule still answers (by its failure_mode), and
        taking all replicas out would only hand the decision to Envoy's failure mode."""
        if self.settings.healthy_with_at_least_one_config_loaded:
            return self._serving and bool(self.limiter.config.domains)
        return self._serving

    async def _publish_health(self) -> None:
        """gRPC health follows healthy(): every service name, SERVING or NOT_SERVING."""
        status = health_pb2.HealthCheckResponse
        state = status.SERVING if self.healthy() else status.NOT_SERVING
        for name in HEALTH_NAMES:
            self._health_status[name] = state
            await self.health.set(name, state)

    def _reload(self) -> None:
        """SIGHUP: read the rule files again (rules by xDS come when the server sends them)."""
        if self.watcher is not None:
            self.watcher.reload()
        else:
            log.info("SIGHUP: rules come from xDS; nothing to reload")

    def _initial_rules(self) -> RateLimitConfig:
        """The rules at start (none by xDS until it sends them). With
        force_start_without_initial_config, rules that fail to load are logged and the service
        starts with none."""
        if self.settings.xds is not None:
            return load_config([])
        try:
            config = load_rules(self.settings)
        except ConfigLoadError as exc:
            if not self.settings.force_start_without_initial_config:
                raise
            self.stats.config_load_error += 1
            for error in exc.errors:
                log.error("config not loaded, starting without it: %s", error)
            return load_config([])
        self.stats.config_load_success += 1
        return config

    def install_rules(self, config: RateLimitConfig) -> None:
        """A config source's new rules, swapped in; health follows when it depends on them."""
        self.limiter.swap_config(config)
        if self._serving and self.settings.healthy_with_at_least_one_config_loaded:
            task = asyncio.get_running_loop().create_task(self._publish_health())
            self._health_updates.add(task)  # held until done: the loop keeps weak refs
            task.add_done_callback(self._health_updates.discard)

    def _healthcheck_page(self) -> tuple[int, str, bytes]:
        store = "healthy" if self.store.healthy() else "unavailable (rules use failure_mode)"
        status, head = (200, b"OK\n") if self.healthy() else (503, b"NOT SERVING\n")
        return status, "text/plain", head + f"store: {self.store_name} {store}\n".encode()

    def _metrics_stream(self) -> tuple[int, str, Iterator[bytes]]:
        """The page in pieces: the HTTP server returns to the event loop between two."""
        return 200, METRICS_TYPE, self.metrics.exposition()

    def _rlconfig_page(self) -> tuple[int, str, bytes]:
        return 200, "text/plain; charset=utf-8", self.limiter.config.dump().encode()

    def _gauges(self) -> Iterator[Metric | None]:
        yield from rule_limit_metrics(self.limiter.config)
        yield from bucket_metrics(self.local)
        zone = self.zone_aggregator.stats() if self.zone_aggregator is not None else {}
        yield from store_metrics(self.store, zone)
        if self.zone_aggregator is not None:
            yield from zone_metrics(self.zone_aggregator)
        yield histogram_family(
            "ratelimit_event_loop_lag_seconds",
            "How late the event loop ran a timer that was due (busy, or not scheduled)",
            self.loop_lag.histogram,
        )
        yield histogram_family(
            "ratelimit_event_loop_blocked_seconds",
            "Of each event loop lag, the part its thread was running: the process's own work"
            " held the loop (the rest it waited for a CPU)",
            self.loop_lag.blocked,
        )
        yield from reconciler_metrics(self.reconciler)
        yield from quota_metrics(self.quota)
        yield from self.tenuring.metrics()
        yield from grpc_call_metrics(None if self.native is None else self.native.counts)


def private_socket() -> tuple[BackendSocket, str | None]:
    """Where grpcio listens behind the native front door, and the directory to remove:
    a socket in a private directory (mode 0700), or where no temporary directory can be
    written (a read-only root file system) an abstract socket of a random name."""
    try:
        directory = tempfile.mkdtemp(prefix="ratelimit-grpc-")
    except OSError:
        name = f"ratelimit-grpc-{os.getpid()}-{secrets.token_hex(8)}"
        return BackendSocket(f"unix-abstract:{name}", "\0" + name), None
    path = os.path.join(directory, "grpcio.sock")
    return BackendSocket(f"unix:{path}", path), directory


def _bind_error(addr: str, reuse_port: bool) -> str:
    """Why gRPC could not bind ``addr`` (its message points at its debug log): bind it ourselves."""
    if addr.startswith("unix:"):
        return "cannot bind the socket path"
    try:
        host, port = _split_addr(addr)
        for family, kind, proto, _, address in socket.getaddrinfo(host, port, 0, 1):
            with socket.socket(family, kind, proto) as probe:
                if reuse_port:
                    probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                probe.bind(address)
    except (OSError, ValueError) as exc:
        return exc.strerror or str(exc) if isinstance(exc, OSError) else str(exc)
    return "the address is not available"


async def _listen(server: HttpServer, addr: str, role: str, reuse_port: bool = False) -> str:
    """Start ``server`` on ``addr``; returns the host. An OSError names the listener."""
    host, port = _split_addr(addr)
    try:
        await server.start(host, port, reuse_port=reuse_port)
    except OSError as exc:
        raise OSError(f"cannot listen on {addr} ({role}): {exc}") from exc
    return host


def _split_addr(addr: str) -> tuple[str, int]:
    host, port = split_host_port(addr, any_port=True)
    return listen_host(host), port
