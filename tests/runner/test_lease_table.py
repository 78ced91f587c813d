"""The lease table on its own, over bare slot indexes: what a grant pins, ids, deadlines, quotas, shutdown."""

from kvcr.domain.eviction import LruPolicy
from kvcr.runner.index import SlotIndex
from kvcr.runner.leases import MISSING_SLOT, LeaseTable
from tests.support import sequence

PAGES = sequence(4)


def indexes(slots=4, lease_cap=4, peer_cap=4, pools=("kv",)):
    """Pools whose indexes hold PAGES, READY, in slots 0..3, each with a digest naming it."""
    made = {}
    for pool in pools:
        ix = SlotIndex(slots, LruPolicy, max_alignment_depth=8, lease_cap=lease_cap, peer_cap=peer_cap)
        _, fills, _ = ix.begin_fills(PAGES[:slots], None, lambda: None)
        for _, page, entry in fills:
            entry.digest = f"{pool}/{page[:4]}".encode()
        ix.admit([page for _, page in ix.finish_fills(fills, True)])
        made[pool] = ix
    return made


def lease(table, ix, requests, holder=0, now=0.0, duration=5.0):
    return table.lease(requests, ix, holder, now, duration)


def test_a_grant_pins_every_ready_page_and_names_its_slot_and_digest():
    table, ix = LeaseTable(4), indexes()
    grant, leased = lease(table, ix, [("kv", PAGES[:2])], duration=3.0)
    assert grant.lease_id != 0 and grant.ttl_s == 3.0 and grant.over_quota == 0
    assert grant.slots == ((0, 1),) and grant.digests == (
        (b"kv/" + PAGES[0][:4].encode(), b"kv/" + PAGES[1][:4].encode()),
    )
    assert leased == {"kv": 2} and len(table) == 1
    assert [(e.claims, e.leased) for e in (ix["kv"].entries[p] for p in PAGES)] == [(1, 1), (1, 1), (0, 0), (0, 0)]
    assert ix["kv"].leased == 2


def test_pages_not_held_malformed_or_of_an_unknown_pool_are_missing_and_nothing_is_held_for_them():
    table, ix = LeaseTable(4), indexes(slots=2)
    grant, leased = lease(table, ix, [("kv", [PAGES[3], 7, "nope", ["x"]]), ("other", PAGES[:1])])
    assert grant.lease_id == 0 and len(table) == 0 and leased == {"kv": 0}
    assert grant.slots == ((MISSING_SLOT,) * 4, (MISSING_SLOT,)) and grant.digests == ((b"",) * 4, (b"",))
    assert grant.over_quota == 0


def test_a_page_being_filled_is_not_leased():
    table = LeaseTable(4)
    filling = {"kv": SlotIndex(1, LruPolicy, max_alignment_depth=1, lease_cap=1, peer_cap=1)}
    filling["kv"].begin_fills(PAGES[:1], None, lambda: None)
    grant, _ = lease(table, filling, [("kv", PAGES[:1])])
    assert grant.slots == ((MISSING_SLOT,),) and grant.lease_id == 0


def test_the_pool_cap_stops_new_pages_but_not_pages_already_leased():
    table, ix = LeaseTable(4), indexes(lease_cap=2)
    lease(table, ix, [("kv", PAGES[:2])])
    grant, leased = lease(table, ix, [("kv", PAGES[1:3])])
    assert grant.slots == ((1, MISSING_SLOT),) and leased == {"kv": 1}
    assert grant.over_quota == 0  # the pool's cap, not the holder's


def test_a_holder_past_its_page_cap_gets_misses_counted_over_quota():
    table, ix = LeaseTable(4), indexes(peer_cap=1)
    first, _ = lease(table, ix, [("kv", PAGES[:1])], holder=5)
    again, _ = lease(table, ix, [("kv", PAGES[:3])], holder=5)
    other, _ = lease(table, ix, [("kv", PAGES[1:2])], holder=6)
    assert first.slots == ((0,),) and again.slots == ((0, MISSING_SLOT, MISSING_SLOT),) and again.over_quota == 2
    assert again.digests[0][1:] == (b"", b"")
    assert other.slots == ((1,),) and other.over_quota == 0


def test_a_holders_page_cap_is_per_pool():
    table, ix = LeaseTable(4), indexes(peer_cap=2, pools=("kv", "idx"))
    grant, leased = lease(table, ix, [("kv", PAGES[:2]), ("idx", PAGES[:2])], holder=5)
    assert grant.over_quota == 0 and leased == {"kv": 2, "idx": 2}  # two pools, two pages each: at the cap
    more, _ = lease(table, ix, [("idx", PAGES[2:3])], holder=5)
    assert more.slots == ((MISSING_SLOT,),) and more.over_quota == 1


def test_a_holder_at_its_lease_cap_gets_nothing_and_every_page_counts_over_quota():
    table, ix = LeaseTable(1), indexes(pools=("kv", "idx"))
    lease(table, ix, [("kv", PAGES[:1])], holder=5)
    grant, leased = lease(table, ix, [("kv", PAGES[1:3]), ("idx", PAGES[:1])], holder=5)
    assert grant.lease_id == 0 and grant.over_quota == 3 and leased == {}
    assert lease(table, ix, [("kv", PAGES[1:2])], holder=0)[0].lease_id != 0  # holder 0 is never capped


