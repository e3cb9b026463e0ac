"""The Envoy side of RLQS for a rules file (``envoy-config --rlqs``): the rate_limit_quota
HTTP filter, with bucket matchers and bucket id builders derived from the rules, its
cluster, and with ``--bootstrap`` a complete runnable bootstrap.

Each rule with a limit becomes one bucket matcher (in envoy_plan.bucket_chains' order:
Envoy takes the first that matches, so a request counts against one rule, the most
specific): it matches a request that carries every key of the rule's chain (and each fixed
value: exact, a ``prefix*``, or a regular expression), and builds the bucket id from those
keys, read as the RLS generator reads them (``remote_address`` is the peer's address).

Envoy 1.40's quirks, handled here: ``reporting_interval`` is required but ignored (it
reports every 5 s); an assignment that expires falls back to ALLOW_ALL for a minute
(``reuse_last_assignment`` is not implemented); a rule of 0 denies from the first
request (``no_assignment_behavior`` DENY_ALL), the others allow until the first
assignment (which answers the bucket's first report, sent at once).
"""

from __future__ import annotations

import re
from typing import Any

from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.core.v3 import base_pb2, grpc_service_pb2
from envoy.config.route.v3 import route_components_pb2
from envoy.extensions.filters.http.rate_limit_quota.v3 import rate_limit_quota_pb2 as rlq
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
from envoy.extensions.matching.common_inputs.network.v3 import network_inputs_pb2
from envoy.type.matcher.v3 import http_inputs_pb2
from envoy.type.v3 import http_status_pb2, ratelimit_strategy_pb2
from google.protobuf.message import Message
from xds.core.v3 import extension_pb2
from xds.type.matcher.v3 import matcher_pb2, regex_pb2, string_pb2

from ratelimit_service.cli.envoy_config import (
    _duration,
    _pack,
    _to_dict,
    bootstrap_around,
    check_clusters,
    load_domain,
    ratelimit_cluster,
    with_header,
)
from ratelimit_service.cli.envoy_plan import (
    DEFAULT_OPTIONS,
    Chain,
    EnvoyOptions,
    bucket_chains,
    header_for,
)
from ratelimit_service.core.config_model import DescriptorNode, DomainConfig

RLQS_FILTER = "envoy.filters.http.rate_limit_quota"
NODE_ID_HEADER = "x-envoy-node-id"
_Strategy = ratelimit_strategy_pb2.RateLimitStrategy
_Settings = rlq.RateLimitQuotaBucketSettings
_Predicate = matcher_pb2.Matcher.MatcherList.Predicate
_Single = _Predicate.SinglePredicate


def _input(key: str) -> extension_pb2.TypedExtensionConfig:
    """Where a key's value comes from, as an Envoy matching input."""
    if key in ("remote_address", "masked_remote_address"):
        name, source = "source_ip", _pack(network_inputs_pb2.SourceIPInput())
    else:
        header = header_for(key)
        name = f"header {header}"
        source = _pack(http_inputs_pb2.HttpRequestHeaderMatchInput(header_name=header))
    return extension_pb2.TypedExtensionConfig(name=name, typed_config=source)


def _regex(pattern: str) -> string_pb2.StringMatcher:
    regex = regex_pb2.RegexMatcher(google_re2=regex_pb2.RegexMatcher.GoogleRE2(), regex=pattern)
    return string_pb2.StringMatcher(safe_regex=regex)


def _value_match(node: DescriptorNode) -> string_pb2.StringMatcher:
    if node.value is None:  # any value: the key must only be present
        return _regex(".*")
    if node.pattern is None:
        return string_pb2.StringMatcher(exact=node.value)
    if node.value.count("*") == 1 and node.value.endswith("*"):
        return string_pb2.StringMatcher(prefix=node.value[:-1])
    return _regex(".*".join(re.escape(part) for part in node.value.split("*")))


def _predicate(chain: Chain) -> Any:
    singles = [
        _Predicate(single_predicate=_Single(input=_input(node.key), value_match=_value_match(node)))
        for node in chain
    ]
    if len(singles) == 1:
        return singles[0]
    return _Predicate(and_matcher=_Predicate.PredicateList(predicate=singles))


