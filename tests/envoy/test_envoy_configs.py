"""The Envoy, Istio, Docker and Kubernetes files, checked without Envoy, Docker or a cluster.

Envoy YAML is parsed into its Envoy API type with unknown fields rejected and ``typed_config``
``Any`` values resolved, then checked against the protoc-gen-validate rules embedded in the
protos (required fields, lengths, enum values), which is what Envoy checks at load time
beyond the parse. The descriptors the routes can send are matched against config/ with the
service's own loader and matcher, in both directions. A real Envoy runs these files in
tests/envoy/test_envoy_real.py (envoy/envoy.yaml) and tests/envoy/test_envoy_generated.py (the
generator's bootstrap, istio/envoyfilter.yaml's patches, ``envoy --mode validate``); what
remains for Docker or a cluster to show is listed in docs/envoy-istio.md.
"""

from __future__ import annotations

import itertools
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import pytest
import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.ratelimit.v3 import rate_limit_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2
from envoy.extensions.filters.network.http_connection_manager.v3 import (
    http_connection_manager_pb2,
)
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2
from google.protobuf import any_pb2, descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from validate import validate_pb2

from ratelimit_harness.fixtures import REPO
from ratelimit_service.cli import envoy_config, envoy_rlqs
from ratelimit_service.cli.envoy_plan import EnvoyOptions
from ratelimit_service.config.files import read_config_files
from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.config_model import DescriptorNode, DomainConfig, NodeChildren
from ratelimit_service.core.matching import find_limit, find_limits
from ratelimit_service.core.settings_table import SETTINGS
from ratelimit_service.server.app import HEALTH_NAMES

HttpFilter = http_connection_manager_pb2.HttpFilter
Hcm = http_connection_manager_pb2.HttpConnectionManager
RouteRateLimit = route_components_pb2.RateLimit
RATELIMIT_TYPE = rate_limit_pb2.RateLimit.DESCRIPTOR.full_name
ROUTER_TYPE = router_pb2.Router.DESCRIPTOR.full_name
HTTP_OPTIONS = http_protocol_options_pb2.HttpProtocolOptions

BOOTSTRAP = REPO / "envoy" / "envoy.yaml"
ENVOY_FILTER = REPO / "istio" / "envoyfilter.yaml"
ISTIO_GATEWAY = REPO / "istio" / "gateway.yaml"
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
K8S = REPO / "k8s"
DOMAIN = "edge"

# Descriptors the routes send that no rule in config/edge.yaml limits. The rules put
# `path=/api/write*` under the default `tenant` only, so a premium tenant's writes are held
# by its 6000/min alone, and a blocked tenant's by its 0/s (which denies them anyway).
# Change config/edge.yaml and this set must change with it: the test compares exactly.
KNOWN_GAPS = {
    # A blocked tenant is denied by its own 0 limit; its writes need no rule of their own.
    "api-write: edge.tenant_blocked has no rule for 'path'",
}


# ---------------------------------------------------------------- strict parsing + PGV


def parse_strict(data: Any, message_type: type[Message]) -> Any:
    """``data`` (YAML-loaded) as ``message_type``; unknown fields and unknown ``@type``s raise."""
    return json_format.ParseDict(data, message_type(), ignore_unknown_fields=False)


def _is_set(message: Message, field: FieldDescriptor) -> bool:
    value = getattr(message, field.name)
    if field.is_repeated:
        return len(value) > 0
    if field.has_presence:
        return message.HasField(field.name)
    return bool(value != field.default_value)


def _unpack(packed: any_pb2.Any) -> Message:
    descriptor = descriptor_pool.Default().FindMessageTypeByName(packed.TypeName())
    inner = message_factory.GetMessageClass(descriptor)()
    assert packed.Unpack(inner)
    return inner


def _children(message: Message, field: FieldDescriptor) -> Iterator[tuple[str, Message]]:
    value = getattr(message, field.name)
    if field.message_type.GetOptions().map_entry:
        if field.message_type.fields_by_name["value"].message_type is not None:
            yield from ((f"[{key!r}]", value[key]) for key in value)
    elif field.is_repeated:
        yield from ((f"[{index}]", item) for index, item in enumerate(value))
    else:
        yield "", value


def _scalar_errors(kind: str, rules: Any, value: Any, field: FieldDescriptor) -> list[str]:
    """The protoc-gen-validate rules of one value: the subset Envoy's protos use."""
    errors: list[str] = []
    if kind == "string":
        for name, test in (
            ("min_len", lambda n: len(value) >= n),
            ("max_len", lambda n: len(value) <= n),
            ("min_bytes", lambda n: len(value.encode()) >= n),
            ("max_bytes", lambda n: len(value.encode()) <= n),
            ("prefix", lambda p: value.startswith(p)),
        ):
            if rules.HasField(name) and not test(getattr(rules, name)):
                errors.append(f"{name} {getattr(rules, name)!r}, got {value!r}")
        if rules.HasField("pattern") and not re.search(rules.pattern, value):
            errors.append(f"pattern {rules.pattern!r}, got {value!r}")
        header = validate_pb2.HTTP_HEADER_NAME
        if rules.well_known_regex == header and value and not re.fullmatch(r":?[!-9;-~]+", value):
            errors.append(f"not an HTTP header name: {value!r}")
    elif kind == "enum":
        if rules.defined_only and field.enum_type.values_by_number.get(value) is None:
            errors.append(f"undefined enum value {value}")
    elif kind in ("duration", "uint32", "uint64", "int32", "int64", "double", "float"):
        number = value.ToNanoseconds() if kind == "duration" else value
        bound = (lambda d: d.ToNanoseconds()) if kind == "duration" else (lambda n: n)
        for name, test in (
            ("lt", lambda b: number < b),
            ("lte", lambda b: number <= b),
            ("gt", lambda b: number > b),
            ("gte", lambda b: number >= b),
        ):
            if rules.HasField(name) and not test(bound(getattr(rules, name))):
                errors.append(f"{name} {bound(getattr(rules, name))}, got {number}")
    allowed = getattr(rules, "in", None)
    if allowed and value not in list(allowed):
        errors.append(f"must be one of {list(allowed)}, got {value!r}")
    return errors


