"""Generate the Envoy side of a descriptor configuration: the ratelimit HTTP filter, the
HTTP/2 cluster it calls, and the route ``rate_limits`` that produce the descriptors.

Behind ``ratelimit-service envoy-config --config PATH``. Every piece is built as the
typed xds-protos message and only then rendered (``MessageToDict`` → YAML), so a field
name or type Envoy would reject cannot get into the output: the snippet is valid by
construction, and it stays in step with the rules because it is derived from them.

Which action produces which descriptor key is a convention, since the rule files do not
say where a value comes from: ``remote_address``, ``masked_remote_address``,
``source_cluster`` and ``destination_cluster`` are Envoy's own actions; ``generic_key``
takes the rule's fixed value; ``path``, ``method`` and ``authority``/``host`` read the
HTTP/2 pseudo-headers; any other key reads the header ``x-<key>`` (``tenant`` →
``x-tenant``). Edit the header names in the output if your headers differ.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import yaml
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.core.v3 import address_pb2, config_source_pb2, grpc_service_pb2, protocol_pb2
from envoy.config.endpoint.v3 import endpoint_components_pb2, endpoint_pb2
from envoy.config.ratelimit.v3 import rls_pb2 as rls_config_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import any_pb2, duration_pb2, json_format
from google.protobuf.message import Message

from ratelimit_service.config_source import read_config_files
from ratelimit_service.core.config_loader import load_config
from ratelimit_service.core.config_model import DescriptorNode, DomainConfig, NodeChildren

Action = route_components_pb2.RateLimit.Action

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
HTTP_PROTOCOL_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

# Descriptor keys whose values Envoy reads from HTTP/2 pseudo-headers.
PSEUDO_HEADERS = {
    "path": ":path",
    "method": ":method",
    "authority": ":authority",
    "host": ":authority",
}


def header_for(key: str) -> str:
    """The request header a descriptor key is read from, by the convention above."""
    return PSEUDO_HEADERS.get(key, "x-" + key.replace("_", "-").lower())


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


def _limited_paths(
    children: NodeChildren, prefix: tuple[DescriptorNode, ...] = ()
) -> Iterator[tuple[DescriptorNode, ...]]:
    """Every chain of nodes, root first, that ends on a node with a ``rate_limit``, in the
    order of the rule files (the index groups nodes by kind, not by line)."""
    for node in sorted(children, key=lambda child: child.line or 0):
        chain = (*prefix, node)
        if node.limit is not None:
            yield chain
        yield from _limited_paths(node.children, chain)


def route_rate_limits(
    domain: DomainConfig,
) -> tuple[list[route_components_pb2.RateLimit], list[str]]:
    """One ``rate_limits`` entry per distinct action chain that reaches a limit, in config
    order, and the config paths no action chain can produce (reported, not emitted)."""
    entries: list[route_components_pb2.RateLimit] = []
    seen: set[bytes] = set()
    skipped: list[str] = []
    for chain in _limited_paths(domain.root):
        actions = [action_for(node) for node in chain]
        if any(action is None for action in actions):
            skipped.append(chain[-1].config_path)
            continue
        entry = route_components_pb2.RateLimit(actions=actions)
        wire = entry.SerializeToString(deterministic=True)
        if wire not in seen:
            seen.add(wire)
            entries.append(entry)
    return entries, skipped


def _duration(text: str) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    try:
        duration.FromJsonString(text)
    except ValueError as exc:
        raise ValueError(f"timeout {text!r}: {exc} (write e.g. 0.02s)") from exc
    return duration


def ratelimit_filter(domain: str, cluster: str, timeout: str) -> Message:
    """The HTTP filter. ``failure_mode_deny: false``: when the service cannot answer in
    time, traffic flows (the service's own rules already choose open/closed per rule)."""
    config = rate_limit_pb2.RateLimit(
        domain=domain,
        timeout=_duration(timeout),
        failure_mode_deny=False,
        enable_x_ratelimit_headers=rate_limit_pb2.RateLimit.DRAFT_VERSION_03,
        rate_limit_service=rls_config_pb2.RateLimitServiceConfig(
            grpc_service=grpc_service_pb2.GrpcService(
                envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=cluster)
            ),
            transport_api_version=config_source_pb2.V3,
        ),
    )
    typed = any_pb2.Any()
    typed.Pack(config)
    return http_connection_manager_pb2.HttpFilter(name=RATELIMIT_FILTER, typed_config=typed)


