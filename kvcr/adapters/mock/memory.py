"""Host memory from ctypes buffers, with injectable copy failures.

``fail_after_moves=n`` makes every copy perform its first ``n`` moves and then raise, which
leaves destinations half-written exactly as a real failure would.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcr.adapters.digests import hasher_for, page_digest
from kvcr.domain.digests import PageDigest
from kvcr.ports.errors import MemoryCopyError, RegistrationError
from kvcr.ports.memory import Allocation, Move


class MockHostMemory:
    def __init__(self, *, fail_after_moves: int | None = None, page_digest: str = PageDigest.XXH3.value) -> None:
        hasher_for(page_digest)  # refuses an unknown name now, not at the first backup
        self.fail_after_moves = fail_after_moves
        self.page_digest = page_digest
        self.copies = 0
        self._buffers: dict[int, ctypes.Array[ctypes.c_char]] = {}
        self._lock = threading.Lock()

    def allocate(self, nbytes: int, label: str) -> Allocation:
        if nbytes <= 0:
            raise RegistrationError(f"{label}: cannot allocate {nbytes} bytes")
        buffer = ctypes.create_string_buffer(nbytes)
        address = ctypes.addressof(buffer)
        with self._lock:
            self._buffers[address] = buffer
        return Allocation(address, nbytes, label)

    def free(self, allocation: Allocation) -> None:
        with self._lock:
            self._buffers.pop(allocation.address, None)

    def copy(self, moves: Sequence[Move]) -> None:
        with self._lock:
            self.copies += 1
        limit = self.fail_after_moves
        for done, move in enumerate(moves):
            if limit is not None and done >= limit:
                raise MemoryCopyError(f"injected failure after {limit} moves")
            ctypes.memmove(move.dst, move.src, move.nbytes)

    def copy_digested(self, pages: Sequence[Sequence[Move]], seeds: Sequence[bytes]) -> list[bytes]:
        """Copy first, digest the destinations after: the plain two passes the real adapter fuses."""
        self.copy([move for moves in pages for move in moves])
        name = self.page_digest
        extents = [[(m.dst, m.nbytes) for m in moves] for moves in pages]
        return [page_digest(page, seed, name) for page, seed in zip(extents, seeds, strict=True)]

    def read(self, address: int, nbytes: int) -> bytes:
        return ctypes.string_at(address, nbytes)

    def digest(self, extents: Sequence[tuple[int, int]], seed: bytes) -> bytes:
        return page_digest(extents, seed, self.page_digest)

    @property
    def live_allocations(self) -> int:
        with self._lock:
            return len(self._buffers)


if TYPE_CHECKING:
    from kvcr.ports.memory import HostMemory

    _: HostMemory = MockHostMemory()