def pgv_errors(message: Message, where: str = "") -> list[str]:
    """Every protoc-gen-validate violation and every deprecated field set in ``message``,
    recursively, looking inside ``Any`` values too."""
    errors: list[str] = []
    if isinstance(message, any_pb2.Any):
        return pgv_errors(_unpack(message), f"{where}<{message.TypeName()}>")
    descriptor = message.DESCRIPTOR
    for oneof in descriptor.oneofs:
        options = oneof.GetOptions()
        required = (
            options.HasExtension(validate_pb2.required)
            and options.Extensions[validate_pb2.required]
        )
        if required and message.WhichOneof(oneof.name) is None:
            errors.append(f"{where or descriptor.name}: one of {oneof.name} is required")
    for field in descriptor.fields:
        name = f"{where}.{field.name}" if where else field.name
        is_set = _is_set(message, field)
        options = field.GetOptions()
        if is_set and options.deprecated:
            errors.append(f"{name}: deprecated field")
        if options.HasExtension(validate_pb2.rules):
            errors += [f"{name}: {e}" for e in _field_errors(message, field, is_set)]
        if field.message_type is not None and is_set:
            for suffix, child in _children(message, field):
                errors += pgv_errors(child, name + suffix)
    return errors


def _field_errors(message: Message, field: FieldDescriptor, is_set: bool) -> list[str]:
    rules = field.GetOptions().Extensions[validate_pb2.rules]
    if field.containing_oneof is not None and not is_set:
        return []  # only the member of a oneof that is set is validated
    kind = rules.WhichOneof("type")
    value = getattr(message, field.name)
    required = rules.message.required or (
        kind in ("duration", "any") and getattr(rules, kind).required
    )
    if required and not is_set:
        return ["required"]
    if kind is None:
        return []
    sub = getattr(rules, kind)
    if kind == "repeated":
        errors = []
        if sub.HasField("min_items") and len(value) < sub.min_items:
            errors.append(f"at least {sub.min_items} items, got {len(value)}")
        if sub.HasField("max_items") and len(value) > sub.max_items:
            errors.append(f"at most {sub.max_items} items, got {len(value)}")
        item_kind = sub.items.WhichOneof("type")
        if item_kind not in (None, "message"):
            for item in value:
                errors += _scalar_errors(item_kind, getattr(sub.items, item_kind), item, field)
        return errors
    if kind == "map":
        if sub.HasField("min_pairs") and len(value) < sub.min_pairs:
            return [f"at least {sub.min_pairs} entries"]
        return []
    if kind in ("message", "any", "bool", "bytes", "timestamp"):
        return []
    if field.message_type is not None:  # a wrapper (UInt32Value...) or Duration
        if not is_set:
            return []
        if kind != "duration":
            value = value.value
    elif not is_set and getattr(sub, "ignore_empty", False):
        return []
    return _scalar_errors(kind, sub, value, field)


def assert_valid(message: Message) -> None:
    assert pgv_errors(message) == []


# ---------------------------------------------------------------- descriptors sent vs. rules

REPRESENTATIVE = {"remote_address": "192.0.2.10", "masked_remote_address": "192.0.2.0/24"}
ANY_VALUE = "acme"  # stands for any value a header can carry


@dataclass(frozen=True)
class RouteScope:
    """What a route lets through, as far as a ``:path`` descriptor can tell."""

    name: str
    path: str | None = None  # exact path
    prefix: str | None = None

    def path_values(self, samples: Iterable[str]) -> set[str]:
        if self.path is not None:
            return {self.path}
        assert self.prefix is not None, f"{self.name}: only path/prefix routes are checked"
        prefix = self.prefix
        return {prefix.rstrip("/") + "/item"} | {s for s in samples if s.startswith(prefix)}


def rule_samples(children: NodeChildren, found: dict[str, set[str]] | None = None) -> dict:
    """Per descriptor key, a value for each exact value and each wildcard in the rules."""
    found = {} if found is None else found
    for node in children:
        if node.value is not None:
            sample = node.value.replace("*", "x") if node.pattern else node.value
            found.setdefault(node.key, set()).add(sample)
        rule_samples(node.children, found)
    return found


def action_values(
    action: Any, scope: RouteScope, samples: dict[str, set[str]]
) -> tuple[str, set[str]]:
    """The descriptor key one action emits and representative values for it: fixed values
    as they are; header- and address-derived ones as an arbitrary value plus every value
    the rules name for that key, because a request can carry any of them."""
    kind = action.WhichOneof("action_specifier")
    if kind == "generic_key":
        return action.generic_key.descriptor_key or "generic_key", {
            action.generic_key.descriptor_value
        }
    if kind == "header_value_match":
        match = action.header_value_match
        return match.descriptor_key or "header_match", {match.descriptor_value}
    if kind in ("remote_address", "masked_remote_address"):
        return kind, {REPRESENTATIVE[kind]} | samples.get(kind, set())
    if kind == "request_headers":
        key = action.request_headers.descriptor_key
        if action.request_headers.header_name == ":path":
            return key, scope.path_values(samples.get(key, set()))
        return key, {ANY_VALUE} | samples.get(key, set())
    raise AssertionError(f"{scope.name}: action {kind} is not covered by this test")


