"""A size-bounded mapping that forgets the least recently used entry first, so that high-cardinality
descriptor values (client addresses, user ids) cannot grow a per-key table without bound."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")

SWEEP_PIECE = 1_000
"""Entries judged per piece of :meth:`LruMap.remove_if` (well under a millisecond)."""


class LruMap(Generic[V]):
    __slots__ = ("_data", "evictions", "max_size")

    def __init__(self, max_size: int) -> None:
        if max_size <= 0:
            raise ValueError("max_size must be positive")
        self._data: OrderedDict[str, V] = OrderedDict()
        self.max_size = max_size
        self.evictions = 0

    def get_or_create(self, key: str, factory: Callable[[], V]) -> V:
        value = self._data.get(key)
        if value is None:
            value = factory()
            self._data[key] = value
            if len(self._data) > self.max_size:
                self._data.popitem(last=False)
                self.evictions += 1
        else:
            self._data.move_to_end(key)
        return value

    def remove_if(self, predicate: Callable[[V], bool], piece: int = SWEEP_PIECE) -> Iterator[int]:
        """Drop the entries for which ``predicate`` holds, ``piece`` entries at a time: yields how
        many each piece removed, so a caller can leave the event loop to other work between pieces.
        The keys are listed first: the map may change between pieces (a key added since waits for
        the next pass); an entry is judged as its piece finds it."""
        data = self._data
        keys = list(data)
        for start in range(0, len(keys), piece):
            removed = 0
            for key in keys[start : start + piece]:
                value = data.get(key)
                if value is not None and predicate(value):
                    del data[key]
                    removed += 1
            yield removed

    def items(self) -> list[tuple[str, V]]:
        """Every entry, least recently used first: a copy, which stays valid while the
        map changes."""
        return list(self._data.items())

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)
