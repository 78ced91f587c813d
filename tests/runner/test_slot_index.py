"""The slot index on its own: states, claims, eviction order and prefix alignment, with no memory at all."""

import pytest

from kvcr.domain.errors import KvcrError
from kvcr.domain.eviction import FifoPolicy, LruPolicy
from kvcr.domain.residency import SlotState
from kvcr.runner.index import SlotIndex
from tests.support import sequence


def index(slots=4, policy=LruPolicy, depth=64, lease_cap=2, peer_cap=1):
    return SlotIndex(slots, policy, max_alignment_depth=depth, lease_cap=lease_cap, peer_cap=peer_cap)


def never():
    raise AssertionError("reclaim called while free slots remained")


def store(ix, pages, parent=None, reclaim=never):
    """Fill ``pages`` as a backup would; returns (held, fills, evicted) of begin_fills."""
    held, fills, evicted = ix.begin_fills(pages, parent, reclaim)
    ix.admit([page for _, page in ix.finish_fills(fills, True)] or list(pages))
    return held, fills, evicted


def test_new_pages_take_the_lowest_free_slots_and_stay_invisible_until_filled():
    ix = index()
    pages = sequence(3)
    held, fills, evicted = ix.begin_fills(pages, None, never)
    assert held == [False] * 3 and evicted == []
    assert [(i, page, e.slot, e.state) for i, page, e in fills] == [
        (i, page, i, SlotState.FILLING) for i, page in enumerate(pages)
    ]
    assert [e.parent for _, _, e in fills] == [None, pages[0], pages[1]]
    assert ix.present(pages) == [False] * 3 and ix.free_count == 1
    assert ix.claim_ready(pages, prefix_only=False) == []
    assert ix.finish_fills(fills, True) == [(0, pages[0]), (1, pages[1]), (2, pages[2])]
    assert ix.present(pages) == [True] * 3
    assert ix.counts() == (3, 0, 0, 0)


def test_a_failed_fill_gives_its_slots_back_and_leaves_no_entry():
    ix = index()
    pages = sequence(2)
    _, fills, _ = ix.begin_fills(pages, None, never)
    assert ix.finish_fills(fills, False) == []
    assert ix.entries == {} and ix.free_count == 4
    assert [e.state for _, _, e in fills] == [SlotState.FREE] * 2


def test_a_page_already_held_or_being_filled_counts_as_stored_and_is_filled_once():
    ix = index()
    pages = sequence(3)
    store(ix, pages[:1])
    _, first, _ = ix.begin_fills(pages[1:2], pages[0], never)  # pages[1] FILLING by another caller
    held, fills, _ = ix.begin_fills([pages[0], pages[1], pages[2], pages[2]], None, never)
    assert held == [True, True, False, False]
    assert [page for _, page, _ in fills] == [pages[2]]
    assert len(first) == 1 and ix.free_count == 1


def test_a_malformed_new_key_is_refused_and_nothing_is_reserved():
    ix = index()
    with pytest.raises(KvcrError):
        ix.begin_fills(["not-a-hash"], None, never)
    with pytest.raises(KvcrError):
        ix.begin_fills([*sequence(1), "x"], None, never)
    with pytest.raises(KvcrError):
        ix.present(["nope"])
    with pytest.raises(KvcrError):
        ix.claim_ready(["nope"], prefix_only=False)
    assert ix.free_count == 4 and ix.entries == {}


def test_eviction_takes_the_policys_first_unclaimed_ready_page_and_reports_it():
    ix = index(slots=2)
    old, new = sequence(1), sequence(1, start=100)
    store(ix, old)
    store(ix, new)
    reclaimed = []
    third = sequence(1, start=200)
    _, fills, evicted = ix.begin_fills(third, None, lambda: reclaimed.append(1))
    assert reclaimed == [1] and evicted == old
    assert fills[0][2].slot == 0 and old[0] not in ix.entries


def test_reclaimed_slots_are_used_before_any_page_is_evicted():
    ix = index(slots=1)
    page = sequence(1)
    store(ix, page)
    [(_, entry)] = ix.claim_ready(page, prefix_only=False)
    ix.clear()  # claimed: DISCARDING, detached
    assert ix.counts() == (0, 0, 1, 0) and ix.free_count == 0
    _, fills, evicted = ix.begin_fills(sequence(1, start=50), None, lambda: ix.unclaim(entry))
    assert evicted == [] and [e.slot for _, _, e in fills] == [0]
    assert ix.detached == 0


