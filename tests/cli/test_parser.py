"""The parser reads core/settings_table.py: serve's flags, their defaults, help, groups
and choices are the declarations', parsing no flag gives Settings' defaults, and
envoy-config's defaults are EnvoyOptions'. docs/settings.md's table is the table's
(tests/test_docs.py holds the README's synopsis to the parser)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ratelimit_service.cli.envoy_plan import DEFAULT_OPTIONS
from ratelimit_service.cli.parser import build_parser
from ratelimit_service.cli.serve import settings_from
from ratelimit_service.core.settings_table import (
    BY_FLAG,
    GROUPS,
    SETTINGS,
    markdown_table,
)
from ratelimit_service.server.settings import Settings

REPO = Path(__file__).resolve().parents[2]
NOT_FLAGS = {"xds", "header_names", "shutdown_grace"}
"""Settings fields that no single flag fills: the xDS client's own settings, the three
header names, and the grace after draining (fixed)."""


@pytest.fixture(autouse=True)
def _no_ratelimit_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each flag's default is the declared one, not a RATELIMIT_* variable's."""
    for name in [n for n in os.environ if n.startswith("RATELIMIT_")]:
        monkeypatch.delenv(name)


def _serve() -> argparse.ArgumentParser:
    commands = build_parser()._subparsers._group_actions[0]  # type: ignore[union-attr]
    serve: argparse.ArgumentParser = commands.choices["serve"]
    return serve


def _action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser._actions if flag in a.option_strings)


def test_every_settings_field_is_filled_by_one_flag() -> None:
    fills = [s.fills for s in SETTINGS if s.fills is not None]
    assert len(fills) == len(set(fills))
    fields = {f.name for f in dataclasses.fields(Settings)}
    assert sorted(fields - set(fills) - NOT_FLAGS) == []
    assert sorted(set(fills) - fields) == []


def test_serve_with_no_flag_gives_the_declared_defaults() -> None:
    args = build_parser().parse_args(["serve", "--config", "config/"])
    settings = settings_from(args)
    assert settings == dataclasses.replace(Settings(), config_path="config/")


def test_serve_flags_take_default_help_and_choices_from_the_table() -> None:
    serve = _serve()
    for setting in SETTINGS:
        action = _action(serve, setting.flag)
        if setting.hidden:
            assert action.help == argparse.SUPPRESS
            continue
        assert action.help is not None and action.help.startswith(setting.help), setting.flag
        assert setting.env in action.help, setting.flag
        if setting.switch:
            assert action.default is False, setting.flag
            continue
        assert action.default == setting.default, setting.flag
        assert action.choices == (None if setting.choices is None else list(setting.choices))


def test_serve_flags_parse_with_the_declared_parser() -> None:
    """A value on the command line is the declaration's parser's: a URL normalized, a
    bad number refused with the parser's message."""
    args = build_parser().parse_args(["serve", "--redis-url", "r:6379", "--workers", "2"])
    assert (args.redis_url, args.workers) == ("redis://r:6379", 2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--near-limit-ratio", "2"])


def test_envoy_config_flags_default_to_the_renderers_options() -> None:
    args = build_parser().parse_args(["envoy-config", "--config", "x"])
    assert (args.domain, args.cluster, args.timeout) == (
        DEFAULT_OPTIONS.domain,
        DEFAULT_OPTIONS.cluster,
        DEFAULT_OPTIONS.timeout,
    )
    assert (args.service_address, args.listen, args.admin_address) == (
        DEFAULT_OPTIONS.service_address,
        DEFAULT_OPTIONS.listen,
        DEFAULT_OPTIONS.admin,
    )
    assert (args.upstream_address, args.node_id) == (
        DEFAULT_OPTIONS.upstream_address,
        DEFAULT_OPTIONS.node_id,
    )


@pytest.mark.slow  # starts a process
def test_every_declared_setting_is_a_flag_of_serve_in_its_group() -> None:
    text = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "serve", "--config", "x", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    titles = [line[:-1] for line in text.splitlines() if line.endswith(":") and line[0] != " "]
    assert titles[-len(GROUPS) :] == list(GROUPS)
    for setting in SETTINGS:
        if not setting.hidden:
            assert f"  {setting.flag}" in text, setting.flag
            assert setting.env in text.replace("\n", " ").replace("  ", ""), setting.flag


def test_docs_settings_table_is_the_declared_one() -> None:
    text = (REPO / "docs" / "settings.md").read_text()
    start = text.index("\n", text.index("<!-- generated from")) + 1
    end = text.index("<!-- end of generated table -->")
    assert text[start:end] == markdown_table(), (
        "docs/settings.md is out of date: paste core.settings_table.markdown_table()"
    )


@pytest.mark.parametrize("flag", ["--redis-timeout", "--drain-timeout", "--mode"])
def test_help_shows_the_declared_default(flag: str) -> None:
    action = _action(_serve(), flag)
    assert action.help is not None
    assert f"default: {BY_FLAG[flag].default}" in action.help


def _help(*command: str) -> str:
    return subprocess.run(
        [sys.executable, "-m", "ratelimit_service", *command, "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.mark.slow  # starts a process
def test_version_and_plain_help_with_defaults_for_every_command() -> None:
    version = subprocess.run(
        [sys.executable, "-m", "ratelimit_service", "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert re.fullmatch(r"ratelimit-service \d+\.\d+\.\d+\n", version)
    envoy = " ".join(_help("envoy-config").split())
    assert "Envoy cluster name (default: ratelimit)" in envoy
    assert "the filter's timeout (default: 0.02s)" in envoy
    tune = _help("tune")
    assert "``" not in tune and "(default" in tune
    client = " ".join(_help("client").split())
    assert "(default: 127.0.0.1:8081" in client
    assert "default: ;" not in _help("serve", "--config", "x")
