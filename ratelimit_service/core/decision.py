"""Small rules that turn per-descriptor results into a response, shared by both modes,
and the one place that says which rule decided an answer (for the response's
metadata, its headers, explain and traces)."""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from ratelimit_service.core.config_model import RateLimit
from ratelimit_service.core.exact import HitRole, denies
from ratelimit_service.core.request import Code, Descriptor, DescriptorStatus, Request, Response
from ratelimit_service.core.settings_table import default

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
    replaced = {name for limit in limits if limit is not None for name in limit.replaces}
    for index, limit in enumerate(limits):
        if limit is not None and limit.name and limit.name in replaced:
            limits[index] = None


def near_threshold(limit: int, ratio: float = default("--near-limit-ratio")) -> int:
    """Hits in the window past which admitted hits count as near the limit (80 % by
    default, as envoyproxy/ratelimit counts them, and its NEAR_LIMIT_RATIO otherwise;
    denied hits are all over the limit)."""
    return int(limit * ratio)


def near_hits(threshold: int, before: int, hits: int) -> int:
    """How many of ``hits``, admitted on top of ``before``, are past ``threshold``."""
    after = before + hits
    if after <= threshold:
        return 0
    return hits if before >= threshold else after - threshold


def role_of(limit: RateLimit) -> HitRole:
    """What a rule's verdict does to the request: a shadow rule never denies (a rule
    both shadow and quota is shadow), a quota rule denies only with every other quota
    rule of the request, any other rule denies alone."""
    if limit.shadow_mode:
        return HitRole.SHADOW
    if limit.quota_mode:
        return HitRole.QUOTA
    return HitRole.ENFORCE


def verdict(statuses: Sequence[DescriptorStatus]) -> tuple[Code, DescriptorStatus | None]:
    """The answer's overall code (OVER_LIMIT when core/exact.py :func:`denies` says so) and the
    status of the rule that decided it, in one pass. On a denial, the last enforcing descriptor
    over, else the last quota descriptor over; otherwise the limited descriptor with the least
    remaining, the first of equals (the rule nearest to denying, as envoyproxy/ratelimit picks the
    descriptor its rate-limit headers report). None when no descriptor has a limit."""
    nearest = enforce_over = quota_over = None
    quota_admitted = False
    for status in statuses:
        limit = status.limit
        if limit is None:
            continue
        if nearest is None or status.remaining < nearest.remaining:
            nearest = status
        if role_of(limit) is HitRole.QUOTA:
            if status.code is _OVER:
                quota_over = status
            else:
                quota_admitted = True
        elif status.code is _OVER:
            enforce_over = status
    quota_seen = quota_admitted or quota_over is not None
    if denies(enforce_over is not None, quota_seen, quota_admitted):
        return _OVER, enforce_over or quota_over
    return _OK, nearest


def answer(statuses: list[DescriptorStatus], admit: bool = False) -> Response:
    """The response for ``statuses`` (:func:`verdict`, worked out once per answer). With
    ``admit`` (global shadow mode, or the limiter admitted the request already) the
    answer is OK, marked ``shadowed`` where the statuses deny."""
    code, decided = verdict(statuses)
    if code is _OVER and admit:
        return Response(_OK, statuses, decided, True)
    return Response(code, statuses, decided)


def rule_name(limit: RateLimit) -> str:
    """How a rule is named to operators: its YAML ``name``, else its stats key."""
    return limit.name or limit.stats_key


def limit_facts(limit: RateLimit) -> dict[str, Any]:
    """What the decision metadata says of a descriptor's rule, the same for every request
    (the wire encoder serializes it once per config)."""
    return {"rule": rule_name(limit), "limit": limit.requests_per_unit, "unit": limit.period}


SHADOW = "shadow"
SHADOW_OVER = "OVER_LIMIT"
"""The decision metadata's mark of a verdict shadow mode turned into OK:
``"shadow": "OVER_LIMIT"``."""


