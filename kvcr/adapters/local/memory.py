"""Host memory from mmap, copied with libc memmove (the GIL is released per call).

Arenas are mapped with MAP_POPULATE so their pages are faulted in at start-up: writing into
freshly mapped memory is several times slower than into resident memory, and a backup must not
pay that on the serving path.

``shared=True`` maps each allocation from its own memfd instead of anonymous memory (the same
copy speed here: shmem and anonymous pages both go without huge pages on this kernel), so the
same-host data plane can hand a read-only descriptor of it to a peer. The file is sealed right
after it is mapped: it can never shrink or grow (a peer's mapping cannot SIGBUS), and no new
writable mapping or ``write`` of it is possible (only this process's first mapping writes). The
descriptor handed out is a read-only reopen, so a peer cannot even ask for write access.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcr.adapters.digests import copy_and_digest, hasher_for, page_digest
from kvcr.domain.digests import PageDigest
from kvcr.ports.errors import MemoryCopyError, RegistrationError
from kvcr.ports.memory import Allocation, Move, SharedBacking

_memmove = ctypes.memmove
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1; not in Python's fcntl module
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | F_SEAL_FUTURE_WRITE
"""What every shared allocation is sealed with (a peer checks the first two before it maps)."""


def _shared_file(nbytes: int, label: str) -> tuple[int, int]:
    """A memfd of ``nbytes`` (read-write) and its read-only reopen; the caller seals it after mapping."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        readonly = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        os.close(fd)
        raise
    return fd, readonly


@dataclass(frozen=True, slots=True)
class _Shared:
    fd: int
    readonly: int
    nbytes: int


class MmapHostMemory:
    """Allocates with mmap (from sealed memfds when ``shared``); copies with memmove; digests with ``page_digest``."""

    def __init__(
        self, *, populate: bool = True, shared: bool = False, page_digest: str = PageDigest.XXH3.value
    ) -> None:
        hasher_for(page_digest)  # refuses an unknown name now, not at the first backup
        self.page_digest = page_digest
        self._populate = populate
        self._shared_files = shared
        self._maps: dict[int, tuple[mmap.mmap, ctypes.Array[ctypes.c_char]]] = {}
        self._files: dict[int, _Shared] = {}  # address -> its memfd, for shared allocations
        self._lock = threading.Lock()

    @property
    def shared(self) -> bool:
        """Whether allocations live in memfds a same-host peer can map."""
        return self._shared_files

    def allocate(self, nbytes: int, label: str) -> Allocation:
        if nbytes <= 0:
            raise RegistrationError(f"{label}: cannot allocate {nbytes} bytes")
        populate = getattr(mmap, "MAP_POPULATE", 0) if self._populate else 0
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        shared: _Shared | None = None
        try:
            if self._shared_files:
                fd, readonly = _shared_file(nbytes, label)
                shared = _Shared(fd, readonly, nbytes)
                mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | populate, prot=prot)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
            else:
                mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate, prot=prot)
        except OSError as exc:
            if shared is not None:
                _close_file(shared)
            raise RegistrationError(f"{label}: cannot map {nbytes} bytes: {exc}") from exc
        view = (ctypes.c_char * nbytes).from_buffer(mapping)
        address = ctypes.addressof(view)
        with self._lock:
            self._maps[address] = (mapping, view)
            if shared is not None:
                self._files[address] = shared
        return Allocation(address, nbytes, label)

    def backing(self, address: int, nbytes: int) -> SharedBacking | None:
        """The read-only memfd holding ``[address, address + nbytes)``, if one shared allocation does."""
        with self._lock:
            for base, shared in self._files.items():
                if base <= address and address + nbytes <= base + shared.nbytes:
                    return SharedBacking(shared.readonly, address - base, shared.nbytes)
        return None

    def free(self, allocation: Allocation) -> None:
        with self._lock:
            entry = self._maps.pop(allocation.address, None)
            shared = self._files.pop(allocation.address, None)
        if shared is not None:
            _close_file(shared)  # a peer's mapping keeps the pages until it unmaps; ours go below
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
            name = self.page_digest
            return [copy_and_digest(moves, seed, name) for moves, seed in zip(pages, seeds, strict=True)]
        except (ctypes.ArgumentError, OSError, ValueError) as exc:
            raise MemoryCopyError(f"copy failed: {exc}") from exc

    def read(self, address: int, nbytes: int) -> bytes:
        return ctypes.string_at(address, nbytes)

    def digest(self, extents: Sequence[tuple[int, int]], seed: bytes) -> bytes:
        return page_digest(extents, seed, self.page_digest)

    def close(self) -> None:
        """Free every allocation still held (for tests and process teardown)."""
        with self._lock:
            addresses = list(self._maps)
        for address in addresses:
            self.free(Allocation(address, 0, ""))


def _close_file(shared: _Shared) -> None:
    for fd in (shared.readonly, shared.fd):
        with contextlib.suppress(OSError):
            os.close(fd)


if TYPE_CHECKING:
    from kvcr.ports.memory import HostMemory, SharesMemory

    _: HostMemory = MmapHostMemory()
    _s: SharesMemory = MmapHostMemory()