def emitted_descriptors(
    scope: RouteScope, rate_limits: Iterable[Any], samples: dict[str, set[str]]
) -> Iterator[tuple[tuple[str, str], ...]]:
    """Every descriptor (entries in order) the route can send, with representative values."""
    for rate_limit in rate_limits:
        keyed = [action_values(action, scope, samples) for action in rate_limit.actions]
        keys = [key for key, _ in keyed]
        for values in itertools.product(*(sorted(values) for _, values in keyed)):
            yield tuple(zip(keys, values, strict=True))


def why_unmatched(domain: DomainConfig, entries: tuple[tuple[str, str], ...]) -> str:
    """Where matching stops, in words (for the assertion message)."""
    children, where = domain.root, domain.name
    node: DescriptorNode | None = None
    for key, value in entries:
        node = children.exact.get((key, value)) or next(
            (w for w in children.wildcards if w.key == key and w.pattern.matches(value)), None
        )
        node = node or children.defaults.get(key)
        if node is None:
            return f"{where} has no rule for {key!r}"
        children, where = node.children, node.config_path
    return f"{where} has no limit"


def limit_nodes(children: NodeChildren) -> Iterator[DescriptorNode]:
    for node in children:
        if node.limits:
            yield node
        yield from limit_nodes(node.children)


@dataclass
class Coverage:
    unmatched: set[str]  # "route: why" for each descriptor sent that no rule limits
    unreached: set[str]  # config paths of limits that no route sends


def coverage(domain: DomainConfig, routes: Iterable[tuple[RouteScope, Any]]) -> Coverage:
    samples = rule_samples(domain.root)
    unmatched: set[str] = set()
    reached: set[str] = set()
    for scope, rate_limits in routes:
        for entries in emitted_descriptors(scope, rate_limits, samples):
            matches = find_limits(domain, entries)
            if not matches:
                unmatched.add(f"{scope.name}: {why_unmatched(domain, entries)}")
            reached.update(match.limit.stats_key for match in matches)
    every = {limit.stats_key for node in limit_nodes(domain.root) for limit in node.limits}
    return Coverage(unmatched, every - reached)


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def domain() -> DomainConfig:
    return load_config(read_config_files(REPO / "config")).domains[DOMAIN]


@pytest.fixture(scope="module")
def bootstrap() -> Any:
    return parse_strict(yaml.safe_load(BOOTSTRAP.read_text()), bootstrap_pb2.Bootstrap)


@pytest.fixture(scope="module")
def envoy_filter() -> dict[str, Any]:
    return yaml.safe_load(ENVOY_FILTER.read_text())


def hcms(bootstrap: Any) -> list[Any]:
    found = []
    for listener in bootstrap.static_resources.listeners:
        for chain in listener.filter_chains:
            for network_filter in chain.filters:
                if network_filter.typed_config.Is(Hcm.DESCRIPTOR):
                    found.append(_unpack(network_filter.typed_config))
    return found


def clusters_by_name(bootstrap: Any) -> dict[str, Any]:
    return {cluster.name: cluster for cluster in bootstrap.static_resources.clusters}


def ratelimit_config(http_filter: Any) -> Any:
    assert http_filter.typed_config.TypeName() == RATELIMIT_TYPE
    return _unpack(http_filter.typed_config)


def is_http2(cluster: Any) -> bool:
    packed = cluster.typed_extension_protocol_options[HTTP_OPTIONS.DESCRIPTOR.full_name]
    options = _unpack(packed)
    return bool(options.explicit_http_config.HasField("http2_protocol_options"))


def bootstrap_routes(bootstrap: Any) -> dict[str, tuple[RouteScope, Any]]:
    """Route name → (scope, the rate_limits Envoy applies: the route's, else the virtual
    host's, as the filter's default ``vh_rate_limits: OVERRIDE`` does)."""
    routes = {}
    for hcm in hcms(bootstrap):
        for vhost in hcm.route_config.virtual_hosts:
            for route in vhost.routes:
                match = route.match
                scope = RouteScope(
                    route.name,
                    path=match.path if match.HasField("path") else None,
                    prefix=match.prefix if match.HasField("prefix") else None,
                )
                routes[route.name] = (scope, route.route.rate_limits or vhost.rate_limits)
    return routes


def patches(envoy_filter: dict[str, Any], apply_to: str) -> list[dict[str, Any]]:
    return [p for p in envoy_filter["spec"]["configPatches"] if p["applyTo"] == apply_to]


def k8s_objects() -> dict[tuple[str, str], dict[str, Any]]:
    objects = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for document in yaml.safe_load_all(path.read_text()):
            objects[(document["kind"], document["metadata"]["name"])] = document
    return objects


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def socket_of(cluster: Any) -> tuple[str, int]:
    (locality,) = cluster.load_assignment.endpoints
    (endpoint,) = locality.lb_endpoints
    address = endpoint.endpoint.address.socket_address
    return address.address, address.port_value


def port_of(addr: str) -> int:
    return int(addr.rpartition(":")[2])


# ---------------------------------------------------------------- the checker can fail


def test_strict_parse_rejects_unknown_fields_and_types() -> None:
    good = {
        "name": "envoy.filters.http.ratelimit",
        "typed_config": {"@type": f"type.googleapis.com/{RATELIMIT_TYPE}", "domain": "d"},
    }
    assert parse_strict(good, HttpFilter).name == "envoy.filters.http.ratelimit"
    misspelled = {**good, "typed_config": {**good["typed_config"], "failure_mode_deny_": True}}
    with pytest.raises(json_format.ParseError, match="failure_mode_deny_"):
        parse_strict(misspelled, HttpFilter)
    unknown_type = {**good, "typed_config": {"@type": "type.googleapis.com/no.such.Type"}}
    with pytest.raises(json_format.ParseError):
        parse_strict(unknown_type, HttpFilter)


