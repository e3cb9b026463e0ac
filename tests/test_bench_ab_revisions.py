"""bench/ab_revisions.py must serve each revision its own package: run from the
repository, ``python -m`` would otherwise import the working tree's (a bug that made
every comparison before commit a235bff compare one code with itself)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import ab_revisions  # noqa: E402  (bench/ is not a package)


def tree_with_marker(root: Path) -> Path:
    package = root / "ratelimit_service"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("MARKER = 'the revision'\n")
    return root


def test_a_tree_is_served_its_own_package_from_the_repository(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)  # where the working tree's package would shadow it
    prefix = ab_revisions.served_from(tree_with_marker(tmp_path / "rev"))
    imported = subprocess.run(
        [*prefix, "-c", "import ratelimit_service as m; print(m.MARKER)"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert imported.stdout.strip() == "the revision"


def test_a_tree_without_the_package_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="imports ratelimit_service from"):
        ab_revisions.served_from(tmp_path / "empty")
