"""What a page digest is, once for every memory adapter: xxh3-128, seeded, over the page's extents.

A source's digest (computed at backup by its memory adapter) is checked by a target's (computed
at restore by its own, possibly another adapter), so every adapter must compute the same value.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import xxhash


def page_digest(extents: Sequence[tuple[int, int]], seed: bytes) -> bytes:
    """xxh3-128 of ``seed`` followed by the bytes at each (address, nbytes) extent, in order."""
    hasher = xxhash.xxh3_128(seed)
    for address, nbytes in extents:
        hasher.update((ctypes.c_char * nbytes).from_address(address))
    return hasher.digest()