def test_pgv_rules_catch_what_envoy_rejects_at_load() -> None:
    # A filter without domain or rate_limit_service parses, and Envoy would still refuse it.
    empty = parse_strict(
        {"name": "f", "typed_config": {"@type": f"type.googleapis.com/{RATELIMIT_TYPE}"}},
        HttpFilter,
    )
    errors = pgv_errors(empty)
    assert any("domain: min_len 1" in e for e in errors), errors
    assert any("rate_limit_service: required" in e for e in errors), errors
    bad_action = parse_strict(
        {"actions": [{"request_headers": {"header_name": "x"}}]}, RouteRateLimit
    )
    assert any("descriptor_key: min_len" in e for e in pgv_errors(bad_action))
    assert any("actions: at least 1" in e for e in pgv_errors(RouteRateLimit()))


def test_coverage_reports_both_directions() -> None:
    rules = """\
domain: t
descriptors:
  - key: user
    rate_limit: {unit: second, requests_per_unit: 1}
  - key: generic_key
    value: never-sent
    rate_limit: {unit: second, requests_per_unit: 1}
"""
    small = load_config([ConfigFile("t.yaml", rules)]).domains["t"]
    sent = [
        {"actions": [{"request_headers": {"header_name": "x-user", "descriptor_key": "user"}}]},
        {"actions": [{"remote_address": {}}]},
    ]
    rate_limits = [parse_strict(entry, RouteRateLimit) for entry in sent]
    result = coverage(small, [(RouteScope("r", prefix="/"), rate_limits)])
    assert result.unmatched == {"r: t has no rule for 'remote_address'"}
    assert result.unreached == {"t.generic_key_never-sent"}


# ---------------------------------------------------------------- envoy/envoy.yaml


def test_bootstrap_is_a_valid_envoy_bootstrap(bootstrap: Any) -> None:
    assert_valid(bootstrap)
    assert len(hcms(bootstrap)) == 1


def test_bootstrap_filter_chain_and_ratelimit_settings(
    bootstrap: Any, domain: DomainConfig
) -> None:
    (hcm,) = hcms(bootstrap)
    names = [f.name for f in hcm.http_filters]
    assert names == ["envoy.filters.http.ratelimit", "envoy.filters.http.router"]
    assert hcm.http_filters[-1].typed_config.TypeName() == ROUTER_TYPE
    config = ratelimit_config(hcm.http_filters[0])
    assert config.domain == domain.name
    assert config.failure_mode_deny is False
    assert config.enable_x_ratelimit_headers == rate_limit_pb2.RateLimit.DRAFT_VERSION_03
    assert config.timeout.ToMilliseconds() == 20
    assert config.rate_limit_service.transport_api_version == 2  # V3
    assert hcm.use_remote_address.value is True


def test_bootstrap_ratelimit_cluster_exists_speaks_http2_and_checks_health(bootstrap: Any) -> None:
    (hcm,) = hcms(bootstrap)
    target = ratelimit_config(hcm.http_filters[0]).rate_limit_service.grpc_service
    clusters = clusters_by_name(bootstrap)
    cluster = clusters[target.envoy_grpc.cluster_name]
    assert is_http2(cluster)
    (check,) = cluster.health_checks
    assert check.grpc_health_check.service_name in HEALTH_NAMES


def test_bootstrap_routes_target_existing_clusters(bootstrap: Any) -> None:
    clusters = clusters_by_name(bootstrap)
    (hcm,) = hcms(bootstrap)
    targets = {r.route.cluster for vh in hcm.route_config.virtual_hosts for r in vh.routes}
    assert targets == {"upstream"}
    assert targets <= clusters.keys()


def test_every_descriptor_the_routes_send_meets_a_rule(
    bootstrap: Any, domain: DomainConfig
) -> None:
    routes = bootstrap_routes(bootstrap)
    assert set(routes) == {"healthz", "api-write", "api-search", "other"}
    assert coverage(domain, routes.values()).unmatched == KNOWN_GAPS


def test_every_rule_in_config_is_reachable_from_a_route(
    bootstrap: Any, domain: DomainConfig
) -> None:
    assert coverage(domain, bootstrap_routes(bootstrap).values()).unreached == set()


def test_health_route_sends_only_the_unlimited_descriptor(
    bootstrap: Any, domain: DomainConfig
) -> None:
    scope, rate_limits = bootstrap_routes(bootstrap)["healthz"]
    sent = list(emitted_descriptors(scope, rate_limits, rule_samples(domain.root)))
    assert sent == [(("path", "/healthz"),)]
    match = find_limit(domain, sent[0])
    assert match is not None and match.limit.unlimited


# ---------------------------------------------------------------- istio/


def test_envoy_filter_patch_values_are_valid_envoy_objects(envoy_filter: dict[str, Any]) -> None:
    assert envoy_filter["kind"] == "EnvoyFilter"
    assert envoy_filter["spec"]["workloadSelector"]["labels"] == {"istio": "ingressgateway"}
    kinds = [p["applyTo"] for p in envoy_filter["spec"]["configPatches"]]
    assert set(kinds) == {"HTTP_FILTER", "CLUSTER", "HTTP_ROUTE"}
    for patch in envoy_filter["spec"]["configPatches"]:
        assert patch["match"]["context"] == "GATEWAY"
        value = patch["patch"]["value"]
        if patch["applyTo"] == "HTTP_FILTER":
            assert patch["patch"]["operation"] == "INSERT_BEFORE"
            subfilter = patch["match"]["listener"]["filterChain"]["filter"]["subFilter"]
            assert subfilter["name"] == "envoy.filters.http.router"
            assert_valid(parse_strict(value, HttpFilter))
        elif patch["applyTo"] == "CLUSTER":
            assert patch["patch"]["operation"] == "ADD"
            assert_valid(parse_strict(value, cluster_pb2.Cluster))
        else:  # a MERGE into the route Istio generates: only our part must be whole
            assert patch["patch"]["operation"] == "MERGE"
            route = parse_strict(value, route_components_pb2.Route)
            assert set(value) == {"route"} and set(value["route"]) == {"rate_limits"}
            for rate_limit in route.route.rate_limits:
                assert_valid(rate_limit)


