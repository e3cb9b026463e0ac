"""ShouldRateLimit bytes in and out, without protobuf objects where they cost most (a
visible share of the CPU at a few thousand requests per second per process):

- **Requests**: most traffic repeats a few descriptor sets, so parsed and validated
  requests are kept by their bytes (small ones, a bounded number).
- **Responses** are written directly in the protobuf wire format: each limit's status
  head (``code`` and ``current_limit``) is serialized once per config, and the rest is
  a handful of varints. Field numbers come from the message descriptors, and the tests
  parse what this module writes with the protobuf runtime.
- **Decision metadata** (``dynamic_metadata``): core.decision.decision_metadata's
  content, from parts kept per limit and per domain; the tests compare the two.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.service.ratelimit.v3 import rls_pb2
from google.protobuf import struct_pb2

from ratelimit_service.core.config_model import OverLimitAnswer, RateLimit
from ratelimit_service.core.decision import SHADOW, SHADOW_OVER, go_metadata, limit_facts, rule_name
from ratelimit_service.core.request import UINT32_MAX, Code, DescriptorStatus, Request, Response

_VARINT = 0
_FIXED64 = 1
_LENGTH_DELIMITED = 2


def _tag(message: Any, field: str, wire_type: int) -> bytes:
    number = message.DESCRIPTOR.fields_by_name[field].number
    return bytes([(number << 3) | wire_type])  # every field number here is < 16


_RESPONSE = rls_pb2.RateLimitResponse
_OVERALL = _tag(_RESPONSE, "overall_code", _VARINT)
_STATUSES = _tag(_RESPONSE, "statuses", _LENGTH_DELIMITED)
_HEADERS = _tag(_RESPONSE, "response_headers_to_add", _LENGTH_DELIMITED)
_CODE = _tag(_RESPONSE.DescriptorStatus, "code", _VARINT)
_CURRENT_LIMIT = _tag(_RESPONSE.DescriptorStatus, "current_limit", _LENGTH_DELIMITED)
_REMAINING = _tag(_RESPONSE.DescriptorStatus, "limit_remaining", _VARINT)
_RESET = _tag(_RESPONSE.DescriptorStatus, "duration_until_reset", _LENGTH_DELIMITED)
_SECONDS = b"\x08"  # google.protobuf.Duration.seconds = 1, varint
_NANOS = b"\x10"  # google.protobuf.Duration.nanos = 2, varint
_HEADER_KEY = _tag(base_pb2.HeaderValue, "key", _LENGTH_DELIMITED)
_HEADER_VALUE = _tag(base_pb2.HeaderValue, "value", _LENGTH_DELIMITED)
_METADATA = _tag(_RESPONSE, "dynamic_metadata", _LENGTH_DELIMITED)
_RAW_BODY = _tag(_RESPONSE, "raw_body", _LENGTH_DELIMITED)
_STRUCT_ENTRY = _tag(struct_pb2.Struct, "fields", _LENGTH_DELIMITED)
_ENTRY_KEY = _tag(struct_pb2.Struct.FieldsEntry, "key", _LENGTH_DELIMITED)
_ENTRY_VALUE = _tag(struct_pb2.Struct.FieldsEntry, "value", _LENGTH_DELIMITED)
_NULL = _tag(struct_pb2.Value, "null_value", _VARINT)
_NUMBER = _tag(struct_pb2.Value, "number_value", _FIXED64)
_STRING = _tag(struct_pb2.Value, "string_value", _LENGTH_DELIMITED)
_BOOL = _tag(struct_pb2.Value, "bool_value", _VARINT)
_STRUCT = _tag(struct_pb2.Value, "struct_value", _LENGTH_DELIMITED)
_LIST = _tag(struct_pb2.Value, "list_value", _LENGTH_DELIMITED)
_LIST_ITEM = _tag(struct_pb2.ListValue, "values", _LENGTH_DELIMITED)
_DOUBLE = struct.Struct("<d").pack
_REMAINING_KEY = _ENTRY_KEY + bytes([9]) + b"remaining" + _ENTRY_VALUE + bytes([9]) + _NUMBER
_REMAINING_HEAD = _STRUCT_ENTRY + bytes([len(_REMAINING_KEY) + 8]) + _REMAINING_KEY
"""The ``remaining`` entry of a descriptor's Struct, up to its 8-byte double."""

