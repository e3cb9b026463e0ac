"""A size-bounded mapping that forgets the least recently used entry first.

High-cardinality descriptor values (client addresses, user ids) would otherwise
grow every per-key table without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


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

    def remove_if(self, predicate: Callable[[V], bool]) -> int:
        """Drop entries for which ``predicate`` holds (used to sweep idle state)."""
        doomed = [key for key, value in self._data.items() if predicate(value)]
        for key in doomed:
            del self._data[key]
        return len(doomed)

    def __len__(self) -> int:
        return len(self._data)

    def __iter__(self) -> Iterator[str]:
        return iter(self._data)
