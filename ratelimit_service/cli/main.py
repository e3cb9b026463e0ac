"""``ratelimit-service`` command line: serve, check-config, client, envoy-config.

Every flag can also come from the environment as ``RATELIMIT_<FLAG_NAME>``
(``--redis-url`` ↔ ``RATELIMIT_REDIS_URL``); a flag given on the command line wins.
``serve`` also reads envoyproxy/ratelimit's own variables (``REDIS_URL``, ``PORT``, …,
see cli/go_env.py), below ours: flag, then ``RATELIMIT_*``, then the Go name.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

import ratelimit_service
from ratelimit_service.cli.go_env import (
    GoEnvironment,
    GoSettingError,
    GoValue,
    read_go_environment,
)
from ratelimit_service.cli.tune import add_tune_parser, cmd_tune
from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_loader import check_config
from ratelimit_service.core.config_model import Mode
from ratelimit_service.engine.tracing import TracingUnavailable
from ratelimit_service.server.logs import configure_logging
from ratelimit_service.server.settings import (
    BY_FLAG,
    GROUPS,
    SETTINGS,
    Setting,
    fields_from,
    positive,
)
from ratelimit_service.storage.redis_connect import Topology, parse_target

if TYPE_CHECKING:
    from ratelimit_service.config.xds_settings import XdsSettings
    from ratelimit_service.server.settings import Settings

log = logging.getLogger("ratelimit_service")

MERGE_HELP = BY_FLAG["--merge-domain-config"].help


def _env(flag: str, default: Any) -> Any:
    return os.environ.get(_env_name(flag), default)


def _env_flag(flag: str, go: GoValue | None = None) -> bool:
    value = _env(flag, None)
    if value is None and go is not None:
        value = go.value
    return str(value or "").lower() in ("1", "true", "yes", "on")


def _arg_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser of server.settings as argparse wants it: its ValueError's text is the
    message (argparse would otherwise say only "invalid value")."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _add_setting(
    serve: argparse.ArgumentParser,
    group: Any,
    setting: Setting,
    go: GoEnvironment | None,
) -> None:
    """One declared setting as a flag of ``serve``, in its group of ``--help``."""
    if setting.hidden:
        group.add_argument(setting.flag, action="store_true", help=argparse.SUPPRESS)
        return
    kwargs: dict[str, Any] = {"help": setting.help}
    if setting.switch:
        kwargs["action"] = "store_true"
    else:
        default = setting.default
        if go is not None and go.go_mode and setting.go_default != "same":
            default = setting.go_default
        kwargs["type"] = _arg_type(setting.parse)
        kwargs["default"] = default
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
    setting for it (``go``); required flags become optional when the environment
    supplies them. Values from the environment are checked like values on the command
    line (argparse does not check defaults). The help text ends with the built-in
    default and the environment name (and its value, when set)."""
    go_value = go.get(flag) if go is not None else None
    env_value, source = _env(flag, None), _env_name(flag)
    if env_value is None and go_value is not None:
        env_value, source = go_value.value, go_value.source
    kwargs["help"] = _help_with_sources(flag, kwargs)
    if kwargs.get("action") == "store_true":
        kwargs["default"] = _env_flag(flag, go_value)
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


def xds_settings_from(args: argparse.Namespace) -> XdsSettings | None:
    """The xDS client's settings from serve's flags (None without --xds-server)."""
    from ratelimit_service.config.xds_settings import XdsSettings, parse_key_values

    if not args.xds_server:
        return None
    tls = bool(args.xds_tls)
    return XdsSettings(
        server_url=args.xds_server,
        node_id=args.xds_node_id,
        node_metadata=parse_key_values(args.xds_node_metadata),
        headers=parse_key_values(args.xds_headers, ":"),
        use_tls=tls,
        client_cert=args.xds_client_cert if tls else None,
        client_key=args.xds_client_key if tls else None,
        server_ca=args.xds_server_ca if tls else None,
        server_san=args.xds_server_san if tls else None,
        backoff_initial=float(args.xds_backoff_initial),
        backoff_max=max(float(args.xds_backoff_max), float(args.xds_backoff_initial)),
        max_message_size=int(args.xds_max_message_size),
    )


