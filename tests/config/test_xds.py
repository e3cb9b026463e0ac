"""Rules by xDS: XdsConfigSource against a real ADS server (grpc.aio on loopback).

The server (harness/ratelimit_harness/xds.py) is a minimal state-of-the-world ADS
server that records every request the client sends (the ACKs and NACKs). Configs
end in a real RateLimiter on the embedded store, and the tests ask it for decisions.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import struct_pb2

from ratelimit_harness.certs import CertPair, make_ca, make_cert
from ratelimit_harness.waiting import eventually_async
from ratelimit_harness.xds import TIMEOUT, AdsServer, domain, limit
from ratelimit_service.config import rls_conf_pb2 as rls
from ratelimit_service.config.xds import XdsConfigSource
from ratelimit_service.config.xds_settings import Backoff, XdsSettings, parse_key_values
from ratelimit_service.config.xds_yaml import TYPE_URL, to_config_file
from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_loader import UNIT_NAMES, ConfigFile, load_config
from ratelimit_service.core.config_model import FailureMode, Mode, RateLimitConfig
from ratelimit_service.core.request import Code, Descriptor, Request
from ratelimit_service.core.units import Unit
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.engine.stats import Stats
from ratelimit_service.storage.embedded import EmbeddedStore

VALID_UNITS = f"; valid units: {UNIT_NAMES}"

FAST = {"backoff_initial": 0.05, "backoff_max": 0.1}


class Service:
    """The parts of the service the source talks to: the loader, a limiter, stats."""

    def __init__(self) -> None:
        self.stats = Stats()
        self.limiter = RateLimiter(
            RateLimitConfig(domains={}), EmbeddedStore(), stats=self.stats, default_mode=Mode.EXACT
        )

    def load(self, files: list[ConfigFile]) -> RateLimitConfig:
        return load_config(files, default_mode=Mode.EXACT, merge_domains=False)

    def source(self, url: str, **settings: Any) -> XdsConfigSource:
        xds = XdsSettings(server_url=url, **{"node_id": "test-node", **FAST, **settings})
        return XdsConfigSource(
            xds, load=self.load, install=self.limiter.swap_config, stats=self.stats
        )

    async def codes(self, domain: str, key: str, value: str, times: int) -> list[Code]:
        out = []
        for _ in range(times):
            request = Request(domain, [Descriptor(((key, value),))])
            out.append((await self.limiter.should_rate_limit(request)).overall)
        return out


@pytest.fixture
async def server() -> AsyncIterator[AdsServer]:
    ads = await AdsServer().start()
    yield ads
    await ads.stop()


@pytest.fixture
async def running(server: AdsServer) -> AsyncIterator[tuple[Service, XdsConfigSource]]:
    service = Service()
    source = service.source(
        f"127.0.0.1:{server.port}", node_metadata={"zone": "z1"}, headers={"X-Token": "t0k"}
    )
    source.start()
    yield service, source
    await source.stop()


async def until(condition: Callable[[], bool], timeout: float = TIMEOUT) -> None:
    await eventually_async(condition, timeout=timeout, what=condition.__name__)


# -- tests --------------------------------------------------------------------------------


async def test_a_pushed_config_is_installed_and_acked_with_its_version_and_nonce(
    server: AdsServer, running: tuple[Service, XdsConfigSource]
) -> None:
    service, source = running
    hello = await server.request()
    assert hello.type_url == TYPE_URL
    assert hello.node.id == "test-node"
    assert dict(hello.node.metadata) == {"zone": "z1"}
    assert (hello.version_info, hello.response_nonce, list(hello.resource_names)) == ("", "", [])
    assert server.headers[0]["x-token"] == "t0k"
    assert not source.loaded

    nonce = server.push("v1", [domain("edge", limit("path", 2))])
    ack = await server.request()
    assert (ack.version_info, ack.response_nonce) == ("v1", nonce)
    assert not ack.HasField("error_detail")
    assert await source.wait_first(TIMEOUT)
    assert source.loaded and source.version == "v1"
    assert service.stats.config_load_success == 1
    assert await service.codes("edge", "path", "/a", 3) == [Code.OK, Code.OK, Code.OVER_LIMIT]
    (rule,) = service.limiter.config.limits()
    assert (rule.requests_per_unit, rule.unit, rule.mode) == (2, Unit.MINUTE, Mode.EXACT)
    assert rule.source.startswith("xds:edge:")


async def test_each_response_replaces_the_whole_set(
    server: AdsServer, running: tuple[Service, XdsConfigSource]
) -> None:
    service, _ = running
    await server.request()
    server.push("v1", [domain("one", limit("k", 1)), domain("two", limit("k", 1))])
    await server.request()
    assert sorted(service.limiter.config.domains) == ["one", "two"]
    assert await service.codes("one", "k", "x", 2) == [Code.OK, Code.OVER_LIMIT]

    nonce = server.push("v2", [domain("two", limit("k", 3))])
    ack = await server.request()
    assert (ack.version_info, ack.response_nonce, ack.HasField("error_detail")) == (
        "v2",
        nonce,
        False,
    )
    assert sorted(service.limiter.config.domains) == ["two"]
    assert await service.codes("one", "k", "x", 2) == [Code.OK, Code.OK]  # no rule: no limit
    assert [lim.requests_per_unit for lim in service.limiter.config.limits()] == [3]
    assert service.stats.config_load_success == 2

    server.push("v3", [])  # an empty world is a valid one: no rules at all
    assert (await server.request()).version_info == "v3"
    assert service.limiter.config.domains == {}


async def test_a_config_that_does_not_load_is_nacked_and_the_old_one_kept(
    server: AdsServer, running: tuple[Service, XdsConfigSource]
) -> None:
    service, source = running
    await server.request()
    server.push("v1", [domain("edge", limit("path", 2))])
    await server.request()
    before = service.limiter.config

    bad = rls.RateLimitDescriptor(
        key="path",
        value="/login",
        rate_limit=rls.RateLimitPolicy(unit=rls.UNKNOWN, requests_per_unit=5),
    )
    nested = rls.RateLimitDescriptor(key="user", descriptors=[bad])
    nonce = server.push("v2", [domain("edge", limit("path", 9)), domain("api", nested)])
    nack = await server.request()
    assert (nack.version_info, nack.response_nonce) == ("v1", nonce)
    assert nack.error_detail.code == 3  # INVALID_ARGUMENT
    assert nack.error_detail.message == (
        "xds:api: descriptor user > path=/login: invalid rate limit unit 'UNKNOWN'" + VALID_UNITS
    )
    assert service.limiter.config is before
    assert source.version == "v1"
    assert (service.stats.config_load_success, service.stats.config_load_error) == (1, 1)
    assert await service.codes("edge", "path", "/a", 3) == [Code.OK, Code.OK, Code.OVER_LIMIT]

    # Two resources for one domain: the loader's duplicate-domain error, named by resource.
    nonce = server.push(
        "v3", [domain("edge", limit("a", 1), resource="r1"), domain("edge", resource="r2")]
    )
    nack = await server.request()
    assert (nack.version_info, nack.response_nonce) == ("v1", nonce)
    assert nack.error_detail.message.startswith("xds:r2: duplicate domain 'edge'")
    assert service.stats.config_load_error == 2

    # A later good push is taken again.
    server.push("v4", [domain("edge", limit("path", 1))])
    ack = await server.request()
    assert (ack.version_info, ack.HasField("error_detail")) == ("v4", False)
    assert await service.codes("edge", "path", "/b", 2) == [Code.OK, Code.OVER_LIMIT]


async def test_a_first_config_that_fails_is_nacked_with_an_empty_version(
    server: AdsServer, running: tuple[Service, XdsConfigSource]
) -> None:
    _, source = running
    await server.request()
    nonce = server.push("v1", [domain("", limit("k", 1), resource="nameless")])
    nack = await server.request()
    assert (nack.version_info, nack.response_nonce) == ("", nonce)
    assert nack.error_detail.message == "xds:nameless: config file cannot have empty domain"
    assert not await source.wait_first(0.05)
    assert not source.loaded


async def test_a_server_restarted_on_the_same_port_is_reconnected_to(
    server: AdsServer,
    running: tuple[Service, XdsConfigSource],
    caplog: pytest.LogCaptureFixture,
) -> None:
    service, source = running
    await server.request()
    server.push("v1", [domain("edge", limit("path", 1))])
    await server.request()
    port = server.port

    with caplog.at_level(logging.DEBUG, logger="ratelimit_service.config.xds"):
        await server.stop()
        await eventually_async(  # several retries at 0.05-0.1 s fail meanwhile
            lambda: sum(r.levelno == logging.DEBUG and "retry" in r.getMessage()
                        for r in caplog.records) >= 2,
            timeout=5, what="two failed retries",
        )  # fmt: skip
        assert service.limiter.config.domains.keys() == {"edge"}  # kept through the outage
        restarted = AdsServer()  # a new server knows nothing of v1
        await restarted.start(port)
        try:
            hello = await restarted.request()
            # It tells the new server what it holds: the version, and no nonce.
            assert (hello.version_info, hello.response_nonce) == ("v1", "")
            assert hello.node.id == "test-node"
            nonce = restarted.push("v2", [domain("api", limit("user", 2))])
            ack = await restarted.request()
            assert (ack.version_info, ack.response_nonce) == ("v2", nonce)
            # Read the log before this server stops too (that would be a new outage).
            records = [r for r in caplog.records if r.name == "ratelimit_service.config.xds"]
        finally:
            await restarted.stop()

    assert source.version == "v2"
    assert sorted(service.limiter.config.domains) == ["api"]
    warnings = [r for r in records if r.levelno == logging.WARNING]
    retries = [r for r in records if r.levelno == logging.DEBUG and "retry" in r.getMessage()]
    back = [r for r in records if r.levelno == logging.INFO and "back after" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "keeping version 'v1'" in warnings[0].getMessage()
    assert len(retries) >= 2
    assert len(back) == 1


async def test_resources_wrapped_in_discovery_resource_are_unwrapped(
    server: AdsServer, running: tuple[Service, XdsConfigSource]
) -> None:
    service, _ = running
    await server.request()
    server.push("v1", [domain("edge", limit("path", 1))], wrap=True)
    ack = await server.request()
    assert (ack.version_info, ack.HasField("error_detail")) == ("v1", False)
    assert await service.codes("edge", "path", "/", 2) == [Code.OK, Code.OVER_LIMIT]


async def test_a_resource_of_another_type_is_nacked(
    server: AdsServer, running: tuple[Service, XdsConfigSource]
) -> None:
    _, source = running
    await server.request()
    nonce = server.push("v1", [struct_pb2.Struct()])
    nack = await server.request()
    assert (nack.version_info, nack.response_nonce) == ("", nonce)
    assert nack.error_detail.message == (
        f"resource 0: type type.googleapis.com/google.protobuf.Struct, expected {TYPE_URL}"
    )
    assert not source.loaded


async def test_a_response_over_the_message_size_bound_is_refused_not_loaded(
    server: AdsServer,
) -> None:
    service = Service()
    source = service.source(f"127.0.0.1:{server.port}", max_message_size=4096)
    big = [limit(f"key{i:04}", 1, value="v" * 50) for i in range(100)]  # ~7 KB
    server.push("v1", [domain("edge", *big)])
    source.start()
    try:
        await until(lambda: source.last_error is not None)
        assert "RESOURCE_EXHAUSTED" in (source.last_error or "")
        assert not source.loaded
        assert service.limiter.config.domains == {}
    finally:
        await source.stop()


# -- mTLS ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertPair]:
    directory: Path = tmp_path_factory.mktemp("xds-certs")
    ca = make_ca(directory)
    return {
        "ca": ca,
        "server": make_cert(directory, ca, "server"),
        "client": make_cert(directory, ca, "client", client=True),
    }


async def test_mtls_a_client_with_a_certificate_gets_rules_one_without_is_refused(
    certs: dict[str, CertPair],
) -> None:
    credentials = grpc.ssl_server_credentials(
        [(certs["server"].key.read_bytes(), certs["server"].cert.read_bytes())],
        root_certificates=certs["ca"].cert.read_bytes(),
        require_client_auth=True,
    )
    server = await AdsServer(credentials).start()
    server.push("v1", [domain("edge", limit("path", 1))])
    url = f"127.0.0.1:{server.port}"
    ca = str(certs["ca"].cert)
    good = Service()
    refused = {
        "no client certificate": Service().source(url, use_tls=True, server_ca=ca),
        "server certificate for another name": Service().source(
            url,
            use_tls=True,
            server_ca=ca,
            client_cert=str(certs["client"].cert),
            client_key=str(certs["client"].key),
            server_san="other.example",
        ),
    }
    source = good.source(
        url,
        use_tls=True,
        server_ca=ca,
        client_cert=str(certs["client"].cert),
        client_key=str(certs["client"].key),
        server_san="localhost",  # the certificate's DNS name, not the address dialled
    )
    sources = [source, *refused.values()]
    for each in sources:
        each.start()
    try:
        assert await source.wait_first(TIMEOUT)
        assert await good.codes("edge", "path", "/", 2) == [Code.OK, Code.OVER_LIMIT]
        for reason, other in refused.items():
            await until(lambda other=other: other.last_error is not None)
            assert not other.loaded, reason
            assert other.last_error and "UNAVAILABLE" in other.last_error, reason
        # Only the good client ever reached the service: one stream, a hello and an ACK.
        hello, ack = await server.request(), await server.request()
        assert (hello.version_info, ack.version_info, ack.HasField("error_detail")) == (
            "",
            "v1",
            False,
        )
        assert server.requests.empty()
        assert len(server.headers) == 1
    finally:
        for each in sources:
            await each.stop()
        await server.stop()


# -- the mapping, the settings, the backoff ------------------------------------------------


def test_every_proto_field_reaches_the_loaded_rule() -> None:
    metadata = struct_pb2.Struct()
    metadata.update({"team": "checkout", "tier": 2})
    message = domain(
        "d",
        rls.RateLimitDescriptor(
            key="path",
            value="/api/*",
            shadow_mode=True,
            detailed_metric=True,
            quota_mode=True,
            metadata=metadata,
            rate_limit=rls.RateLimitPolicy(
                unit=rls.WEEK,
                unit_multiplier=2,
                requests_per_unit=7,
                name="wide",
                replaces=[rls.RateLimitReplace(name="narrow")],
            ),
            descriptors=[
                rls.RateLimitDescriptor(key="user", rate_limit=rls.RateLimitPolicy(unlimited=True)),
                limit("yes", 0, value="no: 'quoted' \"too\""),  # YAML-hostile strings
            ],
        ),
        resource="res",
    )
    file = to_config_file(message)
    assert file.name == "xds:res"
    config = load_config([file], default_mode=Mode.EXACT)
    by_key = {lim.stats_key: lim for lim in config.limits()}
    wide = by_key["d.path_/api/*"]
    assert (wide.unit, wide.requests_per_unit, wide.name) == (Unit.WEEK, 7, "wide")
    assert wide.unit_multiplier == 2 and wide.window_seconds == 14 * 86_400
    assert wide.replaces == frozenset({"narrow"})
    assert (wide.shadow_mode, wide.detailed_metric, wide.quota_mode) == (True, True, True)
    assert wide.metadata == {"team": "checkout", "tier": 2.0}
    assert (wide.mode, wide.failure_mode) == (Mode.EXACT, FailureMode.OPEN)
    assert by_key["d.path_/api/*.user"].unlimited
    hostile = by_key["d.path_/api/*.yes_no: 'quoted' \"too\""]
    assert hostile.requests_per_unit == 0


def test_the_go_service_s_messages_and_ours_parse_both_ways() -> None:
    """unit_multiplier is field 1000: a message without it parses as before, and the
    Go service's decoder skips it as an unknown field."""
    plain = rls.RateLimitPolicy(unit=rls.MINUTE, requests_per_unit=3)
    assert rls.RateLimitPolicy.FromString(plain.SerializeToString()).unit_multiplier == 0
    ours = rls.RateLimitPolicy(unit=rls.MINUTE, requests_per_unit=3, unit_multiplier=10)
    wire = ours.SerializeToString()
    assert wire.startswith(plain.SerializeToString())  # the Go fields first, unchanged
    config = load_config([to_config_file(domain("d", limit("k", 3)))])
    assert next(config.limits()).unit_multiplier == 1


