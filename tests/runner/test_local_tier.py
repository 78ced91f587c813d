"""The runner's local DRAM tier through real memory: round trips, queries, eviction, inventory."""

import pytest

from kvcr.domain.outcomes import Outcome
from kvcr.ports.inventory import InventoryKind
from tests.support import content, indexer_pool, kv_pool, sequence


def fill(host, pages, slots, salt=""):
    for page, slot in zip(pages, slots, strict=True):
        host.write_page(slot, content(page, host.pool.page_bytes, salt))


def test_backup_then_restore_into_other_slots_is_byte_equal(build):
    runner, hosts = build(slots=16)
    host = hosts["kv"]
    pages = sequence(8)
    fill(host, pages, range(8))
    assert runner.backup("kv", pages, list(range(8))) == [True] * 8
    outcomes = runner.restore("kv", pages, list(range(20, 28)))
    assert [o.outcome for o in outcomes] == [Outcome.RESTORED] * 8
    for i, page in enumerate(pages):
        assert host.read_page(20 + i) == content(page, host.pool.page_bytes)


def test_host_slots_in_any_order_map_page_by_page(build):
    runner, hosts = build(slots=8)
    host = hosts["kv"]
    pages = sequence(4)
    src = [9, 3, 40, 4]
    fill(host, pages, src)
    runner.backup("kv", pages, src)
    dst = [50, 12, 13, 2]
    runner.restore("kv", pages, dst)
    for page, slot in zip(pages, dst, strict=True):
        assert host.read_page(slot) == content(page, host.pool.page_bytes)


def test_query_reports_leading_prefix_and_per_key_presence(build):
    runner, hosts = build(slots=16)
    pages = sequence(6)
    fill(hosts["kv"], pages, range(6))
    runner.backup("kv", [pages[0], pages[1], pages[3]], [0, 1, 3])
    result = runner.query("kv", pages)
    assert result.present == (True, True, False, True, False, False)
    assert result.prefix == 2
    assert runner.exists("kv", []) == []


def test_restore_misses_pages_not_held_and_prefix_only_stops_at_the_hole(build):
    runner, hosts = build(slots=16)
    host = hosts["kv"]
    pages = sequence(4)
    fill(host, pages, range(4))
    runner.backup("kv", [pages[0], pages[2]], [0, 2])
    outcomes = runner.restore("kv", pages, [10, 11, 12, 13])
    assert [o.outcome for o in outcomes] == [Outcome.RESTORED, Outcome.MISS, Outcome.RESTORED, Outcome.MISS]
    host.zero_page(12)
    outcomes = runner.restore("kv", pages, [10, 11, 12, 13], prefix_only=True)
    assert [o.outcome for o in outcomes] == [Outcome.RESTORED, Outcome.MISS, Outcome.MISS, Outcome.MISS]
    assert host.read_page(12) == bytes(host.pool.page_bytes)  # nothing copied past the hole


def test_backup_of_held_pages_is_idempotent_and_keeps_first_bytes(build):
    runner, hosts = build(slots=8)
    host = hosts["kv"]
    pages = sequence(2)
    fill(host, pages, [0, 1])
    runner.backup("kv", pages, [0, 1])
    fill(host, pages, [0, 1], salt="changed")
    assert runner.backup("kv", pages, [0, 1]) == [True, True]
    runner.restore("kv", pages, [5, 6])
    assert host.read_page(5) == content(pages[0], host.pool.page_bytes)


def test_a_page_listed_twice_in_one_batch_is_stored_once(build):
    runner, hosts = build(slots=8)
    pages = sequence(2)
    fill(hosts["kv"], pages, [0, 1])
    assert runner.backup("kv", [pages[0], pages[0], pages[1]], [0, 0, 1]) == [True, True, True]
    assert runner.stats().pools[0].ready == 2


def test_multiple_pools_are_independent_tiers(build):
    runner, hosts = build(pools=(kv_pool(), indexer_pool()), slots=8)
    pages = sequence(4)
    fill(hosts["kv"], pages, range(4))
    fill(hosts["indexer"], pages, range(4), salt="idx")
    runner.backup("kv", pages, list(range(4)))
    runner.backup("indexer", pages[:2], [0, 1])
    assert runner.query("indexer", pages).prefix == 2
    runner.restore("indexer", pages[:2], [30, 31])
    assert hosts["indexer"].read_page(31) == content(pages[1], 64, "idx")
    stats = {p.pool: p for p in runner.stats().pools}
    assert stats["kv"].slots == stats["indexer"].slots == 8
    assert stats["kv"].ready == 4 and stats["indexer"].ready == 2