def test_pages_of_two_pools_are_counted_per_pool_and_a_pool_named_twice_adds_up():
    table, ix = LeaseTable(4), indexes(pools=("kv", "idx"))
    grant, leased = lease(table, ix, [("kv", PAGES[:1]), ("idx", PAGES[:3]), ("kv", PAGES[1:2])])
    assert leased == {"kv": 2, "idx": 3} and grant.slots == ((0,), (0, 1, 2), (1,))


def test_nothing_is_granted_once_leasing_stopped():
    table, ix = LeaseTable(4), indexes()
    assert table.leasing is True
    table.leasing = False
    grant, leased = lease(table, ix, [("kv", PAGES[:2])])
    assert grant.lease_id == 0 and grant.slots == ((MISSING_SLOT,) * 2,) and grant.over_quota == 0
    assert ix["kv"].leased == 0 and leased == {}


def test_lease_ids_are_63_bit_draws_never_0_nor_a_live_lease_id():
    drawn, bits = iter([0, 7, 7, 9]), []
    table, ix = LeaseTable(4, draw=lambda n: bits.append(n) or next(drawn)), indexes()
    assert lease(table, ix, [("kv", PAGES[:1])])[0].lease_id == 7
    assert lease(table, ix, [("kv", PAGES[:1])])[0].lease_id == 9
    assert len(table) == 2 and set(bits) == {63}


def test_a_lease_expires_at_its_deadline_and_not_before():
    table, ix = LeaseTable(4), indexes()
    early = lease(table, ix, [("kv", PAGES[:1])], now=10.0, duration=1.0)[0].lease_id
    late = lease(table, ix, [("kv", PAGES[:1])], now=10.0, duration=2.0)[0].lease_id
    assert table.expire(10.999) == []
    [gone] = table.expire(11.0)
    assert gone.lease.lease_id == early and table.get(early) is None and table.get(late) is not None
    assert [h.lease.lease_id for h in table.expire(12.0)] == [late] and len(table) == 0


def test_release_returns_the_lease_once_with_its_claims_and_holder():
    table, ix = LeaseTable(4), indexes()
    lease_id = lease(table, ix, [("kv", PAGES[:2])], holder=3)[0].lease_id
    released = table.release(lease_id)
    assert released is not None and released.holder == 3
    assert [(pool, e.slot) for pool, e in released.claims] == [("kv", 0), ("kv", 1)]
    assert table.release(lease_id) is None and table.release(12345) is None


def test_ending_a_lease_frees_its_holders_quota():
    table, ix = LeaseTable(2), indexes(peer_cap=1)
    first = lease(table, ix, [("kv", PAGES[:1])], holder=5)[0].lease_id
    lease(table, ix, [("kv", PAGES[:1])], holder=5, duration=9.0)
    assert lease(table, ix, [("kv", PAGES[:1])], holder=5)[0].over_quota == 1  # two leases: at its cap
    table.release(first)
    assert table.quota.holders() == 1
    table.expire(10.0)
    assert table.quota.holders() == 0
    assert lease(table, ix, [("kv", PAGES[1:2])], holder=5)[0].slots == ((1,),)  # its page cap is free again


def test_pinned_pools_name_every_pool_a_live_lease_holds():
    table, ix = LeaseTable(4), indexes(pools=("kv", "idx"))
    assert table.pinned_pools() == set()
    both = lease(table, ix, [("kv", PAGES[:1]), ("idx", PAGES[:1])])[0].lease_id
    lease(table, ix, [("kv", PAGES[:1])])
    assert table.pinned_pools() == {"kv", "idx"}
    table.release(both)
    assert table.pinned_pools() == {"kv"}
    assert [len(h.claims) for h in table] == [1]


def test_a_page_the_holders_quota_refuses_leaves_the_pools_lease_room_to_other_peers():
    table, ix = LeaseTable(4), indexes(lease_cap=2, peer_cap=1)
    mine, _ = lease(table, ix, [("kv", PAGES[:3])], holder=5)
    assert mine.slots == ((0, MISSING_SLOT, MISSING_SLOT),) and mine.over_quota == 2
    assert ix["kv"].leased == 1  # only the pinned page takes room under the pool's cap of 2
    theirs, _ = lease(table, ix, [("kv", PAGES[1:3])], holder=6)
    assert theirs.slots == ((1, MISSING_SLOT),)  # the room the refused pages left, then the pool is at its cap
    assert theirs.over_quota == 0 and ix["kv"].leased == 2


def test_a_page_named_twice_in_one_lease_is_pinned_twice_and_released_whole():
    table, ix = LeaseTable(4), indexes()
    grant, leased = lease(table, ix, [("kv", [PAGES[0], PAGES[0]])], holder=5)
    entry = ix["kv"].entries[PAGES[0]]
    assert grant.slots == ((0, 0),) and leased == {"kv": 2}
    assert (entry.claims, entry.leased, ix["kv"].leased) == (2, 2, 1)
    held = table.release(grant.lease_id)
    assert held is not None
    ix["kv"].unpin_all([e for _, e in held.claims])
    assert (entry.claims, entry.leased, ix["kv"].leased) == (0, 0, 0) and table.quota.holders() == 0
