"""The YAML loader, the file reader and ``check-config``, on fixtures written for this project.

Every error test pins the file name, the 1-based line and the message text, because
``check-config`` prints exactly ``<file>:<line>: <message>`` and users act on that.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ratelimit_service.cli.main import main as cli_main
from ratelimit_service.config.files import config_paths, read_config_files
from ratelimit_service.core.config_errors import ConfigError, ConfigLoadError
from ratelimit_service.core.config_loader import UNIT_NAMES, ConfigFile, check_config, load_config
from ratelimit_service.core.config_model import (
    DomainConfig,
    FailureMode,
    Mode,
    OverLimitAnswer,
    RateLimit,
    RateLimitConfig,
)
from ratelimit_service.core.matching import find_limit
from ratelimit_service.core.units import UNIT_SECONDS, Unit

VALID_UNITS = f"; valid units: {UNIT_NAMES}"

NAME = "rules.yaml"
ErrorTuple = tuple[str, int | None, str]


def y(text: str) -> str:
    """Dedent a YAML snippet so that its first line is line 1."""
    return textwrap.dedent(text).lstrip("\n")


def errors_of(text: str, name: str = NAME, *, merge: bool = False) -> list[ErrorTuple]:
    found = check_config([ConfigFile(name, y(text))], merge_domains=merge)
    return [(e.file, e.line, e.message) for e in found]


def load_one(text: str, **kwargs: object) -> DomainConfig:
    config = load_config([ConfigFile(NAME, y(text))], **kwargs)  # type: ignore[arg-type]
    assert len(config.domains) == 1
    return next(iter(config.domains.values()))


def limit_at(domain: DomainConfig, *entries: tuple[str, str]) -> RateLimit:
    match = find_limit(domain, list(entries))
    assert match is not None, f"no limit for {entries}"
    return match.limit


# --------------------------------------------------------------------------- error type


def test_config_error_str_with_and_without_line() -> None:
    assert str(ConfigError("a.yaml", 3, "boom")) == "a.yaml:3: boom"
    assert str(ConfigError("a.yaml", None, "boom")) == "a.yaml: boom"
    exc = ConfigLoadError([ConfigError("a.yaml", 1, "x"), ConfigError("b.yaml", None, "y")])
    assert str(exc) == "a.yaml:1: x\nb.yaml: y"
    assert [e.file for e in exc.errors] == ["a.yaml", "b.yaml"]


def test_load_config_raises_with_every_error() -> None:
    with pytest.raises(ConfigLoadError) as info:
        load_config([ConfigFile("a.yaml", "domain: ''\n"), ConfigFile("b.yaml", "- x\n")])
    assert [str(e) for e in info.value.errors] == [
        "a.yaml:1: config file cannot have empty domain",
        "b.yaml:1: expected a mapping, found a list",
    ]


# --------------------------------------------------------------------------- bad YAML


@pytest.mark.parametrize(
    ("text", "line", "column", "message"),
    [
        (
            'domain: "unterminated\n',
            2,
            1,
            "the quoted string that starts at line 1, column 9 is never closed",
        ),
        (
            "domain: d\n  bad: indent\n",
            2,
            6,
            "unexpected ':'; a value that contains ': ' needs quotes, and a key must line up"
            " with the keys above it",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    value: [a, b\n",
            5,
            1,
            "the list opened with '[' at line 4, column 12 is not closed with ']'",
        ),
        ("\tdomain: d\n", 1, 1, "a tab character; YAML indents with spaces only"),
    ],
)
def test_bad_yaml(text: str, line: int, column: int, message: str) -> None:
    errors = check_config([ConfigFile("broken.yaml", text)])
    assert [(e.file, e.line, e.column, e.message) for e in errors] == [
        ("broken.yaml", line, column, f"error loading config file: invalid YAML: {message}")
    ]
    assert str(errors[0]).startswith(f"broken.yaml:{line}:{column}: error loading config file:")


# --------------------------------------------------------------------------- domain


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("", None),
        ("# only a comment\n", None),
        ("descriptors:\n", 1),
        ("# comment first\ndescriptors: []\n", 2),
        ("domain: ''\n", 1),
        ("domain:\ndescriptors: []\n", 1),
        ("descriptors: []\ndomain: ''\n", 2),
    ],
)
def test_empty_or_missing_domain(text: str, line: int | None) -> None:
    assert errors_of(text) == [(NAME, line, "config file cannot have empty domain")]


def test_top_level_must_be_a_mapping() -> None:
    assert errors_of("- domain: d\n") == [(NAME, 1, "expected a mapping, found a list")]
    assert errors_of("just text\n") == [(NAME, 1, "expected a mapping, found 'just text'")]


def test_duplicate_domain_across_two_files() -> None:
    first = ConfigFile(
        "a.yaml",
        y("""
        domain: shared
        descriptors:
          - key: k1
            rate_limit: {unit: second, requests_per_unit: 1}
        """),
    )
    second = ConfigFile(
        "b.yaml",
        y("""
        # the same domain again
        domain: shared
        descriptors:
          - key: k2
            rate_limit: {unit: second, requests_per_unit: 2}
        """),
    )
    errors = check_config([first, second])
    assert [(e.file, e.line, e.message) for e in errors] == [
        ("b.yaml", 2, "duplicate domain 'shared' in config file; first defined in a.yaml:1")
    ]
    with pytest.raises(ConfigLoadError):
        load_config([first, second])
    merged = load_config([first, second], merge_domains=True)
    assert list(merged.domains) == ["shared"]
    domain = merged.domains["shared"]
    assert limit_at(domain, ("k1", "x")).requests_per_unit == 1
    assert limit_at(domain, ("k2", "x")).requests_per_unit == 2
    assert limit_at(domain, ("k2", "x")).source == "b.yaml:5"
    assert check_config([first, second], merge_domains=True) == []


def test_different_domains_in_several_files_load_without_merge() -> None:
    config = load_config(
        [ConfigFile("a.yaml", "domain: one\n"), ConfigFile("b.yaml", "domain: two\n")]
    )
    assert sorted(config.domains) == ["one", "two"]
    assert config.domains["two"].source == "b.yaml"


MERGE_BASE = """
domain: shared
descriptors:
  - key: k1
    rate_limit: {unit: second, requests_per_unit: 1}
"""
MERGE_DUPLICATE = """
domain: shared
descriptors:
  - key: k2
    rate_limit: {unit: second, requests_per_unit: 2}
  - key: k1
    rate_limit: {unit: second, requests_per_unit: 3}
