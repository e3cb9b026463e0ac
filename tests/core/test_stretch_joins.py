"""The counts of joins (core/stretch.py joins_moved): which slots moved since a member's
last read, its own additions left out."""

from __future__ import annotations

from ratelimit_service.core.stretch import JOIN_SLOTS, join_slot, joins_moved


def test_the_slots_that_moved_but_by_the_reader() -> None:
    seen = [0] * JOIN_SLOTS
    counts = list(seen)
    counts[5] += 1  # another member joined a counter of slot 5
    counts[9] += 1  # this one added to slot 9, in the call that read
    assert joins_moved(seen, counts, [9]) == {5}
    assert joins_moved(seen, seen, []) == set()
    assert joins_moved(None, counts, []) is None  # nothing read before: every slot
    assert joins_moved(counts, seen, []) is None  # went back: the store restarted empty
    counts[9] += 1  # another member joined slot 9 too
    assert joins_moved(seen, counts, [9]) == {5, 9}


def test_a_counter_has_one_slot_and_counters_spread_over_them() -> None:
    keys = [f"q\x1ftenant\x1et{n}\x1f1" for n in range(1000)]
    slots = [join_slot(key) for key in keys]
    assert slots == [join_slot(key) for key in keys]
    assert set(slots) == set(range(JOIN_SLOTS))