def _help_with_sources(flag: str, kwargs: dict[str, Any]) -> str:
    """``help`` followed by ``(default: X; env: RATELIMIT_FLAG)``, as ``--help`` shows it."""
    name = _env_name(flag)
    sources = []
    if kwargs.get("action") == "store_true":
        sources.append(f"env: {name}=1")
    else:
        if kwargs.get("required"):
            sources.append(f"required unless {name} is set")
        elif kwargs.get("default") not in (None, ""):
            sources.append(f"default: {kwargs['default']}")
        sources.append(f"env: {name}")
    env_value = os.environ.get(name)
    if env_value is not None:
        sources.append(f"now {env_value!r} from the environment")
    text = f"{kwargs.get('help') or ''} ({'; '.join(sources)})".strip()
    return text.replace("%", "%%")


def _env_name(flag: str) -> str:
    return "RATELIMIT_" + flag.lstrip("-").replace("-", "_").upper()


class _Parser(argparse.ArgumentParser):
    """A usage error is one line: the wrong thing, and where the flags are listed (the
    whole usage of ``serve`` would bury it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, unless it already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, "", False, argparse.SUPPRESS):
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

    check = commands.add_parser("check-config", help="validate rule files")
    check.add_argument(
        "path",
        nargs="?",
        default=_env("--config", None),
        help="rule file, or directory of *.yaml/*.yml (env: RATELIMIT_CONFIG)",
    )
    _add(check, "--merge-domain-config", action="store_true", help=MERGE_HELP)

    envoy = commands.add_parser(
        "envoy-config",
        help="print the Envoy filter, cluster and route rate_limits for the rules"
        " (--bootstrap: a whole runnable Envoy bootstrap)",
    )
    _add(envoy, "--config", required=True, help="rule file, or directory of *.yaml/*.yml")
    _add(envoy, "--domain", default=None, help="the domain to render (needed if several)")
    envoy.add_argument("--cluster", default="ratelimit", help="Envoy cluster name")
    envoy.add_argument("--timeout", default="0.02s", help="the filter's timeout")
    envoy.add_argument("--service-address", default="ratelimit:8081", help="HOST:PORT")
    _add(envoy, "--merge-domain-config", action="store_true", help=MERGE_HELP)
    envoy.add_argument(
        "--bootstrap",
        action="store_true",
        help="print a complete bootstrap (admin, listener, routes, clusters) for envoy -c",
    )
    envoy.add_argument(
        "--listen", default="0.0.0.0:8080", help="with --bootstrap: the listener's HOST:PORT"
    )
    envoy.add_argument(
        "--admin-address", default="127.0.0.1:9901", help="with --bootstrap: Envoy's admin"
    )
    envoy.add_argument(
        "--upstream-address",
        default="upstream:8080",
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
        default=None,
        help="with --rlqs: this Envoy's name to the service (x-envoy-node-id metadata)",
    )

    client = commands.add_parser("client", help="call ShouldRateLimit once")
    _add(client, "--addr", default="127.0.0.1:8081", help="service address HOST:PORT")
    _add(client, "--domain", required=True)
    client.add_argument(
        "--descriptor",
        action="append",
        required=True,
        help="k=v[,k2=v2]; repeat for several descriptors",
    )
    _add(client, "--hits-addend", type=int, default=0)
    _add(client, "--timeout", type=_arg_type(positive(float)), default=5.0)
    _add(client, "--tls-ca", default=None, help="PEM CA bundle: connect over TLS")
    _add(client, "--tls-cert", default=None, help="PEM client certificate (mTLS)")
    _add(client, "--tls-key", default=None, help="PEM key of --tls-cert")
    explain = commands.add_parser(
        "explain",
        help="which rule each descriptor matches, its window, limit, mode and current count"
        " (nothing recorded)",
    )
    _add(explain, "--domain", required=True)
    explain.add_argument(
        "--descriptor",
        action="append",
        required=True,
        help="k=v[,k2=v2]; repeat for several descriptors",
    )
    explain.add_argument(
        "--admin-addr",
        default="127.0.0.1:6070",
        help="the running service's admin port HOST:PORT (its /explain page)",
    )
    explain.add_argument(
        "--config",
        default=None,
        help="answer from this rule file or directory instead, without a service (no counts)",
    )
    explain.add_argument(
        "--mode",
        choices=[mode.value for mode in Mode],
        default=Mode.PROBABILISTIC.value,
        help="with --config: the mode of rules that do not set one (serve's --mode)",
    )
    _add(explain, "--merge-domain-config", action="store_true", help=MERGE_HELP)
    explain.add_argument("--json", action="store_true", help="print JSON")
    add_tune_parser(commands)
    for command in commands.choices.values():
        command.formatter_class = _Formatter
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    from ratelimit_service.server.app import RateLimitService

    configure_logging(str(args.log_level), str(args.log_format))
    for warning in args.go.warnings if args.go is not None else ():
        log.warning("%s", warning)
    try:
        settings = settings_from(args)
    except ValueError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 2
    if int(args.workers) > 1:
        return _serve_workers(args, settings)
    try:
        service = RateLimitService(settings)
    except ConfigLoadError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        _hint_config_source(args)
        return 1
    except TracingUnavailable as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    try:
        run_loop(service.run_until_signal(), str(args.event_loop))
    except OSError as exc:
        print(f"serve: {exc}", file=sys.stderr)
        return 1
    return 0


def settings_from(args: argparse.Namespace) -> Settings:
    """The service's Settings from the parsed ``serve`` flags (server/settings.py)."""
    from ratelimit_service.server.settings import Settings

    xds = xds_settings_from(args)
    if not args.config and xds is None:
        raise ValueError("--config (or RATELIMIT_CONFIG) is required, or --xds-server")
    if args.zone and not (args.redis_url and args.global_redis_url):
        raise ValueError(
            "--zone needs --redis-url (the zone's store) and --global-redis-url (the store"
            " above the zones)"
        )
    if args.global_redis_url and not args.zone:
        raise ValueError("--global-redis-url is the store above the zones: give --zone too")
    if args.zone and parse_target(args.redis_url).kind is Topology.CLUSTER:
        raise ValueError(
            "--redis-url with --zone is the zone's store: one Redis or Sentinel, not Cluster"
            " (the global store, --global-redis-url, may be a Cluster)"
        )
    return Settings(xds=xds, **fields_from(vars(args)))


