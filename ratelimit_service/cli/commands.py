"""check-config, envoy-config, client and explain: each from its parsed flags to the
module that does the work, and its exit status."""

from __future__ import annotations

import argparse
import sys

from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_loader import check_config
from ratelimit_service.core.config_model import Mode


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
    if errors:
        print(*errors, sep="\n")
        return 1
    if not files:
        print(f"{args.path}: no rule file (*.yaml, *.yml) found")
        return 1
    print(f"{args.path}: OK ({len(files)} file{'s' if len(files) != 1 else ''})")
    return 0


def cmd_envoy_config(args: argparse.Namespace) -> int:
    from ratelimit_service.cli.envoy_config import render, render_bootstrap
    from ratelimit_service.cli.envoy_plan import EnvoyOptions
    from ratelimit_service.cli.envoy_rlqs import render_rlqs

    try:
        options = EnvoyOptions(
            domain=args.domain,
            merge_domains=bool(args.merge_domain_config),
            cluster=args.cluster,
            service_address=args.service_address,
            timeout=args.timeout,
            listen=args.listen,
            admin=args.admin_address,
            upstream_address=args.upstream_address,
            node_id=args.node_id,
        )
        if args.rlqs:
            text = render_rlqs(args.config, options, bootstrap=bool(args.bootstrap))
        elif args.bootstrap:
            text = render_bootstrap(args.config, options)
        else:
            text = render(args.config, options)
    except ConfigLoadError as exc:
        print(*exc.errors, sep="\n", file=sys.stderr)
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
