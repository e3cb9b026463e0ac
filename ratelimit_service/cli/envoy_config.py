"""``envoy-config``: the Envoy side of the rules (the ratelimit HTTP filter, the HTTP/2
cluster it calls, the route ``rate_limits`` that produce the descriptors), as envoy_plan.py
decides it. Every piece is built as the typed xds-protos message and only then rendered
(``MessageToDict`` → YAML), so a field name or type Envoy would reject cannot get in.
What renders a rules file raises ConfigLoadError when the rules do not load, ValueError on
a bad argument.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeAlias

import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2, outlier_detection_pb2
from envoy.config.core.v3 import (
    address_pb2,
    backoff_pb2,
    base_pb2,
    config_source_pb2,
    grpc_service_pb2,
    health_check_pb2,
    protocol_pb2,
)
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.listener.v3 import listener_components_pb2, listener_pb2
from envoy.config.ratelimit.v3 import rls_pb2 as rls_config_pb2
from envoy.config.route.v3 import route_components_pb2, route_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.retry.host.previous_hosts.v3 import previous_hosts_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import any_pb2, duration_pb2, json_format, wrappers_pb2
from google.protobuf.message import Message

from ratelimit_service.cli.envoy_plan import (
    DEFAULT_OPTIONS,
    Chain,
    EnvoyOptions,
    RoutePlan,
    header_for,
    limited_chains,
    pick_domain,
    plan_routes,
    usage_of,
)
from ratelimit_service.config.files import read_config_files
from ratelimit_service.core.address import split_host_port
from ratelimit_service.core.config_loader import load_config
from ratelimit_service.core.config_model import DescriptorNode, DomainConfig, UsageSource

RateLimitEntry: TypeAlias = route_components_pb2.RateLimit
Action = RateLimitEntry.Action
Match = route_components_pb2.RouteMatch

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
ROUTER_FILTER = "envoy.filters.http.router"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
RLS_HEALTH_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
PREVIOUS_HOSTS = "envoy.retry_host_predicates.previous_hosts"
# The calls retried (once, on another replica): those that failed before any replica
# could answer them. Never a slow call, which has spent the filter's timeout already.
RETRY_ON = "connect-failure,refused-stream,reset,unavailable"


def action_for(node: DescriptorNode) -> Message | None:
    """The route action that emits ``node``'s key; None when no action can (a valueless
    ``generic_key``: Envoy's generic key always carries a fixed value)."""
    key = node.key
    if key == "remote_address":
        return Action(remote_address=Action.RemoteAddress())
    if key == "masked_remote_address":
        return Action(masked_remote_address=Action.MaskedRemoteAddress())
    if key == "source_cluster":
        return Action(source_cluster=Action.SourceCluster())
    if key == "destination_cluster":
        return Action(destination_cluster=Action.DestinationCluster())
    if key == "generic_key":
        if node.value is None or node.pattern is not None:
            return None
        return Action(generic_key=Action.GenericKey(descriptor_value=node.value))
    return Action(
        request_headers=Action.RequestHeaders(header_name=header_for(key), descriptor_key=key)
    )


def phased(entry: RateLimitEntry, usage: UsageSource | None) -> list[RateLimitEntry]:
    """``entry`` as Envoy sends it: once, or, for a usage budget, twice (Envoy's
    two-phase form): a check at cost 0 before the request, and a report of the
    response's cost once the stream is done (Envoy ignores its answer)."""
    if usage is None:
        return [entry]
    hits = RateLimitEntry.HitsAddend
    check = RateLimitEntry(
        actions=entry.actions, hits_addend=hits(number=wrappers_pb2.UInt64Value(value=0))
    )
    report = RateLimitEntry(
        actions=entry.actions, apply_on_stream_done=True, hits_addend=hits(format=usage.hits_format)
    )
    return [check, report]