"""


def test_merged_duplicate_key_still_errors() -> None:
    files = [ConfigFile("a.yaml", y(MERGE_BASE)), ConfigFile("b.yaml", y(MERGE_DUPLICATE))]
    errors = check_config(files, merge_domains=True)
    assert [(e.file, e.message) for e in errors] == [
        ("b.yaml", "duplicate descriptor composite key 'shared.k1'")
    ]


def test_merged_duplicate_key_error_names_its_line() -> None:
    files = [ConfigFile("a.yaml", y(MERGE_BASE)), ConfigFile("b.yaml", y(MERGE_DUPLICATE))]
    errors = check_config(files, merge_domains=True)
    assert [str(e) for e in errors] == ["b.yaml:5: duplicate descriptor composite key 'shared.k1'"]


# --------------------------------------------------------------------------- keys


def test_missing_key() -> None:
    text = """
        domain: d
        descriptors:
          - value: v
            rate_limit: {unit: second, requests_per_unit: 1}
        """
    assert errors_of(text) == [(NAME, 3, "descriptor has empty key")]


def test_empty_key_string() -> None:
    text = """
        domain: d
        descriptors:
          - value: v
          - key: ''
            value: w
        """
    assert errors_of(text) == [
        (NAME, 3, "descriptor has empty key"),
        (NAME, 4, "descriptor has empty key"),
    ]


@pytest.mark.parametrize(
    ("entries", "path"),
    [
        ("{key: k, value: v}", "d.k_v"),
        ("{key: k}", "d.k"),
        ("{key: k, value: 'a*'}", "d.k_a*"),
        ("{key: k, value: 'a*b*c'}", "d.k_a*b*c"),
    ],
    ids=["exact", "default", "wildcard", "multi-wildcard"],
)
def test_duplicate_composite_key(entries: str, path: str) -> None:
    text = f"""
        domain: d
        descriptors:
          - {entries}
          - {entries}
        """
    assert errors_of(text) == [(NAME, 4, f"duplicate descriptor composite key '{path}'")]


def test_duplicate_composite_key_nested_and_empty_value_is_default() -> None:
    text = """
        domain: d
        descriptors:
          - key: a
            value: b
            descriptors:
              - key: c
              - key: c
                value: ''
        """
    assert errors_of(text) == [(NAME, 7, "duplicate descriptor composite key 'd.a_b.c'")]


def test_same_key_with_different_values_is_not_a_duplicate() -> None:
    domain = load_one("""
        domain: d
        descriptors:
          - {key: k, rate_limit: {unit: second, requests_per_unit: 1}}
          - {key: k, value: v, rate_limit: {unit: second, requests_per_unit: 2}}
          - {key: k, value: 'v*', rate_limit: {unit: second, requests_per_unit: 3}}
          - {key: k, value: 'w*', rate_limit: {unit: second, requests_per_unit: 4}}
          - {key: j, value: v, rate_limit: {unit: second, requests_per_unit: 5}}
        """)
    assert limit_at(domain, ("k", "other")).requests_per_unit == 1
    assert limit_at(domain, ("k", "v")).requests_per_unit == 2
    assert limit_at(domain, ("k", "v1")).requests_per_unit == 3
    assert limit_at(domain, ("k", "w1")).requests_per_unit == 4
    assert limit_at(domain, ("j", "v")).requests_per_unit == 5
    assert len(domain.root) == 5


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    ("rate_limit", "line", "message"),
    [
        (
            "{unit: fortnight, requests_per_unit: 1}",
            4,
            "invalid rate limit unit 'fortnight'" + VALID_UNITS,
        ),
        (
            "{unit: unknown, requests_per_unit: 1}",
            4,
            "invalid rate limit unit 'unknown'" + VALID_UNITS,
        ),
        (
            "{unit: 5, requests_per_unit: 1}",
            4,
            "invalid rate limit unit '5'" + VALID_UNITS,
        ),
        (
            "{unit: '', requests_per_unit: 1}",
            4,
            "invalid rate limit unit ''" + VALID_UNITS,
        ),
        (
            "{requests_per_unit: 1}",
            4,
            "invalid rate limit unit ''" + VALID_UNITS,
        ),
        (
            "{}",
            4,
            "invalid rate limit unit ''" + VALID_UNITS,
        ),
    ],
)
def test_invalid_rate_limit_unit(rate_limit: str, line: int, message: str) -> None:
    text = f"""
        domain: d
        descriptors:
          - key: k
            rate_limit: {rate_limit}
        """
    assert errors_of(text) == [(NAME, line, message)]


def test_invalid_unit_in_block_mapping_points_at_unit_line() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              requests_per_unit: 5
              unit: secnd
          - key: j
            rate_limit:
              requests_per_unit: 5
        """
    assert errors_of(text) == [
        (
            NAME,
            6,
            "invalid rate limit unit 'secnd'" + VALID_UNITS,
        ),
        (
            NAME,
            9,
            "invalid rate limit unit ''" + VALID_UNITS,
        ),
    ]


@pytest.mark.parametrize(
    ("text", "unit"),
    [
        ("second", Unit.SECOND),
        ("SECOND", Unit.SECOND),
        ("Minute", Unit.MINUTE),
        ("hour", Unit.HOUR),
        ("hOuR", Unit.HOUR),
        ("day", Unit.DAY),
        ("week", Unit.WEEK),
        ("WEEK", Unit.WEEK),
        ("month", Unit.MONTH),
        ("year", Unit.YEAR),
        ("Year", Unit.YEAR),
    ],
)
def test_every_unit_case_insensitive(text: str, unit: Unit) -> None:
    domain = load_one(f"""
        domain: d
        descriptors:
          - key: k
            rate_limit: {{unit: {text}, requests_per_unit: 7}}
        """)
    limit = limit_at(domain, ("k", "v"))
    assert limit.unit is unit
    assert limit.requests_per_unit == 7
    assert limit.window_seconds == UNIT_SECONDS[unit]


def test_unit_window_lengths() -> None:
    assert {u.name: UNIT_SECONDS[u] for u in Unit} == {
        "SECOND": 1,
        "MINUTE": 60,
        "HOUR": 3600,
        "DAY": 86400,
        "WEEK": 604800,
        "MONTH": 2592000,
        "YEAR": 31536000,
    }


def test_unlimited_with_unit_is_rejected() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unlimited: true
              unit: day
              requests_per_unit: 25
        """
    assert errors_of(text) == [(NAME, 6, "should not specify rate limit unit when unlimited")]


def test_unlimited_without_unit_loads() -> None:
    domain = load_one("""
        domain: d
        descriptors:
          - key: k
            rate_limit: {unlimited: true}
        """)
    limit = limit_at(domain, ("k", "v"))
    assert limit.unlimited is True
    assert limit.requests_per_unit == 0


# --------------------------------------------------------------------------- replaces


def test_replaces_self() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              name: me
              replaces:
                - name: other
                - name: me
              unit: second
              requests_per_unit: 5
        """
    assert errors_of(text) == [(NAME, 8, "replaces should not contain name of same descriptor")]


@pytest.mark.parametrize("entry", ["- name:", "- name: ''", "- {}"])
def test_empty_replaces_entry(entry: str) -> None:
    text = f"""
        domain: d
        descriptors:
          - key: k
            rate_limit:
              name: me
              unit: second
              replaces:
                {entry}
        """
    assert errors_of(text) == [(NAME, 8, "should not have an empty replaces entry")]


