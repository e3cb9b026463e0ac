"""Small rules that turn per-descriptor results into a response, shared by both modes."""

from __future__ import annotations

from collections.abc import Sequence

from ratelimit_service.core.config_model import RateLimit
from ratelimit_service.core.exact import denies
from ratelimit_service.core.request import Code, Descriptor, DescriptorStatus

NEAR_LIMIT_RATIO = 0.8

_OK = Code.OK
_OVER = Code.OVER_LIMIT
"""Read per descriptor: module constants, not enum members through the class."""


def hits_for(descriptor: Descriptor, request_hits: int) -> int:
    """Per-descriptor ``hits_addend`` wins, and 0 there means check only; the request's
    ``hits_addend`` applies otherwise, where 0 means 1 (envoyproxy/ratelimit rules)."""
    if descriptor.hits_addend is not None:
        return descriptor.hits_addend
    return request_hits or 1


def drop_replaced(limits: list[RateLimit | None]) -> None:
    """Remove (set to None) every limit named in the ``replaces`` of a matched limit."""
    replaced: set[str] = set()
    for limit in limits:
        if limit is not None and limit.replaces:
            replaced.update(limit.replaces)
    if not replaced:
        return
    for index, limit in enumerate(limits):
        if limit is not None and limit.name and limit.name in replaced:
            limits[index] = None


def near_threshold(limit: int, ratio: float = NEAR_LIMIT_RATIO) -> int:
    """Hits in the window past which admitted hits count as near the limit (80 % by
    default, as envoyproxy/ratelimit counts them, and its NEAR_LIMIT_RATIO otherwise;
    denied hits are all over the limit, since they do not consume the window)."""
    return int(limit * ratio)


def near_hits(threshold: int, before: int, hits: int) -> int:
    """How many of ``hits``, admitted on top of ``before``, are past ``threshold``."""
    after = before + hits
    if after <= threshold:
        return 0
    return hits if before >= threshold else after - threshold


def overall_code(statuses: Sequence[DescriptorStatus]) -> Code:
    """OVER_LIMIT when the statuses deny the request (core/exact.py :func:`denies`): a
    shadow descriptor's status is OK, so an over status that is not quota enforces."""
    enforce_over = quota_seen = quota_admitted = False
    for status in statuses:
        limit = status.limit
        if limit is not None and limit.quota_mode:
            quota_seen = True
            quota_admitted = quota_admitted or status.code is not _OVER
        elif status.code is _OVER:
            enforce_over = True
            break
    return _OVER if denies(enforce_over, quota_seen, quota_admitted) else _OK