def decision_metadata(
    domain: str, response: Response, go_request: Request | None = None
) -> dict[str, Any]:
    """The response's ``dynamic_metadata`` (Envoy's ratelimit filter puts it under its namespace for
    access logs): the domain, the deciding rule (absent when no descriptor has a finite limit),
    ``shadow: OVER_LIMIT`` when the answer is Response.shadowed, and under ``descriptors``, per
    descriptor in request order, its rule's :func:`limit_facts` and ``remaining`` (with
    ``shadow: OVER_LIMIT`` for a shadow rule over its limit), or None without a finite limit. With
    ``go_request`` (``--go-dynamic-metadata``), :func:`go_metadata` too, whose ``descriptors`` move
    ours to ``limits``. rls/wire.py writes the same content straight to bytes."""
    metadata: dict[str, Any] = {"domain": domain}
    statuses, decided = response.statuses, response.decided
    if decided is not None and decided.limit is not None:
        metadata["rule"] = rule_name(decided.limit)
    if response.shadowed:
        metadata[SHADOW] = SHADOW_OVER
    items: list[dict[str, Any] | None] = []
    for status in statuses:
        if status.limit is None:
            items.append(None)
            continue
        item = {**limit_facts(status.limit), "remaining": status.remaining}
        if status.shadow_over:
            item[SHADOW] = SHADOW_OVER
        items.append(item)
    if go_request is not None:
        metadata.update(go_metadata(go_request, statuses))
    metadata["descriptors" if go_request is None else "limits"] = items
    return metadata


def go_metadata(request: Request, statuses: Sequence[DescriptorStatus]) -> dict[str, Any]:
    """What envoyproxy/ratelimit puts in an answer's dynamic metadata with
    RESPONSE_DYNAMIC_METADATA=true (its src/service/ratelimit.go, ratelimitToMetadata),
    but ``domain``: ``descriptors`` (:func:`go_descriptor`), the request's ``hitsAddend``
    when not 0, and ``metadata``: the ``metadata`` maps of the rules whose descriptors
    passed (a finite limit answered OK, shadow rules included) merged, when there is any.
    Envoy routes a request to the backend whose quota passed by it."""
    result: dict[str, Any] = {"descriptors": [go_descriptor(d) for d in request.descriptors]}
    if request.hits_addend:
        result["hitsAddend"] = request.hits_addend
    passed: dict[str, Any] = {}
    for status in statuses:
        limit = status.limit
        if limit is not None and limit.metadata and status.code is _OK:
            merge_metadata(passed, limit.metadata)
    if passed:
        result["metadata"] = passed
    return result


def go_descriptor(descriptor: Descriptor) -> dict[str, Any]:
    """One request descriptor as envoyproxy/ratelimit's metadata lists it: its entries as
    ``key=value``, its ``limit`` override as protobuf text (``requests_per_unit:N
    unit:NAME``) and its own ``hitsAddend``, when it has them."""
    item: dict[str, Any] = {"entries": [f"{key}={value}" for key, value in descriptor.entries]}
    if descriptor.override is not None:
        per_unit, unit = descriptor.override
        name = "UNKNOWN" if unit is None else unit.name
        item["limit"] = f"requests_per_unit:{per_unit} unit:{name}"
    if descriptor.hits_addend is not None:
        item["hitsAddend"] = descriptor.hits_addend
    return item


def merge_metadata(into: dict[str, Any], source: Mapping[str, Any]) -> None:
    """envoyproxy/ratelimit's merge: a key already there keeps its value (the first
    passed rule wins), unless both values are mappings, which merge the same way.
    Copies what it takes, so a rule's own metadata is never changed."""
    for key, value in source.items():
        present = into.get(key)
        if present is None and key not in into:
            into[key] = copy.deepcopy(value)
        elif isinstance(present, dict) and isinstance(value, Mapping):
            merge_metadata(present, value)
