"""The lease table on its own: ids, deadlines, shutdown and the quota's bookkeeping, with no pool at all."""

from kvcr.runner.index import Entry
from kvcr.runner.leases import LeaseTable


def claims(*pools):
    return [(pool, Entry(slot, None)) for slot, pool in enumerate(pools)]


def test_lease_ids_are_never_0_nor_a_live_lease_id():
    drawn = iter([0, 7, 7, 9])
    table = LeaseTable(4, draw=lambda bits: next(drawn))
    assert table.grant(claims("kv"), 0, 0.0, 5.0) == 7
    assert table.grant(claims("kv"), 0, 0.0, 5.0) == 9
    assert len(table) == 2


def test_lease_ids_are_63_bit_draws():
    bits = []
    table = LeaseTable(4, draw=lambda n: bits.append(n) or 5)
    assert table.grant(claims("kv"), 0, 0.0, 1.0) == 5 and bits == [63]


def test_a_lease_expires_at_its_deadline_and_not_before():
    table = LeaseTable(4)
    early = table.grant(claims("kv"), 0, 10.0, 1.0)
    late = table.grant(claims("kv"), 0, 10.0, 2.0)
    assert table.expire(10.999) == []
    [gone] = table.expire(11.0)
    assert gone.lease.lease_id == early and table.get(early) is None and table.get(late) is not None
    assert [h.lease.lease_id for h in table.expire(12.0)] == [late] and len(table) == 0


def test_release_returns_the_lease_once():
    table = LeaseTable(4)
    held = claims("kv", "idx")
    lease_id = table.grant(held, 3, 0.0, 1.0)
    released = table.release(lease_id)
    assert released is not None and released.claims == held and released.holder == 3
    assert table.release(lease_id) is None and table.release(12345) is None


def test_the_quota_counts_a_holders_leases_until_each_ends():
    table = LeaseTable(2)
    quota = table.quota
    first = table.grant(claims("kv"), 5, 0.0, 1.0)
    assert quota.may_lease(5)
    table.grant(claims("kv"), 5, 0.0, 9.0)
    assert not quota.may_lease(5) and quota.may_lease(6) and quota.may_lease(0)
    table.release(first)
    assert quota.may_lease(5) and quota.holders() == 1
    table.expire(10.0)
    assert quota.holders() == 0


def test_pinned_pools_name_every_pool_a_live_lease_holds():
    table = LeaseTable(4)
    assert table.pinned_pools() == set()
    lease_id = table.grant(claims("kv", "indexer"), 0, 0.0, 1.0)
    table.grant(claims("kv"), 0, 0.0, 1.0)
    assert table.pinned_pools() == {"kv", "indexer"}
    table.release(lease_id)
    assert table.pinned_pools() == {"kv"}
    assert [len(h.claims) for h in table] == [1]


def test_a_new_table_grants_until_the_runner_stops_it():
    assert LeaseTable(4).leasing is True


def test_ending_a_lease_unpins_its_holders_pages():
    table = LeaseTable(4)
    [(pool, entry)] = held = claims("kv")
    table.quota.pin(5, pool, entry)
    assert not table.quota.may_pin(5, pool, object(), 1)
    table.release(table.grant(held, 5, 0.0, 1.0))
    assert table.quota.may_pin(5, pool, object(), 1)
