"""The envoyproxy/ratelimit acceptance files in ../shared/compat/envoy-ratelimit, used in place.

EXPECTED.md there says which files the reference rejects (and with what message),
which must load, and what sample lookups return. The rejection table is read from
EXPECTED.md itself, so a row added there is checked here too.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from envoy.service.ratelimit.v3 import rls_pb2

from ratelimit_harness.fixtures import COMPAT, COMPAT_ENV
from ratelimit_service.core.config_loader import UNIT_NAMES, ConfigFile, check_config, load_config
from ratelimit_service.core.config_model import DomainConfig, Mode
from ratelimit_service.core.matching import Match, find_limit, override_stats_key
from ratelimit_service.core.units import Unit

VALID_UNITS = f"; valid units: {UNIT_NAMES}"

if not COMPAT.is_dir():
    pytest.skip(
        f"compat suite not found at {COMPAT}: these tests need envoyproxy/ratelimit's"
        f" acceptance files (EXPECTED.md, test/config/) there, or where {COMPAT_ENV} points",
        allow_module_level=True,
    )

CONFIG_DIR = COMPAT / "test" / "config"
EXPECTED = COMPAT / "EXPECTED.md"
DOMAIN = "test-domain"

OK = rls_pb2.RateLimitResponse.OK
OVER = rls_pb2.RateLimitResponse.OVER_LIMIT
WIRE = rls_pb2.RateLimitResponse.RateLimit
UINT32_MAX = 4294967295


def config_file(path: Path) -> ConfigFile:
    return ConfigFile(name=path.name, text=path.read_text(encoding="utf-8"))


def load_files(*names: str, merge: bool = False) -> dict[str, DomainConfig]:
    files = [config_file(CONFIG_DIR / name) for name in names]
    return dict(load_config(files, merge_domains=merge).domains)


def domain_of(name: str) -> DomainConfig:
    return load_files(name)[DOMAIN]


# --------------------------------------------------------------------------- (a) rejections


@dataclass(frozen=True)
class RejectRow:
    files: tuple[str, ...]
    merge: bool
    file: str
    message: str


def reject_rows() -> list[RejectRow]:
    """Rows of the "Files that must be rejected" table of EXPECTED.md."""
    text = EXPECTED.read_text(encoding="utf-8")
    section = text.split("## Files that must be rejected", 1)[1].split("\n## ", 1)[0]
    rows: list[RejectRow] = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or not cells[0].startswith("test/"):
            continue
        spec, merge, error = cells
        names = re.findall(r"test/config/([\w.]+\.yaml)", spec)
        if spec.endswith(" twice"):
            names = names * 2
        quoted = re.search(r"`([^`]*)`", error)
        assert quoted is not None, line
        file, message = quoted.group(1).split(": ", 1)
        rows.append(RejectRow(tuple(names), merge == "true", file, message))
    return rows


REJECT_ROWS = reject_rows()


def test_reject_table_parsed() -> None:
    assert len(REJECT_ROWS) == 14
    by_file = {row.file: row for row in REJECT_ROWS}
    assert by_file["duplicate_domain.yaml"].files == (
        "basic_config.yaml",
        "duplicate_domain.yaml",
    )
    assert by_file["merge_domain_key1.yaml"].files == ("merge_domain_key1.yaml",) * 2
    assert by_file["merge_domain_key1.yaml"].merge is True
    assert by_file["non_string_key.yaml"].message == "config error, key is not of type string: 0.25"
    assert all(len(row.files) >= 1 for row in REJECT_ROWS)


@pytest.mark.parametrize("row", REJECT_ROWS, ids=[row.file for row in REJECT_ROWS])
def test_rejected(row: RejectRow) -> None:
    files = [config_file(CONFIG_DIR / name) for name in row.files]
    errors = check_config(files, merge_domains=row.merge)
    assert errors, f"{row.files} loaded but the reference rejects it"
    assert {error.file for error in errors} == {row.file}, [str(e) for e in errors]
    if row.file == "bad_yaml.yaml":
        assert any(e.message.startswith("error loading config file:") for e in errors), errors
    else:
        assert any(row.message in e.message for e in errors), [str(e) for e in errors]


def test_rejected_lines() -> None:
    """Where the reference names no line, we do; spot-check a few."""
    expected = {
        "bad_limit_unit.yaml": (
            6,
            "invalid rate limit unit 'foo'" + VALID_UNITS,
        ),
        "duplicate_key.yaml": (6, "duplicate descriptor composite key 'test-domain.key1_value1'"),
        "misspelled_key.yaml": (
            5,
            "config error, unknown key 'ratelimit'; did you mean 'rate_limit'?",
        ),
        "misspelled_key2.yaml": (
            7,
            "config error, unknown key 'requestsperunit'; did you mean 'requests_per_unit'?",
        ),
        "non_map_list.yaml": (3, "config error, yaml file contains list of type other than map: a"),
        "replaces_self.yaml": (10, "replaces should not contain name of same descriptor"),
        "replaces_empty.yaml": (10, "should not have an empty replaces entry"),
        "unlimited_with_unit.yaml": (6, "should not specify rate limit unit when unlimited"),
        "empty_key.yaml": (3, "descriptor has empty key"),
        "bad_yaml.yaml": (
            2,
            "error loading config file: invalid YAML: the quoted string that starts at line 1,"
            " column 1 is never closed",
        ),
    }
    for name, (line, message) in expected.items():
        errors = check_config([config_file(CONFIG_DIR / name)])
        assert (errors[0].file, errors[0].line, errors[0].message) == (name, line, message)


# --------------------------------------------------------------------------- (b) must load


def must_load() -> list[Path]:
    singles = [
        CONFIG_DIR / name
        for name in (
            "basic_config.yaml",
            "shadowmode_config.yaml",
            "wildcard.yaml",
            "share_threshold.yaml",
            "metadata.yaml",
        )
    ]
    examples = sorted((COMPAT / "examples" / "ratelimit" / "config").glob("*.yaml"))
    runtime = sorted((COMPAT / "test" / "integration" / "runtime").rglob("*.yaml"))
    return singles + examples + runtime


@pytest.mark.parametrize("path", must_load(), ids=lambda p: str(p.relative_to(COMPAT)))
def test_must_load(path: Path) -> None:
    assert check_config([config_file(path)]) == []
    config = load_config([config_file(path)])
    assert len(config.domains) == 1
    assert any(True for _ in config.limits())


def test_must_load_file_counts() -> None:
    assert len(must_load()) == 5 + 2 + 4


def test_merge_pair() -> None:
    domains = load_files("merge_domain_key1.yaml", "merge_domain_key2.yaml", merge=True)
    domain = domains[DOMAIN]
    assert_limit(find_limit(domain, [("key1", "value1")]), 10, Unit.MINUTE)
    assert_limit(find_limit(domain, [("key2", "value2")]), 20, Unit.MINUTE)
    without_merge = check_config(
        [
            config_file(CONFIG_DIR / "merge_domain_key1.yaml"),
            config_file(CONFIG_DIR / "merge_domain_key2.yaml"),
        ]
    )
    assert [(e.file, e.message) for e in without_merge] == [
        (
            "merge_domain_key2.yaml",
            "duplicate domain 'test-domain' in config file; first defined in "
            "merge_domain_key1.yaml:2",
        )
    ]


def test_runtime_directory_loads_together() -> None:
    from ratelimit_service.config.files import read_config_files

    files = read_config_files(COMPAT / "test" / "integration" / "runtime")
    assert [Path(f.name).name for f in files] == [
        "reload.yaml",
        "another.yaml",
        "basic.yaml",
        "share_threshold.yaml",
    ]
    config = load_config(files)
    assert sorted(config.domains) == ["another", "basic", "reload", "share-threshold-test"]
    block = find_limit(config.domains["reload"], [("block", "x")])
    assert_limit(block, 0, Unit.SECOND)
    shared = config.domains["share-threshold-test"]
    a = find_limit(shared, [("files", "files/a")])
    b = find_limit(shared, [("files", "files/b")])
    assert a is not None and b is not None and a.bucket_key == b.bucket_key
    c = find_limit(shared, [("files_no_share", "files_no_share/a")])
    d = find_limit(shared, [("files_no_share", "files_no_share/b")])
    assert c is not None and d is not None and c.bucket_key != d.bucket_key


def test_example_yaml() -> None:
    path = COMPAT / "examples" / "ratelimit" / "config" / "example.yaml"
    domain = load_config([config_file(path)]).domains["rl"]
    category = find_limit(domain, [("category", "account")])
    assert_limit(category, 4, Unit.MINUTE)
    assert category is not None
    assert category.limit.replaces == frozenset({"bkthomps", "fake_name"})
    banned = find_limit(domain, [("foo", "x"), ("bar", "banned")])
    assert_limit(banned, 0, Unit.MINUTE, name="banned_limit")
    bkthomps = find_limit(domain, [("foo", "x"), ("bar", "bkthomps")])
    assert_limit(bkthomps, 1, Unit.MINUTE, name="bkthomps")
    fake = find_limit(domain, [("source_cluster", "proxy"), ("destination_cluster", "fake")])
    assert_limit(fake, 2, Unit.MINUTE, name="fake_name")
    shady = find_limit(domain, [("foo", "x"), ("baz", "shady")])
    assert_limit(shady, 3, Unit.MINUTE, shadow=True)
    assert_limit(find_limit(domain, [("foo", "x"), ("baz", "other")]), 1, Unit.SECOND)
    assert_limit(find_limit(domain, [("foo", "x")]), 2, Unit.MINUTE)
    bay = find_limit(domain, [("foo", "x"), ("bay", "y")])
    assert bay is not None and bay.limit.unlimited
    qux = find_limit(domain, [("qux", "q")])
    assert qux is not None and qux.limit.unlimited
    unspec = find_limit(domain, [("unspec", "some")])
    assert_limit(unspec, 2, Unit.MINUTE, stats="rl.unspec_some")
    service = find_limit(domain, [("service", "service_1")])
    assert_limit(service, 1, Unit.MINUTE)
    assert service is not None
    assert service.limit.quota_mode is True
    assert service.limit.metadata == {"service_with_quota": {"name": "service_1"}}
    mongo = load_config(
        [config_file(COMPAT / "examples" / "ratelimit" / "config" / "config.yaml")]
    ).domains["mongo_cps"]
    assert_limit(find_limit(mongo, [("database", "users")]), 500, Unit.SECOND)
    assert find_limit(mongo, [("database", "other")]) is None


# --------------------------------------------------------------------------- (c) lookups


def assert_limit(
    match: Match | None,
    requests_per_unit: int,
    unit: Unit,
    *,
    stats: str | None = None,
    name: str = "",
    shadow: bool = False,
) -> None:
    assert match is not None, "expected a limit, found none"
    limit = match.limit
    assert (limit.requests_per_unit, limit.unit, limit.unlimited) == (
        requests_per_unit,
        unit,
        False,
    )
    assert limit.name == name
    assert limit.shadow_mode is shadow
    if stats is not None:
        assert match.stats_key == stats


Entries = Sequence[tuple[str, str]]
# (entries, expected): expected is None (no limit), "unlimited", or
# (requests_per_unit, unit, stats key or None, extra RateLimit fields to check).
Expectation = None | str | tuple[int, Unit, str | None, dict[str, Any]]

BASIC: list[tuple[Entries, Expectation]] = [
    ([("key1", "something")], None),
    ([("key1", "value1")], None),
    (
        [("key1", "value1"), ("subkey1", "something")],
        (5, Unit.SECOND, "test-domain.key1_value1.subkey1", {}),
    ),
    (
        [("key1", "value1"), ("subkey1", "subvalue1")],
        (10, Unit.SECOND, "test-domain.key1_value1.subkey1_subvalue1", {}),
    ),
    ([("key2", "something")], (20, Unit.MINUTE, "test-domain.key2", {})),
    ([("key2", "value2")], (30, Unit.MINUTE, "test-domain.key2_value2", {})),
    ([("key2", "value3")], None),
    ([("key2", "value2"), ("subkey", "subvalue")], None),
    ([("key3", "foo")], (1, Unit.HOUR, "test-domain.key3", {})),
    ([("key4", "foo")], (1, Unit.DAY, "test-domain.key4", {"name": "key4_rate_limit"})),
    ([("key6", "foo")], "unlimited"),
    ([("key5", "value5"), ("subkey5", "subvalue")], None),
    ([("key5", "value5")], (15, Unit.DAY, "test-domain.key5_value5", {})),
    (
        [("key5", "value5"), ("subkey5", "subvalue5")],
        (25, Unit.DAY, "test-domain.key5_value5.subkey5_subvalue5", {}),
    ),
    (
        [("key7", "unspecified_value")],
        (70, Unit.MINUTE, "test-domain.key7_unspecified_value", {"detailed_metric": True}),
    ),
    ([("key7", "other")], (70, Unit.MINUTE, "test-domain.key7_other", {})),
    ([("nokey", "x")], None),
]

SHADOW: list[tuple[Entries, Expectation]] = [
    (
        [("key1", "value1"), ("subkey1", "subvalue1")],
        (10, Unit.SECOND, "test-domain.key1_value1.subkey1_subvalue1", {"shadow_mode": True}),
    ),
    (
        [("key1", "value1"), ("subkey1", "other")],
        (5, Unit.SECOND, "test-domain.key1_value1.subkey1", {"shadow_mode": False}),
    ),
    ([("key2", "anything")], (20, Unit.MINUTE, "test-domain.key2", {"shadow_mode": True})),
    ([("key2", "value2")], (30, Unit.MINUTE, "test-domain.key2_value2", {"shadow_mode": False})),
]

WILDCARD: list[tuple[Entries, Expectation]] = [
    ([("wild", "foo1")], (20, Unit.MINUTE, "test-domain.wild_foo*", {})),
    ([("wild", "foo2")], (20, Unit.MINUTE, "test-domain.wild_foo*", {})),
    ([("wild", "foo")], (20, Unit.MINUTE, "test-domain.wild_foo*", {})),
    (
        [("nestedWild", "val1"), ("wild", "goo2")],
        (20, Unit.MINUTE, "test-domain.nestedWild_val1.wild_goo*", {}),
    ),
    ([("nestedWild", "val1"), ("wild", "foo2")], None),
    ([("wild", "bar")], None),
    ([("noWild", "foo1")], None),
    ([("noWild", "foo")], (20, Unit.MINUTE, "test-domain.noWild_foo", {})),
    ([("noVal", "foo1")], (20, Unit.MINUTE, "test-domain.noVal", {})),
    ([("midWild", "barab")], (20, Unit.MINUTE, "test-domain.midWild_bar*b", {})),
    ([("midWild", "bar123b")], (20, Unit.MINUTE, "test-domain.midWild_bar*b", {})),
    ([("midWild", "barb")], (20, Unit.MINUTE, "test-domain.midWild_bar*b", {})),
    ([("midWild", "bara")], None),
    ([("midWild", "xbarb")], None),
    (
        [("multiWild", "foo123bar456baz")],
        (10, Unit.MINUTE, "test-domain.multiWild_foo*bar*baz", {}),
    ),
    ([("multiWild", "foobarbaz")], (10, Unit.MINUTE, "test-domain.multiWild_foo*bar*baz", {})),
    ([("multiWild", "foo123baz")], None),
    ([("multiWild", "bar456baz")], None),
]

SHARE: list[tuple[Entries, Expectation]] = [
    ([("files", "files/a.pdf")], (100, Unit.MINUTE, "test-domain.files_files/*", {})),
    ([("files", "files/b.csv")], (100, Unit.MINUTE, "test-domain.files_files/*", {})),
    (
        [("route", "api/v1"), ("method", "GET")],
        (60, Unit.MINUTE, "test-domain.route_api/*.method", {}),
    ),
    (
        [("service", "svc/user"), ("endpoint", "get")],
        (80, Unit.MINUTE, "test-domain.service_svc/*.endpoint_get", {"detailed_metric": True}),
    ),
    (
        [("nested", "parent"), ("files", "nested/file1.txt")],
        (200, Unit.MINUTE, "test-domain.nested_parent.files_nested/*", {}),
    ),
    ([("file", "test1")], (50, Unit.MINUTE, "test-domain.file_test1", {})),
    ([("file", "test2")], (100, Unit.MINUTE, "test-domain.file_test*", {})),
    (
        [("files", "top/a"), ("files", "nested/b")],
        (300, Unit.MINUTE, "test-domain.files_top/*.files_nested/*", {}),
    ),
    ([("midroute", "/api/x/v2")], (80, Unit.MINUTE, "test-domain.midroute_/api*v2", {})),
    ([("midpath", "/api/x/v1")], (100, Unit.MINUTE, "test-domain.midpath_/api*v1", {})),
    ([("multiroute", "svcAepBrpc")], (50, Unit.MINUTE, "test-domain.multiroute_svc*ep*rpc", {})),
    ([("multiroute", "svcArpc")], None),
    (
        [("tenant", "t1prod"), ("resource", "res9v2")],
        (60, Unit.MINUTE, "test-domain.tenant_t*prod.resource_res*v2", {}),
    ),
    (
        [("path", "path/a"), ("file", "file/b"), ("type", "pdf")],
        (120, Unit.MINUTE, "test-domain.path_path/*.file_file/*.type", {}),
    ),
    (
        [("user", "user/1"), ("resource", "res/2"), ("action", "get")],
        (150, Unit.MINUTE, "test-domain.user_user/*.resource_res/*.action", {}),
    ),
]

LOOKUPS = [
    ("basic_config.yaml", BASIC),
    ("shadowmode_config.yaml", SHADOW),
    ("wildcard.yaml", WILDCARD),
    ("share_threshold.yaml", SHARE),
]
LOOKUP_CASES = [(name, entries, expected) for name, cases in LOOKUPS for entries, expected in cases]


@pytest.mark.parametrize(
    ("name", "entries", "expected"),
    LOOKUP_CASES,
    ids=[f"{n}-{','.join(f'{k}={v}' for k, v in e)}" for n, e, _ in LOOKUP_CASES],
)
def test_lookup(name: str, entries: Entries, expected: Expectation) -> None:
    match = find_limit(domain_of(name), entries)
    if expected is None:
        assert match is None, match
        return
    assert match is not None
    if expected == "unlimited":
        assert match.limit.unlimited is True
        return
    assert isinstance(expected, tuple)
    requests_per_unit, unit, stats, fields = expected
    assert (match.limit.requests_per_unit, match.limit.unit) == (requests_per_unit, unit)
    assert match.limit.unlimited is False
    if stats is not None:
        assert match.stats_key == stats
    for field, value in fields.items():
        assert getattr(match.limit, field) == value, field


def bucket(name: str, *entries: tuple[str, str]) -> str:
    match = find_limit(domain_of(name), list(entries))
    assert match is not None
    return match.bucket_key


def test_share_threshold_shares_one_counter() -> None:
    assert bucket("share_threshold.yaml", ("files", "files/a.pdf")) == bucket(
        "share_threshold.yaml", ("files", "files/b.csv")
    )
    assert bucket("share_threshold.yaml", ("file", "test2")) == bucket(
        "share_threshold.yaml", ("file", "test3")
    )
    assert bucket("share_threshold.yaml", ("file", "test1")) != bucket(
        "share_threshold.yaml", ("file", "test2")
    )
    nested = [
        bucket("share_threshold.yaml", ("nested", "parent"), ("files", f"nested/{leaf}"))
        for leaf in ("a", "b")
    ]
    assert nested[0] == nested[1]
    assert nested[0] != bucket("share_threshold.yaml", ("files", "files/a.pdf"))
    # path/* shares, file/* does not: the file value keeps counters apart.
    mixed = [
        bucket("share_threshold.yaml", ("path", f"path/{p}"), ("file", f"file/{f}"), ("type", "t"))
        for p, f in (("a", "x"), ("b", "x"), ("a", "y"))
    ]
    assert mixed[0] == mixed[1]
    assert mixed[0] != mixed[2]
    # The non-shared leaf value (method) still separates counters.
    assert bucket("share_threshold.yaml", ("route", "api/1"), ("method", "GET")) == bucket(
        "share_threshold.yaml", ("route", "api/2"), ("method", "GET")
    )
    assert bucket("share_threshold.yaml", ("route", "api/1"), ("method", "GET")) != bucket(
        "share_threshold.yaml", ("route", "api/1"), ("method", "PUT")
    )


def test_plain_wildcard_keeps_counters_apart() -> None:
    assert bucket("wildcard.yaml", ("wild", "foo1")) != bucket("wildcard.yaml", ("wild", "foo2"))
    assert bucket("wildcard.yaml", ("wild", "foo1")) == bucket("wildcard.yaml", ("wild", "foo1"))


def test_metadata_yaml() -> None:
    domain = domain_of("metadata.yaml")
    sub = find_limit(domain, [("key1", "value1"), ("subkey1", "x")])
    assert_limit(sub, 5, Unit.SECOND)
    assert sub is not None and sub.limit.metadata == {"name": "service_1"}
    key2 = find_limit(domain, [("key2", "x")])
    assert key2 is not None and key2.limit.metadata == {"service_with_quota": {"name": "service_2"}}
    specific = find_limit(domain, [("key1", "value1"), ("subkey1", "subvalue1")])
    assert_limit(specific, 10, Unit.SECOND)
    assert specific is not None and specific.limit.metadata is None


VALUE_TO_METRIC = """
domain: vtm
descriptors:
  - key: route
    value_to_metric: true
    descriptors:
      - key: method
        rate_limit: {unit: minute, requests_per_unit: 1}
      - key: user
        value_to_metric: true
        rate_limit: {unit: minute, requests_per_unit: 2}
  - key: wild
    value: "foo*"
    value_to_metric: true
    rate_limit: {unit: minute, requests_per_unit: 3}
  - key: plainwild
    value: "foo*"
    rate_limit: {unit: minute, requests_per_unit: 4}
  - key: exact
    value: v
    value_to_metric: true
    descriptors:
      - key: leaf
        value: "x*"
        rate_limit: {unit: minute, requests_per_unit: 5}
  - key: shared
    value: "s*"
    share_threshold: true
    value_to_metric: true
    descriptors:
      - key: child
        value_to_metric: true
        rate_limit: {unit: minute, requests_per_unit: 6}