def _bucket_settings(chain: Chain) -> Any:
    builder = _Settings.BucketIdBuilder()
    for node in chain:
        value = builder.bucket_id_builder[node.key]
        if node.value is not None and node.pattern is None:
            value.string_value = node.value  # a fixed value: the rule's own
        else:
            source = _input(node.key)  # the same input, as Envoy's own extension type
            value.custom_value.name = source.name
            value.custom_value.typed_config.CopyFrom(source.typed_config)
    zero = any(limit.requests_per_unit == 0 for limit in chain[-1].limits)
    first = _Strategy.DENY_ALL if zero else _Strategy.ALLOW_ALL
    return _Settings(
        bucket_id_builder=builder,
        reporting_interval=_duration("5s"),
        deny_response_settings=_Settings.DenyResponseSettings(
            http_status=http_status_pb2.HttpStatus(code=http_status_pb2.TooManyRequests),
            response_headers_to_add=[
                base_pb2.HeaderValueOption(
                    header=base_pb2.HeaderValue(key="x-ratelimit-by", value="rlqs")
                )
            ],
        ),
        no_assignment_behavior=_Settings.NoAssignmentBehavior(
            fallback_rate_limit=_Strategy(blanket_rule=first)
        ),
        expired_assignment_behavior=_Settings.ExpiredAssignmentBehavior(
            expired_assignment_behavior_timeout=_duration("60s"),
            fallback_rate_limit=_Strategy(blanket_rule=_Strategy.ALLOW_ALL),
        ),
    )


def bucket_matchers(domain: DomainConfig) -> matcher_pb2.Matcher:
    matchers = [
        matcher_pb2.Matcher.MatcherList.FieldMatcher(
            predicate=_predicate(chain),
            on_match=matcher_pb2.Matcher.OnMatch(
                action=extension_pb2.TypedExtensionConfig(
                    name=chain[-1].config_path, typed_config=_pack(_bucket_settings(chain))
                )
            ),
        )
        for chain in bucket_chains(domain)
    ]
    return matcher_pb2.Matcher(matcher_list=matcher_pb2.Matcher.MatcherList(matchers=matchers))


def rlqs_filter(domain: DomainConfig, cluster: str, node_id: str | None) -> Message:
    service = grpc_service_pb2.GrpcService(
        envoy_grpc=grpc_service_pb2.GrpcService.EnvoyGrpc(cluster_name=cluster)
    )
    if node_id:  # names this Envoy to the service (else: its address and stream)
        service.initial_metadata.append(base_pb2.HeaderValue(key=NODE_ID_HEADER, value=node_id))
    config = rlq.RateLimitQuotaFilterConfig(
        rlqs_server=service, domain=domain.name, bucket_matchers=bucket_matchers(domain)
    )
    return http_connection_manager_pb2.HttpFilter(name=RLQS_FILTER, typed_config=_pack(config))


def build_rlqs_bootstrap(
    domain: DomainConfig, options: EnvoyOptions = DEFAULT_OPTIONS
) -> bootstrap_pb2.Bootstrap:
    """A bootstrap (:func:`bootstrap_around`) running the RLQS filter, every path to the
    upstream. A dead replica is out of the cluster at once, so the stream Envoy reopens at
    its next report lands on a live one: the long-lived stream has no retry policy."""
    options = options.for_rlqs()
    check_clusters(options)
    route = route_components_pb2.Route(
        match=route_components_pb2.RouteMatch(prefix="/"),
        route=route_components_pb2.RouteAction(cluster=options.upstream_cluster),
    )
    http_filter = rlqs_filter(domain, options.cluster, options.node_id)
    return bootstrap_around(http_filter, [route], domain.name, options)


def render_rlqs(
    config_path: str, options: EnvoyOptions = DEFAULT_OPTIONS, *, bootstrap: bool
) -> str:
    """YAML: the filter and its cluster, or (``bootstrap``) a whole bootstrap."""
    rules = load_domain(config_path, options)
    header = [
        f"# RLQS for rate-limit domain '{rules.name}', generated from {config_path}: Envoy"
        " enforces",
        "# token buckets the service assigns, reporting usage every 5 s (no call per request).",
        "# One bucket per request: the first matcher that matches (longest rule chain first).",
    ]
    if bootstrap:
        return with_header(header, _to_dict(build_rlqs_bootstrap(rules, options)))
    options = options.for_rlqs()
    pieces = {
        "http_filters": [_to_dict(rlqs_filter(rules, options.cluster, options.node_id))],
        "clusters": [_to_dict(ratelimit_cluster(options.cluster, options.service_address))],
    }
    return with_header(header, pieces)
