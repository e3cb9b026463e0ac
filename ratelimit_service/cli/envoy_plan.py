"""What envoy-config emits, decided without protobuf (envoy_config.py and envoy_rlqs.py
write it as Envoy's typed messages): the options, the header each descriptor key is read
from, the rule chains that reach a limit, a bootstrap's routes, the RLQS matchers' order.

The rule files do not say where a value comes from, so a convention does:
``remote_address``, ``masked_remote_address``, ``source_cluster`` and
``destination_cluster`` are Envoy's own actions; ``generic_key`` takes the rule's fixed
value; ``path``, ``method`` and ``authority``/``host`` read the HTTP/2 pseudo-headers; any
other key reads the header ``x-<key>`` (``tenant`` → ``x-tenant``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from ratelimit_service.core.config_model import (
    DescriptorNode,
    DomainConfig,
    NodeChildren,
    UsageSource,
    WildcardPattern,
)

Chain = tuple[DescriptorNode, ...]
"""Descriptor nodes from a domain's root down to one with a ``rate_limit``."""

RLQS_CLUSTER = "rlqs"
"""The service's cluster with ``--rlqs`` when ``--cluster`` is left as it is."""


@dataclass(frozen=True)
class EnvoyOptions:
    """envoy-config's flags, built once by the command; their defaults are these."""

    domain: str | None = None  # needed when the rules have several
    merge_domains: bool = False
    cluster: str = "ratelimit"  # the service's; ``rlqs`` with RLQS unless set (for_rlqs)
    service_address: str = "ratelimit:8081"
    timeout: str = "0.02s"  # the ratelimit filter's (RLS)
    listen: str = "0.0.0.0:8080"  # a bootstrap's listener
    admin: str = "127.0.0.1:9901"  # a bootstrap's Envoy admin address
    upstream_address: str = "upstream:8080"  # a bootstrap's placeholder upstream cluster
    upstream_cluster: str = "upstream"
    node_id: str | None = None  # with RLQS: this Envoy's name (x-envoy-node-id metadata)

    def for_rlqs(self) -> EnvoyOptions:
        """These options for the RLQS filter: its cluster is ``rlqs`` unless one was named."""
        if self.cluster != DEFAULT_OPTIONS.cluster:
            return self
        return replace(self, cluster=RLQS_CLUSTER)


DEFAULT_OPTIONS = EnvoyOptions()

PSEUDO_HEADERS = {
    "path": ":path",
    "method": ":method",
    "authority": ":authority",
    "host": ":authority",
}
"""Descriptor keys whose values Envoy reads from HTTP/2 pseudo-headers."""


def header_for(key: str) -> str:
    """The request header a descriptor key is read from, by the convention above."""
    return PSEUDO_HEADERS.get(key, "x-" + key.replace("_", "-").lower())


def pick_domain(domains: Sequence[str], wanted: str | None) -> str:
    """The domain to render: the one asked for, or the only one loaded."""
    if wanted is not None:
        if wanted not in domains:
            raise ValueError(f"domain {wanted!r} is not in the config (has: {', '.join(domains)})")
        return wanted
    if len(domains) != 1:
        raise ValueError(f"the config has domains {', '.join(domains)}: choose one with --domain")
    return domains[0]


def limited_chains(children: NodeChildren, prefix: Chain = ()) -> Iterator[Chain]:
    """Every chain of nodes, root first, that ends on a node with a ``rate_limit``, in the
    order of the rule files (the index groups nodes by kind, not by line)."""
    for node in sorted(children, key=lambda child: child.line or 0):
        chain = (*prefix, node)
        if node.limits:
            yield chain
        yield from limited_chains(node.children, chain)


def usage_of(chain: Chain) -> UsageSource | None:
    """Where Envoy reads a response's cost, when the chain ends on a usage budget."""
    return next((limit.usage for limit in chain[-1].limits if limit.usage is not None), None)


@dataclass(frozen=True)
class RoutePlan:
    """One route of the generated bootstrap: its name, what it matches (an exact
    ``path``, or a ``prefix``) and the rule chains whose descriptors it sends."""

    name: str
    path: str | None
    prefix: str | None
    chains: tuple[Chain, ...]


def _routable(value: str) -> bool:
    """A path rule value that is a route of its own: exact, or one trailing ``*``."""
    return value.startswith("/") and "*" not in value.rstrip("*") and value.count("*") <= 1


def _covers(rule_value: str, route_value: str) -> bool:
    """Whether every request routed to ``route_value`` has a path ``rule_value`` matches."""
    if route_value.endswith("*"):
        return rule_value.endswith("*") and route_value[:-1].startswith(rule_value[:-1])
    if "*" in rule_value:
        return WildcardPattern(rule_value).matches(route_value)
    return rule_value == route_value


def _unlimited(chain: Chain) -> bool:
    return any(limit.unlimited for limit in chain[-1].limits)


def _path_values(chain: Chain) -> list[str]:
    return [node.value for node in chain if node.key == "path" and node.value is not None]


def _route_name(value: str, taken: set[str]) -> str:
    base = value.strip("/*").replace("/", "-") or "root"
    name, number = base, 2
    while name in taken:
        name, number = f"{base}-{number}", number + 1
    taken.add(name)
    return name


def plan_routes(domain: DomainConfig) -> list[RoutePlan]:
    """Routes for the rules: one per ``path`` value a rule names (exact, or a prefix ending
    in one ``*``), most specific first, then ``/`` for everything else.

    A route sends the chains of the path rules that cover it, and the chains that name no
    path, unless every path rule that covers it is ``unlimited``: such a route (``/healthz``)
    sends only those, so it is counted and never limited by another rule. ``/`` sends the
    chains that name no path, and those whose path value no route can match."""
    chains = list(limited_chains(domain.root))
    general = [chain for chain in chains if not _path_values(chain)]
    values = sorted(
        {value for chain in chains for value in _path_values(chain) if _routable(value)},
        key=lambda v: (v.endswith("*"), -len(v), v),
    )
    taken: set[str] = {"other"}
    plans: list[RoutePlan] = []
    for value in values:
        exact = None if value.endswith("*") else value
        concerned = [c for c in chains if any(_covers(rule, value) for rule in _path_values(c))]
        sent = concerned if all(_unlimited(chain) for chain in concerned) else general + concerned
        prefix = value[:-1] if exact is None else None
        plans.append(RoutePlan(_route_name(value, taken), exact, prefix, tuple(sent)))
    leftover = [c for c in chains if _path_values(c) and not all(map(_routable, _path_values(c)))]
    plans.append(RoutePlan(name="other", path=None, prefix="/", chains=(*general, *leftover)))
    return plans


def _specificity(node: DescriptorNode) -> int:
    """As matching ranks a level's children: an exact value, a wildcard, any value."""
    if node.value is None:
        return 2
    return 1 if node.pattern is not None else 0


def bucket_chains(domain: DomainConfig) -> list[Chain]:
    """The rule chains that get an RLQS bucket matcher, most specific first (longer chains,
    then exact values before wildcards before any value, level by level), then in file
    order. Rules no request can reach this way (``unlimited`` ones, a valueless
    ``generic_key``) get none: their requests are allowed and not reported."""
    chains = [
        chain
        for chain in limited_chains(domain.root)
        if not _unlimited(chain)
        and not any(n.key == "generic_key" and n.value is None for n in chain)
    ]
    return sorted(chains, key=lambda chain: (-len(chain), [_specificity(n) for n in chain]))
