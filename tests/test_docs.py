"""Every relative link in the repository's Markdown resolves: the file (or folder) it
names exists inside the repository and, for ``#anchor``, the Markdown file it names has
a heading with that anchor (GitHub's rule for heading anchors)."""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path
from urllib.parse import unquote

import pytest

from ratelimit_service.testing.fixtures import REPO

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