def is_phased(entries: Iterable[RateLimitEntry]) -> bool:
    """Whether some entry carries a cost: Envoy 1.40 sends ``hits_addend`` and
    ``apply_on_stream_done`` only from the ratelimit filter's own ``rate_limits`` (or a
    route's ``RateLimitPerRoute.rate_limits``), not from a route action's."""
    return any(entry.HasField("hits_addend") for entry in entries)


def route_rate_limits(domain: DomainConfig) -> tuple[list[RateLimitEntry], list[str]]:
    """One ``rate_limits`` entry per distinct action chain that reaches a limit (two
    for a usage budget: :func:`phased`), in config order, and the config paths no
    action chain can produce (reported, not emitted)."""
    entries: list[RateLimitEntry] = []
    skipped: list[str] = []
    for chain in limited_chains(domain.root):
        found = _chain_entries(chain, None)
        if not found:
            skipped.append(chain[-1].config_path)
        entries += found
    return _dedup(entries), skipped


def _duration(text: str) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    try:
        duration.FromJsonString(text)
    except ValueError as exc:
        raise ValueError(f"timeout {text!r}: {exc} (write e.g. 0.02s)") from exc
    return duration


def ratelimit_retry_policy() -> base_pb2.RetryPolicy:
    """One retry of a ``RETRY_ON`` failure (a replica killed or shutting down), on another
    replica, at once (the back-off is drawn below ``base_interval``, 1 ms), within the
    filter's timeout. Envoy also takes ``max_interval`` as each try's timeout: at 1 s the
    filter's stays the only one, so no call is cut short while an exact rule waits for Redis."""
    predicate = base_pb2.RetryPolicy.RetryHostPredicate(
        name=PREVIOUS_HOSTS, typed_config=_pack(previous_hosts_pb2.PreviousHostsPredicate())
    )
    return base_pb2.RetryPolicy(
        retry_on=RETRY_ON,
        num_retries=wrappers_pb2.UInt32Value(value=1),
        retry_back_off=backoff_pb2.BackoffStrategy(
            base_interval=_duration("0.001s"), max_interval=_duration("1s")
        ),
        retry_host_predicate=[predicate],
        host_selection_retry_max_attempts=3,
    )


def ratelimit_filter(
    domain: str, cluster: str, timeout: str, rate_limits: Sequence[RateLimitEntry] = ()
) -> Message:
    """The HTTP filter, open when the service cannot answer in time (its rules choose open
    or closed themselves). ``rate_limits``: the filter's own, which Envoy then sends for
    every route instead of the routes' (with RateLimitPerRoute, the only place for a cost)."""
    config = rate_limit_pb2.RateLimit(
        rate_limits=rate_limits,
        domain=domain,
        timeout=_duration(timeout),
        failure_mode_deny=False,
        enable_x_ratelimit_headers=rate_limit_pb2.RateLimit.DRAFT_VERSION_03,
        rate_limit_service=rls_config_pb2.RateLimitServiceConfig(
            grpc_service=grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=cluster),
                retry_policy=ratelimit_retry_policy(),
            ),
            transport_api_version=config_source_pb2.V3,
        ),
    )
    return http_connection_manager_pb2.HttpFilter(name=RATELIMIT_FILTER, typed_config=_pack(config))


def _socket(address: str, what: str) -> address_pb2.Address:
    try:
        host, port = split_host_port(address, need_host=True, any_port=True)
    except ValueError as exc:
        raise ValueError(f"{what} {address!r}: write HOST:PORT ({exc})") from None
    return address_pb2.Address(
        socket_address=address_pb2.SocketAddress(address=host, port_value=port)
    )


def _static_cluster(name: str, address: str, what: str) -> cluster_pb2.Cluster:
    endpoint = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(address=_socket(address, what))
    )
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STRICT_DNS,
        connect_timeout=_duration("1s"),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint])],
        ),
    )


