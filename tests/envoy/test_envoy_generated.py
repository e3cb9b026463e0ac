"""`ratelimit-service envoy-config --bootstrap` and istio/envoyfilter.yaml, run in a real Envoy.

The generator's bootstrap for config/ must start as printed (addresses chosen with its own
flags) and behave like envoy/envoy.yaml: the README walkthrough, /healthz never limited.
The EnvoyFilter's patches are applied to a bootstrap shaped like the Istio ingress
gateway's listener (the patches' context is GATEWAY) and run the same way. Every shipped
and generated config also passes ``envoy --mode validate``.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from ratelimit_harness.envoy import (
    Envoy,
    ServiceProcess,
    Upstream,
    load_yaml,
    substitute_addresses,
    validate,
)
from ratelimit_harness.envoy_fixtures import (
    CONFIG_DIR,
    REPO,
    SHIPPED_BOOTSTRAP,
    patient,
    undecided_calls,
)
from ratelimit_service.cli import envoy_config, envoy_plan
from ratelimit_service.cli.envoy_plan import EnvoyOptions
from ratelimit_service.config.files import read_config_files
from ratelimit_service.core.config_loader import ConfigFile, load_config

StartEnvoy = Callable[..., Envoy]
SpawnService = Callable[..., ServiceProcess]
ENVOY_FILTER = REPO / "istio" / "envoyfilter.yaml"
ISTIO_SERVICE = ("ratelimit-headless.ratelimit.svc.cluster.local", 8081)
WEB_CLUSTER = "outbound|8080||web.default.svc.cluster.local"


def generate(*flags: str) -> str:
    """The CLI's output, as a user gets it."""
    result = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "envoy-config", "--config", str(CONFIG_DIR),
         *flags],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


def generated_bootstrap(service: ServiceProcess, upstream: Upstream) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(
        generate(
            "--bootstrap",
            "--listen",
            "127.0.0.1:0",
            "--admin-address",
            "127.0.0.1:0",
            "--service-address",
            f"127.0.0.1:{service.grpc_port}",
            "--upstream-address",
            f"127.0.0.1:{upstream.port}",
        )
    )
    return data


def descriptor_sets(rate_limits: list[dict[str, Any]]) -> list[list[str]]:
    """What each rate_limits entry sends, as comparable text (generic keys as key=value)."""
    out = []
    for entry in rate_limits:
        keys = []
        for action in entry["actions"]:
            (kind, spec), *_ = action.items()
            if kind == "generic_key":
                keys.append(f"{spec['descriptor_key']}={spec['descriptor_value']}")
            elif kind == "request_headers":
                keys.append(f"{spec['descriptor_key']}<{spec['header_name']}")
            else:
                keys.append(kind)
        out.append(keys)
    return out


