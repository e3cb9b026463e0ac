"""Configuration errors that say which file, which line and what is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ConfigError:
    """One problem in one file. ``line`` and ``column`` are 1-based, or None when the
    parser cannot tell; a column is given for YAML syntax errors."""

    file: str
    line: int | None
    message: str
    column: int | None = None

    def __str__(self) -> str:
        if self.line is None:
            return f"{self.file}: {self.message}"
        if self.column is None:
            return f"{self.file}:{self.line}: {self.message}"
        return f"{self.file}:{self.line}:{self.column}: {self.message}"


class ConfigLoadError(Exception):
    """Raised when a configuration does not load; carries every error found."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = tuple(errors)
        super().__init__("\n".join(str(error) for error in self.errors))
