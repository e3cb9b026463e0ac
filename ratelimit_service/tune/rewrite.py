"""Rule files with the tuner's changes, edited in place (tune/arithmetic.py), checked by
the loader, and written atomically so that live reload never reads half a file."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_loader import ConfigFile, load_config
from ratelimit_service.tune.arithmetic import Span, edit, rule_places
from ratelimit_service.tune.report import Outcome


class RewriteError(Exception):
    """The edited files would not load; nothing is written."""


def new_texts(files: Sequence[ConfigFile], outcomes: list[Outcome]) -> dict[str, str]:
    """Every file's text after the changes (unchanged files as they were). Outcomes
    whose values cannot be edited in place are replaced by ones that leave the rule
    alone, with a note (in ``outcomes``)."""
    places = {f.name: rule_places(f.text) for f in files}
    edits: dict[str, dict[Span, str]] = {}
    for index, outcome in enumerate(outcomes):
        if not outcome.changes:
            continue
        rule = outcome.seen.rule
        where = places.get(rule.file, {}).get(rule.key)
        reason = ""
        if where is None or where.requests_per_unit is None:
            reason = "requests_per_unit not found in its file: left alone"
        elif where.shared:
            reason = "its values are shared through a YAML alias: left alone"
        elif outcome.promote and where.shadow_mode is None:
            reason = "shadow_mode not found in its file: left alone"
        if reason:
            outcomes[index] = replace(outcome, proposed=None, promote=False, note=reason)
            continue
        assert where is not None and where.requests_per_unit is not None
        mine = edits.setdefault(rule.file, {})
        if outcome.proposed is not None:
            mine[where.requests_per_unit] = str(outcome.proposed)
        if outcome.promote and where.shadow_mode is not None:
            mine[where.shadow_mode] = "false"
    return {f.name: edit(f.text, edits.get(f.name, {})) for f in files}


def check_loads(files: Sequence[ConfigFile], texts: dict[str, str], merge: bool) -> None:
    """The edited files load as the service would load them (else RewriteError)."""
    try:
        load_config([ConfigFile(f.name, texts[f.name]) for f in files], merge_domains=merge)
    except ConfigLoadError as exc:
        raise RewriteError("; ".join(str(e) for e in exc.errors)) from None


def write_atomically(name: str, text: str) -> None:
    """Write through a temporary file in the same directory and rename it over the
    target (a symlink's target, so a ConfigMap-style link stays a link)."""
    target = Path(name).resolve()
    mode = target.stat().st_mode & 0o7777 if target.exists() else 0o644
    fd, temporary = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, target)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