def routes_of(bootstrap: dict[str, Any]) -> dict[str, dict[str, Any]]:
    (listener,) = bootstrap["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (vhost,) = manager["route_config"]["virtual_hosts"]
    return {route["name"]: route for route in vhost["routes"]}


def walkthrough(envoy: Envoy) -> None:
    """The README's behaviour, the same for every bootstrap of config/."""
    statuses = [envoy.request("/api/write/1", {"x-tenant": "acme"}).status for _ in range(12)]
    assert statuses == [200] * 5 + [429] * 7
    fresh = envoy.request("/api/write/1", {"x-tenant": "globex"})
    assert fresh.status == 200
    assert fresh.headers["x-ratelimit-limit"].split(",")[0] == "5"
    assert fresh.headers["x-ratelimit-remaining"] == "4"
    assert envoy.request("/", {"x-tenant": "blocked"}).status == 429
    health = [envoy.request("/healthz", {"x-tenant": "blocked"}).status for _ in range(60)]
    assert health == [200] * 60
    # Search is limited in shadow mode only: counted, never denied.
    search = [envoy.request("/api/search/q", {"x-tenant": "acme"}).status for _ in range(25)]
    assert search == [200] * 25
    stats = envoy.stats()
    assert stats["cluster.upstream.ratelimit.ok"] == 5 + 1 + 60 + 25
    assert stats["cluster.upstream.ratelimit.over_limit"] == 7 + 1
    assert stats.get("cluster.upstream.ratelimit.error", 0) == 0


# ------------------------------------------------------------------ without Envoy


@pytest.mark.slow  # starts a process
def test_generated_routes_send_what_the_shipped_bootstrap_sends() -> None:
    generated = routes_of(yaml.safe_load(generate("--bootstrap")))
    shipped = routes_of(load_yaml(SHIPPED_BOOTSTRAP))
    assert list(generated) == ["healthz", "api-search", "api-write", "other"]
    assert set(generated) == set(shipped)
    for name, route in generated.items():
        assert route["match"] == shipped[name]["match"], name
        assert descriptor_sets(route["route"]["rate_limits"]) == descriptor_sets(
            shipped[name]["route"]["rate_limits"]
        ), name
    # The health route sends only its own unlimited descriptor.
    assert descriptor_sets(generated["healthz"]["route"]["rate_limits"]) == [["path=/healthz"]]


@pytest.mark.slow  # starts a process
def test_pieces_without_bootstrap_keep_their_shape() -> None:
    pieces = yaml.safe_load(generate())
    assert list(pieces) == ["http_filters", "clusters", "rate_limits"]
    (cluster,) = pieces["clusters"]
    (check,) = cluster["health_checks"]
    assert check["grpc_health_check"]["service_name"] == envoy_config.RLS_HEALTH_SERVICE
    assert check["no_traffic_interval"] == "5s"
    assert pieces["http_filters"][0]["typed_config"]["failure_mode_deny"] is False


def test_route_plan_for_overlapping_and_unlimited_paths(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "domain: d\ndescriptors:\n"
        "  - key: user\n    rate_limit: {unit: second, requests_per_unit: 10}\n"
        "  - key: path\n    value: /api/*\n    rate_limit: {unit: second, requests_per_unit: 100}\n"
        "  - key: path\n    value: /api/admin*\n"
        "    rate_limit: {unit: second, requests_per_unit: 1}\n"
        "  - key: path\n    value: /ping\n    rate_limit: {unlimited: true}\n"
        "  - key: path\n    value: /x*y\n    rate_limit: {unit: second, requests_per_unit: 3}\n"
    )
    domain = load_config(read_config_files(str(rules))).domains["d"]
    plans = {plan.name: plan for plan in envoy_plan.plan_routes(domain)}
    assert [(p.name, p.path, p.prefix) for p in plans.values()] == [
        ("ping", "/ping", None),
        ("api-admin", None, "/api/admin"),
        ("api", None, "/api/"),
        ("other", None, "/"),
    ]
    # The plan: which rules' chains each route sends (no protobuf yet).
    assert {name: [c[-1].config_path for c in plan.chains] for name, plan in plans.items()} == {
        "ping": ["d.path_/ping"],  # only unlimited rules cover it: only those
        "api-admin": ["d.user", "d.path_/api/*", "d.path_/api/admin*"],
        "api": ["d.user", "d.path_/api/*"],
        "other": ["d.user", "d.path_/x*y"],  # a pattern no route can match: the catch-all
    }

    def sent(name: str) -> list[list[str]]:
        entries = envoy_config.plan_rate_limits(plans[name])
        return descriptor_sets([envoy_config._to_dict(entry) for entry in entries])

    assert sent("ping") == [["path=/ping"]]
    # /api/admin/1 meets both /api/* and /api/admin*: the route sends the path once.
    assert sent("api-admin") == [["user<x-user"], ["path<:path"]]
    assert sent("api") == [["user<x-user"], ["path<:path"]]
    assert sent("other") == [["user<x-user"], ["path<:path"]]
    with pytest.raises(ValueError, match="upstream"):
        envoy_config.build_bootstrap(domain, EnvoyOptions(cluster="upstream"))


# ------------------------------------------------------------------ Istio's patches


def istio_gateway_bootstrap(web: tuple[str, int]) -> dict[str, Any]:
    """What the Istio ingress gateway's Envoy holds for gateway.yaml, reduced: the
    listener 0.0.0.0_8080 (loopback here) with an HTTP connection manager whose route
    configuration http.8080 has the VirtualService's named routes to the web cluster, and
    the router as the only HTTP filter."""
    gateway = list(yaml.safe_load_all((REPO / "istio" / "gateway.yaml").read_text()))
    (service,) = [doc for doc in gateway if doc["kind"] == "VirtualService"]
    routes = []
    for http in service["spec"]["http"]:
        (match,) = http["match"]
        uri = match["uri"]
        kind = "path" if "exact" in uri else "prefix"
        routes.append(
            {
                "name": http["name"],
                "match": {kind: uri.get("exact", uri.get("prefix"))},
                "route": {"cluster": WEB_CLUSTER},
            }
        )
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network."
        "http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "outbound_0.0.0.0_8080",
        "use_remote_address": True,
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
                },
            }
        ],
        "route_config": {
            "name": "http.8080",
            "virtual_hosts": [{"name": "*:80", "domains": ["*"], "routes": routes}],
        },
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
        "static_resources": {
            "listeners": [
                {
                    "name": "0.0.0.0_8080",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": WEB_CLUSTER,
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "load_assignment": {
                        "cluster_name": WEB_CLUSTER,
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {
                                                    "address": web[0],
                                                    "port_value": web[1],
                                                }
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                }
            ],
        },
    }


