"""The ``explain`` command: which rule each descriptor matches, with its window, limit,
mode and current count, asked of a running service's admin port (``/explain``,
nothing recorded) or worked out from rule files alone (no counts then)."""

from __future__ import annotations

import asyncio
import json
import sys
import urllib.error
import urllib.request
from collections.abc import Sequence
from urllib.parse import urlencode

from ratelimit_service.core.config_errors import ConfigLoadError
from ratelimit_service.core.config_model import Mode
from ratelimit_service.core.explain import Explanation
from ratelimit_service.core.request import Descriptor, InvalidRequest, Request, parse_descriptor

ADMIN_TIMEOUT = 5.0
"""Seconds to wait for the admin page."""
MAX_ANSWER_BYTES = 1 << 20


def run_explain(
    domain: str,
    descriptors: Sequence[str],
    *,
    admin: str,
    config: str | None,
    mode: Mode,
    merge_domains: bool,
    as_json: bool,
) -> int:
    """Print the explanation; 2 on bad input, 1 when the service or the files fail."""
    try:
        request = Request(domain, [Descriptor(parse_descriptor(text)) for text in descriptors])
        if config is not None:
            explanation = _from_files(request, config, mode, merge_domains)
        else:
            explanation = _from_service(request, admin)
    except (ValueError, InvalidRequest) as exc:
        print(f"explain: {exc}", file=sys.stderr)
        return 2
    except ConfigLoadError as exc:
        print(*exc.errors, sep="\n", file=sys.stderr)
        return 1
    except _Unreachable as exc:
        print(f"explain: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(explanation.to_dict(), indent=2))
    else:
        print(explanation.text(), end="")
    return 0


class _Unreachable(Exception):
    """The admin port did not answer, or answered with an error."""


def _from_files(request: Request, path: str, mode: Mode, merge_domains: bool) -> Explanation:
    from ratelimit_service.config.files import read_config_files
    from ratelimit_service.core.config_loader import load_config
    from ratelimit_service.engine.explain import explain
    from ratelimit_service.engine.limiter import RateLimiter
    from ratelimit_service.storage.embedded import EmbeddedStore

    rules = load_config(read_config_files(path), default_mode=mode, merge_domains=merge_domains)
    limiter = RateLimiter(rules, EmbeddedStore(), default_mode=mode)
    return asyncio.run(explain(limiter, request, counts=False))


def _from_service(request: Request, admin: str) -> Explanation:
    query = [("domain", request.domain), ("format", "json")]
    for descriptor in request.descriptors:
        query.append(("descriptor", ",".join(f"{k}={v}" for k, v in descriptor.entries)))
    url = f"http://{admin}/explain?{urlencode(query)}"
    try:
        with urllib.request.urlopen(url, timeout=ADMIN_TIMEOUT) as answer:
            body = answer.read(MAX_ANSWER_BYTES)
    except urllib.error.HTTPError as exc:
        line = exc.read(4096).decode("utf-8", "replace").strip()
        if exc.code == 400:
            raise ValueError(line.removeprefix("Bad Request: ")) from None
        raise _Unreachable(f"{admin}: HTTP {exc.code}: {line}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise _Unreachable(f"no admin port answering at {admin}: {reason}") from None
    try:
        return Explanation.from_dict(json.loads(body))
    except (ValueError, KeyError, TypeError) as exc:
        raise _Unreachable(f"{admin}: not an /explain answer: {exc}") from None
