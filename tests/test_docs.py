"""Every relative link in the repository's Markdown resolves: the file (or folder) it
names exists inside the repository and, for ``#anchor``, the Markdown file it names has
a heading with that anchor (GitHub's rule for heading anchors). The README's
command-line synopsis is the parser's: every command and flag, no other."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

from ratelimit_harness.fixtures import REPO
from ratelimit_service.cli.parser import build_parser

SKIPPED_DIRS = {".git", ".venv", "node_modules", "bench/out"}
FENCE = re.compile(r"^ {0,3}(```|~~~)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target): the target up to a space or the closing bracket.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(].*?)?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
HTML_LINK = re.compile(r"""<(?:a|img)\s[^>]*?(?:href|src)=["']([^"']+)["']""", re.IGNORECASE)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
ABSOLUTE = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*:|//)")
HTML_ANCHOR = re.compile(r"""<a\s[^>]*?(?:name|id)=["']([^"']+)["']""", re.IGNORECASE)


def markdown_files(root: Path) -> list[Path]:
    """The Markdown files git would ship (tracked, or new and not ignored)."""
    try:
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.md"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        listed = [str(p.relative_to(root)) for p in root.rglob("*.md")]
    files = []
    for name in sorted(set(listed)):
        if any(name == d or name.startswith(d + "/") or f"/{d}/" in name for d in SKIPPED_DIRS):
            continue
        if (root / name).is_file():
            files.append(root / name)
    return files


def prose_lines(text: str, keep_code: bool = False) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; inline code removed unless kept."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line if keep_code else INLINE_CODE.sub("", line)))
    return lines


def links(text: str) -> list[tuple[int, str]]:
    found = []
    for number, line in prose_lines(text):
        for pattern in (INLINE_LINK, HTML_LINK):
            found.extend((number, m.group(1)) for m in pattern.finditer(line))
        reference = REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in ("L", "N", "M"))
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    result = set()
    for _, line in prose_lines(text, keep_code=True):
        heading = HEADING.match(line)
        if heading:
            base = slug(heading.group(2))
            count = seen.get(base, 0)
            seen[base] = count + 1
            result.add(base if count == 0 else f"{base}-{count}")
        result.update(m.group(1) for m in HTML_ANCHOR.finditer(line))
    return result


def broken_links(root: Path, files: list[Path]) -> list[str]:
    problems = []
    anchor_cache: dict[Path, set[str]] = {}
    for file in files:
        for number, target in links(file.read_text(encoding="utf-8")):
            where = f"{file.relative_to(root)}:{number}: {target}"
            if not target or ABSOLUTE.match(target):
                continue  # https:, mailto:, //host/...
            path_part, _, anchor = target.partition("#")
            path_part = unquote(path_part.split("?")[0])
            resolved = (file.parent / path_part).resolve() if path_part else file.resolve()
            if not resolved.is_relative_to(root.resolve()):
                problems.append(f"{where}: points outside the repository")
                continue
            if not resolved.exists():
                problems.append(f"{where}: no such file")
                continue
            if anchor and resolved.suffix.lower() == ".md":
                if resolved not in anchor_cache:
                    anchor_cache[resolved] = anchors(resolved.read_text(encoding="utf-8"))
                if unquote(anchor).lower() not in anchor_cache[resolved]:
                    problems.append(f"{where}: no heading with this anchor")
    return problems


def test_every_relative_link_in_the_repository_resolves() -> None:
    files = markdown_files(REPO)
    assert REPO / "README.md" in files and REPO / "docs" / "benchmarks.md" in files
    assert broken_links(REPO, files) == []


# -- the checker itself ---------------------------------------------------------------------


def test_slugs_follow_github() -> None:
    assert slug("Plug into Envoy / Istio") == "plug-into-envoy--istio"
    assert slug("`--workers`: one port, N processes") == "--workers-one-port-n-processes"
    assert slug("Differences from envoyproxy/ratelimit (deliberate)") == (
        "differences-from-envoyproxyratelimit-deliberate"
    )
    assert slug("Cost growth (Redis traffic, memory)") == "cost-growth-redis-traffic-memory"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("see [there](missing.md)\n", "missing.md: no such file"),
        ("see [there](other.md#nowhere)\n", "other.md#nowhere: no heading with this anchor"),
        ("see [here](#absent)\n", "#absent: no heading with this anchor"),
        ("![plot](img/none.png)\n", "img/none.png: no such file"),
        ("[ref]: ../../outside.md\n", "../../outside.md: points outside the repository"),
        ('<img src="gone.png">\n', "gone.png: no such file"),
    ],
)
def test_checker_finds_broken_links(tmp_path: Path, text: str, problem: str) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "other.md").write_text("# Somewhere\n")
    page = repo / "docs" / "page.md"
    page.write_text(text)
    assert broken_links(repo, [page]) == [f"docs/page.md:1: {problem}"]


def test_checker_accepts_good_links(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "other.md").write_text("# Some `where`\n\n## Twice\n\n## Twice\n")
    page = repo / "docs" / "page.md"
    page.write_text(
        "[a](other.md) [b](other.md#some-where) [c](other.md#twice-1) [d](#top)\n"
        "# Top\n[e](https://example.com/x.md) [f](../docs/) `[g](nowhere.md)`\n"
        "```\n[h](nowhere.md)\n```\n"
    )
    assert broken_links(repo, [page]) == []


# -- the README's command-line synopsis -----------------------------------------------------

SYNOPSIS_FLAG = re.compile(r"(--[a-z0-9][a-z0-9-]*)(?: ([^\s\[\]]+))?")


def readme_synopsis(text: str) -> dict[str, str]:
    """The code block under ``## Command line``, per command: ``ratelimit-service CMD``
    and its indented continuation lines ('' for the line of the program's own flags; the
    ``ratelimit`` line, serve under the Go service's name, is left out)."""
    section = text[text.index("\n## Command line\n") :]
    start = section.index("```\n") + 4
    blocks: dict[str, str] = {}
    command: str | None = None
    for line in section[start : section.index("```", start)].splitlines():
        if line.startswith("ratelimit-service "):
            word = line.split()[1]
            command = "" if word.startswith(("-", "[")) else word
            assert command not in blocks, f"the synopsis has two lines for {command!r}"
            blocks[command] = line
        elif line.startswith(" ") and command is not None:
            blocks[command] += "\n" + line
        else:
            command = None  # `ratelimit`
    return blocks


def synopsis_flags(block: str) -> dict[str, tuple[int, str | None]]:
    """Each flag of a block at its first mention: its bracket depth (0: required) and
    the word written after it, if any."""
    flags: dict[str, tuple[int, str | None]] = {}
    for match in SYNOPSIS_FLAG.finditer(block):
        before = block[: match.start()]
        depth = before.count("[") - before.count("]")
        value = match.group(2)
        flags.setdefault(match.group(1), (depth, None if value in (None, "|") else value))
    return flags


def parser_commands() -> dict[str, argparse.ArgumentParser]:
    """The parser's commands, '' for the program itself."""
    parser = build_parser()
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {"": parser, **commands.choices}


def shown(action: argparse.Action) -> bool:
    return action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)