def test_envoy_filter_cluster_is_http2_and_points_at_the_k8s_service(
    envoy_filter: dict[str, Any],
) -> None:
    (filter_patch,) = patches(envoy_filter, "HTTP_FILTER")
    (cluster_patch,) = patches(envoy_filter, "CLUSTER")
    config = ratelimit_config(parse_strict(filter_patch["patch"]["value"], HttpFilter))
    cluster = parse_strict(cluster_patch["patch"]["value"], cluster_pb2.Cluster)
    assert config.rate_limit_service.grpc_service.envoy_grpc.cluster_name == cluster.name
    assert config.domain == DOMAIN and config.failure_mode_deny is False
    assert is_http2(cluster)
    host, port = socket_of(cluster)
    name, namespace, *_ = host.split(".")
    service = k8s_objects()[("Service", name)]
    assert service["metadata"]["namespace"] == namespace
    assert service["spec"]["clusterIP"] == "None"  # STRICT_DNS sees every pod
    assert port in {p["port"] for p in service["spec"]["ports"]}


def test_istio_routes_send_the_same_descriptors_as_the_bootstrap(
    envoy_filter: dict[str, Any], bootstrap: Any
) -> None:
    expected = bootstrap_routes(bootstrap)
    by_name = {}
    for patch in patches(envoy_filter, "HTTP_ROUTE"):
        name = patch["match"]["routeConfiguration"]["vhost"]["route"]["name"]
        route = parse_strict(patch["patch"]["value"], route_components_pb2.Route)
        by_name[name] = list(route.route.rate_limits)
    assert by_name.keys() == expected.keys()
    for name, rate_limits in by_name.items():
        assert rate_limits == list(expected[name][1]), name


def test_istio_virtual_service_routes_match_like_the_bootstrap(bootstrap: Any) -> None:
    documents = {d["kind"]: d for d in yaml.safe_load_all(ISTIO_GATEWAY.read_text())}
    gateway, service = documents["Gateway"], documents["VirtualService"]
    assert service["spec"]["gateways"] == [gateway["metadata"]["name"]]
    assert gateway["spec"]["selector"] == {"istio": "ingressgateway"}
    expected = bootstrap_routes(bootstrap)
    scopes = []
    for http in service["spec"]["http"]:
        (match,) = http["match"]
        uri = match["uri"]
        scopes.append(RouteScope(http["name"], path=uri.get("exact"), prefix=uri.get("prefix")))
    assert scopes == [scope for scope, _ in expected.values()]


# ---------------------------------------------------------------- envoy_config.render


@pytest.fixture(scope="module")
def rendered() -> dict[str, Any]:
    return yaml.safe_load(envoy_config.render(str(REPO / "config")))


def test_rendered_snippet_is_valid_and_self_consistent(rendered: dict[str, Any]) -> None:
    (http_filter,) = [parse_strict(f, HttpFilter) for f in rendered["http_filters"]]
    (cluster,) = [parse_strict(c, cluster_pb2.Cluster) for c in rendered["clusters"]]
    rate_limits = [parse_strict(r, RouteRateLimit) for r in rendered["rate_limits"]]
    for message in (http_filter, cluster, *rate_limits):
        assert_valid(message)
    config = ratelimit_config(http_filter)
    assert config.rate_limit_service.grpc_service.envoy_grpc.cluster_name == cluster.name
    assert (config.domain, config.timeout.ToMilliseconds()) == (DOMAIN, 20)
    assert rendered["http_filters"][0]["typed_config"]["failure_mode_deny"] is False
    assert is_http2(cluster)
    assert socket_of(cluster) == ("ratelimit", 8081)


def test_rendered_rate_limits_send_what_the_bootstrap_sends(
    rendered: dict[str, Any], bootstrap: Any, domain: DomainConfig
) -> None:
    def key_sequences(rate_limits: Iterable[Any]) -> set[tuple[str, ...]]:
        scope = RouteScope("any", prefix="/")
        samples = rule_samples(domain.root)
        return {tuple(action_values(a, scope, samples)[0] for a in r.actions) for r in rate_limits}

    generated = [parse_strict(r, RouteRateLimit) for r in rendered["rate_limits"]]
    handwritten = [r for _, limits in bootstrap_routes(bootstrap).values() for r in limits]
    assert key_sequences(generated) == key_sequences(handwritten)
    assert key_sequences(generated) == {
        ("remote_address",),
        ("tenant",),
        ("tenant", "path"),
        ("path",),
    }
    # On a virtual host (every path), they reach every rule.
    assert coverage(domain, [(RouteScope("vhost", prefix="/"), generated)]).unreached == set()


