"""A pool's slot board follows its index: what is READY is findable, and nothing else.

Read here the way a same-host target reads it (the C reader over the board's memory): a page is
published when its backup completes, and withdrawn before its slot can hold anything else
(eviction), when its bytes are found corrupt, and when the pool is cleared.
"""

import ctypes

from kvcr.adapters.shm import _board
from kvcr.domain.board import board_layout
from tests.support import content, sequence


def fill(host, pages, slots):
    for page, slot in zip(pages, slots, strict=True):
        host.write_page(slot, content(page, host.pool.page_bytes))


class Reader:
    def __init__(self, runner, pool="kv"):
        region = runner.share_boards()[pool]
        self.address = region.base
        self.layout = board_layout(region_slots(runner, pool))
        assert region.piece_bytes == self.layout.nbytes

    def find(self, pages):
        return _board.lookup(self.address, self.layout.as_tuple(), list(pages))

    def still(self, slots, gens):
        return _board.still(self.address, self.layout.as_tuple(), slots, gens)


def region_slots(runner, pool):
    return runner.pool_arenas()[pool][0].count


def test_pages_backed_up_before_and_after_sharing_are_found_in_their_slots_with_their_digests(build):
    runner, hosts = build(slots=8, verify_bytes=True)
    pages = sequence(6)
    fill(hosts["kv"], pages, range(6))
    runner.backup("kv", pages[:3], [0, 1, 2])
    board = Reader(runner)
    runner.backup("kv", pages[3:], [3, 4, 5])
    slots, gens, digests = board.find(pages)
    assert sorted(slots) == list(range(6))
    assert all(g > 0 and g % 2 == 0 for g in gens)
    arena = runner.pool_arenas()["kv"]
    for page, slot, digest in zip(pages, slots, digests, strict=True):
        # the slot the board names holds the page's bytes, and the digest is the one a LEASE would give
        assert b"".join(ctypes.string_at(r.address(slot), r.piece_bytes) for r in arena) == content(
            page, hosts["kv"].pool.page_bytes
        )
        grant = runner.lease([("kv", [page])], 1.0, holder=1)
        runner.release_lease(grant.lease_id)
        assert digest and digest == grant.digests[0][0]
    assert board.find(sequence(1, start=100))[0] == [-1]


def test_an_evicted_page_leaves_the_board_before_its_slot_is_refilled(build):
    runner, hosts = build(slots=4)
    board = Reader(runner)
    old = sequence(4)
    fill(hosts["kv"], old, range(4))
    runner.backup("kv", old, range(4))
    slots, gens, _ = board.find(old)
    assert -1 not in slots
    new = sequence(2, start=100)
    fill(hosts["kv"], new, [10, 11])
    assert runner.backup("kv", new, [10, 11]) == [True, True]
    now = board.find(old)[0]
    evicted = [i for i, slot in enumerate(now) if slot == -1]
    assert len(evicted) == 2
    moved = board.still([slots[i] for i in evicted], [gens[i] for i in evicted])
    assert moved == [False, False]  # a reader that found them before the eviction gets a miss
    new_slots = board.find(new)[0]
    assert sorted(new_slots) == sorted(slots[i] for i in evicted)


def test_a_page_found_corrupt_and_a_cleared_pool_leave_the_board(build):
    runner, hosts = build(slots=8, verify_bytes=True)
    board = Reader(runner)
    pages = sequence(3)
    fill(hosts["kv"], pages, range(3))
    runner.backup("kv", pages, range(3))
    slots = board.find(pages)[0]
    arena = runner.pool_arenas()["kv"]
    ctypes.memset(arena[0].address(slots[1]), 0x5A, 16)  # the page's bytes changed in kvcr memory
    outcomes = runner.restore("kv", pages, [20, 21, 22])
    assert [o.restored for o in outcomes] == [True, False, True]
    assert board.find(pages)[0] == [slots[0], -1, slots[2]]
    runner.clear()
    assert board.find(pages)[0] == [-1, -1, -1]
