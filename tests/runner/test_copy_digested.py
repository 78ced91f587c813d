"""Both memory adapters' fused copy-and-digest lands the bytes and agrees with the two-pass digest.

A source computes a page's digest with one adapter and a target checks it with another (or with
``digest`` over what a peer delivered), so the fused path must give exactly ``page_digest``.
"""

from __future__ import annotations

import ctypes
import os

import pytest

from kvcr.adapters.digests import COPY_CHUNK, page_digest
from kvcr.adapters.local.memory import MmapHostMemory
from kvcr.adapters.mock.memory import MockHostMemory
from kvcr.ports.errors import MemoryCopyError
from kvcr.ports.memory import Move

# Pieces that end mid-chunk, span chunks, and are a single byte.
SIZES = (1, COPY_CHUNK + 7, 2 * COPY_CHUNK, 4097)


@pytest.fixture(params=["local", "mock"])
def memory(request):
    adapter = MmapHostMemory() if request.param == "local" else MockHostMemory()
    yield adapter
    if request.param == "local":
        adapter.close()


def test_fused_digests_match_the_two_pass_digest_and_the_bytes_land(memory):
    total = sum(SIZES)
    src = memory.allocate(2 * total, "src")
    dst = memory.allocate(2 * total, "dst")
    payload = os.urandom(2 * total)
    ctypes.memmove(src.address, payload, len(payload))
    pages, offset = [], 0
    for _ in range(2):  # two pages of four components each, destinations in another order
        moves = []
        for size in SIZES:
            moves.append(Move(dst.address + 2 * total - offset - size, src.address + offset, size))
            offset += size
        pages.append(moves)
    seeds = [b"ns#kv#page-0", b"ns#kv#page-1"]

    digests = memory.copy_digested(pages, seeds)

    for moves, seed, digest in zip(pages, seeds, digests, strict=True):
        extents = [(m.dst, m.nbytes) for m in moves]
        assert digest == page_digest(extents, seed) == memory.digest(extents, seed)
        for m in moves:
            assert memory.read(m.dst, m.nbytes) == memory.read(m.src, m.nbytes)
    assert digests[0] != memory.copy_digested([pages[0]], [seeds[1]])[0]  # the seed binds the key


def test_a_failed_fused_copy_raises_the_ports_error():
    memory = MockHostMemory(fail_after_moves=1)
    src, dst = memory.allocate(64, "src"), memory.allocate(64, "dst")
    with pytest.raises(MemoryCopyError):
        halves = [Move(dst.address, src.address, 32), Move(dst.address + 32, src.address + 32, 32)]
        memory.copy_digested([halves], [b""])