def test_eviction_keeps_a_restorable_prefix(build):
    runner, hosts = build(slots=10)
    host = hosts["kv"]
    a = sequence(6, start=0)
    b = sequence(6, start=10_000)
    fill(host, a, range(6))
    fill(host, b, range(6, 12))
    runner.backup("kv", a, list(range(6)))
    runner.backup("kv", b, list(range(6, 12)))
    # 12 pages into 10 slots: A (least recent) loses its two deepest pages, not its root.
    assert runner.query("kv", a).present == (True, True, True, True, False, False)
    assert runner.query("kv", b).prefix == 6


def test_alignment_across_batches_uses_the_parent_chain(build):
    runner, hosts = build(slots=8)
    host = hosts["kv"]
    a = sequence(6)
    other = sequence(3, start=50_000)
    fill(host, a, range(6))
    fill(host, other, range(6, 9))
    runner.backup("kv", a[:3], [0, 1, 2])
    runner.backup("kv", other, [6, 7, 8])
    runner.backup("kv", a[3:], [3, 4, 5], parent=a[2])  # refreshes a[:3] with it
    # Make room for one page: without alignment a[0] (oldest) would go; with it, `other` ages first.
    extra = sequence(1, start=90_000)
    fill(host, extra, [9])
    runner.backup("kv", extra, [9])
    assert runner.query("kv", a).prefix == 6
    assert runner.query("kv", other).present == (True, False, False)  # lost its tail twice


def test_restore_refreshes_recency_so_used_prefixes_survive(build):
    runner, hosts = build(slots=6)
    host = hosts["kv"]
    a, b, c = sequence(3, start=0), sequence(3, start=1000), sequence(3, start=2000)
    for seq, slots in ((a, [0, 1, 2]), (b, [3, 4, 5])):
        fill(host, seq, slots)
        runner.backup("kv", seq, slots)
    runner.restore("kv", a, [10, 11, 12])
    fill(host, c, [6, 7, 8])
    runner.backup("kv", c, [6, 7, 8])
    assert runner.query("kv", a).prefix == 3
    assert runner.query("kv", b).prefix == 0


def test_batch_larger_than_the_arena_stores_its_leading_pages(build):
    runner, hosts = build(slots=4)
    pages = sequence(6)
    fill(hosts["kv"], pages, range(6))
    assert runner.backup("kv", pages, list(range(6))) == [True] * 4 + [False] * 2
    assert runner.query("kv", pages).prefix == 4


def test_inventory_events_follow_residency(build, inventory):
    runner, hosts = build(slots=4)
    pages = sequence(4)
    fill(hosts["kv"], pages, range(4))
    runner.backup("kv", pages[:2], [0, 1])
    runner.backup("kv", pages[2:], [2, 3], parent=pages[1])
    more = sequence(2, start=777)
    fill(hosts["kv"], more, [4, 5])
    runner.backup("kv", more, [4, 5])
    runner.clear()
    kinds = [(e.kind, e.page_hashes, e.parent) for e in inventory.events]
    assert kinds[0] == (InventoryKind.STORED, tuple(pages[:2]), None)
    assert kinds[1] == (InventoryKind.STORED, tuple(pages[2:]), pages[1])
    assert kinds[2] == (InventoryKind.REMOVED, (pages[3], pages[2]), None)
    assert kinds[3] == (InventoryKind.STORED, tuple(more), None)
    assert kinds[4][0] is InventoryKind.CLEARED
    assert runner.query("kv", pages).prefix == 0


def test_clear_frees_every_slot(build):
    runner, hosts = build(slots=4)
    pages = sequence(4)
    fill(hosts["kv"], pages, range(4))
    runner.backup("kv", pages, list(range(4)))
    runner.clear()
    stats = runner.stats().pools[0]
    assert stats.free == 4 and stats.ready == 0
    assert runner.backup("kv", pages, list(range(4))) == [True] * 4


def test_stats_count_operations(build):
    runner, hosts = build(slots=4)
    pages = sequence(2)
    fill(hosts["kv"], pages, [0, 1])
    runner.backup("kv", pages, [0, 1])
    runner.restore("kv", [*pages, sequence(1, start=999)[0]], [5, 6, 7])
    counters = runner.stats().counters
    assert counters["kvcr_pages_total{outcome=ok,path=backup}"] == 2
    assert counters["kvcr_pages_total{outcome=ok,path=local_restore}"] == 2
    assert counters["kvcr_pages_total{outcome=miss,path=local_restore}"] == 1


@pytest.mark.parametrize("slots", [1, 3])
def test_tiny_arenas_still_round_trip(build, slots):
    runner, hosts = build(slots=slots)
    pages = sequence(slots)
    fill(hosts["kv"], pages, range(slots))
    assert all(runner.backup("kv", pages, list(range(slots))))
    assert all(o.restored for o in runner.restore("kv", pages, list(range(10, 10 + slots))))


