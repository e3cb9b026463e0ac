"""Matching of request descriptors against the rule tree, and the keys a match yields."""

from __future__ import annotations

import itertools
import textwrap

import pytest

from ratelimit_service.core import matching
from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.core.config_model import (
    DescriptorNode,
    DomainConfig,
    NodeChildren,
    WildcardPattern,
)
from ratelimit_service.core.matching import (
    Entries,
    bucket_entries,
    bucket_key,
    find_limit,
    match_nodes,
    override_bucket_key,
    override_stats_key,
)


def domain(yaml_text: str, name: str = "d") -> DomainConfig:
    config = load_config([ConfigFile("t.yaml", textwrap.dedent(yaml_text))])
    return config.domains[name]


def limit_of(config: DomainConfig, entries: Entries) -> int | None:
    match = find_limit(config, entries)
    return None if match is None else match.limit.requests_per_unit


# --------------------------------------------------------------------------- precedence

PRECEDENCE = domain(
    """
    domain: d
    descriptors:
      - key: k
        value: exact
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: k
        value: ex*
        rate_limit: {unit: second, requests_per_unit: 2}
      - key: k
        rate_limit: {unit: second, requests_per_unit: 3}
      - key: w
        value: "a*"
        rate_limit: {unit: second, requests_per_unit: 10}
      - key: w
        value: "ab*"
        rate_limit: {unit: second, requests_per_unit: 20}
      - key: v
        value: "ab*"
        rate_limit: {unit: second, requests_per_unit: 30}
      - key: v
        value: "a*"
        rate_limit: {unit: second, requests_per_unit: 40}
      - key: v
        value: "abc"
        rate_limit: {unit: second, requests_per_unit: 50}
      - key: only_wild
        value: "x*y"
        rate_limit: {unit: second, requests_per_unit: 60}
    """
)


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        # exact beats wildcard beats default
        ([("k", "exact")], 1),
        ([("k", "exactly")], 2),
        ([("k", "ex")], 2),
        ([("k", "e")], 3),
        ([("k", "other")], 3),
        ([("k", "")], 3),
        # wildcards in config order: first match wins
        ([("w", "abc")], 10),
        ([("w", "ab")], 10),
        ([("w", "a")], 10),
        ([("v", "abd")], 30),
        ([("v", "ab")], 30),
        ([("v", "axc")], 40),
        # exact beats an earlier wildcard
        ([("v", "abc")], 50),
        # no default for the key: no match
        ([("w", "b")], None),
        ([("only_wild", "xy")], 60),
        ([("only_wild", "x123y")], 60),
        ([("only_wild", "x123")], None),
        # unknown key
        ([("nope", "exact")], None),
        # wildcard of another key never applies
        ([("k2", "exact")], None),
    ],
)
def test_precedence(entries: Entries, expected: int | None) -> None:
    assert limit_of(PRECEDENCE, entries) == expected


# --------------------------------------------------------------------------- wildcards


@pytest.mark.parametrize(
    ("pattern", "value", "expected"),
    [
        # lone star
        ("*", "", True),
        ("*", "anything", True),
        ("*", "a\nb", True),
        # trailing star (prefix)
        ("abc*", "abc", True),
        ("abc*", "abcdef", True),
        ("abc*", "ab", False),
        ("abc*", "xabc", False),
        ("abc*", "ABC", False),
        # leading star (suffix)
        ("*abc", "abc", True),
        ("*abc", "xxabc", True),
        ("*abc", "abcx", False),
        ("*abc", "ab", False),
        # middle star
        ("a*c", "ac", True),
        ("a*c", "abbbc", True),
        ("a*c", "abcd", False),
        ("a*c", "xac", False),
        ("a*c", "a\nc", True),
        # several stars
        ("a*b*c", "abc", True),
        ("a*b*c", "aXbYc", True),
        ("a*b*c", "acb", False),
        ("a*b*c", "aXbYcZ", False),
        ("*b*", "b", True),
        ("*b*", "xxbyy", True),
        ("*b*", "xxyy", False),
        ("**", "", True),
        ("a**", "a", True),
        ("a**", "ba", False),
        # regex metacharacters are literal
        ("a.b*", "axb1", False),
        ("a.b*", "a.b1", True),
        ("a.b*c", "axbc", False),
        ("a.b*c", "a.bc", True),
        ("(x)*", "(x)y", True),
        ("(x)*", "xy", False),
        ("a+*", "aa", False),
        ("a+*", "a+", True),
        ("[ab]*z", "az", False),
        ("[ab]*z", "[ab]z", True),
        ("^a*$", "^ab$", True),
        ("^a*$", "ab", False),
        ("a?*", "ab", False),
        ("a?*", "a?b", True),
        ("a\\d*", "a1", False),
        ("a\\d*", "a\\d1", True),
        ("a|b*", "a", False),
        ("a|b*", "a|bc", True),
        ("*.*", "ab", False),
        ("*.*", "a.b", True),
        ("{1}*", "{1}", True),
        ("x{2}*", "xx", False),
    ],
)
def test_wildcard_pattern(pattern: str, value: str, expected: bool) -> None:
    assert WildcardPattern(pattern).matches(value) is expected


