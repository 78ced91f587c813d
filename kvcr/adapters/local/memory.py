"""Host memory from anonymous mmap, copied with libc memmove (the GIL is released per call).

Arenas are mapped with MAP_POPULATE so their pages are faulted in at start-up: writing into
freshly mapped memory is several times slower than into resident memory, and a backup must not
pay that on the serving path.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcr.adapters.digests import copy_and_digest, page_digest
from kvcr.ports.errors import MemoryCopyError, RegistrationError
from kvcr.ports.memory import Allocation, Move

_memmove = ctypes.memmove


class MmapHostMemory:
    """Allocates with mmap; copies with memmove."""

    def __init__(self, *, populate: bool = True) -> None:
        self._populate = populate
        self._maps: dict[int, tuple[mmap.mmap, ctypes.Array[ctypes.c_char]]] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int, label: str) -> Allocation:
        if nbytes <= 0:
            raise RegistrationError(f"{label}: cannot allocate {nbytes} bytes")
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
        if self._populate:
            flags |= getattr(mmap, "MAP_POPULATE", 0)
        try:
            mapping = mmap.mmap(-1, nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise RegistrationError(f"{label}: cannot map {nbytes} bytes: {exc}") from exc
        view = (ctypes.c_char * nbytes).from_buffer(mapping)
        address = ctypes.addressof(view)
        with self._lock:
            self._maps[address] = (mapping, view)
        return Allocation(address, nbytes, label)

    def free(self, allocation: Allocation) -> None:
        with self._lock:
            entry = self._maps.pop(allocation.address, None)
        if entry is None:
            return
        mapping, view = entry
        del view  # drop the buffer export so the map can close
        entry = None
        mapping.close()

    def copy(self, moves: Sequence[Move]) -> None:
        try:
            for move in moves:
                _memmove(move.dst, move.src, move.nbytes)
        except (ctypes.ArgumentError, OSError, ValueError) as exc:
            raise MemoryCopyError(f"copy failed: {exc}") from exc

    def copy_digested(self, pages: Sequence[Sequence[Move]], seeds: Sequence[bytes]) -> list[bytes]:
        try:
            return [copy_and_digest(moves, seed) for moves, seed in zip(pages, seeds, strict=True)]
        except (ctypes.ArgumentError, OSError, ValueError) as exc:
            raise MemoryCopyError(f"copy failed: {exc}") from exc

    def read(self, address: int, nbytes: int) -> bytes:
        return ctypes.string_at(address, nbytes)

    def digest(self, extents: Sequence[tuple[int, int]], seed: bytes) -> bytes:
        return page_digest(extents, seed)

    def close(self) -> None:
        """Free every allocation still held (for tests and process teardown)."""
        with self._lock:
            addresses = list(self._maps)
        for address in addresses:
            self.free(Allocation(address, 0, ""))


if TYPE_CHECKING:
    from kvcr.ports.memory import HostMemory

    _: HostMemory = MmapHostMemory()