def test_render_options_and_key_conventions(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text(
        "domain: a\ndescriptors:\n"
        "  - key: generic_key\n    value: batch\n"
        "    descriptors:\n      - key: user_id\n"
        "        rate_limit: {unit: hour, requests_per_unit: 10}\n"
        "  - key: generic_key\n    rate_limit: {unit: hour, requests_per_unit: 1}\n"
    )
    (tmp_path / "b.yaml").write_text("domain: b\ndescriptors: [{key: k}]\n")
    with pytest.raises(ValueError, match="--domain"):
        envoy_config.render(str(tmp_path))
    with pytest.raises(ValueError, match="'c' is not in the config"):
        envoy_config.render(str(tmp_path), EnvoyOptions(domain="c"))
    with pytest.raises(ValueError, match="timeout"):
        envoy_config.render(str(tmp_path), EnvoyOptions(domain="a", timeout="20ms"))
    options = EnvoyOptions(domain="a", cluster="rls", timeout="0.05s")
    text = envoy_config.render(str(tmp_path), options)
    snippet = yaml.safe_load(text)
    grpc = snippet["http_filters"][0]["typed_config"]["rate_limit_service"]["grpc_service"]
    assert grpc["envoy_grpc"]["cluster_name"] == "rls" == snippet["clusters"][0]["name"]
    assert snippet["http_filters"][0]["typed_config"]["timeout"] == "0.050s"
    assert snippet["rate_limits"] == [
        {
            "actions": [
                {"generic_key": {"descriptor_value": "batch"}},
                {"request_headers": {"header_name": "x-user-id", "descriptor_key": "user_id"}},
            ]
        }
    ]
    # A valueless generic_key cannot be produced by Envoy: said, not emitted.
    assert "# not emitted (no Envoy action yields it): a.generic_key\n" in text


# ---------------------------------------------------------------- a dead replica


def ratelimit_pairs(bootstrap: Any, envoy_filter: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """Per shipped or generated config: (the ratelimit filter's ``grpc_service``, the
    cluster it calls), parsed strictly. The RLQS bootstrap has no ratelimit filter (its
    stream is not retried: None), only the cluster."""
    pairs = {}

    def from_bootstrap(parsed: Any) -> tuple[Any, Any]:
        (hcm,) = hcms(parsed)
        service = ratelimit_config(hcm.http_filters[0]).rate_limit_service.grpc_service
        return service, clusters_by_name(parsed)[service.envoy_grpc.cluster_name]

    pairs["envoy/envoy.yaml"] = from_bootstrap(bootstrap)
    generated = yaml.safe_load(envoy_config.render_bootstrap(str(REPO / "config")))
    pairs["envoy-config --bootstrap"] = from_bootstrap(
        parse_strict(generated, bootstrap_pb2.Bootstrap)
    )
    snippet = yaml.safe_load(envoy_config.render(str(REPO / "config")))
    pairs["envoy-config"] = (
        ratelimit_config(
            parse_strict(snippet["http_filters"][0], HttpFilter)
        ).rate_limit_service.grpc_service,
        parse_strict(snippet["clusters"][0], cluster_pb2.Cluster),
    )
    (filter_patch,) = patches(envoy_filter, "HTTP_FILTER")
    (cluster_patch,) = patches(envoy_filter, "CLUSTER")
    pairs["istio/envoyfilter.yaml"] = (
        ratelimit_config(
            parse_strict(filter_patch["patch"]["value"], HttpFilter)
        ).rate_limit_service.grpc_service,
        parse_strict(cluster_patch["patch"]["value"], cluster_pb2.Cluster),
    )
    rlqs = parse_strict(
        yaml.safe_load(envoy_rlqs.render_rlqs(str(REPO / "config"), bootstrap=True)),
        bootstrap_pb2.Bootstrap,
    )
    pairs["envoy-config --rlqs --bootstrap"] = (None, clusters_by_name(rlqs)["rlqs"])
    return pairs


def test_every_ratelimit_cluster_and_filter_takes_a_dead_replica_out(
    bootstrap: Any, envoy_filter: dict[str, Any]
) -> None:
    """The shipped bootstrap, the Istio patches and every generated config carry the same
    outlier detection, merge window and health check on the service's cluster, and the
    same retry policy on the ratelimit filter's calls, as the generator builds them: what
    tests/faults/test_replica_killed.py measures in a real Envoy on envoy/envoy.yaml holds
    for all of them."""
    expected = envoy_config.ratelimit_cluster("any", "ratelimit:8081")
    retry = envoy_config.ratelimit_retry_policy()
    for name, (service, cluster) in ratelimit_pairs(bootstrap, envoy_filter).items():
        assert_valid(cluster)
        assert cluster.outlier_detection == expected.outlier_detection, name
        assert cluster.common_lb_config == expected.common_lb_config, name
        assert list(cluster.health_checks) == list(expected.health_checks), name
        if service is not None:
            assert_valid(service)
            assert service.retry_policy == retry, name


def test_the_dead_replica_settings_fit_the_filter_timeout(bootstrap: Any) -> None:
    """What makes the shipped settings work, field by field: calls that failed before a
    replica answered them are retried once, at once, on another replica, and never a
    slow call; no try is cut shorter than the filter's timeout; three local failures in a
    row eject a replica at once, even one of two."""
    (hcm,) = hcms(bootstrap)
    config = ratelimit_config(hcm.http_filters[0])
    retry = config.rate_limit_service.grpc_service.retry_policy
    cluster = clusters_by_name(bootstrap)[
        config.rate_limit_service.grpc_service.envoy_grpc.cluster_name
    ]
    assert set(retry.retry_on.split(",")) == {
        "connect-failure",
        "refused-stream",
        "reset",
        "unavailable",
    }
    assert retry.num_retries.value == 1
    # The first back-off is drawn below base_interval (in whole ms): 1 ms draws 0 ms.
    assert retry.retry_back_off.base_interval.ToMilliseconds() == 1
    # Envoy takes max_interval as each try's timeout: it must not cut a try short.
    assert retry.retry_back_off.max_interval.ToMilliseconds() > config.timeout.ToMilliseconds()
    (predicate,) = retry.retry_host_predicate
    assert predicate.name == "envoy.retry_host_predicates.previous_hosts"
    detection = cluster.outlier_detection
    assert detection.split_external_local_origin_errors is True
    assert detection.consecutive_local_origin_failure.value == 3
    assert detection.enforcing_consecutive_local_origin_failure.value == 100
    # One of two replicas is 50 %: Envoy ejects a host only if the ejected share stays
    # within max_ejection_percent.
    assert detection.max_ejection_percent.value == 50
    assert cluster.common_lb_config.update_merge_window.ToMilliseconds() == 0


# ---------------------------------------------------------------- docker-compose.yml, Dockerfile


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1])
        for line in lines
        if line and not line.startswith("#")
    ]


