"""The slot board: its layout, the writer (``kvcr.runner.board``) and the C reader (``_board``) together.

The reader is what a same-host target runs against a source's memory, so it is also fed boards
a hostile source could write: slot numbers past the board, digest lengths past a digest, torn
(odd) generations, layouts that do not fit. Each is skipped or refused, never read past.
"""

import ctypes
import functools
import hashlib
import itertools

import pytest

from kvcr.adapters.shm import _board  # built by the editable install: CI fails here, not skips, without it
from kvcr.domain.board import DIGEST_BYTES, KEY_BYTES, MAGIC, PROBES, BoardHits, BoardLayout, board_layout, home_bucket
from kvcr.runner.board import SlotBoard


def key(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


class Board:
    """A zeroed board in ctypes memory, with its writer, and a reader over the same bytes."""

    def __init__(self, slots: int) -> None:
        self.layout = board_layout(slots)
        self.memory = (ctypes.c_char * self.layout.nbytes)()
        self.address = ctypes.addressof(self.memory)
        self.writer = SlotBoard(self.address, self.layout)

    def find(self, *pages: str) -> tuple[list[int], list[int], list[bytes]]:
        return _board.lookup(self.address, self.layout.as_tuple(), list(pages))

    def still(self, slots: list[int], gens: list[int]) -> list[bool]:
        return _board.still(self.address, self.layout.as_tuple(), slots, gens)

    def poke(self, offset: int, data: bytes) -> None:
        ctypes.memmove(self.address + offset, data, len(data))


@pytest.mark.parametrize("slots", [1, 7, 8, 9, 1000, 4096])
def test_a_layout_has_a_power_of_two_table_twice_the_slots_and_its_arrays_do_not_overlap(slots):
    layout = board_layout(slots)
    assert layout.buckets & (layout.buckets - 1) == 0
    assert layout.buckets >= max(2 * slots, PROBES)
    extents = [
        (layout.gens, 8 * slots),
        (layout.keys, KEY_BYTES * slots),
        (layout.digests, DIGEST_BYTES * slots),
        (layout.lengths, slots),
        (layout.table, 4 * layout.buckets),
    ]
    assert extents[0][0] >= len(MAGIC)
    for (start, size), (following, _) in itertools.pairwise(extents):
        assert start + size <= following
    assert extents[-1][0] + extents[-1][1] <= layout.nbytes
    assert layout.gens % 8 == 0 and layout.table % 4 == 0


@pytest.mark.parametrize(
    ("slots", "expected"),
    [
        # the layout is the wire format between peers: (slots, buckets, gens, keys, digests, lengths, table, nbytes)
        (1, (1, 8, 64, 128, 192, 256, 320, 384)),
        (8, (8, 16, 64, 128, 384, 640, 704, 768)),
        (9, (9, 32, 64, 192, 512, 832, 896, 1024)),
        (1000, (1000, 2048, 64, 8064, 40064, 72064, 73088, 81280)),
    ],
)
def test_a_layout_is_exactly_the_wire_format_peers_agree_on(slots, expected):
    assert board_layout(slots).as_tuple() == expected


def test_hits_are_complete_only_when_every_key_was_found():
    assert BoardHits([3, 0], [2, 4], [b"", b""]).complete
    assert not BoardHits([3, -1], [2, 0], [b"", b""]).complete
    assert BoardHits([], [], []).complete


def test_a_home_bucket_is_the_keys_first_eight_bytes_little_endian_within_the_table():
    key = bytes(range(32))
    assert home_bucket(key, 1 << 64) == int.from_bytes(bytes(range(8)), "little")
    assert home_bucket(key, 1 << 72) == int.from_bytes(bytes(range(8)), "little")  # 8 bytes, not more
    assert home_bucket(key, 16) == 0x00 & 15
    assert home_bucket(bytes([0xFE, 0x01, *range(30)]), 256) == 0xFE


@pytest.mark.parametrize("slots", [0, -1, 0xFFFFFFFF])
def test_a_layout_for_no_slots_or_more_than_a_hint_can_name_is_refused(slots):
    with pytest.raises(ValueError, match=rf"a slot board needs 1\.\.4294967294 slots, got {slots}$"):
        board_layout(slots)


def test_a_published_page_is_found_with_its_slot_generation_and_digest_and_others_are_not():
    board = Board(16)
    board.writer.publish(5, key(1), b"d" * 16)
    board.writer.publish(9, key(2), b"")
    slots, gens, digests = board.find(key(1), key(3), key(2))
    assert slots == [5, -1, 9]
    assert gens[0] % 2 == 0 and gens[0] > 0 and gens[2] % 2 == 0
    assert digests == [b"d" * 16, b"", b""]
    assert board.still([5, 9], [gens[0], gens[2]]) == [True, True]
    assert bytes(board.memory[: len(MAGIC)]) == MAGIC == b"kvcrbd01"


def test_a_digest_longer_than_the_field_is_not_published_and_the_slot_keeps_nothing_stale():
    board = Board(8)
    board.writer.publish(2, key(1), b"a" * DIGEST_BYTES)
    board.writer.publish(2, key(2), b"b" * (DIGEST_BYTES + 1))  # the slot's new page: too long a digest
    assert board.find(key(1), key(2))[0] == [-1, -1]
    assert board.writer.published == 0


def test_a_withdrawn_slot_is_not_found_and_a_reader_that_found_it_before_sees_it_moved():
    board = Board(8)
    board.writer.publish(3, key(1), b"x" * 32)
    slots, gens, _ = board.find(key(1))
    board.writer.withdraw(3)
    assert board.find(key(1))[0] == [-1]
    assert board.still(slots, gens) == [False]
    board.writer.publish(3, key(2), b"y" * 32)  # the slot holds another page now
    assert board.find(key(1))[0] == [-1]
    assert board.find(key(2))[0] == [3]
    assert board.still(slots, gens) == [False]
    board.writer.withdraw(3)
    board.writer.withdraw(3)  # twice: nothing more happens
    assert board.writer.published == 0


def test_keys_sharing_a_home_fill_its_probe_window_and_the_next_one_is_left_to_a_lease():
    board = Board(32)
    buckets = board.layout.buckets
    home = home_bucket(bytes.fromhex(key(0)), buckets)
    same_home = [k for k in (key(i) for i in range(20_000)) if home_bucket(bytes.fromhex(k), buckets) == home]
    assert len(same_home) > PROBES
    for slot, page in enumerate(same_home[: PROBES + 1]):
        board.writer.publish(slot, page, b"")
    assert board.writer.hinted == PROBES and board.writer.published == PROBES + 1
    found = board.find(*same_home[: PROBES + 1])[0]
    assert found == [*range(PROBES), -1]
    board.writer.withdraw(2)  # its bucket is free again: a later page of that home takes it
    board.writer.publish(20, same_home[PROBES + 1], b"")
    assert board.find(same_home[PROBES + 1])[0] == [20]


def test_a_hostile_board_is_read_within_its_bounds():
    board = Board(8)
    layout = board.layout
    board.writer.publish(1, key(1), b"z" * 8)
    home = home_bucket(bytes.fromhex(key(2)), layout.buckets)
    # A hint naming a slot past the board, then one naming slot 1 (which holds another key).
    board.poke(layout.table + 4 * home, (9999).to_bytes(4, "little"))
    board.poke(layout.table + 4 * ((home + 1) % layout.buckets), (2).to_bytes(4, "little"))
    assert board.find(key(2))[0] == [-1]
    # A digest length past a digest: the record is skipped, not read past.
    board.poke(layout.lengths + 1, bytes([DIGEST_BYTES + 1]))
    assert board.find(key(1))[0] == [-1]
    board.poke(layout.lengths + 1, bytes([8]))
    assert board.find(key(1))[0] == [1]
    # A torn record (odd generation) is skipped.
    gen = int.from_bytes(bytes(board.memory[layout.gens + 8 : layout.gens + 16]), "little")
    board.poke(layout.gens + 8, (gen + 1).to_bytes(8, "little"))
    assert board.find(key(1))[0] == [-1]
    assert board.still([1, -1, 8, 10**6], [gen, 0, 0, 0]) == [False, False, False, False]


def test_a_reader_refuses_a_layout_that_does_not_fit_and_keys_that_are_not_canonical():
    board = Board(8)
    layout = board.layout
    board.writer.publish(1, key(1), b"")
    too_small = BoardLayout(**{**_fields(layout), "nbytes": layout.table})
    with pytest.raises(ValueError, match="does not fit"):
        _board.lookup(board.address, too_small.as_tuple(), [key(1)])
    not_power = BoardLayout(**{**_fields(layout), "buckets": layout.buckets - 1})
    with pytest.raises(ValueError, match="does not fit"):
        _board.still(board.address, not_power.as_tuple(), [0], [0])
    # A key the board could not hold as written (upper case, short, long, not hex, not ASCII, not a str):
    # refused, not looked up under another spelling or cut to its first 32 bytes.
    for bad in [key(1).upper(), key(1)[:-1], key(1) + "0", key(1)[:-1] + "g", key(1)[:-1] + "\u00e9", bytes(64)]:
        with pytest.raises(ValueError, match="64 lowercase hex characters"):
            _board.lookup(board.address, layout.as_tuple(), [key(1), bad])
    assert board.find(key(1))[0] == [1]
    with pytest.raises(ValueError, match="one generation per slot"):
        _board.still(board.address, layout.as_tuple(), [0, 1], [0])
    with pytest.raises(TypeError):
        _board.lookup(board.address, list(layout.as_tuple()), [key(1)])
    with pytest.raises(TypeError):
        _board.lookup(board.address, layout.as_tuple(), (key(1),))


class Arena:
    """``slots`` pieces of ``size`` bytes every ``stride`` in ctypes memory; piece i filled with byte i + fill."""

    def __init__(self, slots: int, size: int, stride: int, fill: int = 0) -> None:
        self.slots, self.size, self.stride = slots, size, stride
        self.memory = (ctypes.c_char * (stride * slots))()
        self.address = ctypes.addressof(self.memory)
        for i in range(slots):
            ctypes.memset(self.address + i * stride, (i + fill) % 256, size)

    def piece(self, i: int) -> bytes:
        return ctypes.string_at(self.address + i * self.stride, self.size)


def pieces(src: Arena, dst: Arena) -> list[tuple[int, int, int, int, int, int, int]]:
    return [(src.address, src.stride, src.slots, dst.address, dst.stride, dst.slots, src.size)]


@pytest.mark.parametrize("stride", [256, 320])  # dense (one copy per run) and with gaps (one per page)
def test_a_board_copy_moves_each_found_page_into_its_slot_and_says_which_stayed_put(stride):
    board = Board(8)
    for slot in range(8):
        board.writer.publish(slot, key(slot), b"")
    src, dst = Arena(8, 256, stride, fill=1), Arena(16, 256, stride, fill=100)
    slots, gens, _ = board.find(key(2), key(3), key(4), key(7))
    board.writer.withdraw(7)  # its slot may change from now on: a reader that found it must not trust it
    stayed = _board.copy(board.address, board.layout.as_tuple(), pieces(src, dst), slots, [10, 11, 12, 0], gens)
    assert stayed == [True, True, True, False]
    assert [dst.piece(i) for i in (10, 11, 12, 0)] == [src.piece(s) for s in (2, 3, 4, 7)]
    assert dst.piece(13) == bytes([113]) * 256  # nothing past the pages asked
    assert dst.piece(9) == bytes([109]) * 256


def test_a_board_copy_takes_every_component_of_a_page_however_many():
    board = Board(4)
    board.writer.publish(2, key(2), b"")
    slots, gens, _ = board.find(key(2))
    arenas = [(Arena(4, 64, 64, fill=c), Arena(4, 64, 64, fill=200)) for c in range(80)]
    got = _board.copy(board.address, board.layout.as_tuple(), [pieces(s, d)[0] for s, d in arenas], slots, [1], gens)
    assert got == [True]
    assert all(dst.piece(1) == src.piece(2) for src, dst in arenas)


def test_a_board_copy_with_a_slot_outside_a_region_copies_nothing():
    board = Board(8)
    board.writer.publish(1, key(1), b"")
    src, dst = Arena(4, 64, 64), Arena(4, 64, 64, fill=50)
    before = [dst.piece(i) for i in range(4)]
    copy = functools.partial(_board.copy, board.address, board.layout.as_tuple(), pieces(src, dst))
    with pytest.raises(ValueError, match="source slot 5 is outside its region"):
        copy([1, 5], [0, 1], [2, 2])  # slot 5 is on the board (8 slots) but past the source region's 4
    with pytest.raises(ValueError, match="destination slot 4 is outside"):
        copy([1, 1], [0, 4], [2, 2])
    with pytest.raises(ValueError, match="source slot -1"):
        copy([-1], [0], [2])
    with pytest.raises(ValueError, match="one slot pair and generation per page"):
        copy([1], [0, 1], [2])
    with pytest.raises(ValueError, match="a component"):
        _board.copy(board.address, board.layout.as_tuple(), [], [1], [0], [2])
    with pytest.raises(ValueError, match="strides of at least its size"):
        _board.copy(
            board.address, board.layout.as_tuple(), [(src.address, 32, 4, dst.address, 64, 4, 64)], [1], [0], [2]
        )
    with pytest.raises(TypeError):
        _board.copy(board.address, board.layout.as_tuple(), [(src.address,)], [1], [0], [2])
    assert [dst.piece(i) for i in range(4)] == before


def _fields(layout: BoardLayout) -> dict[str, int]:
    return {name: getattr(layout, name) for name in BoardLayout.__slots__}