WILDCARD_TREE = domain(
    """
    domain: d
    descriptors:
      - key: p
        value: "a.b*"
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: p
        value: "*.json"
        rate_limit: {unit: second, requests_per_unit: 2}
      - key: p
        value: "/api/*/users/*"
        rate_limit: {unit: second, requests_per_unit: 3}
      - key: p
        value: "*"
        rate_limit: {unit: second, requests_per_unit: 4}
    """
)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a.b1", 1),
        ("axb1", 4),
        ("x.json", 2),
        ("xjson", 4),
        ("/api/v1/users/7", 3),
        ("/api/v1/users", 4),
        ("", 4),
    ],
)
def test_wildcards_anywhere_in_config(value: str, expected: int) -> None:
    assert limit_of(WILDCARD_TREE, [("p", value)]) == expected


# --------------------------------------------------------------------------- depth

DEPTH = domain(
    """
    domain: d
    descriptors:
      - key: a
        rate_limit: {unit: second, requests_per_unit: 1}
        descriptors:
          - key: b
            rate_limit: {unit: second, requests_per_unit: 2}
            descriptors:
              - key: c
                value: z
                rate_limit: {unit: second, requests_per_unit: 3}
      - key: n
        descriptors:
          - key: m
            rate_limit: {unit: second, requests_per_unit: 4}
          - key: empty
    """
)


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([("a", "1")], 1),
        ([("a", "1"), ("b", "2")], 2),
        ([("a", "1"), ("b", "2"), ("c", "z")], 3),
        ([("a", "1"), ("b", "2"), ("c", "y")], None),
        # deeper than the config
        ([("a", "1"), ("b", "2"), ("c", "z"), ("d", "1")], None),
        ([("a", "1"), ("b", "2"), ("c", "z"), ("c", "z")], None),
        # shorter than the config, on a node without a limit
        ([("n", "1")], None),
        ([("n", "1"), ("m", "1")], 4),
        ([("n", "1"), ("empty", "1")], None),
        # a key that only exists below the root
        ([("b", "1")], None),
        ([("a", "1"), ("x", "1")], None),
        # order matters
        ([("b", "2"), ("a", "1")], None),
        ([], None),
    ],
)
def test_limit_only_on_last_entry(entries: Entries, expected: int | None) -> None:
    assert limit_of(DEPTH, entries) == expected


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        ([("a", "1")], ["d.a"]),
        ([("a", "1"), ("b", "2")], ["d.a", "d.a.b"]),
        ([("a", "1"), ("b", "2"), ("c", "z")], ["d.a", "d.a.b", "d.a.b.c_z"]),
        ([("n", "1")], ["d.n"]),
        ([("a", "1"), ("x", "1")], None),
        ([("a", "1"), ("b", "2"), ("c", "z"), ("d", "1")], None),
        ([], []),
    ],
)
def test_match_nodes_paths(entries: Entries, expected: list[str] | None) -> None:
    path = match_nodes(DEPTH, entries)
    if expected is None:
        assert path is None
    else:
        assert path is not None
        assert [node.config_path for node in path] == expected


# --------------------------------------------------------------------------- stats keys

