"""One pool's DRAM arena: component regions over one allocation.

Component ``k`` of slot ``s`` lives at ``region_k.base + s * piece_k``: each component is a dense
region, so consecutive slots of one component are adjacent and batched copies merge into runs.
Which slots are free is the slot index's business (``index.py``).
"""

from __future__ import annotations

from kvcr.domain.board import board_layout
from kvcr.domain.layout import RegionDescriptor
from kvcr.domain.pools import PoolSpec
from kvcr.ports.memory import Allocation, HostMemory
from kvcr.runner.board import SlotBoard


def arena_label(pool: str, component: str) -> str:
    return f"kvcr/{pool}/{component}"


def host_label(pool: str, component: str) -> str:
    return f"host/{pool}/{component}"


class Arena:
    """The memory of one pool's slots, which kvcr owns."""

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
        self.board_allocation: Allocation | None = None

    def share_board(self) -> tuple[SlotBoard, RegionDescriptor]:
        """A slot board for this arena, in memory of its own (same-host peers map it as one region)."""
        layout = board_layout(self.slots)
        if self.board_allocation is None:
            self.board_allocation = self._memory.allocate(layout.nbytes, f"kvcr/{self.pool.name}/board")
        address = self.board_allocation.address
        region = RegionDescriptor(f"kvcr/{self.pool.name}/board", address, layout.nbytes, 1, layout.nbytes)
        return SlotBoard(address, layout), region

    def release(self) -> None:
        """Give the memory back (only when quiescent)."""
        if self.allocation is not None:
            self._memory.free(self.allocation)
            self.allocation = None
        if self.board_allocation is not None:
            self._memory.free(self.board_allocation)
            self.board_allocation = None
