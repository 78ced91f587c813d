"""HostMemory: DRAM that kvcr owns, and copies between addresses this process can touch.

Call order: ``allocate`` once per arena at start-up (memory comes back zeroed and already
faulted in, so the first backup does not pay page faults); ``copy`` per batch; ``free`` once at
close, only after every copy that touches the allocation has returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class Allocation:
    """A block of host memory: its address, size and the label it was allocated under."""

    address: int
    nbytes: int
    label: str


@dataclass(frozen=True, slots=True)
class Move:
    """Copy ``nbytes`` from address ``src`` to address ``dst``."""

    dst: int
    src: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class SharedBacking:
    """Where an address range lives in a shareable file: a read-only descriptor and the range's offset.

    ``fd`` stays owned by the memory adapter (valid until the allocation is freed); ``size`` is the
    whole file's, sealed so that it can neither shrink nor grow.
    """

    fd: int
    offset: int
    size: int


@runtime_checkable
class SharesMemory(Protocol):
    """Optional: host memory whose allocations live in sealed memory files a same-host peer can map."""

    def backing(self, address: int, nbytes: int) -> SharedBacking | None:
        """The file behind ``[address, address + nbytes)``, or None if no single shared allocation holds it."""


class HostMemory(Protocol):
    page_digest: str
    """Which digest ``digest`` and ``copy_digested`` compute (a ``kvcr.domain.digests.PageDigest`` name)."""

    def allocate(self, nbytes: int, label: str) -> Allocation:
        """Reserve ``nbytes`` of zeroed, pre-faulted memory.

        Raises:
            RegistrationError: the memory could not be obtained.
        """

    def free(self, allocation: Allocation) -> None:
        """Return an allocation; the caller guarantees nothing still touches it."""

    def copy(self, moves: Sequence[Move]) -> None:
        """Perform every move.

        Raises:
            MemoryCopyError: some move did not complete; destinations are undefined.
        """

    def copy_digested(self, pages: Sequence[Sequence[Move]], seeds: Sequence[bytes]) -> list[bytes]:
        """Perform every page's moves and return, per page, the digest of what landed at its destinations.

        Each digest equals ``digest`` over that page's destination extents, in move order, with its
        seed; computing it while the bytes are still in cache is what makes integrity cheap.

        Raises:
            MemoryCopyError: some move did not complete; destinations are undefined.
        """

    def read(self, address: int, nbytes: int) -> bytes:
        """Return a copy of ``nbytes`` at ``address`` (diagnostics)."""

    def digest(self, extents: Sequence[tuple[int, int]], seed: bytes) -> bytes:
        """The adapter's page digest (``page_digest``: 16-byte XXH3-128 or 32-byte BLAKE3) of ``seed``
        then every (address, nbytes) extent, in order, without copying.

        The seed binds the digest to what the bytes are (a page's key), so the digest of one
        page never vouches for another page's bytes.
        """
