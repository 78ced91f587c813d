"""Eviction policies, LRU by default, with prefix-recency alignment.

Pages of one prefix are touched together, in prefix order, and the deepest page ends up the
least recent of the group: under pressure a prefix loses its tail first, so what stays is still
a restorable prefix. Policies see block keys only; the runner decides which slots are evictable.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Protocol


class EvictionPolicy(Protocol):
    """Orders resident keys for eviction.

    Call order: ``admit`` when a key becomes resident, ``touch`` when a prefix is used,
    ``victims`` to walk candidates (first = evict first), ``remove`` when a key leaves.
    """

    def admit(self, keys: Sequence[str]) -> None:
        """Start tracking ``keys`` (in prefix order) as the most recent group."""

    def touch(self, keys: Sequence[str]) -> None:
        """Mark ``keys`` (in prefix order, shallowest first) as used together now."""

    def remove(self, key: str) -> None:
        """Stop tracking ``key``; unknown keys are ignored."""

    def victims(self) -> Iterator[str]:
        """Keys from first-to-evict to last, lazily; collect before calling ``remove``."""

    def __len__(self) -> int: ...


class LruPolicy:
    """Least recently used first; within one touch, deepest first."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def admit(self, keys: Sequence[str]) -> None:
        self.touch(keys)

    def touch(self, keys: Sequence[str]) -> None:
        order = self._order
        # Move the deepest first so the shallowest ends up most recent.
        for key in reversed(keys):
            order[key] = None
            order.move_to_end(key)

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


class FifoPolicy:
    """First admitted, first evicted; touches do not refresh (deepest first within a group)."""

    def __init__(self) -> None:
        self._order: OrderedDict[str, None] = OrderedDict()

    def admit(self, keys: Sequence[str]) -> None:
        for key in reversed(keys):
            if key not in self._order:
                self._order[key] = None

    def touch(self, keys: Sequence[str]) -> None:
        del keys  # FIFO ignores use

    def remove(self, key: str) -> None:
        self._order.pop(key, None)

    def victims(self) -> Iterator[str]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


POLICIES: dict[str, type[LruPolicy] | type[FifoPolicy]] = {"lru": LruPolicy, "fifo": FifoPolicy}
