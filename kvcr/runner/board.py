"""The writer of one pool's slot board (layout and reading rules: ``kvcr.domain.board``).

The slot index calls :meth:`SlotBoard.publish` when a page turns READY and :meth:`SlotBoard.withdraw`
before its slot can be handed to another page (eviction, discard, clear), always under the
runner's lock, so there is one writer. A withdrawal makes the slot's generation odd *before* its
bytes can change; a publication writes key and digest while the generation is odd and makes it
even afterwards. Stores from Python land in program order on x86-64 (TSO), which is what a
same-host reader relies on; ``shares_boards`` says whether this host is one.
"""

from __future__ import annotations

import ctypes
import platform

from kvcr.domain.board import DIGEST_BYTES, KEY_BYTES, MAGIC, PROBES, BoardLayout, home_bucket


def shares_boards() -> bool:
    """Whether boards written here are safe to read from another process without fences (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class SlotBoard:
    """A board over ``layout.slots`` slots at ``address`` (zeroed memory of ``layout.nbytes`` bytes)."""

    __slots__ = ("_buckets", "_digests", "_gens", "_hinted", "_keys", "_lengths", "_table", "layout")

    def __init__(self, address: int, layout: BoardLayout) -> None:
        self.layout = layout
        raw = memoryview((ctypes.c_char * layout.nbytes).from_address(address)).cast("B")
        n = layout.slots
        raw[: len(MAGIC)] = MAGIC
        self._gens = raw[layout.gens : layout.gens + 8 * n].cast("Q")
        self._keys = raw[layout.keys : layout.keys + KEY_BYTES * n]
        self._digests = raw[layout.digests : layout.digests + DIGEST_BYTES * n]
        self._lengths = raw[layout.lengths : layout.lengths + n]
        self._table = raw[layout.table : layout.table + 4 * layout.buckets].cast("I")
        self._buckets = layout.buckets
        self._hinted: dict[int, int] = {}  # published slot -> its hint's bucket (-1: published, not hinted)

    def publish(self, slot: int, page: str, digest: bytes) -> None:
        """``slot`` now holds ``page`` (a checked 64-hex key) with ``digest``: make it findable.

        A digest longer than a board's digest field is not published (cut short it would fail every
        reader's check): such a page is leased the usual way.
        """
        self.withdraw(slot)
        if len(digest) > DIGEST_BYTES:
            return
        key = bytes.fromhex(page)
        gens = self._gens
        gen = gens[slot]
        if not gen & 1:
            gen += 1
            gens[slot] = gen  # odd: key and digest change now
        at = slot * KEY_BYTES
        self._keys[at : at + KEY_BYTES] = key
        at = slot * DIGEST_BYTES
        self._digests[at : at + len(digest)] = digest
        self._lengths[slot] = len(digest)
        gens[slot] = gen + 1  # even: published
        table, mask = self._table, self._buckets - 1
        home = home_bucket(key, self._buckets)
        bucket = -1
        for probe in range(PROBES):
            candidate = (home + probe) & mask
            if not table[candidate]:
                table[candidate] = slot + 1
                bucket = candidate
                break
        self._hinted[slot] = bucket  # no free bucket near home: readers lease this page the usual way

    def withdraw(self, slot: int) -> None:
        """``slot``'s bytes may change from now on: readers that found it before get a miss."""
        bucket = self._hinted.pop(slot, None)
        if bucket is None:
            return
        self._gens[slot] += 1  # odd
        if bucket >= 0:
            self._table[bucket] = 0

    def withdraw_all(self) -> None:
        for slot in list(self._hinted):
            self.withdraw(slot)

    @property
    def published(self) -> int:
        return len(self._hinted)

    @property
    def hinted(self) -> int:
        """Published pages a reader can find (the rest found no free bucket near their home)."""
        return sum(1 for bucket in self._hinted.values() if bucket >= 0)
