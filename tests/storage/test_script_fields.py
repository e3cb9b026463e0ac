"""Every hash field the Lua scripts read or write, one name for one meaning across all
of them: the table below is the only list, and each script's fields are read from its
source (every HSET, HMGET, HGET, HINCRBY and HDEL call), so a field added, renamed or
given a second meaning fails here until the table says what it means."""

from __future__ import annotations

import re

import pytest

from ratelimit_service.storage.redis_calls import script_text

FIELDS = {
    # exact_window.lua: a window's hash, besides its slices (slice index -> hits)
    "sum": "hits in the window's live slices",
    "first": "the index of the window's oldest live slice",
    "last": "the index of the window's newest slice",
    # fleet_sync.lua: a probabilistic bucket's fleet hash
    "v": "a bucket's or counter's state, packed (storage/script_calls.py FleetState and"
    " CounterState): the figures each sync or publish reads and writes",
    "tk": "the fleet bucket's tokens, in an earlier layout (now in v)",
    "ts": "when the tokens were last updated (microseconds), in an earlier layout",
    "o": "hits offered to the fleet, a monotonic count, in an earlier layout",
    "a": "hits the fleet admitted, a count, in an earlier layout",
    "c": "when the bucket was created (microseconds)",
    "L": "the bucket's limit per window",
    "T": "a calendar budget's bucket in a zone: the admitted total the zone may reach",
    "E": "a calendar budget's bucket in a zone: when its period ends (microseconds)",
    # quota_tier.lua: an RLQS counter's hash
    "D": "the live members' demands summed, in an earlier layout (now in v)",
    "N": "the live members' instances summed, in an earlier layout",
    "P": "the live members' parts summed, in an earlier layout",
    "d:*": "a member's demand (thousandths of a hit per second), in an earlier layout",
    "n:*": "a member's instances, in an earlier layout",
    "p:*": "a member's part (thousandths of a hit per second), in an earlier layout",
    "f:*": "the highest fencing token seen from a member",
    "w": "the index of the current fixed window, in an earlier layout",
    "u": "the hits allowed in window w, in an earlier layout",
    "R": "the rule's limit (thousandths of a hit per second)",
    # fleet_sync.lua's buckets and quota_tier.lua's counters alike
    "x": "when the key expires (microseconds), in an earlier layout",
    # a zone's counters and buckets alike
    "K": "the counter's or bucket's key",
    "W": "the window (microseconds)",
    "Z": "the zone's part of the limit (thousandths of a hit per second)",
    "i": "when its score in the zone's index was last renewed, in an earlier layout",
    "G": "the hits the whole fleet allowed in window gw, as the global store counted",
    "gw": "the index of the window G counts",
    "g": "of those, the hits this zone already forwarded to the global store",
    # lease.lua: a zone's lease
    "h": "the lease's holder",
    "t": "the holder's fencing token",
    "e": "when the lease expires (microseconds)",
}

SCRIPTS = {
    "exact_window.lua": {"sum", "first", "last"},
    "fleet_sync.lua": {"v", "tk", "ts", "o", "a", "c", "K", "L", "W", "Z", "T", "E", "x", "i"},
    "quota_tier.lua": {"v", "D", "N", "P", "d:*", "n:*", "p:*", "f:*", "w", "u", "x"}
    | {"K", "R", "W", "Z", "G", "gw", "g", "i"},
    "zone_read.lua": {"K", "v", "D", "N", "R", "W", "w", "u", "gw", "g"},
    "zone_read_fleet.lua": {"K", "v", "o", "a", "L", "W", "g", "c", "E"},
    "zone_write.lua": {"Z", "G", "gw", "g", "T"},
    "lease.lua": {"h", "t", "e"},
}

_CALL = re.compile(r"call\('(HSET|HMGET|HGET|HINCRBY|HDEL)',")


def _arguments(source: str, start: int) -> list[str]:
    """The arguments of the call whose '(' is at ``start``, split at its own commas."""
    depth, args, current = 0, [], ""
    for char in source[start:]:
        if char == "(":
            depth += 1
            if depth == 1:
                continue
        elif char == ")":
            depth -= 1
            if depth == 0:
                args.append(current.strip())
                return args
        if char == "," and depth == 1:
            args.append(current.strip())
            current = ""
        else:
            current += char
    raise AssertionError("unclosed call")


def _name(argument: str) -> str | None:
    """A field named by a literal ('x'), or a family of them ('x:' .. who: 'x:*')."""
    if match := re.fullmatch(r"'([^']*)'", argument):
        return match.group(1)
    if match := re.fullmatch(r"'([^']*)'\s*\.\..*", argument, re.DOTALL):
        return match.group(1) + "*"
    return None


def fields_of(source: str) -> set[str]:
    found: set[str] = set()
    for call in _CALL.finditer(source):
        command = call.group(1)
        args = _arguments(source, call.start() + len("call"))[2:]  # past command and key
        if command == "HSET":
            args = args[::2]  # field, value, field, value...
        elif command in ("HGET", "HINCRBY"):
            args = args[:1]
        found.update(name for arg in args if (name := _name(arg)) is not None)
    return found


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_each_script_uses_only_fields_the_table_defines(script: str) -> None:
    assert fields_of(script_text(script)) == SCRIPTS[script]
    assert SCRIPTS[script] <= FIELDS.keys()


def test_every_field_in_the_table_is_used() -> None:
    assert set().union(*SCRIPTS.values()) == FIELDS.keys()


def test_the_reader_finds_fields_and_families() -> None:
    source = """call('HSET', k, 'x', format('%d', n), 'y:' .. who, v)
    call('HMGET', k, 'a', 'b')  call('HINCRBY', k, 'c', '1')"""
    assert fields_of(source) == {"x", "y:*", "a", "b", "c"}
