"""``ratelimit-service`` and ``ratelimit``: the entry points. The parser is
cli/parser.py; each command is its own function (cli/serve.py, cli/commands.py,
cli/tune.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from ratelimit_service.cli import commands
from ratelimit_service.cli.go_env import GoEnvironment, GoSettingError, read_go_environment
from ratelimit_service.cli.parser import build_parser
from ratelimit_service.cli.serve import cmd_serve
from ratelimit_service.cli.tune import cmd_tune

COMMANDS: dict[str, Callable[[Any], int]] = {
    "serve": cmd_serve,
    "check-config": commands.cmd_check_config,
    "client": commands.cmd_client,
    "envoy-config": commands.cmd_envoy_config,
    "explain": commands.cmd_explain,
    "tune": cmd_tune,
}


def main(argv: Sequence[str] | None = None, *, go_mode: bool = False) -> int:
    """``go_mode``: the Go service's defaults apply (see cli/go_env.py); also on for
    ``serve`` given no ``--config`` and no ``RATELIMIT_CONFIG``."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        go = _go_environment(arguments, go_mode)
    except GoSettingError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    args = build_parser(go).parse_args(arguments)
    args.argv = arguments
    args.go = go
    stdout = sys.stdout
    sys.stdout = _ClosedPipeTolerant(stdout)
    try:
        code = COMMANDS[args.command](args)
        sys.stdout.flush()
    finally:
        sys.stdout = stdout
    return code


def go_main(argv: Sequence[str] | None = None) -> int:
    """``ratelimit`` (the image's ``/bin/ratelimit``): envoyproxy/ratelimit's command,
    configured by its environment alone, as Envoy Gateway runs it."""
    return main(["serve", *(sys.argv[1:] if argv is None else argv)], go_mode=True)


def _go_environment(arguments: list[str], go_mode: bool) -> GoEnvironment | None:
    """The Go settings for ``serve`` (None for the other commands, which ignore them)."""
    command = next((a for a in arguments if not a.startswith("-")), None)
    if command != "serve":
        return None
    given = any(a == "--config" or a.startswith("--config=") for a in arguments)
    go_mode = go_mode or not (given or "RATELIMIT_CONFIG" in os.environ)
    return read_go_environment(os.environ, go_mode=go_mode)


class _ClosedPipeTolerant:
    """stdout that stops writing, quietly, once its reader has gone (``| head -1``): the
    command still runs to the end and exits with its own status, without a traceback."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return int(self._stream.write(text))
        except BrokenPipeError:
            self._discard()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._discard()

    def _discard(self) -> None:
        # Point the descriptor at /dev/null: what is still buffered, and the
        # interpreter's last flush at exit, then go nowhere instead of failing again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