MAX_CACHED_REQUEST_BYTES = 512
"""Requests up to this size are kept by their bytes; larger ones are parsed each time."""
MAX_CACHED_REQUESTS = 10_000
"""Kept requests at most (cleared when full): at most about 5 MB of keys."""


_SMALL = tuple(bytes([value]) for value in range(0x80))
"""One-byte varints: codes, small counts and most whole seconds."""


def _varint(value: int) -> bytes:
    # Unrolled up to three bytes, where a loop costs twice as much; the longer varints
    # (large remaining counts, durations' nanos) are written into fields that are kept.
    if value < 0x80:
        return _SMALL[value]
    if value < 0x4000:
        return bytes(((value & 0x7F) | 0x80, value >> 7))
    if value < 0x200000:
        return bytes(((value & 0x7F) | 0x80, ((value >> 7) & 0x7F) | 0x80, value >> 14))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: bytes, payload: bytes) -> bytes:
    """A length-delimited field: tag, length, payload."""
    return tag + _varint(len(payload)) + payload


def limit_bytes(limit: RateLimit) -> bytes:
    """A status's whole ``current_limit`` field (serialized by protobuf): built once per limit."""
    message = _RESPONSE.RateLimit(
        name=limit.name, requests_per_unit=limit.requests_per_unit, unit=int(limit.unit)
    )
    return _field(_CURRENT_LIMIT, message.SerializeToString())


_CODES = {code: _CODE + _varint(int(code)) for code in Code}
_OVERALL_CODES = {code: _varint(int(code)) for code in Code}
_OVER_LIMIT = Code.OVER_LIMIT


class LimitHeads:
    """Each limit's status head (``code`` and ``current_limit`` fields) for each code, serialized
    once per config and found by id() (kept alive here, so no other object has one of their ids). A
    per-request override is serialized when encoded."""

    def __init__(self, limits: Iterable[RateLimit] = ()) -> None:
        self._limits = tuple(limits)
        self.by_code: dict[Code, dict[int, bytes]] = {
            code: {id(limit): _CODES[code] + limit_bytes(limit) for limit in self._limits}
            for code in Code
        }
        self.items: dict[int, bytes] = {id(limit): item_head(limit) for limit in self._limits}
        """Each limit's descriptor item of the decision metadata, up to its remaining."""
        self.rule: dict[int, bytes] = {id(limit): rule_entry(limit) for limit in self._limits}
        """Each limit's ``rule`` entry of the decision metadata."""
        self.over_limit: dict[int, bytes] = {
            id(limit): over_limit_fields(limit.over_limit)
            for limit in self._limits
            if limit.over_limit is not None
        }
        """The ``raw_body`` and content-type fields of each limit with an over_limit."""


_NO_HEADS = LimitHeads()

_CONTINUED = tuple(_REMAINING + bytes([low | 0x80]) for low in range(0x80))
"""The limit_remaining tag and the low seven bits of a varint of two bytes or more."""
_HIGHS: dict[int, bytes] = {}
"""The rest of such a varint (value >> 7), kept: it changes every 128 values."""
MAX_CACHED_HIGHS = 4096
_DURATIONS: dict[int, bytes] = {}
"""Whole ``duration_until_reset`` fields by milliseconds."""
MAX_CACHED_DURATIONS = 65_536