def test_claimed_filling_and_protected_pages_are_never_evicted():
    ix = index(slots=3)
    claimed, prefix = sequence(1, start=0), sequence(1, start=10)
    store(ix, claimed)
    store(ix, prefix)
    ix.claim_ready(claimed, prefix_only=False)
    _, filling, _ = ix.begin_fills(sequence(1, start=20), None, never)
    held, fills, evicted = ix.begin_fills(sequence(1, start=30), prefix[0], lambda: None)
    assert (fills, evicted) == ([], [])  # prefix is the batch's parent: protected
    assert held == [False]
    assert ix.present([*claimed, *prefix]) == [True, True] and filling[0][2].state is SlotState.FILLING


def test_a_batch_larger_than_what_can_be_freed_gets_what_there_is():
    ix = index(slots=2)
    _, fills, _ = ix.begin_fills(sequence(3), None, lambda: None)
    assert [e.slot for _, _, e in fills] == [0, 1]


def test_prefix_only_claims_stop_at_the_first_hole_and_full_claims_skip_it():
    ix = index(slots=4)
    pages = sequence(3)
    store(ix, [pages[0], pages[2]])
    assert [i for i, _ in ix.claim_ready(pages, prefix_only=True)] == [0]
    assert [i for i, _ in ix.claim_ready(pages, prefix_only=False)] == [0, 2]
    assert ix.entries[pages[0]].claims == 2 and ix.entries[pages[2]].claims == 1
    assert ix.counts() == (2, 0, 0, 2)


def test_the_last_claim_on_a_dropped_page_gives_its_slot_back():
    ix = index(slots=2)
    page = sequence(1)
    store(ix, page)
    [(_, a)] = ix.claim_ready(page, prefix_only=False)
    [(_, b)] = ix.claim_ready(page, prefix_only=False)
    ix.clear()
    assert a is b and a.state is SlotState.DISCARDING and ix.free_count == 1
    ix.unclaim(a)
    assert a.state is SlotState.DISCARDING and ix.free_count == 1
    ix.unclaim(a)
    assert a.state is SlotState.FREE and ix.free_count == 2 and ix.detached == 0


def test_discard_drops_the_page_now_and_frees_its_slot_with_the_last_claim():
    ix = index(slots=2)
    page = sequence(1)
    store(ix, page)
    [(_, entry)] = ix.claim_ready(page, prefix_only=False)
    ix.claim_ready(page, prefix_only=False)
    assert ix.discard(page[0], entry) is True
    assert page[0] not in ix.entries and len(ix.policy) == 0
    assert entry.state is SlotState.DISCARDING and ix.counts() == (0, 0, 1, 0)
    assert ix.discard(page[0], entry) is False  # the second reader found it corrupt too
    assert entry.state is SlotState.FREE and ix.free_count == 2 and ix.detached == 0


def test_discard_of_the_only_claim_frees_the_slot_at_once():
    ix = index(slots=1)
    page = sequence(1)
    store(ix, page)
    [(_, entry)] = ix.claim_ready(page, prefix_only=False)
    assert ix.discard(page[0], entry) is True
    assert entry.state is SlotState.FREE and ix.free_count == 1 and ix.detached == 0


def test_a_page_cleared_while_being_filled_gives_its_slot_back_when_the_fill_ends():
    ix = index(slots=2)
    pages = sequence(2)
    _, fills, _ = ix.begin_fills(pages, None, never)
    ix.clear()
    assert ix.counts() == (0, 0, 2, 0)
    assert ix.finish_fills(fills, True) == []
    assert ix.free_count == 2 and ix.detached == 0 and ix.entries == {}


def test_clear_frees_unclaimed_pages_at_once_and_starts_a_new_policy():
    ix = index(slots=3)
    store(ix, sequence(3))
    ix.clear()
    assert ix.free_count == 3 and ix.entries == {} and len(ix.policy) == 0


def test_leases_pin_pages_up_to_the_pool_cap_and_count_each_page_once():
    ix = index(slots=4, lease_cap=2)
    pages = sequence(3)
    store(ix, pages)
    a, b, c = (ix.entries[p] for p in pages)
    slots, digests, pinned, refused = ix.pin_for_lease([pages[0], pages[0]])
    assert digests == (a.digest, a.digest)
    assert slots == (a.slot, a.slot) and pinned == [a, a] and refused == 0
    assert ix.leased == 1 and (a.claims, a.leased) == (2, 2)
    slots, _, pinned, _ = ix.pin_for_lease([pages[1], pages[0], pages[2]])
    assert slots == (b.slot, a.slot, -1) and pinned == [b, a]  # c is over the cap; a costs nothing more
    assert ix.leased == 2 and (c.claims, c.leased) == (0, 0)
    ix.unpin_all([a, a])
    assert ix.leased == 2 and (a.claims, a.leased) == (1, 1)
    ix.unpin_all([a, b])
    assert ix.leased == 0 and ix.pin_for_lease([pages[2]])[0] == (c.slot,)