def ratelimit_health_check() -> health_check_pb2.HealthCheck:
    """gRPC health checks: a replica that reports NOT_SERVING (draining on SIGTERM) leaves
    the rotation. ``no_traffic_interval`` too, or Envoy checks every 60 s until the cluster
    carries traffic of its own (the filter's calls do not count)."""
    return health_check_pb2.HealthCheck(
        timeout=_duration("1s"),
        interval=_duration("5s"),
        no_traffic_interval=_duration("5s"),
        unhealthy_threshold=wrappers_pb2.UInt32Value(value=2),
        healthy_threshold=wrappers_pb2.UInt32Value(value=1),
        grpc_health_check=health_check_pb2.HealthCheck.GrpcHealthCheck(
            service_name=RLS_HEALTH_SERVICE
        ),
    )


def ratelimit_outlier_detection() -> outlier_detection_pb2.OutlierDetection:
    """A dead replica out within milliseconds, not at its health checks: three local failures
    in a row (connection refused or reset, apart from errors a replica answers; not the
    filter's timeouts) eject it. At most half the replicas (Envoy's 10 % is not one of two
    or three); back after 30 s, longer after each ejection, or at a passing health check."""
    return outlier_detection_pb2.OutlierDetection(
        split_external_local_origin_errors=True,
        consecutive_local_origin_failure=wrappers_pb2.UInt32Value(value=3),
        enforcing_consecutive_local_origin_failure=wrappers_pb2.UInt32Value(value=100),
        interval=_duration("1s"),
        base_ejection_time=_duration("30s"),
        max_ejection_percent=wrappers_pb2.UInt32Value(value=50),
    )


def ratelimit_cluster(name: str, address: str) -> Message:
    """The cluster the filter calls: HTTP/2 for gRPC; STRICT_DNS spreads the calls over every
    address the name resolves to (every replica behind a headless service); host health
    changes reach the workers at once (``update_merge_window``; Envoy's default is 1 s)."""
    options = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    cluster = _static_cluster(name, address, "service address")
    cluster.typed_extension_protocol_options[HTTP_PROTOCOL_OPTIONS].CopyFrom(_pack(options))
    cluster.health_checks.append(ratelimit_health_check())
    cluster.outlier_detection.CopyFrom(ratelimit_outlier_detection())
    cluster.common_lb_config.update_merge_window.CopyFrom(_duration("0s"))
    return cluster


def _to_dict(message: Message) -> dict[str, Any]:
    """Proto-JSON with Envoy's snake_case names, as plain dicts and lists for the YAML
    dumper (``MessageToDict`` nests OrderedDicts for ``Any`` values)."""
    result: dict[str, Any] = _plain(
        json_format.MessageToDict(message, preserving_proto_field_name=True)
    )
    return result


def _plain(value: Any) -> Any:
    """``value`` as plain dicts and lists, with ``failure_mode_deny: false`` written into
    every ratelimit filter (proto3 JSON drops a false bool; the reader should see the
    fail-open choice) and an RLQS bucket's id builders in key order, so the same rules
    give the same text."""
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if not isinstance(value, dict):
        return value
    plain = {key: _plain(item) for key, item in value.items()}
    ids = plain.get("bucket_id_builder")
    if isinstance(ids, dict) and isinstance(ids.get("bucket_id_builder"), dict):
        # A protobuf map iterates in an order of the process's: write its keys sorted.
        ids["bucket_id_builder"] = dict(sorted(ids["bucket_id_builder"].items()))
    if plain.get("name") == RATELIMIT_FILTER and isinstance(plain.get("typed_config"), dict):
        plain["typed_config"]["failure_mode_deny"] = False
    return plain


def load_domain(config_path: str, options: EnvoyOptions) -> DomainConfig:
    """The rules of the domain to render, from ``config_path``."""
    config = load_config(read_config_files(config_path), merge_domains=options.merge_domains)
    return config.domains[pick_domain(sorted(config.domains), options.domain)]