def dockerignored(path: str) -> bool:
    """Whether the build context leaves ``path`` out (last matching pattern wins)."""
    ignored = False
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        if fnmatch(path, pattern) or fnmatch(path.split("/")[0], pattern):
            ignored = not negate
    return ignored


def test_dockerfile_ports_entrypoint_and_build_context() -> None:
    instructions = dockerfile_instructions()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    exposed = {int(p) for kind, args in instructions if kind == "EXPOSE" for p in args.split()}
    env = dict(
        item.split("=", 1)
        for kind, args in instructions
        if kind == "ENV"
        for item in shlex.split(args)
    )
    # No RATELIMIT_* in the image: they would win over the Go settings /bin/ratelimit reads.
    assert not [name for name in env if name.startswith("RATELIMIT_")]
    (command,) = [yaml.safe_load(args) for kind, args in instructions if kind == "CMD"]
    flags = dict(zip(command[1::2], command[2::2], strict=True))
    assert command[0] == "serve" and flags["--admin-addr"].startswith("0.0.0.0:")
    # Ours (gRPC, admin) and the Go command's HTTP port, which its probes use.
    assert exposed == {port_of(flags["--grpc-addr"]), port_of(flags["--admin-addr"]), 8080}
    (entrypoint,) = [args for kind, args in instructions if kind == "ENTRYPOINT"]
    assert yaml.safe_load(entrypoint) == ["ratelimit-service"]
    assert project["scripts"]["ratelimit"] == "ratelimit_service.cli.main:go_main"
    runs = " ".join(args for kind, args in instructions if kind == "RUN")
    assert 'ln -s "$(command -v ratelimit)" /bin/ratelimit' in runs
    python = {args.split()[0] for kind, args in instructions if kind == "FROM"}
    minimum = project["requires-python"].removeprefix(">=")
    assert python == {f"python:{minimum}-slim"}
    for kind, args in instructions:
        if kind == "COPY" and not args.startswith("--from"):
            for source in args.split()[:-1]:
                assert (REPO / source).exists(), source
                assert not dockerignored(source.rstrip("/")), source
    assert dockerignored(".git") and dockerignored("tests")


def test_compose_wires_envoy_service_redis_and_upstream(bootstrap: Any) -> None:
    services = compose()
    assert set(services) == {"redis", "ratelimit", "upstream", "envoy"}
    service = services["ratelimit"]
    env = service["environment"]
    assert service["build"] == "." and DOCKERFILE.exists()
    assert service["deploy"]["replicas"] == 2
    assert env["RATELIMIT_MODE"] == "probabilistic"
    redis_url = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", env["RATELIMIT_REDIS_URL"])
    assert redis_url is not None and redis_url[1] in services
    redis_command = services["redis"]["command"]
    assert redis_command[redis_command.index("--port") + 1] == redis_url[2]
    source, target, _ = service["volumes"][0].split(":")
    assert target == env["RATELIMIT_CONFIG"]
    assert DOMAIN in load_config(read_config_files(REPO / source)).domains
    assert env["RATELIMIT_ADMIN_ADDR"] == "0.0.0.0:6070"
    assert (
        f":{port_of(env['RATELIMIT_ADMIN_ADDR'])}/healthcheck" in service["healthcheck"]["test"][-1]
    )

    clusters = clusters_by_name(bootstrap)
    assert socket_of(clusters["ratelimit"]) == ("ratelimit", port_of(env["RATELIMIT_GRPC_ADDR"]))
    upstream = services["upstream"]
    listen = next(arg for arg in upstream["command"] if arg.startswith("-listen="))
    assert socket_of(clusters["upstream"]) == ("upstream", port_of(listen))

    envoy = services["envoy"]
    mount_source, mount_target, _ = envoy["volumes"][0].split(":")
    assert (REPO / mount_source).resolve() == BOOTSTRAP
    assert envoy["command"][envoy["command"].index("-c") + 1] == mount_target
    published = {int(p.split(":")[1]) for p in envoy["ports"]}
    listener_ports = {
        listener.address.socket_address.port_value
        for listener in bootstrap.static_resources.listeners
    }
    assert published == listener_ports | {bootstrap.admin.address.socket_address.port_value}


def test_images_are_pinned_and_shared_with_k8s() -> None:
    services = compose()
    for name, service in services.items():
        image = service["image"]
        assert ":" in image and not image.endswith(":latest"), (name, image)
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert services["ratelimit"]["image"] == f"ratelimit-service:{version}"
    objects = k8s_objects()
    k8s_image = {
        name: objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"][0]["image"]
        for name in ("ratelimit", "redis")
    }
    assert k8s_image == {n: services[n]["image"] for n in ("ratelimit", "redis")}


# ---------------------------------------------------------------- k8s/


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    files = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    namespaces = {o["metadata"].get("namespace") for o in k8s_objects().values()}
    assert namespaces == {None, "ratelimit"}  # the Namespace itself, then its contents


def test_configmap_holds_the_same_rules_as_config_dir() -> None:
    configmap = k8s_objects()[("ConfigMap", "ratelimit-config")]
    files = [ConfigFile(name, text) for name, text in configmap["data"].items()]
    assert load_config(files).dump() == load_config(read_config_files(REPO / "config")).dump()


