"""One declaration per setting (server/settings.py): serve's parser, its --help, the
Settings defaults and docs/settings.md's table all follow it (tests/test_docs.py holds
the README's synopsis to the parser)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ratelimit_service.cli.main import build_parser, settings_from
from ratelimit_service.server.settings import (
    BY_FLAG,
    GROUPS,
    SETTINGS,
    Settings,
    markdown_table,
)

REPO = Path(__file__).resolve().parents[2]
NOT_FLAGS = {"xds", "header_names", "shutdown_grace"}
"""Settings fields that no single flag fills: the xDS client's own settings, the three
header names, and the grace after draining (fixed)."""


def test_every_settings_field_is_declared_once_with_its_default() -> None:
    fills = [s.fills for s in SETTINGS if s.fills is not None]
    assert len(fills) == len(set(fills))
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    assert sorted(set(fields) - set(fills) - NOT_FLAGS) == []
    defaults = Settings()
    for setting in SETTINGS:
        if setting.fills is not None:
            default = setting.default if not setting.switch else False
            assert getattr(defaults, setting.fills) == setting.field(default), setting.flag


def test_serve_with_no_flag_gives_the_declared_defaults(monkeypatch) -> None:
    for name in [n for n in __import__("os").environ if n.startswith("RATELIMIT_")]:
        monkeypatch.delenv(name)
    args = build_parser().parse_args(["serve", "--config", "config/"])
    settings = settings_from(args)
    assert settings == dataclasses.replace(Settings(), config_path="config/")


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
        "docs/settings.md is out of date: paste server.settings.markdown_table()"
    )


@pytest.mark.parametrize("flag", ["--redis-timeout", "--drain-timeout", "--mode"])
def test_help_shows_the_declared_default(flag: str) -> None:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    action = next(a for a in serve._actions if flag in a.option_strings)
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