def render(config_path: str, options: EnvoyOptions = DEFAULT_OPTIONS) -> str:
    """YAML for the Envoy side of ``config_path``'s rules: ``http_filters`` (place before
    the router), ``clusters`` and ``rate_limits`` (for a virtual host or a route action)."""
    domain = load_domain(config_path, options)
    name = domain.name
    rate_limits, skipped = route_rate_limits(domain)
    # Costs go on the filter itself (is_phased); plain entries under a route or host.
    on_filter = rate_limits if is_phased(rate_limits) else []
    http_filter = ratelimit_filter(name, options.cluster, options.timeout, on_filter)
    snippet: dict[str, Any] = {
        "http_filters": [_to_dict(http_filter)],
        "clusters": [_to_dict(ratelimit_cluster(options.cluster, options.service_address))],
    }
    if not on_filter:
        snippet["rate_limits"] = [_to_dict(entry) for entry in rate_limits]
    header = [
        f"# Envoy configuration for rate-limit domain '{name}', generated from {config_path}.",
        "# http_filters: add to the HttpConnectionManager's http_filters, before the router.",
        "# clusters: add to static_resources.clusters (point the endpoint at the service).",
        "# rate_limits: put under a virtual host, or under a route's `route:` action. It is",
        "# every descriptor of every rule: on a route that some rules must not limit (a",
        "# /healthz only an `unlimited` rule covers) it limits too much; --bootstrap prints",
        "# whole routes, each with what its rules need.",
    ]
    if on_filter:
        header[3:7] = [
            "# rate_limits are the filter's own (a usage budget's cost is sent only from",
            "# there): a check at cost 0 before the request, the response's cost once the",
            "# stream is done. Envoy then ignores the routes' and virtual hosts' rate_limits;",
            "# --bootstrap prints whole routes, each with what its rules need.",
        ]
    return with_header(header, snippet, skipped)


def _chain_entries(chain: Chain, exact_path: str | None) -> list[RateLimitEntry]:
    """A chain's rate_limits entries (:func:`phased`); none when no action yields a key."""
    entry = _chain_entry(chain, exact_path)
    return [] if entry is None else phased(entry, usage_of(chain))


def _chain_entry(chain: Chain, exact_path: str | None) -> RateLimitEntry | None:
    """The rate_limits entry for a chain on a route. On an exact-path route, a ``path``
    node with that very value becomes a fixed ``generic_key`` (the query string, which
    ``:path`` would carry, cannot then spoil the match)."""
    actions = []
    for node in chain:
        if node.key == "path" and exact_path is not None and node.value == exact_path:
            action: Message | None = Action(
                generic_key=Action.GenericKey(descriptor_key="path", descriptor_value=exact_path)
            )
        else:
            action = action_for(node)
        if action is None:
            return None
        actions.append(action)
    return RateLimitEntry(actions=actions)


def _dedup(entries: Iterable[RateLimitEntry]) -> list[RateLimitEntry]:
    """Each distinct entry once, where it first appears."""
    unique = {entry.SerializeToString(deterministic=True): entry for entry in entries}
    return list(unique.values())


