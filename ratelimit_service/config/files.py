"""Read the rule files named by ``--config``: one file, or every YAML file under a directory.

Entries whose name starts with a dot are skipped, which keeps Kubernetes ConfigMap
volumes (``..data``, ``..2024_01_01...``) from being loaded twice.
"""

from __future__ import annotations

import os
from pathlib import Path

from ratelimit_service.core.config_errors import ConfigError, ConfigLoadError
from ratelimit_service.core.config_loader import ConfigFile

YAML_SUFFIXES = (".yaml", ".yml")


def config_paths(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ConfigLoadError([ConfigError(str(path), None, "no such file or directory")])
    found: list[Path] = []
    for root, dirs, files in os.walk(path, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith(".") and name.endswith(YAML_SUFFIXES):
                found.append(Path(root) / name)
    return found


def read_config_files(path: str | Path) -> list[ConfigFile]:
    """Every rule file's display name and text; unreadable files raise ConfigLoadError."""
    files: list[ConfigFile] = []
    errors: list[ConfigError] = []
    for file_path in config_paths(Path(path)):
        try:
            files.append(ConfigFile(str(file_path), file_path.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError) as exc:
            errors.append(ConfigError(str(file_path), None, f"cannot read file: {exc}"))
    if errors:
        raise ConfigLoadError(errors)
    return files
