"""The ``client`` command: one ShouldRateLimit call, printed for people."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from envoy.extensions.common.ratelimit.v3 import ratelimit_pb2
from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc

from ratelimit_service.core.decision import SHADOW
from ratelimit_service.core.request import parse_descriptor

_CODES = {0: "UNKNOWN", 1: "OK", 2: "OVER_LIMIT"}
_UNIT_NAMES = {number: name for name, number in rls_pb2.RateLimitResponse.RateLimit.Unit.items()}


def build_request(domain: str, descriptors: Sequence[str], hits_addend: int) -> Any:
    Entry = ratelimit_pb2.RateLimitDescriptor.Entry
    return rls_pb2.RateLimitRequest(
        domain=domain,
        hits_addend=hits_addend,
        descriptors=[
            ratelimit_pb2.RateLimitDescriptor(
                entries=[Entry(key=k, value=v) for k, v in parse_descriptor(text)]
            )
            for text in descriptors
        ],
    )


def _shadow(struct: Any) -> str:
    """`` (shadow: OVER_LIMIT)`` when a decision metadata Struct marks a verdict that
    shadow mode turned into OK, else nothing."""
    value = struct.fields.get(SHADOW)
    return f" (shadow: {value.string_value})" if value is not None else ""


def format_response(descriptors: Sequence[str], response: Any) -> str:
    """The overall code and, per descriptor, its code, limit, remaining and reset; a code
    shadow mode made OK is marked per descriptor (a shadow rule) or overall (global)."""
    metadata = response.dynamic_metadata
    overall = _CODES.get(response.overall_code, response.overall_code)
    lines = [f"overall: {overall}{_shadow(metadata)}"]
    listed = metadata.fields.get("descriptors")
    items = list(listed.list_value.values) if listed is not None else []
    for index, (text, status) in enumerate(zip(descriptors, response.statuses, strict=False)):
        item = items[index] if index < len(items) else None
        shadow = _shadow(item.struct_value) if item is not None else ""
        line = f"  [{text}] {_CODES.get(status.code, status.code)}{shadow}"
        if status.HasField("current_limit"):
            limit = status.current_limit
            unit = _UNIT_NAMES.get(limit.unit, str(limit.unit))
            name = f" name={limit.name}" if limit.name else ""
            reset = status.duration_until_reset
            line += (
                f" limit={limit.requests_per_unit}/{unit}{name} remaining={status.limit_remaining}"
                f" reset={reset.seconds + reset.nanos / 1e9:.3f}s"
            )
        elif status.limit_remaining:
            line += " unlimited"
        else:
            line += " no limit"
        lines.append(line)
    return "\n".join(lines)


def open_channel(addr: str, tls: tuple[str, str | None, str | None] | None) -> grpc.Channel:
    """Plaintext, or TLS with (CA bundle, client certificate, client key) file paths."""
    if tls is None:
        return grpc.insecure_channel(addr)
    ca, cert, key = tls
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if cert else None,
    )
    return grpc.secure_channel(addr, credentials)


def call_and_print(
    addr: str,
    domain: str,
    descriptors: Sequence[str],
    hits_addend: int,
    timeout: float,
    tls: tuple[str, str | None, str | None] | None = None,
) -> int:
    try:
        request = build_request(domain, descriptors, hits_addend)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    with open_channel(addr, tls) as channel:
        stub = rls_pb2_grpc.RateLimitServiceStub(channel)
        try:
            response = stub.ShouldRateLimit(request, timeout=timeout)
        except grpc.RpcError as exc:
            print(f"error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    print(format_response(descriptors, response))
    return 0