def written_default_problem(action: argparse.Action, value: str | None) -> str | None:
    """A value written after a flag is a placeholder (upper case, the metavar, ``...``),
    or the flag's choices (``a|b``), or its default, which must then be the parser's."""
    if value is None or action.default in (None, False) or value == action.metavar:
        return None
    if value.isupper() or "..." in value:
        return None
    if action.choices is not None and "|" in value:
        if set(value.split("|")) != {str(choice) for choice in action.choices}:
            return f"choices {value}, the parser's {sorted(action.choices)}"
        return None
    try:
        same = str(action.default) == value or float(value) == float(action.default)
    except (TypeError, ValueError):
        same = False
    return None if same else f"default {value}, the parser's {action.default!r}"


def synopsis_problems(text: str) -> list[str]:
    blocks = readme_synopsis(text)
    commands = parser_commands()
    problems = [f"README synopsis: no command {name!r}" for name in blocks if name not in commands]
    for name, command in commands.items():
        where = f"README synopsis of {name or 'ratelimit-service'}"
        if name not in blocks:
            problems.append(f"{where}: missing")
            continue
        written = synopsis_flags(blocks[name])
        actions = [a for a in command._actions if shown(a)]
        options = {flag: a for a in actions for flag in a.option_strings}
        problems += [f"{where}: no flag {flag}" for flag in sorted(set(written) - set(options))]
        problems += [f"{where}: {flag} missing" for flag in sorted(set(options) - set(written))]
        for flag, (depth, value) in written.items():
            action = options.get(flag)
            if action is None:
                continue
            if (depth == 0) != bool(action.required):
                kind = "required" if action.required else "optional"
                problems.append(f"{where}: {flag} is {kind} in the parser")
            problem = written_default_problem(action, value)
            if problem is not None:
                problems.append(f"{where}: {flag} {problem}")
        for action in actions:
            if not action.option_strings and action.dest.upper() not in blocks[name]:
                problems.append(f"{where}: the argument {action.dest.upper()} missing")
    return problems


@pytest.fixture
def no_ratelimit_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parser's own defaults: a RATELIMIT_* variable sets a default, or makes a
    required flag optional."""
    for name in [n for n in os.environ if n.startswith("RATELIMIT_")]:
        monkeypatch.delenv(name)


@pytest.mark.usefixtures("no_ratelimit_variables")
def test_the_readme_synopsis_is_the_parsers() -> None:
    """Every command, every flag its parser shows and nothing else, required flags bare
    and optional ones in brackets, defaults and choices as the parser has them."""
    assert synopsis_problems((REPO / "README.md").read_text(encoding="utf-8")) == []


@pytest.mark.usefixtures("no_ratelimit_variables")
def test_the_synopsis_check_finds_drift() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    edits = [
        (" [--hits-addend N]", ""),
        ("[--timeout 5.0]", "[--timeout 7.0] [--retries N]"),
        ("[--config PATH | --xds-server HOST:PORT]", "(--config PATH | --xds-server HOST:PORT)"),
        ("[--log-format text|json]", "[--log-format text|yaml]"),
        ("tune --prometheus URL", "tune [--prometheus URL]"),
    ]
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    assert synopsis_problems(text) == [
        "README synopsis of serve: --config is optional in the parser",
        "README synopsis of serve: --xds-server is optional in the parser",
        "README synopsis of serve: --log-format choices text|yaml, the parser's ['json', 'text']",
        "README synopsis of client: no flag --retries",
        "README synopsis of client: --hits-addend missing",
        "README synopsis of client: --timeout default 7.0, the parser's 5.0",
        "README synopsis of tune: --prometheus is required in the parser",
    ]