"""


@pytest.mark.parametrize(
    ("entries", "stats"),
    [
        ([("route", "/a"), ("method", "GET")], "vtm.route_/a.method"),
        ([("route", "/a"), ("user", "bob")], "vtm.route_/a.user_bob"),
        ([("wild", "foo1")], "vtm.wild_foo1"),
        ([("plainwild", "foo1")], "vtm.plainwild_foo*"),
        ([("exact", "v"), ("leaf", "x9")], "vtm.exact_v.leaf_x*"),
        ([("shared", "s1"), ("child", "c1")], "vtm.shared_s*.child_c1"),
    ],
)
def test_value_to_metric_stats_keys(entries: Entries, stats: str) -> None:
    """value_to_metric puts the request's value in the stats key of the nodes that set it;
    share_threshold nodes keep their pattern (reference GetLimit's value_to_metric path)."""
    domain = load_config([ConfigFile("vtm.yaml", textwrap.dedent(VALUE_TO_METRIC))]).domains["vtm"]
    match = find_limit(domain, entries)
    assert match is not None
    assert match.stats_key == stats


def test_value_to_metric_empty_request_value() -> None:
    """The reference writes ``key`` alone (no ``_``) for a value_to_metric node when the
    request's value is empty."""
    domain = load_config([ConfigFile("vtm.yaml", textwrap.dedent(VALUE_TO_METRIC))]).domains["vtm"]
    match = find_limit(domain, [("route", ""), ("user", "bob")])
    assert match is not None
    assert match.stats_key == "vtm.route.user_bob"


def test_override_stats_key() -> None:
    """Per-request override stats key: the request path, ``key`` alone for empty values
    (reference descriptorKey)."""
    assert (
        override_stats_key(DOMAIN, [("key1", "value1"), ("subkey1", "something")])
        == "test-domain.key1_value1.subkey1_something"
    )
    assert override_stats_key(DOMAIN, [("a", ""), ("b", "c")]) == "test-domain.a.b_c"


# --------------------------------------------------------------------------- (d) end to end


BASIC_PATH = CONFIG_DIR / "basic_config.yaml"
SHADOW_PATH = CONFIG_DIR / "shadowmode_config.yaml"
Start = Callable[..., Any]


async def test_e2e_basic_config(start_service: Start) -> None:
    svc = await start_service(BASIC_PATH, mode=Mode.EXACT)

    unknown = await svc.call("foo_domain", [("key1", "value1")])
    assert unknown.overall_code == OK
    assert [s.code for s in unknown.statuses] == [OK]
    assert not unknown.statuses[0].HasField("current_limit")
    assert svc.service.stats.domain_not_found == {"foo_domain": 1}

    whitelisted = await svc.call("test-domain", [("key2", "value3")])
    assert whitelisted.overall_code == OK
    assert not whitelisted.statuses[0].HasField("current_limit")

    default = await svc.call("test-domain", [("key2", "something")])
    assert default.overall_code == OK
    status = default.statuses[0]
    assert status.code == OK
    assert status.HasField("current_limit")
    assert (status.current_limit.requests_per_unit, status.current_limit.unit) == (
        20,
        WIRE.MINUTE,
    )
    assert status.limit_remaining == 19

    named = await svc.call("test-domain", [("key4", "x")])
    assert named.statuses[0].current_limit.name == "key4_rate_limit"
    assert named.statuses[0].current_limit.unit == WIRE.DAY

    override = await svc.call(
        "test-domain",
        {"entries": [("key1", "value1"), ("subkey1", "something")], "limit": (10, WIRE.DAY)},
    )
    assert override.overall_code == OK
    limit = override.statuses[0].current_limit
    assert (limit.requests_per_unit, limit.unit) == (10, WIRE.DAY)
    assert override.statuses[0].limit_remaining == 9
    assert "test-domain.key1_value1.subkey1_something" in svc.service.stats.rules

    override_unknown = await svc.call(
        "foo_domain", {"entries": [("key1", "value1")], "limit": (10, WIRE.DAY)}
    )
    assert override_unknown.overall_code == OK
    assert not override_unknown.statuses[0].HasField("current_limit")

    unlimited = await svc.call("test-domain", [("key6", "anything")])
    assert unlimited.overall_code == OK
    assert unlimited.statuses[0].code == OK
    assert unlimited.statuses[0].limit_remaining == UINT32_MAX
    assert not unlimited.statuses[0].HasField("current_limit")

    hour = await svc.call("test-domain", [("key3", "a")])
    assert hour.overall_code == OK
    denied = await svc.call("test-domain", [("key3", "a")])
    assert denied.overall_code == OVER
    assert denied.statuses[0].code == OVER
    assert denied.statuses[0].current_limit.unit == WIRE.HOUR


async def test_e2e_shadow_mode(start_service: Start) -> None:
    svc = await start_service(SHADOW_PATH, mode=Mode.EXACT)

    # key2 default: 20/minute in shadow mode. 25 hits at once are over, yet reported OK.
    shadow = await svc.call("test-domain", [("key2", "anything")], hits_addend=25)
    assert shadow.overall_code == OK
    assert shadow.statuses[0].code == OK
    assert shadow.statuses[0].current_limit.requests_per_unit == 20
    assert svc.service.stats.rules["test-domain.key2"].shadow_mode == 25
    # Like the Go service, shadowed hits also count as over_limit (what enforcing would do).
    assert svc.service.stats.rules["test-domain.key2"].over_limit == 25

    # key1_value1.subkey1_subvalue1: 10/second in shadow mode.
    nested = await svc.call(
        "test-domain", [("key1", "value1"), ("subkey1", "subvalue1")], hits_addend=11
    )
    assert nested.overall_code == OK
    assert nested.statuses[0].code == OK
    key = "test-domain.key1_value1.subkey1_subvalue1"
    assert svc.service.stats.rules[key].shadow_mode == 11

    # key2_value2: 30/minute, enforced.
    within = await svc.call("test-domain", [("key2", "value2")], hits_addend=30)
    assert within.overall_code == OK
    assert within.statuses[0].limit_remaining == 0
    over = await svc.call("test-domain", [("key2", "value2")])
    assert over.overall_code == OVER
    assert over.statuses[0].code == OVER
    assert over.statuses[0].current_limit.requests_per_unit == 30
    assert svc.service.stats.rules["test-domain.key2_value2"].over_limit == 1

    # A request with an over shadow descriptor and an over enforced one is denied by
    # the enforced one only.
    both = await svc.call(
        "test-domain", {"entries": [("key2", "other")], "hits": 21}, [("key2", "value2")]
    )
    assert both.overall_code == OVER
    assert [s.code for s in both.statuses] == [OK, OVER]


@pytest.mark.slow  # starts a process
def test_check_config_cli_on_reference_directory() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATELIMIT_")}
    result = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "check-config", str(CONFIG_DIR)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr
    lines = result.stdout.splitlines()
    assert lines, result.stderr
    pattern = re.compile(r"^(?P<file>.+?):(?:(?P<line>\d+):(?:\d+:)?)? (?P<message>.+)$")
    parsed = [pattern.match(line) for line in lines]
    assert all(parsed), lines
    files = {Path(m.group("file")).name for m in parsed if m}
    for row in REJECT_ROWS:
        assert row.file in files, row.file
    for row in REJECT_ROWS:
        if row.file == "bad_yaml.yaml" or row.merge:
            continue
        assert any(
            m and Path(m.group("file")).name == row.file and row.message in m.group("message")
            for m in parsed
        ), row
    # basic_config.yaml is the first valid test-domain file, so it is the one kept.
    assert "basic_config.yaml" not in files
    assert "OK" not in result.stdout
