"""What a page digest is, once for every memory adapter: XXH3-128 or BLAKE3, seeded, over the page's extents.

A source's digest (computed at backup by its memory adapter) is checked by a target's (computed
at restore by its own, possibly another adapter), so every adapter must compute the same value.
``copy_and_digest`` computes the same value while it copies: each chunk is hashed right after it
lands, while it is still in cache, instead of reading the whole page back from DRAM afterwards.
Which digest (``kvcr.domain.digests.PageDigest``) is the memory adapter's choice at construction.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import Protocol

import blake3
import xxhash

from kvcr.domain.digests import PAGE_DIGEST_NAMES, PageDigest
from kvcr.domain.errors import ConfigError
from kvcr.ports.memory import Move


class _Hasher(Protocol):
    def update(self, data: ctypes.Array[ctypes.c_char], /) -> object: ...

    def digest(self) -> bytes: ...


def _xxh3(seed: bytes) -> _Hasher:
    return xxhash.xxh3_128(seed)


class _Blake3:
    """BLAKE3 over ctypes buffers: its binding asks for strides, which a ctypes array's buffer lacks."""

    __slots__ = ("_hasher",)

    def __init__(self, seed: bytes) -> None:
        self._hasher = blake3.blake3(seed)  # one thread: the engine owns the other cores

    def update(self, data: ctypes.Array[ctypes.c_char], /) -> object:
        return self._hasher.update(memoryview(data).cast("B"))

    def digest(self) -> bytes:
        return self._hasher.digest()


def _blake3(seed: bytes) -> _Hasher:
    return _Blake3(seed)


_HASHERS: dict[str, Callable[[bytes], _Hasher]] = {PageDigest.XXH3.value: _xxh3, PageDigest.BLAKE3.value: _blake3}


def hasher_for(name: str) -> Callable[[bytes], _Hasher]:
    """The hasher factory of a ``page_digest`` name (ConfigError naming the setting for any other)."""
    try:
        return _HASHERS[name]
    except (KeyError, TypeError):
        raise ConfigError(f"page_digest must be one of {', '.join(PAGE_DIGEST_NAMES)}, got {name!r}") from None


def page_digest(extents: Sequence[tuple[int, int]], seed: bytes, name: str = PageDigest.XXH3.value) -> bytes:
    """Digest ``name`` of ``seed`` followed by the bytes at each (address, nbytes) extent, in order."""
    hasher = hasher_for(name)(seed)
    for address, nbytes in extents:
        hasher.update((ctypes.c_char * nbytes).from_address(address))
    return hasher.digest()


# Small enough that a copied chunk is still in L2 when it is hashed, large enough that the two calls
# per chunk cost little next to the bytes (measured on the 2-core VM: 256 KiB ~0.9-1.0x a plain copy
# for 2 MiB pages, 64 KiB ~0.6-0.9x; copy then hash ~0.5-0.65x).
COPY_CHUNK = 256 << 10


def copy_and_digest(moves: Sequence[Move], seed: bytes, name: str = PageDigest.XXH3.value) -> bytes:
    """Perform ``moves`` in order and return ``page_digest`` of their destination extents."""
    hasher = hasher_for(name)(seed)
    update = hasher.update
    memmove = ctypes.memmove
    for move in moves:
        dst, src, nbytes = move.dst, move.src, move.nbytes
        for offset in range(0, nbytes, COPY_CHUNK):
            n = min(COPY_CHUNK, nbytes - offset)
            memmove(dst + offset, src + offset, n)
            update((ctypes.c_char * n).from_address(dst + offset))
    return hasher.digest()
