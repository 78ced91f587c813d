"""The beacon a data plane exposes and the scratch slots its own beacon reads land in.

A peer reads our beacon (``BEACON_BYTES`` of random bytes whose digest is in our description) to
finish UCX's wire-up within its connect deadline and to learn whether our READs end inside the
post; we read theirs into one of ``SCRATCH_SLOTS`` scratch slots. A slot is reused only after its
READ has ended, so a READ that never ends keeps its slot and at most that many connects wait at once.
Not thread-safe: the data plane calls it under its lock.
"""

from __future__ import annotations

import ctypes
import hashlib
import os

BEACON_BYTES = 256 << 10  # a tcp READ of this size cannot complete within SYNC_WINDOW_S of its post
SCRATCH_SLOTS = 8  # concurrent connects; a slot whose READ never ended stays taken


def digest(data: bytes) -> bytes:
    """What a description vouches for its beacon with."""
    return hashlib.blake2b(data, digest_size=16).digest()


class Beacon:
    """Our beacon (exposed to peers) and our scratch slots (private), as two buffers to register."""

    def __init__(self) -> None:
        self._beacon = ctypes.create_string_buffer(os.urandom(BEACON_BYTES), BEACON_BYTES)
        self.digest = digest(self._beacon.raw)
        self._scratch = ctypes.create_string_buffer(BEACON_BYTES * SCRATCH_SLOTS)
        self._free = list(range(SCRATCH_SLOTS))

    @property
    def address(self) -> int:
        return ctypes.addressof(self._beacon)

    @property
    def scratch_extent(self) -> tuple[int, int]:
        """(address, bytes) of every scratch slot together."""
        return ctypes.addressof(self._scratch), len(self._scratch)

    def take_slot(self) -> int | None:
        """A free scratch slot, zeroed; None when every slot waits for a READ to end."""
        if not self._free:
            return None
        slot = self._free.pop()
        ctypes.memset(self.slot_address(slot), 0, BEACON_BYTES)
        return slot

    def slot_address(self, slot: int) -> int:
        return ctypes.addressof(self._scratch) + slot * BEACON_BYTES

    def slot_bytes(self, slot: int) -> bytes:
        return ctypes.string_at(self.slot_address(slot), BEACON_BYTES)

    def give_back(self, slot: int) -> None:
        self._free.append(slot)