def test_a_page_the_admit_check_refuses_is_not_pinned_and_takes_no_room():
    ix = index(slots=4, lease_cap=1)
    pages = sequence(2)
    store(ix, pages)
    slots, digests, pinned, refused = ix.pin_for_lease(pages, admit=lambda entry: entry.slot != 0)
    assert slots == (-1, ix.entries[pages[1]].slot) and digests[0] == b"" and refused == 1
    assert pinned == [ix.entries[pages[1]]] and ix.leased == 1 and ix.entries[pages[0]].claims == 0


def test_pages_not_ready_or_not_keys_are_left_out_of_a_lease():
    ix = index(slots=2)
    pages = sequence(2)
    store(ix, pages[:1])
    slots, digests, pinned, refused = ix.pin_for_lease([pages[1], 7, pages[0]])
    assert digests == (b"", b"", ix.entries[pages[0]].digest)
    assert slots == (-1, -1, ix.entries[pages[0]].slot) and pinned == [ix.entries[pages[0]]] and refused == 0


def test_an_unpinned_page_that_was_cleared_gives_its_slot_back():
    ix = index(slots=1)
    page = sequence(1)
    store(ix, page)
    entry = ix.entries[page[0]]
    ix.pin_for_lease(page)
    ix.clear()
    assert ix.free_count == 0
    ix.unpin_all([entry])
    assert ix.free_count == 1 and ix.leased == 0


def test_a_batch_is_admitted_with_its_resident_ancestors_first():
    ix = index(slots=8)
    chain, other = sequence(4), sequence(1, start=100)
    store(ix, chain[:2])
    store(ix, other)
    _, fills, _ = ix.begin_fills(chain[2:], chain[1], never)
    ix.admit([page for _, page in ix.finish_fills(fills, True)])
    assert list(ix.policy.victims()) == [*other, *reversed(chain)]  # the prefix ages as one, deepest first
    assert ix.aligned(chain[2:]) == chain
    assert ix.ancestors(chain[1]) == chain[:2]
    assert ix.ancestors(chain[3], exclude=[chain[2]]) == [chain[3]]


def test_ancestors_stop_at_a_page_not_ready_and_at_the_depth_limit():
    ix = index(slots=8, depth=2)
    chain = sequence(4)
    store(ix, chain[:1])
    _, fills, _ = ix.begin_fills(chain[1:2], chain[0], never)  # FILLING
    ix.finish_fills(ix.begin_fills(chain[2:], chain[1], never)[1], True)
    assert ix.ancestors(chain[2]) == [chain[2]]  # its parent is still FILLING
    ix.finish_fills(fills, True)
    assert ix.ancestors(chain[3]) == chain[2:4]
    assert ix.ancestors(None) == []


def test_touching_a_prefix_protects_its_root_from_eviction():
    ix = index(slots=3)
    chain, other = sequence(2), sequence(1, start=100)
    store(ix, chain)
    store(ix, other)
    ix.claim_ready(chain[1:], prefix_only=False)  # touches chain[0] too
    ix.unclaim(ix.entries[chain[1]])
    _, _, evicted = ix.begin_fills(sequence(1, start=200), None, lambda: None)
    assert evicted == other


def test_forget_drops_the_index_but_not_the_slots():
    ix = index(slots=2)
    store(ix, sequence(2))
    ix.forget()
    assert ix.entries == {} and ix.free_count == 0


def test_a_full_fifo_index_still_evicts_what_it_admitted():
    ix = index(slots=1, policy=FifoPolicy)
    first = sequence(1)
    store(ix, first)
    _, fills, evicted = ix.begin_fills(sequence(1, start=9), None, lambda: None)
    assert evicted == first and len(fills) == 1


def test_a_new_index_knows_its_size_and_caps_and_an_unsealed_page_has_an_empty_digest():
    ix = index(slots=5, lease_cap=3, peer_cap=2)
    assert (ix.slots, ix.free_count, ix.lease_cap, ix.peer_cap, ix.leased, ix.detached) == (5, 5, 3, 2, 0, 0)
    _, [(_, _, entry)], _ = ix.begin_fills(sequence(1), None, never)
    assert entry.digest == b"" and (entry.claims, entry.leased) == (0, 0)