def apply_envoy_filter(bootstrap: dict[str, Any], envoy_filter: dict[str, Any]) -> dict[str, Any]:
    """The patches as Istio applies them, for the operations envoyfilter.yaml uses:
    HTTP_FILTER INSERT_BEFORE a named sub-filter, CLUSTER ADD, HTTP_ROUTE MERGE by route
    name (a proto merge: repeated fields append). Anything else raises."""
    result = copy.deepcopy(bootstrap)
    resources = result["static_resources"]
    managers = [
        f["typed_config"]
        for listener in resources["listeners"]
        for chain in listener["filter_chains"]
        for f in chain["filters"]
        if f["name"] == "envoy.filters.network.http_connection_manager"
    ]
    for patch in envoy_filter["spec"]["configPatches"]:
        apply_to, match, body = patch["applyTo"], patch["match"], patch["patch"]
        assert match["context"] == "GATEWAY", patch
        operation, value = body["operation"], copy.deepcopy(body["value"])
        if apply_to == "HTTP_FILTER" and operation == "INSERT_BEFORE":
            anchor = match["listener"]["filterChain"]["filter"]["subFilter"]["name"]
            for manager in managers:
                names = [f["name"] for f in manager["http_filters"]]
                manager["http_filters"].insert(names.index(anchor), value)
        elif apply_to == "CLUSTER" and operation == "ADD":
            resources["clusters"].append(value)
        elif apply_to == "HTTP_ROUTE" and operation == "MERGE":
            name = match["routeConfiguration"]["vhost"]["route"]["name"]
            found = [
                route
                for manager in managers
                for vhost in manager["route_config"]["virtual_hosts"]
                for route in vhost["routes"]
                if route["name"] == name
            ]
            assert found, f"no route named {name!r}"
            for route in found:
                merge(route, value)
        else:
            raise AssertionError(f"patch not modelled: {apply_to} {operation}")
    return result


def merge(target: dict[str, Any], value: dict[str, Any]) -> None:
    for key, item in value.items():
        if isinstance(item, dict) and isinstance(target.get(key), dict):
            merge(target[key], item)
        elif isinstance(item, list) and isinstance(target.get(key), list):
            target[key].extend(item)
        else:
            target[key] = item


def istio_bootstrap(service: tuple[str, int], web: tuple[str, int]) -> dict[str, Any]:
    """The gateway with the EnvoyFilter applied; only the service's address made loopback."""
    patched = apply_envoy_filter(istio_gateway_bootstrap(web), load_yaml(ENVOY_FILTER))
    result: dict[str, Any] = substitute_addresses(
        patched,
        {
            ("127.0.0.1", 0): ("127.0.0.1", 0),
            (web[0], web[1]): web,
            ISTIO_SERVICE: service,
        },
    )
    return result


def test_envoy_filter_patches_land_where_istio_puts_them() -> None:
    patched = istio_bootstrap(("127.0.0.1", 1), ("127.0.0.1", 2))
    manager = patched["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    assert [f["name"] for f in manager["typed_config"]["http_filters"]] == [
        "envoy.filters.http.ratelimit",
        "envoy.filters.http.router",
    ]
    assert [c["name"] for c in patched["static_resources"]["clusters"]] == [
        WEB_CLUSTER,
        "ratelimit",
    ]
    routes = routes_of(patched)
    shipped = routes_of(load_yaml(SHIPPED_BOOTSTRAP))
    for name, route in routes.items():
        assert descriptor_sets(route["route"]["rate_limits"]) == descriptor_sets(
            shipped[name]["route"]["rate_limits"]
        ), name


# ------------------------------------------------------------------ in Envoy


def test_generated_bootstrap_runs_the_walkthrough(
    start_envoy: StartEnvoy, spawn_service: SpawnService, upstream: Upstream
) -> None:
    service = spawn_service(CONFIG_DIR)
    envoy = start_envoy(patient(generated_bootstrap(service, upstream)))
    # Its gRPC health check reaches the service and passes.
    assert envoy.healthy_hosts("ratelimit") == {f"127.0.0.1:{service.grpc_port}"}
    assert envoy.stat("cluster.ratelimit.health_check.success") >= 1
    walkthrough(envoy)