# --------------------------------------------------------------------------- unknown keys


def test_unknown_key_at_top_level() -> None:
    text = """
        domain: d
        descriptor:
          - key: k
        """
    assert errors_of(text) == [
        (NAME, 2, "config error, unknown key 'descriptor'; did you mean 'descriptors'?")
    ]


def test_misspelled_domain_reports_unknown_key_and_empty_domain() -> None:
    assert errors_of("domian: d\n") == [
        (NAME, 1, "config error, unknown key 'domian'; did you mean 'domain'?"),
        (NAME, 1, "config file cannot have empty domain"),
    ]


def test_unknown_key_in_descriptor() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            value: v
            ratelimit:
              unit: day
              requests_per_unit: 5
        """
    assert errors_of(text) == [
        (NAME, 5, "config error, unknown key 'ratelimit'; did you mean 'rate_limit'?")
    ]


def test_unknown_key_in_nested_descriptor() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            descriptors:
              - key: s
                shadowmode: true
        """
    assert errors_of(text) == [
        (NAME, 6, "config error, unknown key 'shadowmode'; did you mean 'shadow_mode'?")
    ]


def test_unknown_key_in_rate_limit() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: day
              requestsperunit: 5
        """
    assert errors_of(text) == [
        (NAME, 6, "config error, unknown key 'requestsperunit'; did you mean 'requests_per_unit'?")
    ]


def test_unknown_key_in_replaces_entry() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: day
              replaces:
                - name: a
                  nmae: b
        """
    assert errors_of(text) == [(NAME, 8, "config error, unknown key 'nmae'; did you mean 'name'?")]


def test_mode_is_not_a_rate_limit_key() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            rate_limit: {unit: day, mode: exact}
        """
    assert errors_of(text) == [(NAME, 4, "config error, unknown key 'mode'")]


# --------------------------------------------------------------------------- key types


@pytest.mark.parametrize(("key", "shown"), [("0.25", "0.25"), ("1", "1"), ("true", "true")])
def test_non_string_key_at_top_level(key: str, shown: str) -> None:
    errors = errors_of(f"domain: d\n{key}: x\n")
    assert errors == [(NAME, 2, f"config error, key is not of type string: {shown}")]


def test_non_string_key_in_descriptor() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            7: x
        """
    assert errors_of(text) == [(NAME, 4, "config error, key is not of type string: 7")]


def test_list_of_non_map() -> None:
    text = """
        domain: d
        descriptors:
          - a
          - key: fine
          - 5
        """
    assert errors_of(text) == [
        (NAME, 3, "config error, yaml file contains list of type other than map: a"),
        (NAME, 5, "config error, yaml file contains list of type other than map: 5"),
    ]


def test_list_of_lists_message_shows_yaml_values() -> None:
    text = """
        domain: d
        descriptors:
          - [a, b]
        """
    [(file, line, message)] = errors_of(text)
    assert (file, line) == (NAME, 3)
    assert message.startswith("config error, yaml file contains list of type other than map: ")
    shown = message.rsplit(": ", 1)[1]
    assert "Node" not in shown and "tag:yaml.org" not in shown, message
    assert "a" in shown and "b" in shown


def test_descriptors_must_be_a_list() -> None:
    text = """
        domain: d
        descriptors:
          key: k
        """
    assert errors_of(text) == [(NAME, 3, "'descriptors' must be a list, found a mapping")]


def test_key_and_value_must_be_scalars() -> None:
    text = """
        domain: d
        descriptors:
          - key: [a]
          - key: k
            value: 1.5
          - key: j
            value: {a: 1}
        """
    assert errors_of(text) == [
        (NAME, 3, "'key' must be a string, found a list"),
        (NAME, 3, "descriptor has empty key"),
        (NAME, 5, "'value' must be a string, found 1.5"),
        (NAME, 7, "'value' must be a string, found a mapping"),
    ]


# --------------------------------------------------------------------------- share_threshold


def test_share_threshold_requires_a_wildcard() -> None:
    text = """
        domain: d
        descriptors:
          - key: files
            value: docs
            share_threshold: true
            rate_limit: {unit: minute, requests_per_unit: 10}
          - key: other
            share_threshold: true
        """
    assert errors_of(text) == [
        (
            NAME,
            5,
            "share_threshold can only be used with wildcard values (containing '*'), "
            "but found key 'files_docs'",
        ),
        (
            NAME,
            8,
            "share_threshold can only be used with wildcard values (containing '*'), "
            "but found key 'other'",
        ),
    ]


def test_share_threshold_with_wildcard_anywhere_loads() -> None:
    domain = load_one("""
        domain: d
        descriptors:
          - {key: a, value: 'x*', share_threshold: true, rate_limit: {unit: minute}}
          - {key: b, value: '*y', share_threshold: true, rate_limit: {unit: minute}}
          - {key: c, value: 'p*q', share_threshold: false, rate_limit: {unit: minute}}
          - {key: e, value: plain, share_threshold: false, rate_limit: {unit: minute}}
        """)
    shared = {node.key: node.share_threshold for node in domain.root}
    assert shared == {"a": True, "b": True, "c": False, "e": False}


# --------------------------------------------------------------------------- requests_per_unit


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("1.5", "1.5"),
        ("-1", "-1"),
        ("4294967296", "4294967296"),
        ("'5'", "'5'"),
        ('"10"', "'10'"),
        ("true", "true"),
        ("[1]", "a list"),
    ],
)
def test_bad_requests_per_unit(value: str, shown: str) -> None:
    text = f"""
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: {value}
        """
    assert errors_of(text) == [
        (NAME, 6, f"requests_per_unit must be an integer from 0 to 4294967295, found {shown}")
    ]


@pytest.mark.parametrize(("value", "expected"), [("0", 0), ("4294967295", 4294967295), ("", 0)])
def test_requests_per_unit_bounds_accepted(value: str, expected: int) -> None:
    domain = load_one(f"""
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              requests_per_unit: {value}
        """)
    assert limit_at(domain, ("k", "v")).requests_per_unit == expected


# --------------------------------------------------------------------------- flags


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [
        ("shadow_mode", "1", "1"),
        ("shadow_mode", "'true'", "'true'"),
        ("quota_mode", "maybe", "'maybe'"),
        ("detailed_metric", "2", "2"),
        ("value_to_metric", "[]", "a list"),
    ],
)
def test_non_bool_flags(field: str, value: str, shown: str) -> None:
    text = f"""
        domain: d
        descriptors:
          - key: k
            {field}: {value}
            rate_limit: {{unit: second, requests_per_unit: 1}}
        """
    assert errors_of(text) == [(NAME, 4, f"'{field}' must be true or false, found {shown}")]