def test_flat_page_copy_path_round_trips_through_arbitrary_addresses(build):
    import ctypes

    runner, _ = build(slots=4)
    page = sequence(1)[0]
    data = content(page, 512)
    src = ctypes.create_string_buffer(data, 512)
    dst = ctypes.create_string_buffer(512)
    base_src, base_dst = ctypes.addressof(src), ctypes.addressof(dst)
    assert runner.store_page("kv", page, [base_src, base_src + 256])
    assert runner.query("kv", [page]).prefix == 1
    assert runner.load_page("kv", page, [base_dst, base_dst + 256])
    assert dst.raw == data
    assert not runner.load_page("kv", sequence(1, start=77)[0], [base_dst, base_dst + 256])


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_both_policies_keep_storing_once_the_arena_is_full(build, policy):
    runner, hosts = build(slots=4, policy=policy)
    host = hosts["kv"]
    for round_ in range(5):
        pages = sequence(4, start=1000 * round_)
        fill(host, pages, range(4))
        assert runner.backup("kv", pages, list(range(4))) == [True] * 4, f"round {round_} stored nothing"
        assert runner.exists("kv", pages) == [True] * 4
    assert runner.stats().pools[0].ready == 4


def test_fifo_evicts_the_first_admitted_pages_whatever_was_used(build):
    runner, hosts = build(slots=4, policy="fifo")
    host = hosts["kv"]
    old, new = sequence(2), sequence(2, start=500)
    fill(host, old + new, range(4))
    runner.backup("kv", old, [0, 1])
    runner.backup("kv", new, [2, 3])
    runner.restore("kv", old, [10, 11])  # a use refreshes LRU, never FIFO
    newest = sequence(2, start=900)
    fill(host, newest, [4, 5])
    runner.backup("kv", newest, [4, 5])
    assert runner.exists("kv", old) == [False, False]
    assert runner.exists("kv", new) == [True, True]


def test_a_page_is_not_present_while_its_copy_is_still_running(build):
    import threading

    runner, hosts = build(slots=8)
    host = hosts["kv"]
    pages = sequence(2)
    fill(host, pages, [0, 1])
    memory = runner._memory
    entered, gate = threading.Event(), threading.Event()
    copy, copy_digested = memory.copy, memory.copy_digested

    def slow_copy(moves):
        entered.set()
        gate.wait(5)
        copy(moves)

    def slow_copy_digested(pages, seeds):  # the verify_bytes path (the default)
        entered.set()
        gate.wait(5)
        return copy_digested(pages, seeds)

    memory.copy, memory.copy_digested = slow_copy, slow_copy_digested
    writer = threading.Thread(target=runner.backup, args=("kv", pages, [0, 1]))
    writer.start()
    try:
        assert entered.wait(5)
        assert runner.exists("kv", pages) == [False, False]  # FILLING is not READY
        assert runner.query("kv", pages).prefix == 0
        assert [o.outcome for o in runner.restore("kv", pages, [9, 10])] == [Outcome.MISS] * 2
    finally:
        gate.set()
        writer.join(5)
        memory.copy, memory.copy_digested = copy, copy_digested
    assert runner.exists("kv", pages) == [True, True]


def test_leases_are_refused_when_a_pool_is_already_half_pinned(build):
    runner, hosts = build(slots=8)
    host = hosts["kv"]
    pages = sequence(8)
    fill(host, pages, range(8))
    runner.backup("kv", pages, list(range(8)))
    first = runner.lease([("kv", pages[:6])], 10.0)
    assert sum(s >= 0 for s in first.slots[0]) == 4  # at most half of the pool's slots
    second = runner.lease([("kv", pages)], 10.0)
    granted = [p for p, s in zip(pages, second.slots[0], strict=True) if s >= 0]
    assert granted == pages[:4]  # pages already pinned may be leased again; no new ones
    assert runner.release_lease(first.lease_id) and runner.release_lease(second.lease_id)
    assert not runner.release_lease(first.lease_id)  # an unknown lease reports nothing released
    assert runner.leased_slots(first.lease_id) is None


def test_lease_ids_are_random_and_a_nothing_grant_holds_no_lease(build):
    runner, hosts = build(slots=8)
    nothing = runner.lease([("kv", sequence(2)), ("no-such-pool", sequence(1))], 10.0)
    assert nothing.lease_id == 0 and runner.active_leases == 0
    assert nothing.slots == ((-1, -1), (-1,))
    fill(hosts["kv"], sequence(1), [0])
    runner.backup("kv", sequence(1), [0])
    ids = [runner.lease([("kv", sequence(1))], 10.0).lease_id for _ in range(8)]
    assert len(set(ids)) == 8 and all(ids) and max(ids) - min(ids) > 1 << 32