def test_absent_pages_are_not_present_and_not_ready():
    ix = index()
    page, absent = sequence(1), sequence(1, start=40)
    store(ix, page)
    assert ix.present([*absent, *page]) == [False, True]
    assert ix.is_ready(page[0]) and not ix.is_ready(absent[0])
    ix.begin_fills(absent, None, never)
    assert not ix.is_ready(absent[0])


def test_a_batch_of_held_pages_only_reserves_nothing_and_evicts_nothing():
    ix = index(slots=2)
    pages = sequence(2)
    store(ix, pages)
    assert ix.begin_fills(pages, None, never) == ([True, True], [], [])


def test_an_all_new_batch_naming_a_page_twice_fills_it_once():
    ix = index(slots=4)
    page = sequence(1)
    held, fills, _ = ix.begin_fills([page[0], page[0]], None, never)
    assert held == [False, False] and [i for i, _, _ in fills] == [0] and ix.free_count == 3


def test_backing_up_a_held_page_again_refreshes_it():
    ix = index(slots=2)
    a, b = sequence(1), sequence(1, start=10)
    store(ix, a)
    store(ix, b)
    assert ix.begin_fills(a, None, never) == ([True], [], [])  # held: nothing to fill, but a is touched
    _, _, evicted = ix.begin_fills(sequence(1, start=20), None, lambda: None)
    assert evicted == b


def test_slots_reclaimed_beyond_the_need_stay_free_and_nothing_is_evicted():
    ix = index(slots=5)
    pages, resident = sequence(3), sequence(1, start=40)
    store(ix, pages)
    claimed = [entry for _, entry in ix.claim_ready(pages, prefix_only=False)]
    ix.clear()
    store(ix, resident)
    assert ix.free_count == 1

    def reclaim():
        for entry in claimed:
            ix.unclaim(entry)

    _, fills, evicted = ix.begin_fills(sequence(2, start=30), None, reclaim)
    assert evicted == [] and len(fills) == 2 and ix.free_count == 2
    assert ix.is_ready(resident[0])


def test_when_reclaiming_is_not_enough_exactly_the_shortfall_is_evicted():
    ix = index(slots=4)
    first, rest = sequence(1), sequence(3, start=10)
    store(ix, first)
    [(_, pinned)] = ix.claim_ready(first, prefix_only=False)
    ix.clear()  # first: DISCARDING until its claim ends
    store(ix, rest[:1])
    store(ix, rest[1:2])
    store(ix, rest[2:])
    victims = [ix.entries[p] for p in rest[:1]]
    _, fills, evicted = ix.begin_fills(sequence(2, start=50), None, lambda: ix.unclaim(pinned))
    assert evicted == rest[:1] and sorted(e.slot for _, _, e in fills) == [0, 1]
    assert victims[0].state is SlotState.FREE and len(ix.policy) == 2 and ix.free_count == 0


def test_a_claim_past_a_hole_refreshes_the_page_it_claimed():
    ix = index(slots=3)
    a, b, c = sequence(1), sequence(1, start=10), sequence(1, start=20)
    for page in (a, b, c):
        store(ix, page)
    [(_, entry)] = ix.claim_ready([*sequence(1, start=90), *a], prefix_only=False)
    ix.unclaim(entry)
    _, _, evicted = ix.begin_fills(sequence(1, start=30), None, lambda: None)
    assert evicted == b


def test_two_pages_dropped_while_others_read_them_are_both_counted_discarding():
    ix = index(slots=2)
    pages = sequence(2)
    store(ix, pages)
    first = ix.claim_ready(pages, prefix_only=False)
    ix.claim_ready(pages, prefix_only=False)
    for i, entry in first:
        assert ix.discard(pages[i], entry)
    assert ix.detached == 2 and ix.counts() == (0, 0, 2, 0)


def test_a_parent_cycle_neither_repeats_a_page_nor_runs_to_the_depth_limit():
    ix = index(slots=4)
    x, y, z = sequence(1), sequence(1, start=10), sequence(1, start=20)
    store(ix, x, parent=y[0])
    store(ix, y, parent=x[0])  # x <-> y: parents point at each other
    assert ix.aligned(x) == [*y, *x]
    store(ix, z, parent=x[0])
    assert ix.ancestors(x[0], exclude=z) == [*y, *x]