@pytest.mark.parametrize(
    ("field", "value", "shown"),
    [("shadow_mode", "'true'", "'true'"), ("quota_mode", "3", "3")],
)
def test_non_bool_flags_rejected_without_rate_limit(field: str, value: str, shown: str) -> None:
    """A malformed flag is a config error whether or not the descriptor has a limit
    (the reference rejects it while unmarshalling, before looking at rate_limit)."""
    text = f"""
        domain: d
        descriptors:
          - key: k
            {field}: {value}
            descriptors:
              - key: s
                rate_limit: {{unit: second, requests_per_unit: 1}}
        """
    assert errors_of(text) == [(NAME, 4, f"'{field}' must be true or false, found {shown}")]


def test_non_bool_unlimited() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            rate_limit: {unlimited: 'yes'}
        """
    errors = errors_of(text)
    assert errors[0] == (NAME, 4, "'unlimited' must be true or false, found 'yes'")
    # A malformed flag counts as "not unlimited", so the missing unit is reported as well.
    assert errors[1:] == [
        (
            NAME,
            4,
            "invalid rate limit unit ''" + VALID_UNITS,
        )
    ]


# --------------------------------------------------------------------------- mode / failure_mode


@pytest.mark.parametrize(
    ("text", "line", "message"),
    [
        ("domain: d\nmode: fast\n", 2, "invalid mode 'fast' (exact or probabilistic)"),
        ("domain: d\nfailure_mode: maybe\n", 2, "invalid failure_mode 'maybe' (open or closed)"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    mode: 5\n",
            4,
            "invalid mode '5' (exact or probabilistic)",
        ),
        (
            "domain: d\ndescriptors:\n  - key: k\n    descriptors:\n"
            "      - key: s\n        failure_mode: shut\n",
            6,
            "invalid failure_mode 'shut' (open or closed)",
        ),
        ("domain: d\nmode: [exact]\n", 2, "'mode' must be a string, found a list"),
    ],
)
def test_invalid_mode_and_failure_mode(text: str, line: int, message: str) -> None:
    assert check_config([ConfigFile(NAME, text)]) == [ConfigError(NAME, line, message)]


INHERIT = """
domain: d
mode: exact
failure_mode: closed
descriptors:
  - key: a
    rate_limit: {unit: second, requests_per_unit: 1}
    descriptors:
      - key: a1
        rate_limit: {unit: second, requests_per_unit: 1}
  - key: b
    mode: Probabilistic
    rate_limit: {unit: second, requests_per_unit: 1}
    descriptors:
      - key: b1
        rate_limit: {unit: second, requests_per_unit: 1}
      - key: b2
        mode: EXACT
        failure_mode: open
        rate_limit: {unit: second, requests_per_unit: 1}
        descriptors:
          - key: b21
            rate_limit: {unit: second, requests_per_unit: 1}
  - key: c
    failure_mode: OPEN
    descriptors:
      - key: c1
        rate_limit: {unit: second, requests_per_unit: 1}
"""


def test_mode_and_failure_mode_inheritance() -> None:
    domain = load_one(INHERIT)

    def modes(*keys: str) -> tuple[Mode, FailureMode]:
        limit = limit_at(domain, *((key, "v") for key in keys))
        return limit.mode, limit.failure_mode

    assert modes("a") == (Mode.EXACT, FailureMode.CLOSED)
    assert modes("a", "a1") == (Mode.EXACT, FailureMode.CLOSED)
    assert modes("b") == (Mode.PROBABILISTIC, FailureMode.CLOSED)
    assert modes("b", "b1") == (Mode.PROBABILISTIC, FailureMode.CLOSED)
    assert modes("b", "b2") == (Mode.EXACT, FailureMode.OPEN)
    assert modes("b", "b2", "b21") == (Mode.EXACT, FailureMode.OPEN)
    assert modes("c", "c1") == (Mode.EXACT, FailureMode.OPEN)


def test_default_mode_argument_applies_only_to_rules_without_a_mode() -> None:
    text = """
        domain: d
        descriptors:
          - key: plain
            rate_limit: {unit: second, requests_per_unit: 1}
          - key: declared
            mode: probabilistic
            failure_mode: open
            rate_limit: {unit: second, requests_per_unit: 1}
        """
    default = load_one(text)
    assert limit_at(default, ("plain", "v")).mode is Mode.PROBABILISTIC
    assert limit_at(default, ("plain", "v")).failure_mode is FailureMode.OPEN
    exact = load_one(text, default_mode=Mode.EXACT, default_failure_mode=FailureMode.CLOSED)
    assert limit_at(exact, ("plain", "v")).mode is Mode.EXACT
    assert limit_at(exact, ("plain", "v")).failure_mode is FailureMode.CLOSED
    assert limit_at(exact, ("declared", "v")).mode is Mode.PROBABILISTIC
    assert limit_at(exact, ("declared", "v")).failure_mode is FailureMode.OPEN


def test_domain_mode_overrides_default_mode_argument() -> None:
    domain = load_one(
        """
        domain: d
        mode: probabilistic
        descriptors:
          - key: k
            rate_limit: {unit: second, requests_per_unit: 1}
        """,
        default_mode=Mode.EXACT,
    )
    assert limit_at(domain, ("k", "v")).mode is Mode.PROBABILISTIC


# --------------------------------------------------------------------------- metadata


@pytest.mark.parametrize(("value", "line"), [("[a, b]", 5), ("just text", 5), ("7", 5)])
def test_metadata_must_be_a_mapping(value: str, line: int) -> None:
    text = f"""
        domain: d
        descriptors:
          - key: k
            rate_limit: {{unit: second, requests_per_unit: 1}}
            metadata: {value}
        """
    assert errors_of(text) == [(NAME, line, "error parsing metadata: 'metadata' must be a mapping")]


def test_metadata_must_be_a_mapping_without_rate_limit() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            metadata: [a, b]
        """
    assert errors_of(text) == [(NAME, 4, "error parsing metadata: 'metadata' must be a mapping")]


def test_metadata_mapping_is_kept() -> None:
    domain = load_one("""
        domain: d
        descriptors:
          - key: k
            rate_limit: {unit: second, requests_per_unit: 1}
            metadata:
              owner: {name: team-a, tier: 2}
              tags: [x, y]
          - key: j
            rate_limit: {unit: second, requests_per_unit: 1}
        """)
    assert limit_at(domain, ("k", "v")).metadata == {
        "owner": {"name": "team-a", "tier": 2},
        "tags": ["x", "y"],
    }
    assert limit_at(domain, ("j", "v")).metadata is None


# --------------------------------------------------------------------------- YAML structure


def test_multiple_yaml_documents() -> None:
    text = """
        domain: a
        descriptors: []
        ---
        domain: b
        """
    assert errors_of(text) == [(NAME, 4, "config file must hold one YAML document, found several")]


def test_leading_document_marker_is_one_document() -> None:
    domain = load_one("""
        ---
        domain: d
        descriptors:
          - key: k
            rate_limit: {unit: second, requests_per_unit: 3}
        """)
    assert domain.name == "d"
    assert limit_at(domain, ("k", "v")).requests_per_unit == 3


