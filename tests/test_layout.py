"""The tree is the architecture: the README's layout lists every module (and nothing
that is gone), imports point down the floors only, and the service never imports the
test harness, which lives beside the package, not in it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "ratelimit_service"
HARNESS = REPO / "harness" / "ratelimit_harness"
"""The test harness: its own distribution (harness/pyproject.toml), which tests/ and
bench/ import and the service's wheel does not carry."""
README = REPO / "README.md"

FLOORS = ["core", "storage", "engine", "rls", "rlqs", "config", "tune", "server", "cli"]
"""Bottom to top; a module may import from its own floor and those below. The front
doors rls, rlqs, config and tune are side by side (none imports another)."""
DOORS = {"rls", "rlqs", "config", "tune"}
SIDE_BY_SIDE = {door: DOORS - {door} for door in DOORS}


def readme_layout() -> set[str]:
    """Paths from the repository's root: a line at the block's margin names a root
    (``ratelimit_service/``, ``harness/ratelimit_harness/``), two spaces a package or a
    module of that root, four a module of that package."""
    text = README.read_text()
    block = text[text.index("## Layout") :]
    block = block[block.index("```\n") + 4 :]
    block = block[: block.index("```")]
    listed, root, package = set(), "", ""
    for line in block.splitlines():
        if m := re.match(r"^([\w/]+/)\s", line + " "):
            root, package = m.group(1), ""
        elif m := re.match(r"^  (\w+)/", line):
            package = m.group(1)
        elif m := re.match(r"^    (\w+\.py)\b", line):
            listed.add(f"{root}{package}/{m.group(1)}")
        elif m := re.match(r"^  (\w+\.py)\b", line):
            listed.add(f"{root}{m.group(1)}")
    return listed


def modules(root: Path) -> set[str]:
    """The modules under ``root``, as paths from the repository's root."""
    found = set()
    for path in root.rglob("*.py"):
        relative = path.relative_to(REPO).as_posix()
        if path.name != "__init__.py" and "resources" not in relative:
            found.add(relative)
    return found


def test_the_readme_layout_lists_every_module_and_only_those() -> None:
    listed, present = readme_layout(), modules(PACKAGE) | modules(HARNESS)
    assert sorted(present - listed) == [], "modules missing from the README's layout"
    assert sorted(listed - present) == [], "the README's layout lists modules that are gone"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def _floors(path: Path) -> set[str]:
    """The floors of ratelimit_service that ``path`` imports."""
    return {n.split(".")[1] for n in _imports(path) if n.startswith("ratelimit_service.")}


def test_imports_point_down_only() -> None:
    upward = []
    for path in PACKAGE.rglob("*.py"):
        floor = path.relative_to(PACKAGE).parts[0]
        if floor not in FLOORS:  # __main__
            continue
        allowed = set(FLOORS[: FLOORS.index(floor) + 1]) - SIDE_BY_SIDE.get(floor, set())
        for target in _floors(path):
            if target in FLOORS and target not in allowed:
                upward.append(f"{path.relative_to(PACKAGE)} imports {target}")
    assert upward == []


def test_the_service_never_imports_the_harness_or_pytest() -> None:
    """The harness imports the service, never the reverse, and nothing in the package
    needs the test tools: the wheel is the service alone."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for name in _imports(path):
            if name.split(".")[0] in ("ratelimit_harness", "pytest", "_pytest"):
                found.append(f"{path.relative_to(REPO)} imports {name}")
    assert found == []


def test_the_core_imports_no_io() -> None:
    for path in (PACKAGE / "core").glob("*.py"):
        text = path.read_text()
        for banned in ("import grpc", "import redis", "import asyncio", "from redis", "from grpc"):
            assert banned not in text, f"{path.name}: {banned}"


def test_nothing_casts_a_store() -> None:
    """The engine and the front doors talk to the storage seam (storage/base.Store)
    only: no isinstance() on a store, no getattr() for a method it may lack."""
    casts = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "storage":
            continue
        text = path.read_text()
        for pattern in (r"isinstance\([\w.]*store\b", r"getattr\([\w.]*store\b", r"RedisStore\)"):
            casts += [f"{relative}: {m.group(0)}" for m in re.finditer(pattern, text)]
    assert casts == []


def test_the_pure_arithmetic_stays_pure() -> None:
    """tune's arithmetic lives beside tune/ but, like the core, imports no I/O."""
    text = (PACKAGE / "tune" / "arithmetic.py").read_text()
    for banned in ("import grpc", "import redis", "import asyncio", "urllib", "import requests"):
        assert banned not in text