def test_deployment_probes_ports_resources_and_config_mount() -> None:
    objects = k8s_objects()
    deployment = objects[("Deployment", "ratelimit")]
    pod = deployment["spec"]["template"]
    assert (
        deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    (container,) = pod["spec"]["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {
        "grpc": port_of(env["RATELIMIT_GRPC_ADDR"]),
        "admin": port_of(env["RATELIMIT_ADMIN_ADDR"]),
    }
    assert env["RATELIMIT_ADMIN_ADDR"].startswith("0.0.0.0:")
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/healthcheck", "port": "admin"}
    resources = container["resources"]
    assert {"cpu", "memory"} <= resources["requests"].keys() and "memory" in resources["limits"]
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == env["RATELIMIT_CONFIG"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == mount["name"]]
    assert ("ConfigMap", volume["configMap"]["name"]) in objects
    assert env["RATELIMIT_MODE"] == "probabilistic" and container["args"] == ["serve"]

    # Redis is reached by its Service, on a port the Service exposes.
    redis_url = re.fullmatch(
        r"redis://([^.]+)\.([^.]+)\.svc\.cluster\.local:(\d+)/0", env["RATELIMIT_REDIS_URL"]
    )
    assert redis_url is not None
    redis_service = objects[("Service", redis_url[1])]
    assert redis_service["metadata"]["namespace"] == redis_url[2]
    assert int(redis_url[3]) in {p["port"] for p in redis_service["spec"]["ports"]}


def test_services_select_the_pods_and_name_their_ports() -> None:
    objects = k8s_objects()
    for name in ("ratelimit", "ratelimit-headless", "redis"):
        service = objects[("Service", name)]
        target = "redis" if name == "redis" else "ratelimit"
        pod = objects[("Deployment", target)]["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items(), name
        container_ports = {p["name"] for c in pod["spec"]["containers"] for p in c["ports"]}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in container_ports, (name, port)
    (redis,) = objects[("Deployment", "redis")]["spec"]["template"]["spec"]["containers"]
    assert redis["args"][redis["args"].index("--port") + 1] == str(
        redis["ports"][0]["containerPort"]
    )


@pytest.mark.slow  # starts a process
def test_envoy_config_command(tmp_path: Path) -> None:
    """The CLI prints the generator's output for the repo's rules; bad rules exit 1."""
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "envoy-config", "--config", "config/"],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "envoy.filters.http.ratelimit" in result.stdout and "domain: edge" in result.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: fortnight}\n")
    failed = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "envoy-config", "--config", str(bad)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert failed.returncode == 1
    assert f"{bad}:4: invalid rate limit unit 'fortnight'" in failed.stderr


def test_the_zones_overlay_gives_each_zone_its_store_and_the_global_one() -> None:
    """k8s/zones/: every zone's replicas name their zone, reach their zone's Redis and
    the base's Redis (the global store) by Services that exist, run where their Redis
    runs, and are the only Deployment of the service (the base's is deleted)."""
    zones = K8S / "zones"
    kustomization = yaml.safe_load((zones / "kustomization.yaml").read_text())
    files = {p.name for p in zones.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(r for r in kustomization["resources"] if r != "../") == sorted(files)
    deleted = [p["patch"] for p in kustomization["patches"]]
    assert any("$patch: delete" in p and "name: ratelimit\n" in p for p in deleted)
    base = k8s_objects()
    flags = {setting.flag for setting in SETTINGS}
    for path in sorted(zones.glob("zone-*.yaml")):
        documents = yaml.safe_load_all(path.read_text())
        objects = {(d["kind"], d["metadata"]["name"]): d for d in documents}
        zone = path.stem
        pod = objects[("Deployment", f"ratelimit-{zone}")]["spec"]["template"]
        (container,) = pod["spec"]["containers"]
        env = {item["name"]: item["value"] for item in container["env"]}
        for name in env:  # every variable is a setting's
            assert "--" + name.removeprefix("RATELIMIT_").lower().replace("_", "-") in flags
        assert (
            env["RATELIMIT_ZONE"]
            == zone
            == pod["spec"]["nodeSelector"]["topology.kubernetes.io/zone"]
        )
        store = re.fullmatch(r"redis://([^.]+)\.ratelimit\.svc\.cluster\.local:6379/0",
                             env["RATELIMIT_REDIS_URL"])  # fmt: skip
        assert store is not None and ("Service", store[1]) in objects
        redis_pod = objects[("Deployment", store[1])]["spec"]["template"]["spec"]
        assert redis_pod["nodeSelector"] == pod["spec"]["nodeSelector"]
        assert (
            env["RATELIMIT_GLOBAL_REDIS_URL"] == "redis://redis.ratelimit.svc.cluster.local:6379/0"
        )
        assert ("Service", "redis") in base
        headless = objects[("Service", f"ratelimit-{zone}-headless")]
        assert headless["spec"]["selector"].items() <= pod["metadata"]["labels"].items()


def _id_builders(value: Any) -> Iterator[dict[str, Any]]:
    """Every RLQS bucket's id-builder map in a rendered document."""
    if isinstance(value, list):
        for item in value:
            yield from _id_builders(item)
    elif isinstance(value, dict):
        ids = value.get("bucket_id_builder")
        if isinstance(ids, dict) and isinstance(ids.get("bucket_id_builder"), dict):
            yield ids["bucket_id_builder"]
        for item in value.values():
            yield from _id_builders(item)


def test_rlqs_config_is_the_same_text_in_every_process() -> None:
    """A bucket's id builders are a protobuf map, which each process iterates in an order
    of its own: the generator writes them in key order, so a config kept in git does not
    change when it is generated again from the same rules."""
    command = [sys.executable, "-m", "ratelimit_service", "envoy-config", "--rlqs"]
    command += ["--config", str(REPO / "config")]
    texts = {subprocess.run(command, capture_output=True, text=True, check=True).stdout
             for _ in range(5)}  # fmt: skip
    assert len(texts) == 1
    builders = list(_id_builders(yaml.safe_load(texts.pop())))
    assert any(len(builder) > 1 for builder in builders)
    for builder in builders:
        assert list(builder) == sorted(builder)