@pytest.mark.parametrize(
    ("text", "line", "key"),
    [
        ("domain: a\ndomain: b\n", 2, "domain"),
        ("domain: d\ndescriptors:\n  - key: k\n    value: a\n    value: b\n", 5, "value"),
        (
            "domain: d\ndescriptors:\n  - key: k\n    rate_limit:\n      unit: day\n"
            "      requests_per_unit: 1\n      unit: hour\n",
            7,
            "unit",
        ),
    ],
)
def test_duplicate_yaml_key_in_one_mapping(text: str, line: int, key: str) -> None:
    assert check_config([ConfigFile(NAME, text)]) == [
        ConfigError(NAME, line, f"config error, duplicate key '{key}'")
    ]


def test_several_errors_in_one_file_reported_in_one_pass() -> None:
    text = """
        domain: d
        mode: sometimes
        descriptors:
          - key: a
            rate_limit: {unit: lightyear, requests_per_unit: 1}
          - value: no-key
          - key: b
            rate_limit:
              unit: second
              requests_per_unit: -3
          - key: c
            bogus: 1
          - key: c
          - key: e
            rate_limit: {unit: minute, requests_per_unit: 1}
            descriptors:
              - key: f
                rate_limit: {unlimited: true, unit: hour}
        """
    assert errors_of(text, "many.yaml") == [
        ("many.yaml", 2, "invalid mode 'sometimes' (exact or probabilistic)"),
        (
            "many.yaml",
            5,
            "invalid rate limit unit 'lightyear'" + VALID_UNITS,
        ),
        ("many.yaml", 6, "descriptor has empty key"),
        (
            "many.yaml",
            10,
            "requests_per_unit must be an integer from 0 to 4294967295, found -3",
        ),
        ("many.yaml", 12, "config error, unknown key 'bogus'"),
        ("many.yaml", 13, "duplicate descriptor composite key 'd.c'"),
        ("many.yaml", 18, "should not specify rate limit unit when unlimited"),
    ]


def test_errors_in_several_files_reported_together() -> None:
    files = [
        ConfigFile("one.yaml", "domain: ''\n"),
        ConfigFile("two.yaml", "domain: ok\n"),
        ConfigFile("three.yaml", "domain: x\ndescriptors:\n  - key: k\n    rate_limit: {}\n"),
    ]
    assert [str(e) for e in check_config(files)] == [
        "one.yaml:1: config file cannot have empty domain",
        "three.yaml:4: invalid rate limit unit ''" + VALID_UNITS,
    ]


# --------------------------------------------------------------------------- positive cases


NESTED = """
domain: dom
descriptors:
  - key: key1
    value: value1
    descriptors:
      - key: subkey1
        rate_limit: {unit: second, requests_per_unit: 5}
        descriptors:
          - key: deep
            value: d1
            rate_limit: {unit: hour, requests_per_unit: 9}
      - key: subkey1
        value: subvalue1
        rate_limit: {unit: second, requests_per_unit: 10}
  - key: key2
    rate_limit: {unit: minute, requests_per_unit: 20}
"""


def test_nested_descriptors_and_stats_keys() -> None:
    domain = load_one(NESTED)
    assert domain.name == "dom"
    assert domain.source == NAME
    sub = find_limit(domain, [("key1", "value1"), ("subkey1", "anything")])
    assert sub is not None
    assert (sub.limit.requests_per_unit, sub.limit.unit) == (5, Unit.SECOND)
    assert sub.limit.stats_key == "dom.key1_value1.subkey1"
    assert sub.stats_key == "dom.key1_value1.subkey1"
    specific = find_limit(domain, [("key1", "value1"), ("subkey1", "subvalue1")])
    assert specific is not None
    assert specific.limit.requests_per_unit == 10
    assert specific.stats_key == "dom.key1_value1.subkey1_subvalue1"
    deep = find_limit(domain, [("key1", "value1"), ("subkey1", "x"), ("deep", "d1")])
    assert deep is not None
    assert (deep.limit.requests_per_unit, deep.limit.unit) == (9, Unit.HOUR)
    assert deep.stats_key == "dom.key1_value1.subkey1.deep_d1"
    assert find_limit(domain, [("key1", "value1")]) is None
    assert find_limit(domain, [("key1", "other"), ("subkey1", "x")]) is None
    assert find_limit(domain, [("key2", "v"), ("more", "x")]) is None
    key1 = domain.root.exact[("key1", "value1")]
    assert key1.limits == ()
    assert key1.config_path == "dom.key1_value1"
    assert sorted(n.config_path for n in key1.children) == [
        "dom.key1_value1.subkey1",
        "dom.key1_value1.subkey1_subvalue1",
    ]


def test_valueless_default_keys() -> None:
    domain = load_one("""
        domain: d
        descriptors:
          - key: k
            rate_limit: {unit: minute, requests_per_unit: 20}
          - key: j
            value:
            rate_limit: {unit: minute, requests_per_unit: 21}
        """)
    assert set(domain.root.defaults) == {"k", "j"}
    assert not domain.root.exact and not domain.root.wildcards
    node = domain.root.defaults["k"]
    assert node.value is None
    assert node.stats_element() == "k"
    assert limit_at(domain, ("k", "anything")).requests_per_unit == 20
    assert limit_at(domain, ("j", "")).requests_per_unit == 21


@pytest.mark.parametrize(
    ("pattern", "matching", "not_matching"),
    [
        ("*", ["", "x", "anything/at/all"], []),
        ("foo*", ["foo", "foo1", "foo/bar"], ["fo", "xfoo"]),
        ("*bar", ["bar", "xbar", "a/b/bar"], ["barx", "ba"]),
        ("a*z", ["az", "abz", "a/x/z"], ["a", "z", "aza", "xaz"]),
        ("a*b*c", ["abc", "a1b2c", "abbc"], ["ac", "a1c", "bc", "abcx"]),
        ("*mid*", ["mid", "xmidy"], ["mi", "md"]),
        ("a.b*", ["a.b", "a.bc"], ["axb", "axbc"]),
        ("(x)*[y]", ["(x)[y]", "(x)..[y]"], ["x[y]", "(x)y"]),
    ],
)
def test_wildcards_anywhere(pattern: str, matching: list[str], not_matching: list[str]) -> None:
    domain = load_one(f"""
        domain: d
        descriptors:
          - key: k
            value: '{pattern}'
            rate_limit: {{unit: minute, requests_per_unit: 4}}
        """)
    [node] = domain.root.wildcards
    assert node.value == pattern
    assert node.config_path == f"d.k_{pattern}"
    for value in matching:
        match = find_limit(domain, [("k", value)])
        assert match is not None, value
        assert match.stats_key == f"d.k_{pattern}"
    for value in not_matching:
        assert find_limit(domain, [("k", value)]) is None, value


