"""One pool's DRAM arena: component regions over one allocation, and its free slots.

Component ``k`` of slot ``s`` lives at ``region_k.base + s * piece_k``: each component is a dense
region, so consecutive slots of one component are adjacent and batched copies merge into runs.
Free slots are handed out lowest first, which keeps a batch's slots consecutive when it can.
"""

from __future__ import annotations

import bisect

from kvcr.domain.layout import RegionDescriptor
from kvcr.domain.pools import PoolSpec
from kvcr.ports.memory import Allocation, HostMemory


def arena_label(pool: str, component: str) -> str:
    return f"kvcr/{pool}/{component}"


def host_label(pool: str, component: str) -> str:
    return f"host/{pool}/{component}"


class Arena:
    """Slots of one pool in memory kvcr owns. Not thread-safe: the runner's lock guards it."""

    def __init__(self, pool: PoolSpec, slots: int, memory: HostMemory) -> None:
        self.pool = pool
        self.slots = slots
        self._memory = memory
        self.allocation: Allocation | None = memory.allocate(slots * pool.page_bytes, f"kvcr/{pool.name}")
        regions = []
        offset = 0
        for component in pool.components:
            regions.append(
                RegionDescriptor(
                    label=arena_label(pool.name, component.label),
                    base=self.allocation.address + offset,
                    stride=component.piece_bytes,
                    count=slots,
                    piece_bytes=component.piece_bytes,
                )
            )
            offset += slots * component.piece_bytes
        self.regions: tuple[RegionDescriptor, ...] = tuple(regions)
        self._free: list[int] = list(range(slots))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        """Up to ``count`` free slots, lowest first."""
        taken = self._free[:count]
        del self._free[:count]
        return taken

    def give_back(self, slot: int) -> None:
        """Return a slot to the free list (the caller guarantees nothing touches it)."""
        bisect.insort(self._free, slot)

    def give_back_many(self, slots: list[int]) -> None:
        """Return several slots at once (one sort instead of one insertion each)."""
        if slots:
            self._free.extend(slots)
            self._free.sort()

    def release(self) -> None:
        """Give the memory back (only when quiescent)."""
        if self.allocation is not None:
            self._memory.free(self.allocation)
            self.allocation = None
