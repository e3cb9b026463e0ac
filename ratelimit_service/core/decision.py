"""Small rules that turn per-descriptor results into a response, shared by both modes,
and the one place that says which rule decided an answer (for the response's
metadata, its headers, explain and traces)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

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


def deciding_status(statuses: Sequence[DescriptorStatus]) -> DescriptorStatus | None:
    """The status of the rule that decided the answer: the last over-limit descriptor
    not in quota mode; else the limited descriptor with the least remaining (on an OK,
    the rule nearest to denying; when every quota descriptor is over, one of them).
    None when no descriptor has a finite limit. The rate-limit headers report it too,
    as envoyproxy/ratelimit chooses the descriptor they report."""
    chosen: DescriptorStatus | None = None
    for status in statuses:
        if status.limit is not None and (chosen is None or status.remaining < chosen.remaining):
            chosen = status
    for status in statuses:
        limit = status.limit
        if status.code is _OVER and limit is not None and not limit.quota_mode:
            chosen = status
    return chosen


def rule_name(limit: RateLimit) -> str:
    """How a rule is named to operators: its YAML ``name``, else its stats key."""
    return limit.name or limit.stats_key


def deciding_rule(statuses: Sequence[DescriptorStatus]) -> str | None:
    """The name (:func:`rule_name`) of the rule that decided the answer, or None."""
    status = deciding_status(statuses)
    return None if status is None or status.limit is None else rule_name(status.limit)


def limit_facts(limit: RateLimit) -> dict[str, Any]:
    """What the decision metadata says of a descriptor's rule: the same for every
    request it matches (the wire encoder serializes it once per config)."""
    return {"rule": rule_name(limit), "limit": limit.requests_per_unit, "unit": limit.period}


def decision_metadata(domain: str, statuses: Sequence[DescriptorStatus]) -> dict[str, Any]:
    """The response's ``dynamic_metadata``, which Envoy's ratelimit filter puts under
    its namespace for access logs: the domain, the deciding rule (:func:`deciding_rule`;
    absent when no descriptor has a finite limit) and, per descriptor in request order,
    its rule's :func:`limit_facts` and ``remaining``, or None when it has no finite
    limit. rls/wire.py writes the same content straight to bytes."""
    metadata: dict[str, Any] = {"domain": domain}
    rule = deciding_rule(statuses)
    if rule is not None:
        metadata["rule"] = rule
    metadata["descriptors"] = [
        None
        if status.limit is None
        else {**limit_facts(status.limit), "remaining": status.remaining}
        for status in statuses
    ]
    return metadata