def test_exact_beats_wildcard_beats_default_and_first_wildcard_wins() -> None:
    domain = load_one("""
        domain: d
        descriptors:
          - {key: k, rate_limit: {unit: minute, requests_per_unit: 1}}
          - {key: k, value: 'ab*', rate_limit: {unit: minute, requests_per_unit: 2}}
          - {key: k, value: 'a*', rate_limit: {unit: minute, requests_per_unit: 3}}
          - {key: k, value: abc, rate_limit: {unit: minute, requests_per_unit: 4}}
        """)
    assert limit_at(domain, ("k", "abc")).requests_per_unit == 4
    assert limit_at(domain, ("k", "abd")).requests_per_unit == 2
    assert limit_at(domain, ("k", "ax")).requests_per_unit == 3
    assert limit_at(domain, ("k", "zzz")).requests_per_unit == 1


def test_rate_limit_fields() -> None:
    domain = load_one("""
        domain: dom
        descriptors:
          - key: key1
            value: value1
            descriptors:
              - key: subkey1
                shadow_mode: true
                quota_mode: true
                detailed_metric: true
                rate_limit:
                  name: sub-limit
                  unit: hour
                  requests_per_unit: 12
                  replaces:
                    - name: first
                    - name: second
          - key: plain
            rate_limit: {unit: day, requests_per_unit: 3}
        """)
    limit = limit_at(domain, ("key1", "value1"), ("subkey1", "x"))
    assert limit == RateLimit(
        requests_per_unit=12,
        unit=Unit.HOUR,
        name="sub-limit",
        unlimited=False,
        replaces=frozenset({"first", "second"}),
        shadow_mode=True,
        quota_mode=True,
        detailed_metric=True,
        mode=Mode.PROBABILISTIC,
        failure_mode=FailureMode.OPEN,
        stats_key="dom.key1_value1.subkey1",
        metadata=None,
        source=f"{NAME}:11",
    )
    plain = limit_at(domain, ("plain", "x"))
    assert (plain.name, plain.replaces, plain.shadow_mode, plain.quota_mode) == (
        "",
        frozenset(),
        False,
        False,
    )
    assert (plain.detailed_metric, plain.unlimited, plain.stats_key) == (False, False, "dom.plain")


def test_replaces_with_other_names_loads() -> None:
    domain = load_one("""
        domain: d
        descriptors:
          - key: k
            rate_limit:
              unit: second
              replaces: [{name: 5}, {name: other}]
          - key: j
            rate_limit: {unit: second, replaces: []}
        """)
    assert limit_at(domain, ("k", "v")).replaces == frozenset({"5", "other"})
    assert limit_at(domain, ("j", "v")).replaces == frozenset()


def test_integer_and_bool_scalars_are_key_and_value_text() -> None:
    config = load_config(
        [
            ConfigFile(
                NAME,
                y("""
        domain: 123
        descriptors:
          - key: 42
            value: true
            rate_limit: {unit: second, requests_per_unit: 1}
          - key: port
            value: 0010
            rate_limit: {unit: second, requests_per_unit: 2}
          - key: flag
            value: yes
            rate_limit: {unit: second, requests_per_unit: 3}
          - key: true
            value: 7
            rate_limit: {unit: second, requests_per_unit: 4}
        """),
            )
        ]
    )
    assert list(config.domains) == ["123"]
    domain = config.domains["123"]
    first = find_limit(domain, [("42", "true")])
    assert first is not None
    assert first.limit.requests_per_unit == 1
    assert first.stats_key == "123.42_true"
    assert limit_at(domain, ("port", "0010")).requests_per_unit == 2
    assert find_limit(domain, [("port", "8")]) is None
    assert limit_at(domain, ("flag", "yes")).requests_per_unit == 3
    assert limit_at(domain, ("true", "7")).requests_per_unit == 4


@pytest.mark.parametrize("descriptors", ["descriptors: []", "descriptors:", ""])
def test_empty_descriptors(descriptors: str) -> None:
    domain = load_one(f"domain: empty\n{descriptors}\n")
    assert domain.name == "empty"
    assert len(domain.root) == 0
    assert find_limit(domain, [("k", "v")]) is None


def test_anchors_and_aliases_are_followed() -> None:
    domain = load_one("""
        domain: d
        descriptors:
          - key: a
            rate_limit: &shared {unit: minute, requests_per_unit: 6}
          - key: b
            rate_limit: *shared
        """)
    assert limit_at(domain, ("b", "v")).requests_per_unit == 6
    assert limit_at(domain, ("b", "v")).stats_key == "d.b"


def test_dump() -> None:
    config = load_config(
        [
            ConfigFile(
                "b.yaml",
                y("""
            domain: beta
            mode: exact
            descriptors:
              - key: k
                value: v
                shadow_mode: true
                rate_limit: {unit: minute, requests_per_unit: 5, name: lim}
              - key: u
                rate_limit: {unlimited: true}
            """),
            ),
            ConfigFile(
                "a.yaml",
                y("""
            domain: alpha
            failure_mode: closed
            descriptors:
              - key: q
                quota_mode: true
                rate_limit: {unit: day, requests_per_unit: 2}
                descriptors:
                  - key: s
                    rate_limit: {unit: week, requests_per_unit: 1}
            """),
            ),
        ]
    )
    assert config.dump() == (
        "alpha.q: unit=DAY requests_per_unit=2, mode=probabilistic, failure_mode=closed,"
        " quota_mode\n"
        "alpha.q.s: unit=WEEK requests_per_unit=1, mode=probabilistic, failure_mode=closed\n"
        "beta.k_v: unit=MINUTE requests_per_unit=5, mode=exact, failure_mode=open,"
        " shadow_mode, name=lim\n"
        "beta.u: unlimited, mode=exact, failure_mode=open\n"
    )
    assert sorted(limit.stats_key for limit in config.limits()) == [
        "alpha.q",
        "alpha.q.s",
        "beta.k_v",
        "beta.u",
    ]
    assert RateLimitConfig(domains={}).dump() == ""


# --------------------------------------------------------------------------- rate_limit forms


def test_empty_rate_limit_means_no_limit() -> None:
    """``rate_limit:`` with nothing under it is a null, which the reference reads as no
    limit (a nil pointer), so the descriptor loads as a whitelisting node."""
    domain = load_one("""
        domain: d
        descriptors:
          - key: k
            value: open
            rate_limit:
          - key: k
            rate_limit: {unit: second, requests_per_unit: 1}
        """)
    assert find_limit(domain, [("k", "open")]) is None
    assert limit_at(domain, ("k", "other")).requests_per_unit == 1