STATS = domain(
    """
    domain: d
    descriptors:
      - key: plain
        value: v
        descriptors:
          - key: user
            rate_limit: {unit: second, requests_per_unit: 1}
      - key: wild
        value: "/w/*"
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: detailed
        descriptors:
          - key: path
            value: "/api/*"
            detailed_metric: true
            rate_limit: {unit: second, requests_per_unit: 1}
      - key: shared
        value: "/s/*"
        share_threshold: true
        detailed_metric: true
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: sharedplain
        value: "/sp/*"
        share_threshold: true
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: vtm
        value_to_metric: true
        descriptors:
          - key: user
            rate_limit: {unit: second, requests_per_unit: 1}
      - key: vtmleaf
        descriptors:
          - key: user
            value_to_metric: true
            rate_limit: {unit: second, requests_per_unit: 1}
      - key: vtmshare
        value: "/x/*"
        share_threshold: true
        value_to_metric: true
        descriptors:
          - key: user
            value_to_metric: true
            rate_limit: {unit: second, requests_per_unit: 1}
    """
)


@pytest.mark.parametrize(
    ("entries", "expected"),
    [
        # config path
        ([("plain", "v"), ("user", "u1")], "d.plain_v.user"),
        ([("plain", "v"), ("user", "u2")], "d.plain_v.user"),
        ([("wild", "/w/abc")], "d.wild_/w/*"),
        # detailed_metric: the request path
        ([("detailed", "x"), ("path", "/api/users")], "d.detailed_x.path_/api/users"),
        ([("detailed", "y"), ("path", "/api/")], "d.detailed_y.path_/api/"),
        # an empty value shows as the bare key, as the Go service writes it
        ([("detailed", ""), ("path", "/api/x")], "d.detailed.path_/api/x"),
        # detailed_metric on a share_threshold node keeps the pattern
        ([("shared", "/s/abc")], "d.shared_/s/*"),
        ([("sharedplain", "/sp/abc")], "d.sharedplain_/sp/*"),
        # value_to_metric: the value of the flagged nodes only
        ([("vtm", "a"), ("user", "u1")], "d.vtm_a.user"),
        ([("vtm", ""), ("user", "u1")], "d.vtm.user"),
        ([("vtmleaf", "a"), ("user", "u1")], "d.vtmleaf.user_u1"),
        # value_to_metric on a share_threshold node keeps the pattern
        ([("vtmshare", "/x/1"), ("user", "u1")], "d.vtmshare_/x/*.user_u1"),
    ],
)
def test_stats_key(entries: Entries, expected: str) -> None:
    match = find_limit(STATS, entries)
    assert match is not None
    assert match.stats_key == expected


def test_override_stats_key_is_request_path() -> None:
    entries = [("a", "1"), ("b", "x.y")]
    assert override_stats_key("d", entries) == "d.a_1.b_x.y"
    assert override_stats_key("d", [("a", ""), ("b", "2")]) == "d.a.b_2"


# --------------------------------------------------------------------------- bucket keys


def bucket_of(config: DomainConfig, entries: Entries) -> str:
    match = find_limit(config, entries)
    assert match is not None, entries
    return match.bucket_key


def test_bucket_keys_distinct_per_value() -> None:
    keys = {bucket_of(STATS, [("plain", "v"), ("user", f"u{i}")]) for i in range(50)}
    assert len(keys) == 50
    wild = {bucket_of(STATS, [("wild", f"/w/{i}")]) for i in range(20)}
    assert len(wild) == 20
    assert not keys & wild


def test_share_threshold_shares_one_bucket() -> None:
    shared = {bucket_of(STATS, [("shared", f"/s/{i}")]) for i in range(20)}
    assert len(shared) == 1
    other = bucket_of(STATS, [("sharedplain", "/sp/1")])
    assert other == bucket_of(STATS, [("sharedplain", "/sp/2")])
    assert other not in shared
    # the shared node keeps one counter while the child below it still splits by value
    nested = {bucket_of(STATS, [("vtmshare", f"/x/{i}"), ("user", "u")]) for i in range(5)}
    assert len(nested) == 1
    users = {bucket_of(STATS, [("vtmshare", "/x/1"), ("user", f"u{i}")]) for i in range(5)}
    assert len(users) == 5


