"""Configuration errors that say which file, which line and what is wrong."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ConfigError:
    """One problem in one file. ``line`` is 1-based, or None when the parser cannot tell."""

    file: str
    line: int | None
    message: str

    def __str__(self) -> str:
        if self.line is None:
            return f"{self.file}: {self.message}"
        return f"{self.file}:{self.line}: {self.message}"


class ConfigLoadError(Exception):
    """Raised when a configuration does not load; carries every error found."""

    def __init__(self, errors: Sequence[ConfigError]) -> None:
        self.errors = tuple(errors)
        super().__init__("\n".join(str(error) for error in self.errors))