def test_rate_limit_that_is_not_a_mapping() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            rate_limit: [unit, second]
        """
    assert errors_of(text) == [(NAME, 4, "expected a mapping, found a list")]


# --------------------------------------------------------------------------- config_source


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_read_config_files_walks_directory_sorted(tmp_path: Path) -> None:
    root = tmp_path / "cfg"
    _write(root / "b.yaml", "domain: b\n")
    _write(root / "a.yml", "domain: a\n")
    _write(root / "c.json", "{}")
    _write(root / "notes.txt", "x")
    _write(root / ".hidden.yaml", "domain: hidden\n")
    _write(root / "sub" / "z.yaml", "domain: z\n")
    _write(root / "sub" / "deeper" / "y.yaml", "domain: y\n")
    _write(root / "aaa" / "m.yaml", "domain: m\n")
    _write(root / ".git" / "x.yaml", "domain: git\n")
    _write(root / "sub" / ".cache" / "w.yaml", "domain: cache\n")
    files = read_config_files(root)
    assert [Path(f.name).relative_to(root).as_posix() for f in files] == [
        "a.yml",
        "b.yaml",
        "aaa/m.yaml",
        "sub/z.yaml",
        "sub/deeper/y.yaml",
    ]
    assert files[1] == ConfigFile(str(root / "b.yaml"), "domain: b\n")
    config = load_config(files)
    assert sorted(config.domains) == ["a", "b", "m", "y", "z"]
    # A string path works the same way.
    assert [f.name for f in read_config_files(str(root))] == [f.name for f in files]


def test_read_config_files_single_file(tmp_path: Path) -> None:
    path = _write(tmp_path / "one.yaml", "domain: one\n")
    _write(tmp_path / "two.yaml", "domain: two\n")
    assert read_config_files(path) == [ConfigFile(str(path), "domain: one\n")]


def test_kubernetes_configmap_layout_loads_each_file_once(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    version = volume / "..2024_01_01_00_00_00.123456789"
    _write(version / "first.yaml", "domain: first\n")
    _write(version / "second.yml", "domain: second\n")
    (volume / "..data").symlink_to(version.name)
    (volume / "first.yaml").symlink_to(Path("..data") / "first.yaml")
    (volume / "second.yml").symlink_to(Path("..data") / "second.yml")
    files = read_config_files(volume)
    assert [Path(f.name).name for f in files] == ["first.yaml", "second.yml"]
    assert [f.name for f in files] == [str(volume / "first.yaml"), str(volume / "second.yml")]
    assert [f.text for f in files] == ["domain: first\n", "domain: second\n"]
    config = load_config(files)
    assert sorted(config.domains) == ["first", "second"]


def test_symlinked_subdirectory_is_followed(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    _write(elsewhere / "x.yaml", "domain: x\n")
    root = tmp_path / "cfg"
    root.mkdir()
    (root / "linked").symlink_to(elsewhere, target_is_directory=True)
    assert [p.relative_to(root).as_posix() for p in config_paths(root)] == ["linked/x.yaml"]


def test_missing_path_is_an_error_naming_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ConfigLoadError) as info:
        read_config_files(missing)
    assert info.value.errors == (ConfigError(str(missing), None, "no such file or directory"),)
    assert str(info.value) == f"{missing}: no such file or directory"


def test_empty_directory_gives_no_files(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    assert read_config_files(tmp_path / "empty") == []


def test_undecodable_file_is_an_error(tmp_path: Path) -> None:
    bad = tmp_path / "cfg" / "bad.yaml"
    bad.parent.mkdir()
    bad.write_bytes(b"domain: \xff\xfe\n")
    with pytest.raises(ConfigLoadError) as info:
        read_config_files(bad.parent)
    [error] = info.value.errors
    assert (error.file, error.line) == (str(bad), None)
    assert error.message.startswith("cannot read file:")


# --------------------------------------------------------------------------- check-config CLI


VALID = """
domain: good
descriptors:
  - key: k
    rate_limit: {unit: second, requests_per_unit: 1}
"""
INVALID = """
domain: bad
descriptors:
  - key: k
    rate_limit: {unit: parsec, requests_per_unit: 1}
  - key: k