def test_underscore_joining_does_not_collide() -> None:
    config = domain(
        """
        domain: d
        descriptors:
          - key: a
            rate_limit: {unit: second, requests_per_unit: 1}
          - key: a_b
            rate_limit: {unit: second, requests_per_unit: 1}
        """
    )
    left = bucket_of(config, [("a", "b_c")])
    right = bucket_of(config, [("a_b", "c")])
    assert left != right


SEPARATORS = domain(
    """
    domain: d
    descriptors:
      - key: k
        rate_limit: {unit: second, requests_per_unit: 1}
        descriptors:
          - key: k2
            rate_limit: {unit: second, requests_per_unit: 1}
    """
)


def test_separator_characters_do_not_collide() -> None:
    one_entry = bucket_of(SEPARATORS, [("k", "v\x1fk2\x1ev2")])
    two_entries = bucket_of(SEPARATORS, [("k", "v"), ("k2", "v2")])
    assert one_entry != two_entries
    assert bucket_of(SEPARATORS, [("k", "a\\rb")]) != bucket_of(SEPARATORS, [("k", "a\x1eb")])
    assert bucket_of(SEPARATORS, [("k", "a\\ub")]) != bucket_of(SEPARATORS, [("k", "a\x1fb")])
    assert bucket_of(SEPARATORS, [("k", "a\\\\")]) != bucket_of(SEPARATORS, [("k", "a\\")])


ALPHABET = ("a", "\\", "\x1e", "\x1f", "r", "u")


def _values(max_length: int) -> list[str]:
    return [
        "".join(chars)
        for length in range(max_length + 1)
        for chars in itertools.product(ALPHABET, repeat=length)
    ]


def test_bucket_key_is_injective_over_tricky_values() -> None:
    values = _values(4)
    single = [bucket_of(SEPARATORS, [("k", value)]) for value in values]
    assert len(set(single)) == len(values)
    pairs = list(itertools.product(_values(2), repeat=2))
    double = [bucket_of(SEPARATORS, [("k", a), ("k2", b)]) for a, b in pairs]
    assert len(set(double)) == len(pairs)
    assert not set(single) & set(double)


def test_override_bucket_key_is_injective_over_tricky_entries() -> None:
    texts = _values(2)
    lists: list[tuple[tuple[str, str], ...]] = [((k, v),) for k in texts for v in texts]
    lists += [((k, "x"), (k2, v)) for k in texts for k2 in texts[:10] for v in texts[:10]]
    keys = [override_bucket_key("d", entries) for entries in lists]
    assert len(set(keys)) == len(lists)


def test_bucket_key_matches_function_of_path() -> None:
    entries = [("k", "v"), ("k2", "w")]
    path = match_nodes(SEPARATORS, entries)
    assert path is not None
    # find_limit's key is the function's, plus the window (a counter is per unit too).
    assert bucket_key("d", path, entries) + "\x1f1" == bucket_of(SEPARATORS, entries)
    # the domain is part of the identity
    assert bucket_key("d", path, entries) != bucket_key("e", path, entries)


def test_an_rlqs_bucket_is_matched_by_one_try_per_key_not_per_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every bucket of every RLQS report is put in the rules' order: the work per bucket
    does not grow with the values the rules list (a thousand tenants), matched or not."""
    values = "".join(
        f"  - {{key: tenant, value: t{n}, rate_limit: {{unit: second, requests_per_unit: 5}}}}\n"
        for n in range(1000)
    )
    path = "  - {key: path, rate_limit: {unit: second, requests_per_unit: 9}}\n"
    text = f"domain: d\ndescriptors:\n{values}{path}"
    rules = load_config([ConfigFile("t.yaml", text)]).domains["d"]
    tries: list[str] = []
    child = matching._child

    def counted(children: NodeChildren, key: str, value: str) -> DescriptorNode | None:
        tries.append(key)
        return child(children, key, value)

    monkeypatch.setattr(matching, "_child", counted)
    for bucket, entries in (
        ({"tenant": "t999"}, (("tenant", "t999"),)),
        ({"tenant": "nobody"}, (("tenant", "nobody"),)),  # no rule: the key goes last
        ({"path": "/x", "zone": "z"}, (("path", "/x"), ("zone", "z"))),
    ):
        tries.clear()
        assert bucket_entries(rules, bucket) == entries
        assert len(tries) <= len(bucket), (bucket, len(tries))