def _hint_config_source(args: argparse.Namespace) -> None:
    """Rules that did not load came from the Go settings' path: say where that came from."""
    go_value = args.go.get("--config") if args.go is not None else None
    if go_value is not None and go_value.value == args.config:
        print(
            f"serve: rules read from {args.config} ({go_value.source});"
            " give --config or RATELIMIT_CONFIG to read them elsewhere",
            file=sys.stderr,
        )


def _serve_workers(args: argparse.Namespace, settings: Settings) -> int:
    """Check what can be checked once, then hand over to the supervisor."""
    from ratelimit_service.server.app import load_rules
    from ratelimit_service.server.supervisor import Supervisor

    if not args.redis_url:
        print(
            "serve: --workers > 1 needs --redis-url: with the embedded store every worker "
            "would keep its own counts and the fleet would admit N times the limit",
            file=sys.stderr,
        )
        return 2
    if not args.admin_addr or settings.xds is not None:
        print(
            "serve: --workers > 1 needs --admin-addr (the workers' merged /metrics) and rule"
            " files (--config): each worker would keep its own xDS stream",
            file=sys.stderr,
        )
        return 2
    if args.debug_addr:
        print(
            "serve: --debug-addr with --workers > 1: each worker would need the port; read"
            " /metrics and /rlconfig on --admin-addr, where the workers' counters are merged",
            file=sys.stderr,
        )
        return 2
    try:
        load_rules(settings)
    except ConfigLoadError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        return 1
    return asyncio.run(Supervisor(args.argv, int(args.workers), args.admin_addr).run())


