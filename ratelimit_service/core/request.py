"""Request and response types of the core, and the checks a request must pass (plain
types: the gRPC adapter converts protobuf messages into them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ratelimit_service.core.config_model import RateLimit
from ratelimit_service.core.settings_table import default
from ratelimit_service.core.units import Unit

UINT32_MAX = 2**32 - 1


class Code(enum.IntEnum):
    """Equal to envoy's RateLimitResponse.Code numbers."""

    OK = 1
    OVER_LIMIT = 2


@dataclass(slots=True)
class Descriptor:
    entries: tuple[tuple[str, str], ...]
    override: tuple[int, Unit | None] | None = None
    """The request's own ``limit`` (requests_per_unit, unit); unit None means UNKNOWN."""
    hits_addend: int | None = None
    """Per-descriptor hits; None when the field is absent (0 is a valid check-only value)."""


@dataclass(slots=True)
class Request:
    domain: str
    descriptors: list[Descriptor]
    hits_addend: int = 0
    plan: object = field(default=None, compare=False, repr=False)
    """What the limiter worked out for this request under one config (validation,
    matching), kept here because the servicer reuses a request for equal bytes."""


@dataclass(slots=True)
class DescriptorStatus:
    code: Code
    limit: RateLimit | None = None
    remaining: int = 0
    reset_after: float | None = None
    shadow_over: bool = False
    """A shadow rule over its limit: its code stays OK (it never denies), and the
    decision metadata says it would have denied (core.decision.decision_metadata)."""


@dataclass(slots=True)
class Response:
    """An answer (core.decision.answer makes it), its verdict worked out once for all
    that read it (the metadata, the headers, the over_limit body)."""

    overall: Code
    statuses: list[DescriptorStatus] = field(default_factory=list)
    decided: DescriptorStatus | None = None
    """The status of the rule that decided the answer (core.decision.verdict); None
    when no descriptor has a limit."""
    shadowed: bool = False
    """The answer is OK where its statuses deny (global shadow mode)."""


class InvalidRequest(ValueError):
    """A request the service refuses to evaluate; the message goes back to the caller."""


@dataclass(frozen=True, slots=True)
class RequestBounds:
    """Limits on what one request may carry, so a bad client cannot cost unbounded work."""

    max_descriptors: int = default("--max-descriptors")
    max_entries: int = default("--max-entries")
    max_text_length: int = 1024


def validate(request: Request, bounds: RequestBounds) -> None:
    """Raise :class:`InvalidRequest` naming the first problem found."""
    if not request.domain:
        raise InvalidRequest("rate limit domain must not be empty")
    if not request.descriptors:
        raise InvalidRequest("rate limit descriptor list must not be empty")
    if len(request.descriptors) > bounds.max_descriptors:
        raise InvalidRequest(
            f"too many descriptors: {len(request.descriptors)} (at most {bounds.max_descriptors})"
        )
    if len(request.domain) > bounds.max_text_length:
        raise InvalidRequest(f"domain longer than {bounds.max_text_length} characters")
    for index, descriptor in enumerate(request.descriptors):
        _validate_descriptor(index, descriptor, bounds)


def _validate_descriptor(index: int, descriptor: Descriptor, bounds: RequestBounds) -> None:
    if not descriptor.entries:
        raise InvalidRequest(f"descriptor {index} has no entries")
    if len(descriptor.entries) > bounds.max_entries:
        raise InvalidRequest(
            f"descriptor {index} has {len(descriptor.entries)} entries "
            f"(at most {bounds.max_entries})"
        )
    for key, value in descriptor.entries:
        if not key:
            raise InvalidRequest(f"descriptor {index} has an entry with an empty key")
        if len(key) > bounds.max_text_length or len(value) > bounds.max_text_length:
            raise InvalidRequest(
                f"descriptor {index} has an entry longer than {bounds.max_text_length} characters"
            )
    if descriptor.override is not None and descriptor.override[1] is None:
        raise InvalidRequest(f"descriptor {index} has a limit override with an unknown unit")
    if descriptor.hits_addend is not None and descriptor.hits_addend > UINT32_MAX:
        raise InvalidRequest(f"descriptor {index} hits_addend exceeds {UINT32_MAX}")


def parse_descriptor(text: str) -> tuple[tuple[str, str], ...]:
    """``k=v,k2=v2`` (a descriptor as people type it) → entries; ValueError on a part
    without ``=`` or with an empty key."""
    entries = []
    for part in text.split(","):
        key, sep, value = part.partition("=")
        if not sep or not key:
            raise ValueError(f"bad descriptor {text!r}: expected k=v[,k2=v2]")
        entries.append((key, value))
    return tuple(entries)