def ratelimit_cluster(name: str, address: str) -> Message:
    """The cluster the filter calls. gRPC needs HTTP/2; STRICT_DNS spreads the calls over
    every address the name resolves to (every replica behind a headless service)."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"service address {address!r}: write HOST:PORT")
    options = http_protocol_options_pb2.HttpProtocolOptions(
        explicit_http_config=http_protocol_options_pb2.HttpProtocolOptions.ExplicitHttpConfig(
            http2_protocol_options=protocol_pb2.Http2ProtocolOptions()
        )
    )
    packed = any_pb2.Any()
    packed.Pack(options)
    endpoint = endpoint_components_pb2.LbEndpoint(
        endpoint=endpoint_components_pb2.Endpoint(
            address=address_pb2.Address(
                socket_address=address_pb2.SocketAddress(address=host, port_value=int(port))
            )
        )
    )
    return cluster_pb2.Cluster(
        name=name,
        type=cluster_pb2.Cluster.STRICT_DNS,
        connect_timeout=_duration("1s"),
        lb_policy=cluster_pb2.Cluster.ROUND_ROBIN,
        typed_extension_protocol_options={HTTP_PROTOCOL_OPTIONS: packed},
        load_assignment=endpoint_pb2.ClusterLoadAssignment(
            cluster_name=name,
            endpoints=[endpoint_components_pb2.LocalityLbEndpoints(lb_endpoints=[endpoint])],
        ),
    )


def _to_dict(message: Message) -> dict[str, Any]:
    """Proto-JSON with Envoy's snake_case names, as plain dicts and lists for the YAML
    dumper (``MessageToDict`` nests OrderedDicts for ``Any`` values)."""
    result: dict[str, Any] = _plain(
        json_format.MessageToDict(message, preserving_proto_field_name=True)
    )
    return result


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value


def pick_domain(domains: Sequence[str], wanted: str | None) -> str:
    """The domain to render: the one asked for, or the only one loaded."""
    if wanted is not None:
        if wanted not in domains:
            raise ValueError(f"domain {wanted!r} is not in the config (has: {', '.join(domains)})")
        return wanted
    if len(domains) != 1:
        raise ValueError(f"the config has domains {', '.join(domains)}: choose one with --domain")
    return domains[0]


def render(
    config_path: str,
    *,
    domain: str | None = None,
    cluster: str = "ratelimit",
    timeout: str = "0.02s",
    service_address: str = "ratelimit:8081",
    merge_domains: bool = False,
) -> str:
    """YAML for the Envoy side of ``config_path``'s rules: ``http_filters`` (place before
    the router), ``clusters`` and ``rate_limits`` (for a virtual host or a route action).

    Raises ConfigLoadError when the rules do not load, ValueError on a bad argument."""
    config = load_config(read_config_files(config_path), merge_domains=merge_domains)
    name = pick_domain(sorted(config.domains), domain)
    rate_limits, skipped = route_rate_limits(config.domains[name])
    filter_dict = _to_dict(ratelimit_filter(name, cluster, timeout))
    # Spelled out although it is the default, so the reader sees the fail-open choice.
    filter_dict["typed_config"]["failure_mode_deny"] = False
    snippet = {
        "http_filters": [filter_dict],
        "clusters": [_to_dict(ratelimit_cluster(cluster, service_address))],
        "rate_limits": [_to_dict(entry) for entry in rate_limits],
    }
    header = [
        f"# Envoy configuration for rate-limit domain '{name}', generated from {config_path}.",
        "# http_filters: add to the HttpConnectionManager's http_filters, before the router.",
        "# clusters: add to static_resources.clusters (point the endpoint at the service).",
        "# rate_limits: put under a virtual host, or under a route's `route:` action.",
        "# Header names follow the convention x-<key>; edit them to match your requests.",
    ]
    header += [f"# not emitted (no Envoy action yields it): {path}" for path in skipped]
    return "\n".join(header) + "\n" + yaml.safe_dump(snippet, sort_keys=False)
