"""The slot board: a source's table of which page sits in which slot, readable by same-host peers.

A same-host peer that maps the source's arena can also map its board and find a page's slot
without asking (no LEASE round trip). The board is a seqlock per slot plus a hint table:

- per slot a *generation* (u64): even and non-zero while the slot holds a published page, odd
  while its bytes may change; the slot's *key* (the page hash's 32 bytes) and *digest* (up to 32
  bytes, with its length) are valid only between two equal even reads of the generation;
- a *hint table* of ``buckets`` u32 entries (slot + 1, 0 = empty). A key's home bucket is its
  first 8 bytes (little endian) modulo ``buckets``; a key is hinted in one of the ``PROBES``
  buckets from its home, or not at all (then a reader leases it the usual way). Readers look at
  every probe bucket (an empty one does not end the search), so the writer may clear buckets.

A reader takes (slot, generation, digest) where the key matches, copies the slot, and keeps the
page only if the generation is still the same afterwards: a slot evicted and refilled during
the copy is a miss, never wrong bytes. The layout below is the wire format between peers.
"""

from __future__ import annotations

from dataclasses import dataclass

MAGIC = b"kvcrbd01"
KEY_BYTES = 32
DIGEST_BYTES = 32
PROBES = 8
HEADER_BYTES = 64
_ALIGN = 64


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


@dataclass(frozen=True, slots=True)
class BoardLayout:
    """Where each array of a board over ``slots`` slots lives, as byte offsets from its start."""

    slots: int
    buckets: int
    gens: int
    keys: int
    digests: int
    lengths: int
    table: int
    nbytes: int

    def as_tuple(self) -> tuple[int, int, int, int, int, int, int, int]:
        """(slots, buckets, gens, keys, digests, lengths, table, nbytes): what the reader is given."""
        return (self.slots, self.buckets, self.gens, self.keys, self.digests, self.lengths, self.table, self.nbytes)


def board_layout(slots: int) -> BoardLayout:
    """The layout of a board for ``slots`` slots: a power-of-two hint table at least twice as large.

    Raises:
        ValueError: ``slots`` is not positive or does not fit a u32 hint.
    """
    if not 0 < slots < 0xFFFFFFFF:
        raise ValueError(f"a slot board needs 1..{0xFFFFFFFF - 1} slots, got {slots}")
    buckets = max(PROBES, 1 << (2 * slots - 1).bit_length())
    gens = HEADER_BYTES
    keys = _aligned(gens + 8 * slots)
    digests = _aligned(keys + KEY_BYTES * slots)
    lengths = _aligned(digests + DIGEST_BYTES * slots)
    table = _aligned(lengths + slots)
    nbytes = _aligned(table + 4 * buckets)
    return BoardLayout(slots, buckets, gens, keys, digests, lengths, table, nbytes)


def home_bucket(key: bytes, buckets: int) -> int:
    """The first bucket a 32-byte key may be hinted in."""
    return int.from_bytes(key[:8], "little") & (buckets - 1)


@dataclass(frozen=True, slots=True)
class BoardHits:
    """What a board lookup found, per key asked: its slot (-1: not found), generation and digest."""

    slots: list[int]
    gens: list[int]
    digests: list[bytes]

    @property
    def complete(self) -> bool:
        return -1 not in self.slots