def test_istio_envoy_filter_applied_to_a_gateway_listener_limits(
    start_envoy: StartEnvoy, spawn_service: SpawnService, upstream: Upstream
) -> None:
    service = spawn_service(CONFIG_DIR)
    envoy = start_envoy(patient(istio_bootstrap(service.address, ("127.0.0.1", upstream.port))))
    assert envoy.healthy_hosts("ratelimit") == {f"127.0.0.1:{service.grpc_port}"}
    assert envoy.stat("cluster.ratelimit.health_check.success") >= 1
    statuses = [envoy.request("/api/write/1", {"x-tenant": "acme"}).status for _ in range(8)]
    assert statuses == [200] * 5 + [429] * 3
    assert envoy.request("/", {"x-tenant": "blocked"}).status == 429
    health = [envoy.request("/healthz", {"x-tenant": "blocked"}).status for _ in range(60)]
    assert health == [200] * 60
    first = envoy.request("/api/write/1", {"x-tenant": "globex"})
    assert first.headers["x-ratelimit-remaining"] == "4"
    stats = envoy.stats()
    cluster_stats = f"cluster.{WEB_CLUSTER}.ratelimit"
    assert stats[f"{cluster_stats}.ok"] == 5 + 60 + 1
    assert stats[f"{cluster_stats}.over_limit"] == 3 + 1
    assert undecided_calls(envoy) == 0


def configs_to_validate(tmp_path: Path) -> dict[str, Path]:
    generated = tmp_path / "generated.yaml"
    generated.write_text(generate("--bootstrap"))
    istio = tmp_path / "istio.yaml"
    istio.write_text(
        yaml.safe_dump(
            apply_envoy_filter(
                istio_gateway_bootstrap(("127.0.0.1", 8080)), load_yaml(ENVOY_FILTER)
            )
        )
    )
    return {"envoy/envoy.yaml": SHIPPED_BOOTSTRAP, "generated": generated, "istio": istio}


@pytest.mark.parametrize("name", ["envoy/envoy.yaml", "generated", "istio"])
def test_envoy_validates_every_shipped_and_generated_config(
    envoy_binary: str, tmp_path: Path, name: str
) -> None:
    path = configs_to_validate(tmp_path)[name]
    result = validate(envoy_binary, path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_envoy_validate_rejects_a_broken_config(envoy_binary: str, tmp_path: Path) -> None:
    """The check above can fail: routes to a cluster that is not there. (A ratelimit
    filter whose cluster is missing passes validation: Envoy looks it up per request, so
    tests/envoy/test_envoy_configs.py checks that one.)"""
    broken = load_yaml(SHIPPED_BOOTSTRAP)
    broken["static_resources"]["clusters"] = [
        c for c in broken["static_resources"]["clusters"] if c["name"] != "upstream"
    ]
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(broken))
    result = validate(envoy_binary, path)
    assert result.returncode != 0
    assert "unknown cluster 'upstream'" in result.stdout + result.stderr


def test_a_usage_rule_is_sent_in_the_two_phase_form_from_the_filter_itself() -> None:
    """A rule with ``usage``: its descriptors go twice, a check at cost 0 and a report
    of the response's cost on stream done, on the filter's own rate_limits (Envoy 1.40
    sends neither field from a route action's); no route-level list is printed."""
    example = REPO / "config" / "token-budget.yaml.example"
    snippet = yaml.safe_load(envoy_config.render(str(example)))
    assert "rate_limits" not in snippet
    (ratelimit,) = snippet["http_filters"]
    tenant = [{"request_headers": {"header_name": "x-tenant", "descriptor_key": "tenant"}}]
    assert ratelimit["typed_config"]["rate_limits"] == [
        {"actions": tenant, "hits_addend": {"number": "0"}},
        {"actions": tenant, "hits_addend": {"format": "%RESP(x-tokens)%"},
         "apply_on_stream_done": True},
    ]  # fmt: skip
    metadata = example.read_text().replace(
        "usage: {from_header: x-tokens}",
        "usage: {from_metadata: {namespace: io.envoy.ai_gateway, key: llm_total_token}}",
    )
    domain = next(iter(load_config([ConfigFile("ai.yaml", metadata)]).domains.values()))
    entries, _ = envoy_config.route_rate_limits(domain)
    assert (
        entries[1].hits_addend.format == "%DYNAMIC_METADATA(io.envoy.ai_gateway:llm_total_token)%"
    )
    # A rule without usage keeps the route-level list (config/edge.yaml has none).
    assert "rate_limits" in yaml.safe_load(envoy_config.render(str(CONFIG_DIR)))
