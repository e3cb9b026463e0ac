"""``ratelimit-service``'s parser: every command's flags and ``--help``; ``serve``'s are
core/settings_table.py's declarations, in their groups.

A flag given on the command line wins over ``RATELIMIT_<FLAG_NAME>`` (``--redis-url`` ↔
``RATELIMIT_REDIS_URL``), which wins, for ``serve``, over envoyproxy/ratelimit's own
variable for it (``REDIS_URL``, ``PORT``, …: cli/go_env.py).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import ratelimit_service
from ratelimit_service.cli import tune as tune_command
from ratelimit_service.cli.envoy_plan import DEFAULT_OPTIONS
from ratelimit_service.cli.go_env import GoEnvironment
from ratelimit_service.core.config_model import Mode
from ratelimit_service.core.settings_table import (
    BY_FLAG,
    GROUPS,
    SETTINGS,
    Setting,
    env_name,
    positive,
)
from ratelimit_service.tune.arithmetic import parse_duration, parse_stat

MERGE_HELP = BY_FLAG["--merge-domain-config"].help


def _env(flag: str) -> str | None:
    return os.environ.get(env_name(flag))


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser of core/settings_table.py as argparse wants it: its ValueError's text is
    the message (argparse would otherwise say only "invalid value")."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _add_setting(
    serve: argparse.ArgumentParser, group: Any, setting: Setting, go: GoEnvironment | None
) -> None:
    """One declared setting as a flag of ``serve``, in its group of ``--help``."""
    if setting.hidden:
        group.add_argument(setting.flag, action="store_true", help=argparse.SUPPRESS)
        return
    kwargs: dict[str, Any] = {"help": setting.help}
    if setting.switch:
        kwargs["action"] = "store_true"
    else:
        go_default = go is not None and go.go_mode and setting.go_default != "same"
        kwargs["type"] = _arg_type(setting.parse)
        kwargs["default"] = setting.go_default if go_default else setting.default
        if setting.choices is not None:
            kwargs["choices"] = list(setting.choices)
        else:
            kwargs["metavar"] = setting.metavar
    _add(serve, setting.flag, go, target=group, **kwargs)


def _add(
    parser: argparse.ArgumentParser,
    flag: str,
    go: GoEnvironment | None = None,
    target: Any = None,
    **kwargs: Any,
) -> None:
    """Add a flag whose default comes from RATELIMIT_<FLAG>, else from the Go service's
    setting for it (``go``), checked like a value on the command line (argparse does not
    check defaults); a required flag becomes optional when the environment supplies it."""
    go_value = go.get(flag) if go is not None else None
    env_value, source = _env(flag), env_name(flag)
    if env_value is None and go_value is not None:
        env_value, source = go_value.value, go_value.source
    kwargs["help"] = _help_with_sources(flag, kwargs)
    if kwargs.get("action") == "store_true":
        kwargs["default"] = (env_value or "").lower() in ("1", "true", "yes", "on")
    elif env_value is not None:
        convert = kwargs.get("type", str)
        try:
            value = convert(env_value)
        except (argparse.ArgumentTypeError, ValueError) as exc:
            parser.error(f"{flag} from {source}={env_value!r}: {exc}")
        choices = kwargs.get("choices")
        if choices is not None and value not in choices:
            parser.error(f"{flag} from {source}={env_value!r}: choose from {', '.join(choices)}")
        kwargs["default"] = value
        kwargs.pop("required", None)
    (parser if target is None else target).add_argument(flag, **kwargs)


def _help_with_sources(flag: str, kwargs: dict[str, Any]) -> str:
    """``help`` followed by ``(default: X; env: RATELIMIT_FLAG)``, as ``--help`` shows it."""
    name = env_name(flag)
    sources = []
    if kwargs.get("action") == "store_true":
        sources.append(f"env: {name}=1")
    else:
        if kwargs.get("required"):
            sources.append(f"required unless {name} is set")
        elif kwargs.get("default") not in (None, ""):
            sources.append(f"default: {kwargs['default']}")
        sources.append(f"env: {name}")
    env_value = _env(flag)
    if env_value is not None:
        sources.append(f"now {env_value!r} from the environment")
    return f"{kwargs.get('help') or ''} ({'; '.join(sources)})".strip().replace("%", "%%")


class _Parser(argparse.ArgumentParser):
    """A usage error is one line: the wrong thing, and where the flags are listed (the
    whole usage of ``serve`` would bury it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless it already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if "default" in text or action.default in (None, "", False, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def build_parser(go: GoEnvironment | None = None) -> argparse.ArgumentParser:
    """``go``: envoyproxy/ratelimit's settings, read from the environment for ``serve``."""
    parser = _Parser(
        prog="ratelimit-service",
        description="Envoy external rate-limit service",
        formatter_class=_Formatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"%(prog)s {ratelimit_service.__version__}"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    _add_serve(commands, go)
    _add_check_config(commands)
    _add_envoy_config(commands)
    _add_client(commands)
    _add_explain(commands)
    _add_tune(commands)
    for command in commands.choices.values():
        command.formatter_class = _Formatter
    return parser


def _add_serve(commands: Any, go: GoEnvironment | None) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the service",
        usage="%(prog)s [--config PATH | --xds-server HOST:PORT] [flags]",
        description="Run the service. Every flag can also be set by its environment"
        " variable (RATELIMIT_<FLAG>), or by envoyproxy/ratelimit's name for it.",
    )
    groups = {name: serve.add_argument_group(name) for name in GROUPS}
    for setting in SETTINGS:
        _add_setting(serve, groups[setting.group], setting, go)


def _add_check_config(commands: Any) -> None:
    check = commands.add_parser("check-config", help="validate rule files")
    check.add_argument(
        "path",
        nargs="?",
        default=_env("--config"),
        help="rule file, or directory of *.yaml/*.yml (env: RATELIMIT_CONFIG)",
    )
    _add(check, "--merge-domain-config", action="store_true", help=MERGE_HELP)


def _add_envoy_config(commands: Any) -> None:
    """envoy-config's flags; their defaults are EnvoyOptions' (cli/envoy_plan.py)."""
    envoy = commands.add_parser(
        "envoy-config",
        help="print the Envoy filter, cluster and route rate_limits for the rules"
        " (--bootstrap: a whole runnable Envoy bootstrap)",
    )
    _add(envoy, "--config", required=True, help="rule file, or directory of *.yaml/*.yml")
    _add(envoy, "--domain", help="the domain to render (needed if several)")
    envoy.add_argument("--cluster", default=DEFAULT_OPTIONS.cluster, help="Envoy cluster name")
    envoy.add_argument("--timeout", default=DEFAULT_OPTIONS.timeout, help="the filter's timeout")
    envoy.add_argument(
        "--service-address", default=DEFAULT_OPTIONS.service_address, help="HOST:PORT"
    )
    _add(envoy, "--merge-domain-config", action="store_true", help=MERGE_HELP)
    envoy.add_argument(
        "--bootstrap",
        action="store_true",
        help="print a complete bootstrap (admin, listener, routes, clusters) for envoy -c",
    )
    envoy.add_argument(
        "--listen",
        default=DEFAULT_OPTIONS.listen,
        help="with --bootstrap: the listener's HOST:PORT",
    )
    envoy.add_argument(
        "--admin-address", default=DEFAULT_OPTIONS.admin, help="with --bootstrap: Envoy's admin"
    )
    envoy.add_argument(
        "--upstream-address",
        default=DEFAULT_OPTIONS.upstream_address,
        help="with --bootstrap: HOST:PORT of the placeholder upstream cluster",
    )
    envoy.add_argument(
        "--rlqs",
        action="store_true",
        help="the rate_limit_quota filter instead (RLQS: Envoy enforces token buckets the"
        " service assigns; no call per request); --cluster defaults to rlqs",
    )
    envoy.add_argument(
        "--node-id",
        default=DEFAULT_OPTIONS.node_id,
        help="with --rlqs: this Envoy's name to the service (x-envoy-node-id metadata)",
    )


def _add_descriptors(command: argparse.ArgumentParser) -> None:
    text = "k=v[,k2=v2]; repeat for several descriptors"
    command.add_argument("--descriptor", action="append", required=True, help=text)


def _add_client(commands: Any) -> None:
    client = commands.add_parser("client", help="call ShouldRateLimit once")
    _add(client, "--addr", default="127.0.0.1:8081", help="service address HOST:PORT")
    _add(client, "--domain", required=True)
    _add_descriptors(client)
    _add(client, "--hits-addend", type=int, default=0)
    _add(client, "--timeout", type=_arg_type(positive(float)), default=5.0)
    _add(client, "--tls-ca", help="PEM CA bundle: connect over TLS")
    _add(client, "--tls-cert", help="PEM client certificate (mTLS)")
    _add(client, "--tls-key", help="PEM key of --tls-cert")


def _add_explain(commands: Any) -> None:
    explain = commands.add_parser(
        "explain",
        help="which rule each descriptor matches, its window, limit, mode and current count"
        " (nothing recorded)",
    )
    _add(explain, "--domain", required=True)
    _add_descriptors(explain)
    explain.add_argument(
        "--admin-addr",
        default=BY_FLAG["--admin-addr"].default,
        help="the running service's admin port HOST:PORT (its /explain page)",
    )
    explain.add_argument(
        "--config",
        help="answer from this rule file or directory instead, without a service (no counts)",
    )
    explain.add_argument(
        "--mode",
        choices=[mode.value for mode in Mode],
        default=BY_FLAG["--mode"].default,
        help="with --config: the mode of rules that do not set one (serve's --mode)",
    )
    _add(explain, "--merge-domain-config", action="store_true", help=MERGE_HELP)
    explain.add_argument("--json", action="store_true", help="print JSON")


def _fraction(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _percent(text: str) -> float:
    value = float(text.rstrip("% "))
    if not 0 <= value <= 100:
        raise argparse.ArgumentTypeError(f"expected a percentage from 0 to 100, got {text}")
    return value / 100


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _when(text: str) -> float:
    """Unix seconds or an ISO 8601 time with its zone."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected unix seconds or ISO 8601, got {text!r}"
        ) from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(f"give the time zone too (Z or +00:00): {text!r}")
    return moment.timestamp()


def _add_tune(commands: Any) -> None:
    """tune's flags (cli/tune.py runs the command)."""
    duration = _arg_type(parse_duration)
    tune = commands.add_parser(
        "tune",
        help="propose limits from the demand Prometheus observed (--write: apply them)",
        description=(tune_command.__doc__ or "").replace("``", ""),
    )
    tune.add_argument("--prometheus", required=True, help="Prometheus base URL, http://HOST:PORT")
    tune.add_argument("--config", required=True, help="rule file, or directory of *.yaml/*.yml")
    tune.add_argument(
        "--window",
        type=duration,
        default=parse_duration("14d"),
        metavar="DURATION",
        help="how far back to look (Prometheus durations: 14d, 36h, 2w; default 14d)",
    )
    tune.add_argument(
        "--headroom",
        type=_fraction,
        default=0.3,
        help="proposed = ceil(peak x (1 + HEADROOM)); default 0.3",
    )
    tune.add_argument(
        "--stat",
        type=_arg_type(parse_stat),
        metavar="max|pNN",
        help="the peak: max (default) or a quantile such as p99.9 (nearest rank)",
    )
    tune.add_argument(
        "--min-samples",
        type=_count,
        default=60,
        help="rules with fewer demand samples are listed and left alone (60)",
    )
    tune.add_argument(
        "--floor",
        type=_count,
        help="never propose below this (default: the current limit; with"
        " --allow-lower and no --floor: 1)",
    )
    tune.add_argument(
        "--allow-lower",
        action="store_true",
        help="let a proposal go below the current limit (down to --floor)",
    )
    tune.add_argument(
        "--promote",
        action="store_true",
        help="turn shadow_mode off for shadow rules whose would-deny share over"
        " the window is below --promote-below",
    )
    tune.add_argument(
        "--promote-below",
        type=_percent,
        default=0.001,
        metavar="PERCENT",
        help="percent of hits (default 0.1)",
    )
    tune.add_argument(
        "--write",
        action="store_true",
        help="rewrite the rule files (atomically; live reload picks them up)",
    )
    tune.add_argument(
        "--plot",
        type=Path,
        metavar="DIR",
        help="one PNG per rule (demand, current and proposed limit) and index.html",
    )
    tune.add_argument(
        "--scrape-interval",
        type=duration,
        metavar="DURATION",
        help="default: measured from each rule's recent samples",
    )
    tune.add_argument(
        "--end",
        type=_when,
        metavar="TIME",
        help="the window's end, unix seconds or ISO 8601 (default: now)",
    )
    tune.add_argument("--timeout", type=float, default=30.0, help="seconds per Prometheus query")
    tune.add_argument("--merge-domain-config", action="store_true")