def _pack(message: Message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def plan_rate_limits(plan: RoutePlan) -> list[RateLimitEntry]:
    """The rate_limits entries a planned route sends: its chains', each once."""
    return _dedup(entry for chain in plan.chains for entry in _chain_entries(chain, plan.path))


def _route(plan: RoutePlan, upstream_cluster: str) -> route_components_pb2.Route:
    """A planned route. Its rate_limits go on the route action, or, when some carry a
    cost (:func:`is_phased`), all of them in the route's ``RateLimitPerRoute`` (which
    Envoy then reads instead of the action's)."""
    rate_limits = plan_rate_limits(plan)
    match = Match(path=plan.path) if plan.path is not None else Match(prefix=plan.prefix)
    route = route_components_pb2.Route(
        name=plan.name,
        match=match,
        route=route_components_pb2.RouteAction(cluster=upstream_cluster),
    )
    if is_phased(rate_limits):
        per_route = rate_limit_pb2.RateLimitPerRoute(rate_limits=rate_limits)
        route.typed_per_filter_config[RATELIMIT_FILTER].CopyFrom(_pack(per_route))
    else:
        route.route.rate_limits.extend(rate_limits)
    return route


def build_bootstrap(
    domain: DomainConfig, options: EnvoyOptions = DEFAULT_OPTIONS
) -> bootstrap_pb2.Bootstrap:
    """A whole bootstrap (:func:`bootstrap_around`): the ratelimit filter over ``plan_routes``."""
    check_clusters(options)
    routes = [_route(plan, options.upstream_cluster) for plan in plan_routes(domain)]
    http_filter = ratelimit_filter(domain.name, options.cluster, options.timeout)
    return bootstrap_around(http_filter, routes, domain.name, options)


def check_clusters(options: EnvoyOptions) -> None:
    """A bootstrap's two clusters need two names."""
    if options.cluster == options.upstream_cluster:
        raise ValueError(f"--cluster {options.cluster!r} is the name of the upstream cluster")


def bootstrap_around(
    http_filter: Message,
    routes: Sequence[route_components_pb2.Route],
    name: str,
    options: EnvoyOptions,
) -> bootstrap_pb2.Bootstrap:
    """What the RLS and RLQS bootstraps share: an admin, one listener whose HTTP connection
    manager runs ``http_filter`` then the router over ``routes``, the placeholder upstream
    cluster and the service's cluster, as ``options`` place them."""
    router = http_connection_manager_pb2.HttpFilter(
        name=ROUTER_FILTER, typed_config=_pack(router_pb2.Router())
    )
    manager = http_connection_manager_pb2.HttpConnectionManager(
        stat_prefix=name,
        # Envoy at the edge: remote_address is the peer, not a forgeable X-Forwarded-For.
        use_remote_address=wrappers_pb2.BoolValue(value=True),
        http_filters=[http_filter, router],
        route_config=route_pb2.RouteConfiguration(
            name=name,
            virtual_hosts=[
                route_components_pb2.VirtualHost(name=name, domains=["*"], routes=routes)
            ],
        ),
    )
    listener = listener_pb2.Listener(
        name=name,
        address=_socket(options.listen, "listen address"),
        filter_chains=[
            listener_components_pb2.FilterChain(
                filters=[
                    listener_components_pb2.Filter(name=HCM_FILTER, typed_config=_pack(manager))
                ]
            )
        ],
    )
    return bootstrap_pb2.Bootstrap(
        admin=bootstrap_pb2.Admin(address=_socket(options.admin, "admin address")),
        static_resources=bootstrap_pb2.Bootstrap.StaticResources(
            listeners=[listener],
            clusters=[
                _static_cluster(
                    options.upstream_cluster, options.upstream_address, "upstream address"
                ),
                ratelimit_cluster(options.cluster, options.service_address),
            ],
        ),
    )


def render_bootstrap(config_path: str, options: EnvoyOptions = DEFAULT_OPTIONS) -> str:
    """YAML of ``build_bootstrap`` for ``config_path``'s rules, runnable as ``envoy -c``."""
    domain = load_domain(config_path, options)
    rendered = _to_dict(build_bootstrap(domain, options))
    _, skipped = route_rate_limits(domain)
    header = [
        f"# Envoy bootstrap for rate-limit domain '{domain.name}', generated from {config_path}.",
        f"# Run: envoy -c FILE. Listener {options.listen}, admin {options.admin}; the service"
        f" at {options.service_address}.",
        "# The 'upstream' cluster is a placeholder: point it at your application.",
        "# Routes: one per path a rule names, then '/'; each sends the descriptors its rules",
        "# need (a path only `unlimited` rules cover sends only those, so it is never limited).",
    ]
    return with_header(header, rendered, skipped)


def with_header(header: list[str], document: Any, skipped: Sequence[str] = ()) -> str:
    """Comment lines (``header``, the header names' convention, the config paths no action
    yields), then ``document`` as YAML."""
    notes = [f"# not emitted (no Envoy action yields it): {path}" for path in skipped]
    convention = "# Header names follow the convention x-<key>; edit them to match your requests."
    lines = [*header, convention, *notes]
    return "\n".join(lines) + "\n" + yaml.safe_dump(document, sort_keys=False)