def encode_response(
    response: Response,
    headers: Sequence[tuple[str, str]] | None,
    heads: LimitHeads = _NO_HEADS,
    domain: str | None = None,
    go_request: Request | None = None,
) -> bytes:
    """The response's wire bytes, in one loop without calls where it can. ``domain``: to write the
    decision metadata (None: none); ``go_request``: to add envoyproxy/ratelimit's keys."""
    parts = [_OVERALL, _OVERALL_CODES[response.overall]]
    small, codes, durations, highs = _SMALL, _CODES, _DURATIONS, _HIGHS
    by_code = heads.by_code
    for status in response.statuses:
        remaining = status.remaining
        if not remaining:
            tail = b""
        elif remaining < 0x80:
            tail = _REMAINING + small[remaining]
        else:
            if remaining > UINT32_MAX:
                remaining = UINT32_MAX
            high = highs.get(remaining >> 7)
            if high is None:
                high = _kept(highs, MAX_CACHED_HIGHS, remaining >> 7, _varint(remaining >> 7))
            tail = _CONTINUED[remaining & 0x7F] + high
        limit = status.limit
        if limit is None:
            body = codes[status.code] + tail
        else:
            head = by_code[status.code].get(id(limit))
            if head is None:
                head = codes[status.code] + limit_bytes(limit)
            reset = status.reset_after or 0.0
            # Whole milliseconds, rounded up (a client that waits that long finds
            # room): the same few thousand values recur, so their bytes are kept.
            millis = int(reset * 1000.0)
            if millis < reset * 1000.0:
                millis += 1
            duration = durations.get(millis)
            if duration is None:
                duration = _duration_field(millis)
            body = head + tail + duration
        size = len(body)
        parts += (_STATUSES, small[size] if size < 0x80 else _varint(size), body)
    for key, value in headers or ():
        parts.append(_header(key.encode(), value.encode()))
    if heads.over_limit and response.overall is _OVER_LIMIT:
        parts.append(over_limit_field(response.decided, heads))
    if domain is not None:
        parts.append(metadata_field(domain, response, heads, go_request))
    return b"".join(parts)


def over_limit_fields(answer: OverLimitAnswer) -> bytes:
    """A rule's 429 as RLS answer fields: ``raw_body`` and any ``content-type`` header."""
    fields = _field(_RAW_BODY, answer.body)
    if answer.content_type is not None:
        fields += _header(b"content-type", answer.content_type.encode())
    return fields


def _header(key: bytes, value: bytes) -> bytes:
    """One ``response_headers_to_add`` field."""
    return _field(_HEADERS, _field(_HEADER_KEY, key) + _field(_HEADER_VALUE, value))


def over_limit_field(decided: DescriptorStatus | None, heads: LimitHeads) -> bytes:
    """The over_limit answer of the rule that decided a denial (Response.decided), if any."""
    if decided is None or decided.limit is None or decided.limit.over_limit is None:
        return b""
    fields = heads.over_limit.get(id(decided.limit))
    return fields if fields is not None else over_limit_fields(decided.limit.over_limit)


def _value(value: Any) -> bytes:
    """A google.protobuf.Value's payload for a str, number, bool, None, mapping or list."""
    if value is None:
        return _NULL + b"\x00"
    if isinstance(value, bool):
        return _BOOL + _SMALL[int(value)]
    if isinstance(value, (int, float)):
        return _NUMBER + _DOUBLE(value)
    if isinstance(value, str):
        return _field(_STRING, value.encode())
    if isinstance(value, Mapping):
        return _field(_STRUCT, struct_entries(value))
    return _field(_LIST, b"".join(_field(_LIST_ITEM, _value(item)) for item in value))


def _entry(key: str, value_payload: bytes) -> bytes:
    """One Struct field (a map entry) whose value's payload is given."""
    return _field(
        _STRUCT_ENTRY, _field(_ENTRY_KEY, key.encode()) + _field(_ENTRY_VALUE, value_payload)
    )


def struct_entries(mapping: Mapping[str, Any]) -> bytes:
    """A google.protobuf.Struct's payload: one entry per key."""
    return b"".join(_entry(key, _value(value)) for key, value in mapping.items())


def item_head(limit: RateLimit) -> bytes:
    """A descriptor's item in the metadata's list (its limit_facts and ``remaining``) up
    to the remaining count's 8 bytes, which come last."""
    body = struct_entries(limit_facts(limit)) + _REMAINING_HEAD
    value = _STRUCT + _varint(len(body) + 8) + body
    return _LIST_ITEM + _varint(len(value) + 8) + value