def run_loop(main: Coroutine[Any, Any, None], choice: str) -> None:
    """uvloop when available (it serves more requests per second than asyncio's own
    loop for the same service), else asyncio's own loop."""
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise SystemExit(
                    "serve: --event-loop uvloop, but uvloop is not installed"
                ) from None
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


def cmd_check_config(args: argparse.Namespace) -> int:
    from ratelimit_service.config.files import read_config_files

    if not args.path:
        print("check-config: a PATH (or RATELIMIT_CONFIG) is required", file=sys.stderr)
        return 2
    try:
        files = read_config_files(args.path)
    except ConfigLoadError as exc:
        errors = list(exc.errors)
    else:
        errors = check_config(files, merge_domains=bool(args.merge_domain_config))
    for error in errors:
        print(error)
    if errors:
        return 1
    if not files:
        print(f"{args.path}: no rule file (*.yaml, *.yml) found")
        return 1
    print(f"{args.path}: OK ({len(files)} file{'s' if len(files) != 1 else ''})")
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    from ratelimit_service.cli.envoy_config import render, render_bootstrap
    from ratelimit_service.cli.envoy_rlqs import render_rlqs

    try:
        if args.rlqs:
            text = render_rlqs(
                args.config,
                bootstrap=bool(args.bootstrap),
                domain=args.domain,
                cluster="rlqs" if args.cluster == "ratelimit" else args.cluster,
                service_address=args.service_address,
                node_id=args.node_id,
                merge_domains=bool(args.merge_domain_config),
                listen=args.listen,
                admin=args.admin_address,
                upstream_address=args.upstream_address,
            )
        elif args.bootstrap:
            text = render_bootstrap(
                args.config,
                domain=args.domain,
                cluster=args.cluster,
                timeout=args.timeout,
                service_address=args.service_address,
                merge_domains=bool(args.merge_domain_config),
                listen=args.listen,
                admin=args.admin_address,
                upstream_address=args.upstream_address,
            )
        else:
            text = render(
                args.config,
                domain=args.domain,
                cluster=args.cluster,
                timeout=args.timeout,
                service_address=args.service_address,
                merge_domains=bool(args.merge_domain_config),
            )
    except ConfigLoadError as exc:
        for error in exc.errors:
            print(error, file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"envoy-config: {exc}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


def cmd_client(args: argparse.Namespace) -> int:
    from ratelimit_service.cli.client import call_and_print

    tls = (args.tls_ca, args.tls_cert, args.tls_key) if args.tls_ca else None
    return call_and_print(
        args.addr, args.domain, args.descriptor, int(args.hits_addend), float(args.timeout), tls
    )


def cmd_explain(args: argparse.Namespace) -> int:
    from ratelimit_service.cli.explain import run_explain

    return run_explain(
        args.domain,
        args.descriptor,
        admin=args.admin_addr,
        config=args.config,
        mode=Mode(args.mode),
        merge_domains=bool(args.merge_domain_config),
        as_json=bool(args.json),
    )


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
    handlers = {
        "serve": cmd_serve,
        "check-config": cmd_check_config,
        "client": cmd_client,
        "envoy-config": cmd_envoy_config,
        "explain": cmd_explain,
        "tune": cmd_tune,
    }
    stdout = sys.stdout
    sys.stdout = _ClosedPipeTolerant(stdout)
    try:
        code = handlers[args.command](args)
        sys.stdout.flush()
    finally:
        sys.stdout = stdout
    return code


def go_main(argv: Sequence[str] | None = None) -> int:
    """``ratelimit`` (the image's ``/bin/ratelimit``): envoyproxy/ratelimit's command,
    configured by its environment alone, as Envoy Gateway runs it."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    return main(["serve", *arguments], go_mode=True)


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