"""


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("RATELIMIT_"):
            monkeypatch.delenv(name)


@pytest.mark.usefixtures("clean_env")
def test_cli_check_config_ok(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cfg"
    _write(root / "a.yaml", y(VALID))
    _write(root / "nested" / "b.yaml", "domain: other\n")
    assert cli_main(["check-config", str(root)]) == 0
    captured = capsys.readouterr()
    assert captured.out == f"{root}: OK (2 files)\n"
    assert "OK" in captured.out
    single = root / "a.yaml"
    assert cli_main(["check-config", str(single)]) == 0
    assert capsys.readouterr().out == f"{single}: OK (1 file)\n"


@pytest.mark.usefixtures("clean_env")
def test_cli_check_config_invalid(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cfg"
    good = _write(root / "a.yaml", y(VALID))
    bad = _write(root / "b.yaml", y(INVALID))
    dup = _write(root / "c.yaml", "# again\ndomain: good\n")
    assert good.exists()
    assert cli_main(["check-config", str(root)]) == 1
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"{bad}:4: invalid rate limit unit 'parsec'" + VALID_UNITS,
        f"{bad}:5: duplicate descriptor composite key 'bad.k'",
        f"{dup}:2: duplicate domain 'good' in config file; first defined in {good}:1",
    ]
    assert "OK" not in out


@pytest.mark.usefixtures("clean_env")
def test_cli_check_config_merge_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "cfg"
    _write(root / "a.yaml", "domain: same\ndescriptors: [{key: a}]\n")
    second = _write(root / "b.yaml", "domain: same\ndescriptors: [{key: b}]\n")
    assert cli_main(["check-config", str(root)]) == 1
    first = root / "a.yaml"
    assert capsys.readouterr().out == (
        f"{second}:1: duplicate domain 'same' in config file; first defined in {first}:1\n"
    )
    assert cli_main(["check-config", "--merge-domain-config", str(root)]) == 0
    assert capsys.readouterr().out == f"{root}: OK (2 files)\n"


@pytest.mark.usefixtures("clean_env")
def test_cli_check_config_missing_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "absent"
    assert cli_main(["check-config", str(missing)]) == 1
    assert capsys.readouterr().out == f"{missing}: no such file or directory\n"


@pytest.mark.usefixtures("clean_env")
def test_cli_check_config_needs_a_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check-config"]) == 2
    assert "PATH" in capsys.readouterr().err


@pytest.mark.slow  # starts a process
def test_cli_check_config_subprocess(tmp_path: Path) -> None:
    root = tmp_path / "cfg"
    _write(root / "ok.yaml", y(VALID))
    bad = _write(root / "zz.yaml", "domain: ''\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RATELIMIT_")}
    command = [sys.executable, "-m", "ratelimit_service", "check-config"]
    failed = subprocess.run(
        [*command, str(root)], capture_output=True, text=True, env=env, timeout=60
    )
    assert failed.returncode == 1, failed.stderr
    assert failed.stdout == f"{bad}:1: config file cannot have empty domain\n"
    passed = subprocess.run(
        [*command, str(root / "ok.yaml")], capture_output=True, text=True, env=env, timeout=60
    )
    assert passed.returncode == 0, passed.stderr
    assert passed.stdout == f"{root / 'ok.yaml'}: OK (1 file)\n"


# --------------------------------------------------------------------------- over_limit


def test_over_limit_body_and_content_type_reach_every_limit_of_the_descriptor() -> None:
    domain = load_one(
        """
        domain: ai
        descriptors:
          - key: tenant
            over_limit:
              content_type: application/json; charset=utf-8
              body: '{"error": {"type": "tokens", "message": "budget spent"}}'
            rate_limits:
              - {unit: minute, requests_per_unit: 6000}
              - {unit: month, requests_per_unit: 1000000}
          - key: user
            rate_limit: {unit: minute, requests_per_unit: 5}
        """
    )
    answer = OverLimitAnswer(
        b'{"error": {"type": "tokens", "message": "budget spent"}}',
        "application/json; charset=utf-8",
    )
    tenant = domain.root.defaults["tenant"]
    assert [limit.over_limit for limit in tenant.limits] == [answer, answer]
    assert limit_at(domain, ("user", "u")).over_limit is None


@pytest.mark.parametrize(
    ("over_limit", "line", "message"),
    [
        ("{content_type: text/plain}", 4, "over_limit needs a non-empty 'body'"),
        ("{body: ''}", 4, "over_limit needs a non-empty 'body'"),
        ("{body: x, content_type: json}", 4,
         "over_limit content_type 'json' is not a media type (e.g. application/json)"),
        ("{body: x, content_type: \"text/plain\\r\\nx-a: b\"}", 4,
         "over_limit content_type 'text/plain\r\nx-a: b' is not a media type"
         " (e.g. application/json)"),
        (f"{{body: {'x' * 16385}}}", 4, "over_limit body is 16385 bytes; at most 16384"),
        ("[x]", 4, "expected a mapping, found a list"),
    ],
)  # fmt: skip
def test_over_limit_errors_name_the_line(over_limit: str, line: int, message: str) -> None:
    text = f"""
        domain: d
        descriptors:
          - key: k
            over_limit: {over_limit}
            rate_limit: {{unit: second, requests_per_unit: 1}}
        """
    assert errors_of(text) == [(NAME, line, message)]


def test_a_misspelt_over_limit_key_is_named_with_a_suggestion() -> None:
    text = """
        domain: d
        descriptors:
          - key: k
            over_limit: {bodyy: x}
            rate_limit: {unit: second, requests_per_unit: 1}
        """
    assert errors_of(text) == [
        (NAME, 4, "config error, unknown key 'bodyy'; did you mean 'body'?"),
        (NAME, 4, "over_limit needs a non-empty 'body'"),
    ]


# --------------------------------------------------------------------------- calendar


def test_calendar_rules_carry_their_time_zone() -> None:
    domain = load_one(
        """
        domain: ai
        descriptors:
          - key: tenant
            rate_limits:
              - {unit: minute, requests_per_unit: 6000}
              - {unit: month, requests_per_unit: 1000000, calendar: Europe/Paris}
          - key: team
            mode: exact
            rate_limit: {unit: day, requests_per_unit: 50000, calendar: UTC}
        """
    )
    per_minute, per_month = domain.root.defaults["tenant"].limits
    assert (per_minute.calendar, per_month.calendar) == (None, "Europe/Paris")
    # A calendar budget keeps the mode it inherits (probabilistic by default) or declares.
    assert (per_minute.mode, per_month.mode) == (Mode.PROBABILISTIC, Mode.PROBABILISTIC)
    team = limit_at(domain, ("team", "t"))
    assert (team.calendar, team.mode) == ("UTC", Mode.EXACT)


@pytest.mark.parametrize(
    ("rate_limit", "message"),
    [
        ("{unit: month, requests_per_unit: 5, calendar: Europe/Pari}",
         "unknown time zone 'Europe/Pari'; did you mean 'Europe/Paris'?"),
        ("{unit: minute, requests_per_unit: 5, calendar: UTC}",
         "calendar needs unit day, week, month or year, found minute"),
        ("{unit: day, unit_multiplier: 2, requests_per_unit: 5, calendar: UTC}",
         "a calendar period is one unit long: drop unit_multiplier"),
        ("{unlimited: true, calendar: UTC}", "calendar has no place beside unlimited"),
        ("{unit: day, requests_per_unit: 5, calendar: }",
         "calendar needs a time zone (e.g. UTC or Europe/Paris)"),
        ("{unit: day, requests_per_unit: 5, calendar: [UTC]}",
         "'calendar' must be a string, found a list"),
        ("{unit: day, requests_per_unit: 5, burst: 2, calendar: UTC}",
         "burst has no place beside calendar: a calendar budget holds its whole limit"
         " from the start of its period"),
    ],
)  # fmt: skip
def test_calendar_errors_name_the_line(rate_limit: str, message: str) -> None:
    text = f"""
        domain: d
        descriptors:
          - key: k
            rate_limit: {rate_limit}
        """
    assert errors_of(text) == [(NAME, 4, message)]


# --------------------------------------------------------------------------- usage


def test_usage_names_where_envoy_reads_a_cost() -> None:
    domain = load_one(
        """
        domain: ai
        descriptors:
          - key: tenant
            usage: {from_header: x-tokens}
            rate_limit: {unit: minute, requests_per_unit: 6000}
          - key: model
            usage: {from_metadata: {namespace: io.envoy.ai_gateway, key: llm_total_token}}
            rate_limit: {unit: minute, requests_per_unit: 6000}
        """
    )
    header = limit_at(domain, ("tenant", "t")).usage
    metadata = limit_at(domain, ("model", "m")).usage
    assert header is not None and header.hits_format == "%RESP(x-tokens)%"
    assert metadata is not None
    assert metadata.hits_format == "%DYNAMIC_METADATA(io.envoy.ai_gateway:llm_total_token)%"


@pytest.mark.parametrize(
    ("usage", "message"),
    [
        ("{from_header: X-Tokens}",
         "usage from_header 'X-Tokens' is not a header name in lower case (e.g. x-tokens)"),
        ("{from_header: x-tokens, from_metadata: {namespace: a, key: b}}",
         "usage takes one of from_header or from_metadata"),
        ("{from_metadata: {namespace: 'a:b', key: c}}",
         "usage from_metadata needs a namespace (no ':') and a key"
         " (e.g. {namespace: io.envoy.ai_gateway, key: llm_total_token})"),
        ("{from_metadata: {namespace: a}}",
         "usage from_metadata needs a namespace (no ':') and a key"
         " (e.g. {namespace: io.envoy.ai_gateway, key: llm_total_token})"),
        ("{}", "usage takes one of from_header or from_metadata"),
    ],
)  # fmt: skip
def test_usage_errors_name_the_line(usage: str, message: str) -> None:
    text = f"""
        domain: d
        descriptors:
          - key: k
            usage: {usage}
            rate_limit: {{unit: second, requests_per_unit: 1}}
        """
    assert errors_of(text) == [(NAME, 4, message)]