def test_rate_limits_by_xds() -> None:
    message = domain(
        "d",
        rls.RateLimitDescriptor(
            key="user",
            rate_limits=[
                rls.RateLimitPolicy(unit=rls.SECOND, requests_per_unit=3),
                rls.RateLimitPolicy(unit=rls.MINUTE, requests_per_unit=5, name="sustained"),
            ],
        ),
    )
    config = load_config([to_config_file(message)])
    assert [(lim.stats_key, lim.requests_per_unit) for lim in config.limits()] == [
        ("d.user.per_second", 3),
        ("d.user.sustained", 5),
    ]


def test_an_unknown_unit_number_is_a_loader_error() -> None:
    message = domain("d", rls.RateLimitDescriptor(
        key="k", rate_limit=rls.RateLimitPolicy(unit=42, requests_per_unit=1)))  # fmt: skip
    with pytest.raises(
        ConfigLoadError,
        match="invalid rate limit unit '42'",
    ):
        load_config([to_config_file(message)])


def test_settings_are_checked_and_pairs_parsed() -> None:
    assert XdsSettings().node_id == "default"
    assert (XdsSettings().backoff_initial, XdsSettings().backoff_max) == (10.0, 60.0)
    with pytest.raises(ValueError, match="host:port"):
        XdsSettings(server_url="no-port")
    with pytest.raises(ValueError, match="go together"):
        XdsSettings(use_tls=True, client_cert="c.pem")
    with pytest.raises(ValueError, match="use_tls is false"):
        XdsSettings(server_ca="ca.pem")
    assert parse_key_values("a=1, b = two,,") == {"a": "1", "b": "two"}
    assert parse_key_values("x-token:abc", ":") == {"x-token": "abc"}
    with pytest.raises(ValueError):
        parse_key_values("novalue")


def test_the_backoff_grows_to_its_maximum_with_jitter_and_resets() -> None:
    steady = Backoff(10, 60, random_factor=0.5, jitter=False)
    assert [steady.next() for _ in range(7)] == [10, 15, 22.5, 33.75, 50.625, 60, 60]
    steady.reset()
    assert steady.next() == 10
    low = Backoff(10, 60, random_factor=0.5, draw=lambda: 0.0)
    high = Backoff(10, 60, random_factor=0.5, draw=lambda: 0.999999)
    assert low.next() == 5.0
    assert high.next() == pytest.approx(15.0)