def rule_entry(limit: RateLimit) -> bytes:
    return _entry("rule", _value(rule_name(limit)))


_NO_LIMIT_ITEM = _field(_LIST_ITEM, _value(None))
_SHADOW_ENTRY = _entry(SHADOW, _value(SHADOW_OVER))
_DESCRIPTORS_KEY = _field(_ENTRY_KEY, b"descriptors") + _ENTRY_VALUE
_LIMITS_KEY = _field(_ENTRY_KEY, b"limits") + _ENTRY_VALUE
_DOMAINS: dict[str, bytes] = {}
MAX_CACHED_DOMAINS = 1024


def metadata_field(
    domain: str, response: Response, heads: LimitHeads, go_request: Request | None = None
) -> bytes:
    """The whole ``dynamic_metadata`` field: core.decision.decision_metadata's content
    (envoyproxy/ratelimit's keys encoded per answer; a shadow rule over its limit whole)."""
    domain_entry = _DOMAINS.get(domain)
    if domain_entry is None:
        domain_entry = _kept(_DOMAINS, MAX_CACHED_DOMAINS, domain, _entry("domain", _value(domain)))
    parts = [domain_entry]
    statuses, decided = response.statuses, response.decided
    if decided is not None and decided.limit is not None:
        rule = heads.rule.get(id(decided.limit))
        parts.append(rule if rule is not None else rule_entry(decided.limit))
    if response.shadowed:  # global shadow mode
        parts.append(_SHADOW_ENTRY)
    heads_of = heads.items
    items = []
    for status in statuses:
        limit = status.limit
        if limit is None:
            items.append(_NO_LIMIT_ITEM)
            continue
        if status.shadow_over:
            item = {**limit_facts(limit), "remaining": status.remaining, SHADOW: SHADOW_OVER}
            items.append(_field(_LIST_ITEM, _value(item)))
            continue
        head = heads_of.get(id(limit))
        if head is None:
            head = item_head(limit)
        items.append(head + _DOUBLE(status.remaining))
    listed = _field(_LIST, b"".join(items))
    key = _DESCRIPTORS_KEY
    if go_request is not None:
        parts.append(struct_entries(go_metadata(go_request, statuses)))
        key = _LIMITS_KEY
    entry = key + _varint(len(listed)) + listed
    parts.append(_STRUCT_ENTRY + _varint(len(entry)) + entry)
    return _field(_METADATA, b"".join(parts))


def _kept(cache: dict[Any, bytes], most: int, key: Any, value: bytes) -> bytes:
    """``value``, kept in ``cache`` under ``key`` (cleared when it holds ``most``)."""
    if len(cache) >= most:
        cache.clear()
    cache[key] = value
    return value


def _duration_field(millis: int) -> bytes:
    """The whole ``duration_until_reset`` field for ``millis``, kept for reuse."""
    seconds, rest = divmod(millis, 1000)
    payload = b""
    if seconds:
        payload = _SECONDS + _varint(seconds)
    if rest:
        payload += _NANOS + _varint(rest * 1_000_000)
    return _kept(_DURATIONS, MAX_CACHED_DURATIONS, millis, _RESET + _SMALL[len(payload)] + payload)


class RequestCache:
    """Converted requests by their bytes; ``convert`` raises on an invalid one (not kept)."""

    def __init__(self, convert: Callable[[bytes], Request]) -> None:
        self._convert = convert
        self._kept: dict[bytes, Request] = {}
        self.find = self._kept.get
        """A kept request or None, without a Python frame (get() converts)."""

    def clear(self) -> None:
        self._kept.clear()

    def get(self, raw: bytes) -> Request:
        request = self._kept.get(raw)
        if request is not None:
            return request
        request = self._convert(raw)
        if len(raw) <= MAX_CACHED_REQUEST_BYTES:
            if len(self._kept) >= MAX_CACHED_REQUESTS:
                self._kept.clear()
            self._kept[raw] = request
        return request
