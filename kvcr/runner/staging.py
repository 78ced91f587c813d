"""Staging memory: where reads from peers land when a given-up read might still write later.

On transports that cannot fence a read kvcr gave up on (``PeerInfo.late_writes``, e.g. RMA
emulated over TCP, where a frozen source sends the bytes whenever it resumes), landing straight
in the engine's host pages would let late bytes overwrite pages the engine already reused. Such
reads land here instead, in kvcr-owned memory registered as private with the data plane; only a
read that ended DONE is copied on into the host pages. A buffer whose read never settled is
quarantined: never reused, never freed, so late bytes land in memory nobody reads. At most
``max_buffers`` per pool exist; when every one is busy or quarantined, such reads are misses.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from kvcr.domain.layout import RegionDescriptor, page_extents
from kvcr.domain.pools import PoolSpec
from kvcr.ports.dataplane import DataPlane
from kvcr.ports.memory import Allocation, HostMemory


@dataclass(frozen=True, slots=True)
class StagingBuffer:
    """``pages`` pages of one pool: one dense region per component, registered with the data plane."""

    pool: str
    regions: tuple[RegionDescriptor, ...]
    ids: tuple[int, ...]
    allocation: Allocation

    def extents(self, index: int) -> list[tuple[int, int]]:
        """(address, bytes) of every component piece of staged page ``index``."""
        return page_extents(self.regions, index)


class StagingPool:
    """Bounded, lazily allocated staging buffers per pool. Thread-safe."""

    def __init__(self, memory: HostMemory, data_plane: DataPlane, pages: int, max_buffers: int = 4) -> None:
        self._memory = memory
        self._data_plane = data_plane
        self._pages = pages
        self._max = max_buffers
        self._lock = threading.Lock()
        self._free: dict[str, list[StagingBuffer]] = {}
        self._count: dict[str, int] = {}
        self._quarantined: list[StagingBuffer] = []

    @property
    def pages(self) -> int:
        return self._pages

    @property
    def quarantined(self) -> int:
        with self._lock:
            return len(self._quarantined)

    def take(self, spec: PoolSpec) -> StagingBuffer | None:
        """A free buffer for ``spec``'s pages, allocating one if under the cap; None otherwise."""
        with self._lock:
            free = self._free.setdefault(spec.name, [])
            if free:
                return free.pop()
            if self._count.get(spec.name, 0) >= self._max:
                return None
            self._count[spec.name] = self._count.get(spec.name, 0) + 1
        try:
            return self._allocate(spec)
        except BaseException:
            with self._lock:
                self._count[spec.name] -= 1
            raise

    def give_back(self, buffer: StagingBuffer) -> None:
        with self._lock:
            self._free.setdefault(buffer.pool, []).append(buffer)

    def quarantine(self, buffer: StagingBuffer) -> None:
        """Do not reuse ``buffer``: a read into it may still be in flight."""
        with self._lock:
            self._quarantined.append(buffer)

    def release_quarantined(self, buffer: StagingBuffer) -> None:
        """The read into ``buffer`` ended after all (its source came back): it may be reused."""
        with self._lock:
            if buffer in self._quarantined:
                self._quarantined.remove(buffer)
                self._free.setdefault(buffer.pool, []).append(buffer)

    def close(self) -> None:
        """Deregister and free every buffer that is not quarantined."""
        with self._lock:
            buffers = [b for free in self._free.values() for b in free]
            self._free.clear()
        for buffer in buffers:
            self._data_plane.deregister(buffer.ids)
            self._memory.free(buffer.allocation)

    def _allocate(self, spec: PoolSpec) -> StagingBuffer:
        allocation = self._memory.allocate(self._pages * spec.page_bytes, f"kvcr-staging/{spec.name}")
        regions: list[RegionDescriptor] = []
        offset = 0
        for component in spec.components:
            regions.append(
                RegionDescriptor(
                    f"kvcr-staging/{spec.name}/{component.label}/{allocation.address:x}",
                    allocation.address + offset,
                    component.piece_bytes,
                    self._pages,
                    component.piece_bytes,
                )
            )
            offset += self._pages * component.piece_bytes
        try:
            ids = self._data_plane.register(regions, exposed=False)
        except BaseException:
            self._memory.free(allocation)
            raise
        return StagingBuffer(spec.name, tuple(regions), tuple(ids), allocation)
