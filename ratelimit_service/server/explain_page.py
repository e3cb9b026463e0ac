"""The admin page ``/explain?domain=D&descriptor=k=v[,k2=v2]&...[&format=json]``: the
rules each descriptor matches, with their limits and current counts, read without
recording a hit (engine/explain.py). Text for people, JSON with ``format=json``;
bad input gets 400 and one line saying what is wrong."""

from __future__ import annotations

import json
import logging
from urllib.parse import parse_qsl

from ratelimit_service.core.request import Descriptor, InvalidRequest, Request, parse_descriptor
from ratelimit_service.engine.explain import explain
from ratelimit_service.engine.limiter import RateLimiter
from ratelimit_service.server.http_server import PageResult

log = logging.getLogger(__name__)

_PARAMETERS = frozenset({"domain", "descriptor", "format"})


def request_from_query(query: str) -> tuple[Request, bool]:
    """The request a query names and whether JSON is asked for; ValueError (one line) otherwise."""
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise ValueError(f"malformed query string {query!r}") from None
    unknown = sorted({name for name, _ in pairs} - _PARAMETERS)
    if unknown:
        raise ValueError(f"unknown parameter {unknown[0]!r} (domain, descriptor, format)")
    domains = [value for name, value in pairs if name == "domain"]
    if len(domains) != 1 or not domains[0]:
        raise ValueError("one domain=D is required")
    texts = [value for name, value in pairs if name == "descriptor"]
    if not texts:
        raise ValueError("at least one descriptor=k=v[,k2=v2] is required")
    formats = [value for name, value in pairs if name == "format"]
    if formats not in ([], ["text"], ["json"]):
        raise ValueError("format is text (the default) or json")
    descriptors = [Descriptor(parse_descriptor(text)) for text in texts]
    return Request(domains[0], descriptors), formats == ["json"]


async def explain_page(limiter: RateLimiter, query: str) -> PageResult:
    try:
        request, as_json = request_from_query(query)
        explanation = await explain(limiter, request)
    except (ValueError, InvalidRequest) as exc:
        log.debug("/explain: %s", exc)
        return 400, "text/plain; charset=utf-8", f"Bad Request: {exc}\n".encode()
    if as_json:
        text = json.dumps(explanation.to_dict(), separators=(",", ":")) + "\n"
        return 200, "application/json", text.encode()
    return 200, "text/plain; charset=utf-8", explanation.text().encode()
