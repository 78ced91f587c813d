"""What a page digest is, once for every memory adapter: xxh3-128, seeded, over the page's extents.

A source's digest (computed at backup by its memory adapter) is checked by a target's (computed
at restore by its own, possibly another adapter), so every adapter must compute the same value.
``copy_and_digest`` computes the same value while it copies: each chunk is hashed right after it
lands, while it is still in cache, instead of reading the whole page back from DRAM afterwards.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import xxhash

from kvcr.ports.memory import Move


def page_digest(extents: Sequence[tuple[int, int]], seed: bytes) -> bytes:
    """xxh3-128 of ``seed`` followed by the bytes at each (address, nbytes) extent, in order."""
    hasher = xxhash.xxh3_128(seed)
    for address, nbytes in extents:
        hasher.update((ctypes.c_char * nbytes).from_address(address))
    return hasher.digest()


# Small enough that a copied chunk is still in L2 when it is hashed, large enough that the two calls
# per chunk cost little next to the bytes (measured on the 2-core VM: 256 KiB ~0.9-1.0x a plain copy
# for 2 MiB pages, 64 KiB ~0.6-0.9x; copy then hash ~0.5-0.65x).
COPY_CHUNK = 256 << 10


def copy_and_digest(moves: Sequence[Move], seed: bytes) -> bytes:
    """Perform ``moves`` in order and return ``page_digest`` of their destination extents."""
    hasher = xxhash.xxh3_128(seed)
    update = hasher.update
    memmove = ctypes.memmove
    for move in moves:
        dst, src, nbytes = move.dst, move.src, move.nbytes
        for offset in range(0, nbytes, COPY_CHUNK):
            n = min(COPY_CHUNK, nbytes - offset)
            memmove(dst + offset, src + offset, n)
            update((ctypes.c_char * n).from_address(dst + offset))
    return hasher.digest()
