"""The local tier's bookkeeping: counters and gauges, inventory events, claims and leases, discarded pages.

Each test reads what an operator or a peer would see (metrics, events, grants, stats) after one
kind of operation, so a miscount or a slot that is never given back shows up as a wrong number.
"""

import ctypes
import threading
import time

import pytest

from kvcr.adapters.local import InMemoryMetrics, MonotonicClock, RecordingInventory
from kvcr.adapters.mock import FakeClock, MockHostMemory
from kvcr.domain.deadlines import Timing
from kvcr.domain.errors import ClosedError, LayoutError
from kvcr.domain.layout import ComponentSpec, RegionDescriptor
from kvcr.domain.outcomes import Outcome
from kvcr.domain.pools import PoolSpec
from kvcr.ports.inventory import InventoryKind
from tests.support import HostPool, content, indexer_pool, kv_pool, make_runner, sequence

PAGE = kv_pool().page_bytes  # 512


class Env:
    def __init__(self, slots=8, pools=None, memory=None, clock=None, **changes):
        self.memory = memory or MockHostMemory()
        self.metrics = InMemoryMetrics(strict=True)
        self.inventory = RecordingInventory()
        self.clock = clock or MonotonicClock()
        pools = tuple(pools or (kv_pool(),))
        self.runner = make_runner(pools, slots, self.memory, self.clock, self.metrics, self.inventory, **changes)
        self.hosts = {p.name: HostPool(p, 64) for p in pools}
        for name, host in self.hosts.items():
            self.runner.register_host_pool(name, host.regions)

    def store(self, pages, slots=None, pool="kv", **kwargs):
        slots = list(range(len(pages))) if slots is None else slots
        host = self.hosts[pool]
        for page, slot in zip(pages, slots, strict=True):
            host.write_page(slot, content(page, host.pool.page_bytes))
        return self.runner.backup(pool, pages, slots, **kwargs)

    def value(self, key):
        return self.metrics.snapshot().get(key, 0)


@pytest.fixture
def env():
    made = []

    def make(**kwargs):
        made.append(Env(**kwargs))
        return made[-1]

    yield make
    for e in made:
        e.runner.close()


# ---------------------------------------------------------------------------------------------- counters and gauges


def test_backups_count_pages_and_bytes_by_outcome_and_one_failure_per_batch(env):
    e = env(slots=4)
    pages = sequence(6)
    assert e.store(pages) == [True] * 4 + [False] * 2
    assert e.value("kvcr_pages_total{outcome=ok,path=backup}") == 4
    assert e.value("kvcr_bytes_total{outcome=ok,path=backup}") == 4 * PAGE
    assert e.value("kvcr_pages_total{outcome=miss,path=backup}") == 2
    assert "kvcr_bytes_total{outcome=miss,path=backup}" not in e.metrics.snapshot()
    assert "kvcr_pages_total{outcome=failed,path=backup}" not in e.metrics.snapshot()
    assert e.value("kvcr_failures_total{path=backup,reason=no_space}") == 1
    e.memory.fail_after_moves = 0
    assert e.store(sequence(2, start=500)) == [False, False]
    assert e.value("kvcr_pages_total{outcome=failed,path=backup}") == 2
    assert e.value("kvcr_bytes_total{outcome=failed,path=backup}") == 2 * PAGE
    assert e.value("kvcr_failures_total{path=backup,reason=copy_error}") == 1


def test_a_batch_of_held_pages_counts_no_miss_and_no_failure(env):
    e = env(slots=4)
    pages = sequence(2)
    e.store(pages)
    e.store(pages)
    assert e.value("kvcr_pages_total{outcome=ok,path=backup}") == 2  # stored once
    assert "kvcr_pages_total{outcome=miss,path=backup}" not in e.metrics.snapshot()
    assert "kvcr_failures_total{path=backup,reason=no_space}" not in e.metrics.snapshot()


def test_local_restores_count_by_outcome_and_time_their_reads(env):
    clock = FakeClock()
    e = env(clock=clock)
    pages = sequence(3)
    e.store(pages[:2])
    e.runner.restore("kv", pages, [10, 11, 12])
    assert e.value("kvcr_pages_total{outcome=ok,path=local_restore}") == 2
    assert e.value("kvcr_bytes_total{outcome=ok,path=local_restore}") == 2 * PAGE
    assert e.value("kvcr_pages_total{outcome=miss,path=local_restore}") == 1
    assert e.value("kvcr_restore_seconds_count{path=local_restore}") == 1
    assert e.value("kvcr_restore_seconds_sum{path=local_restore}") == 0.0  # the fake clock did not move
    e.runner.restore("kv", sequence(1, start=900), [13])  # nothing claimed: nothing timed
    assert e.value("kvcr_restore_seconds_count{path=local_restore}") == 1
    e.memory.fail_after_moves = 0
    failed = e.runner.restore("kv", pages, [10, 11, 12])
    assert [o.reason for o in failed] == ["local copy failed", "local copy failed", "not held"]
    assert e.value("kvcr_pages_total{outcome=failed,path=local_restore}") == 2
    assert e.value("kvcr_pages_total{outcome=ok,path=local_restore}") == 2  # unchanged
    assert e.value("kvcr_failures_total{path=local_restore,reason=copy_error}") == 1


def test_a_corrupt_page_is_counted_dropped_and_announced(env):
    e = env(verify_bytes=True)
    pages = sequence(3)
    e.store(pages)
    arena = e.runner.pool_arenas()["kv"]
    ctypes.memset(arena[1].address(1), 0x5A, 4)  # page 1's V piece changes behind kvcr's back
    outcomes = e.runner.restore("kv", pages, [10, 11, 12])
    assert [o.outcome for o in outcomes] == [Outcome.RESTORED, Outcome.FAILED, Outcome.RESTORED]
    assert outcomes[1].reason == "bytes differ from their backup digest"
    assert e.value("kvcr_pages_total{outcome=ok,path=local_restore}") == 2
    assert e.value("kvcr_pages_total{outcome=failed,path=local_restore}") == 1
    assert e.value("kvcr_verification_failures_total{path=local_restore}") == 1
    assert e.inventory.events[-1].kind is InventoryKind.REMOVED
    assert (e.inventory.events[-1].pool, e.inventory.events[-1].page_hashes) == ("kv", (pages[1],))
    assert e.runner.exists("kv", pages) == [True, False, True]
    stats = e.runner.stats().pools[0]
    assert (stats.ready, stats.free, stats.discarding) == (2, 6, 0)  # the corrupt page's slot is free again
    assert e.store([pages[1]], [1]) == [True]  # and the page can be backed up afresh


def test_a_corrupt_page_another_reader_still_holds_is_freed_when_that_reader_ends(env):
    memory = GatedMemory()
    e = env(memory=memory, verify_bytes=True)
    pages = sequence(1)
    e.store(pages)
    memory.armed = True
    slow = threading.Thread(target=lambda: e.runner.restore("kv", pages, [20]))
    slow.start()
    assert memory.entered.wait(5)  # a reader claims the page and is copying it
    ctypes.memset(e.runner.pool_arenas()["kv"][0].address(0), 0x11, 4)
    memory.gate.set()
    slow.join(5)
    stats = e.runner.stats().pools[0]
    assert stats.discarding == 0 and stats.free == 8 and stats.ready == 0


def test_dram_gauges_follow_the_free_slots(env):
    e = env(slots=4)
    assert e.value("kvcr_dram_free_bytes{pool=kv}") == 4 * PAGE
    assert e.value("kvcr_dram_used_bytes{pool=kv}") == 0
    e.store(sequence(3))
    assert e.value("kvcr_dram_free_bytes{pool=kv}") == PAGE
    assert e.value("kvcr_dram_used_bytes{pool=kv}") == 3 * PAGE
    e.runner.clear()
    assert e.value("kvcr_dram_free_bytes{pool=kv}") == 4 * PAGE


def test_leases_are_a_gauge_expiries_a_counter_and_served_pages_are_counted(env):
    clock = FakeClock()
    e = env(clock=clock, timing=Timing(lease_s=2.0, lease_margin_s=0.5))
    pages = sequence(2)
    e.store(pages)
    first = e.runner.lease([("kv", pages)], 2.0)
    e.runner.lease([("kv", pages[:1])], 2.0)
    assert e.value("kvcr_leases_held{role=source}") == 2
    assert e.value("kvcr_pages_total{outcome=ok,path=served}") == 3
    assert e.value("kvcr_bytes_total{outcome=ok,path=served}") == 3 * PAGE
    e.runner.release_lease(first.lease_id)
    assert e.value("kvcr_leases_held{role=source}") == 1
    clock.advance(2.0)
    assert e.runner.expire_leases() == 1
    assert e.value("kvcr_leases_expired_total") == 1
    assert e.value("kvcr_leases_held{role=source}") == 0


def test_evictions_are_counted_per_pool_and_announced_with_the_pool(env):
    e = env(slots=2)
    e.store(sequence(2))
    newer = sequence(1, start=100)
    e.store(newer, [5])
    assert e.value("kvcr_evicted_pages_total{pool=kv}") == 1
    removed = [ev for ev in e.inventory.events if ev.kind is InventoryKind.REMOVED]
    assert [(ev.pool, len(ev.page_hashes)) for ev in removed] == [("kv", 1)]


# ---------------------------------------------------------------------------------------------- inventory


def test_stored_runs_name_the_page_before_them(env):
    e = env()
    pages = sequence(5)
    e.store(pages[:1])
    e.store(pages[2:4], [2, 3], parent=pages[1])
    e.store(pages, [0, 1, 2, 3, 4])  # only pages 1 and 4 are new: two runs
    stored = [(ev.pool, ev.page_hashes, ev.parent) for ev in e.inventory.events if ev.kind is InventoryKind.STORED]
    assert stored == [
        ("kv", (pages[0],), None),
        ("kv", (pages[2], pages[3]), pages[1]),
        ("kv", (pages[1],), pages[0]),
        ("kv", (pages[4],), pages[3]),
    ]


# ---------------------------------------------------------------------------------------------- leases and claims


def test_a_lease_for_a_negative_time_is_no_time(env):
    clock = FakeClock()
    e = env(clock=clock)
    e.store(sequence(1))
    grant = e.runner.lease([("kv", sequence(1))], -3.0)
    assert grant.ttl_s == 0.0
    assert e.runner.leased_slots(grant.lease_id) is None  # expired at once
    assert e.runner.lease([("kv", sequence(1))], 0.25).ttl_s == 0.25


def test_a_lease_skips_unknown_pools_and_bad_keys_and_goes_on(env):
    e = env(pools=(kv_pool(), indexer_pool()))
    pages = sequence(2)
    e.store(pages)
    e.store(pages, pool="indexer")
    grant = e.runner.lease([("nope", pages), ("kv", [42, pages[0]]), ("indexer", pages)], 5.0)
    assert grant.slots[0] == (-1, -1) and grant.digests[0] == (b"", b"")
    assert grant.slots[1][0] == -1 and grant.digests[1][0] == b"" and grant.slots[1][1] >= 0
    assert all(s >= 0 for s in grant.slots[2])


def test_a_lease_counts_the_pages_and_bytes_it_serves_across_every_pool(env):
    e = env(pools=(kv_pool(), indexer_pool()))
    pages = sequence(3)
    e.store(pages)
    e.store(pages[:2], pool="indexer")
    e.runner.lease([("kv", pages), ("indexer", pages)], 5.0)  # the indexer lacks the third page
    assert e.value("kvcr_pages_total{outcome=ok,path=served}") == 5
    assert e.value("kvcr_bytes_total{outcome=ok,path=served}") == 3 * PAGE + 2 * indexer_pool().page_bytes


def test_a_stopped_runner_grants_nothing(env):
    e = env()
    e.store(sequence(1))
    e.runner.stop_leasing()
    grant = e.runner.lease([("kv", sequence(1))], 5.0)
    assert grant.lease_id == 0 and grant.slots == ((-1,),) and grant.digests == ((b"",),)


def test_a_page_two_leases_hold_stays_pinned_until_both_end(env):
    e = env(slots=2)
    pages = sequence(2)
    e.store(pages)
    one = e.runner.lease([("kv", pages[:1])], 5.0)
    two = e.runner.lease([("kv", pages[:1])], 5.0)
    e.runner.release_lease(one.lease_id)
    e.store(sequence(2, start=50), [4, 5])  # pressure: the pinned page must survive
    assert e.runner.exists("kv", pages[:1]) == [True]
    e.runner.release_lease(two.lease_id)
    e.store(sequence(2, start=80), [6, 7])
    assert e.runner.exists("kv", pages[:1]) == [False]  # now evictable


def test_released_leases_give_their_pages_back_to_the_lease_cap(env):
    e = env(slots=4)  # at most 2 pages leased at once
    pages = sequence(4)
    e.store(pages)
    first = e.runner.lease([("kv", pages[:2])], 5.0)
    again = e.runner.lease([("kv", pages[:2])], 5.0)  # the same pages again: no new page pinned
    assert all(s >= 0 for s in again.slots[0])
    assert e.runner.lease([("kv", pages[2:])], 5.0).lease_id == 0  # the cap is reached
    e.runner.release_lease(first.lease_id)
    e.runner.release_lease(again.lease_id)
    assert all(s >= 0 for s in e.runner.lease([("kv", pages[2:])], 5.0).slots[0])


def test_a_cleared_page_a_lease_holds_is_freed_when_the_lease_ends(env):
    e = env(slots=2)
    pages = sequence(1)
    e.store(pages)
    grant = e.runner.lease([("kv", pages)], 5.0)
    e.runner.clear()
    assert e.runner.stats().pools[0].discarding == 1
    e.runner.release_lease(grant.lease_id)
    stats = e.runner.stats().pools[0]
    assert (stats.discarding, stats.free) == (0, 2)


def test_leased_slots_name_each_pool_a_lease_holds(env):
    e = env(pools=(kv_pool(), indexer_pool()))
    pages = sequence(2)
    e.store(pages)
    e.store(pages, [3, 4], pool="indexer")
    grant = e.runner.lease([("kv", pages), ("indexer", pages[1:])], 5.0)
    assert e.runner.leased_slots(grant.lease_id) == {"kv": {0, 1}, "indexer": {1}}


def test_lease_ids_fit_a_signed_64_bit_int(env):
    e = env()
    e.store(sequence(1))
    ids = [e.runner.lease([("kv", sequence(1))], 5.0).lease_id for _ in range(64)]
    assert all(0 < i < 1 << 63 for i in ids)


# ---------------------------------------------------------------------------------------------- concurrent callers


class GatedMemory(MockHostMemory):
    def __init__(self):
        super().__init__()
        self.entered, self.gate, self.armed = threading.Event(), threading.Event(), False

    def copy(self, moves):
        if self.armed:
            self.armed = False
            self.entered.set()
            assert self.gate.wait(5)
        super().copy(moves)


def test_a_page_another_caller_is_storing_counts_as_stored(env):
    memory = GatedMemory()
    e = env(memory=memory)
    pages = sequence(1)
    memory.armed = True
    first = threading.Thread(target=lambda: e.store(pages))
    first.start()
    assert memory.entered.wait(5)
    assert e.runner.backup("kv", pages, [9]) == [True]  # FILLING by the first caller, the same bytes
    memory.gate.set()
    first.join(5)
    assert e.runner.exists("kv", pages) == [True]


# ---------------------------------------------------------------------------------------------- layouts


def test_strided_host_regions_move_piece_by_piece(env):
    pool = PoolSpec("kv", (ComponentSpec("k", 64), ComponentSpec("v", 64)), anchor=True)
    e = env(pools=(pool,), slots=8)
    buffer = ctypes.create_string_buffer(128 * 16)
    base = ctypes.addressof(buffer)
    # K and V interleaved per page: K at 0, V at 64 of every 128 bytes (neither region is dense).
    regions = [RegionDescriptor("k", base, 128, 16, 64), RegionDescriptor("v", base + 64, 128, 16, 64)]
    e.runner.register_host_pool("kv", regions)
    pages = sequence(3)
    for i, page in enumerate(pages):
        ctypes.memmove(base + 128 * (2 + i), content(page, 128), 128)
    assert e.runner.backup("kv", pages, [2, 3, 4]) == [True] * 3
    assert all(o.restored for o in e.runner.restore("kv", pages, [9, 10, 11]))
    for i, page in enumerate(pages):
        assert ctypes.string_at(base + 128 * (9 + i), 128) == content(page, 128)
    assert ctypes.string_at(base + 128 * 8, 128) == bytes(128)  # nothing outside the target pages


def test_host_slots_out_of_range_name_the_bad_slot(env):
    e = env()
    with pytest.raises(LayoutError) as low:
        e.runner.restore("kv", sequence(2), [-1, 3])
    assert str(low.value) == "host slot -1 is outside the host pool's 64 pages"
    with pytest.raises(LayoutError) as high:
        e.runner.backup("kv", sequence(2), [0, 64])
    assert str(high.value) == "host slot 64 is outside the host pool's 64 pages"
    with pytest.raises(LayoutError) as zero:
        e.runner.backup("kv", sequence(2), [0, 99])
    assert str(zero.value) == "host slot 99 is outside the host pool's 64 pages"


def test_a_closed_runner_says_which_runner(env):
    e = env()
    e.runner.close()
    with pytest.raises(ClosedError) as err:
        e.runner.exists("kv", sequence(1))
    assert str(err.value) == "runner 'r0' is closed"


def test_the_replica_namespace_is_a_stable_digest_of_every_pool_namespace(env):
    a, b = env(), env()
    assert a.runner.namespace == b.runner.namespace and len(a.runner.namespace) == 16
    other = env(pools=(kv_pool(), indexer_pool()))
    assert other.runner.namespace != a.runner.namespace
    assert a.runner.stats().namespace == a.runner.namespace


# ---------------------------------------------------------------------------------------------- more edges


def test_a_corrupt_page_two_readers_hold_is_freed_when_the_last_one_ends(env):
    memory = GatedMemory()
    e = env(memory=memory, verify_bytes=True)
    pages = sequence(1)
    e.store(pages)
    ctypes.memset(e.runner.pool_arenas()["kv"][0].address(0), 0x11, 4)
    memory.armed = True
    slow = threading.Thread(target=lambda: e.runner.restore("kv", pages, [20]))
    slow.start()
    assert memory.entered.wait(5)  # the first reader holds the page
    assert [o.outcome for o in e.runner.restore("kv", pages, [21])] == [Outcome.FAILED]
    assert e.runner.stats().pools[0].discarding == 1  # dropped, but still read by the first reader
    memory.gate.set()
    slow.join(5)
    stats = e.runner.stats().pools[0]
    assert (stats.discarding, stats.free) == (0, 8)


def test_a_dropped_corrupt_page_is_never_chosen_for_eviction(env):
    e = env(slots=2, verify_bytes=True)
    pages = sequence(2)
    e.store(pages)
    ctypes.memset(e.runner.pool_arenas()["kv"][0].address(0), 0x22, 4)
    e.runner.restore("kv", pages, [10, 11])  # page 0 is dropped
    assert e.store(sequence(2, start=300), [20, 21]) == [True, True]  # one free slot, one eviction


def test_stats_count_claimed_pages_and_name_the_runner(env):
    e = env(pools=(kv_pool(), indexer_pool()))
    pages = sequence(2)
    e.store(pages)
    e.runner.lease([("kv", pages)], 5.0)
    stats = e.runner.stats()
    assert stats.name == "r0"
    kv = next(p for p in stats.pools if p.pool == "kv")
    assert (kv.claimed, kv.ready, kv.page_bytes) == (2, 2, PAGE)
    assert next(p for p in stats.pools if p.pool == "indexer").page_bytes == 64


def test_a_logical_pool_shows_no_slots():
    logical = PoolSpec("kv", (), anchor=True, logical=True)
    memory, metrics, inventory = MockHostMemory(), InMemoryMetrics(strict=True), RecordingInventory()
    runner = make_runner((logical, indexer_pool()), 4, memory, MonotonicClock(), metrics, inventory)
    try:
        pools = {p.pool: p for p in runner.stats().pools}
        assert (pools["kv"].slots, pools["kv"].free, pools["kv"].page_bytes) == (0, 0, 0)
        assert pools["indexer"].slots == 4
    finally:
        runner.close()


def test_stats_still_answer_after_close(env):
    e = env()
    e.store(sequence(1))
    e.runner.close()
    assert e.runner.stats().pools[0].ready == 0


def test_host_regions_lists_every_registered_pool(env):
    e = env(pools=(kv_pool(), indexer_pool()))
    labels = [r.label for r in e.runner.host_regions()]
    assert labels == ["host/kv/k", "host/kv/v", "host/indexer/i"]


def test_the_flat_copy_path_needs_one_destination_per_component(env):
    e = env()
    e.store(sequence(1))
    with pytest.raises(LayoutError) as err:
        e.runner.load_page("kv", sequence(1)[0], [0])
    assert str(err.value) == "pool 'kv' has 2 components, 1 destinations given"
    assert e.runner.load_page("kv", sequence(1, start=50)[0], [0, 0]) is False


def test_host_regions_cannot_move_while_an_operation_is_in_flight(env):
    memory = GatedMemory()
    e = env(memory=memory)
    e.store(sequence(1))
    memory.armed = True
    reader = threading.Thread(target=lambda: e.runner.restore("kv", sequence(1), [3]))
    reader.start()
    assert memory.entered.wait(5)
    try:
        with pytest.raises(LayoutError) as err:
            e.runner.register_host_pool("kv", HostPool(kv_pool(), 8).regions)
        assert str(err.value) == "pool 'kv': host regions cannot change while operations are in flight"
        e.runner.register_host_pool("kv", e.hosts["kv"].regions)  # the same geometry is fine
    finally:
        memory.gate.set()
        reader.join(5)
    e.runner.register_host_pool("kv", HostPool(kv_pool(), 8).regions)  # and a new one once quiet


def test_a_successful_restore_counts_no_copy_failure(env):
    e = env()
    e.store(sequence(1))
    e.runner.restore("kv", sequence(1), [5])
    assert "kvcr_failures_total{path=local_restore,reason=copy_error}" not in e.metrics.snapshot()


def test_a_failed_copy_counts_no_extra_misses(env):
    e = env(slots=4)
    pages = sequence(3)
    e.store(pages[:1])
    e.memory.fail_after_moves = 0
    assert e.store(pages) == [True, False, False]  # the held page still counts as stored
    assert "kvcr_pages_total{outcome=miss,path=backup}" not in e.metrics.snapshot()
    assert e.value("kvcr_pages_total{outcome=failed,path=backup}") == 2


def test_expiries_are_counted_one_per_lease(env):
    clock = FakeClock()
    e = env(clock=clock, timing=Timing(lease_s=2.0, lease_margin_s=0.5))
    e.store(sequence(2))
    e.runner.lease([("kv", sequence(2)[:1])], 2.0)
    e.runner.lease([("kv", sequence(2)[1:])], 2.0)
    clock.advance(2.0)
    assert e.runner.expire_leases() == 2
    assert e.value("kvcr_leases_expired_total") == 2


def test_the_lease_cap_counts_pages_not_leases(env):
    e = env(slots=2)  # at most one page leased at a time
    pages = sequence(2)
    e.store(pages)
    first = e.runner.lease([("kv", pages[:1])], 5.0)
    e.runner.release_lease(first.lease_id)
    assert e.runner.lease([("kv", pages[1:])], 5.0).slots[0][0] >= 0  # the cap came back
    both = e.runner.lease([("kv", pages)], 5.0)
    assert sum(s >= 0 for s in both.slots[0]) == 1


def test_a_page_leased_twice_pins_one_cap_slot_until_both_end(env):
    e = env(slots=4)  # cap: 2 pages
    pages = sequence(3)
    e.store(pages)
    a = e.runner.lease([("kv", pages[:1])], 5.0)
    e.runner.lease([("kv", pages[:1])], 5.0)
    e.runner.release_lease(a.lease_id)  # page 0 is still leased by the second
    more = e.runner.lease([("kv", pages[1:])], 5.0)
    assert [s >= 0 for s in more.slots[0]] == [True, False]


def test_an_unhashable_key_in_a_lease_is_a_miss(env):
    e = env()
    e.store(sequence(1))
    grant = e.runner.lease([("kv", [["not", "a", "key"], sequence(1)[0]])], 5.0)
    assert grant.slots[0][0] == -1 and grant.slots[0][1] >= 0


def test_backing_up_held_pages_refreshes_their_recency(env):
    e = env(slots=2)
    pages = sequence(2)
    e.store(pages[:1])
    e.store(pages[1:], [1])
    e.store(pages[:1])  # page 0 is used again: page 1 is now the least recent
    e.store(sequence(1, start=400), [7])
    assert e.runner.exists("kv", pages) == [True, False]


def test_a_page_listed_twice_takes_one_slot(env):
    e = env()
    page = sequence(1)
    assert e.store(page * 2, [0, 0]) == [True, True]
    stats = e.runner.stats().pools[0]
    assert (stats.ready, stats.filling, stats.free) == (1, 0, 7)


def test_alignment_walks_at_most_max_alignment_depth_ancestors(env):
    e = env(slots=4, max_alignment_depth=1)
    chain = sequence(3)
    e.store(chain[:1], [0])
    e.store(chain[1:2], [1], parent=chain[0])
    e.store(chain[2:], [2], parent=chain[1])
    other = sequence(1, start=500)
    e.store(other, [3])
    e.runner.restore("kv", chain[2:], [10])  # touches page 2 and one ancestor (page 1), not page 0
    e.store(sequence(1, start=600), [4])
    assert e.runner.exists("kv", chain) == [False, True, True]


def test_slots_expired_leases_free_are_used_before_any_page_is_evicted(env):
    clock = FakeClock()
    e = env(slots=4, clock=clock, timing=Timing(lease_s=2.0, lease_margin_s=0.5))  # lease cap: 2 pages
    cleared = sequence(2)
    e.store(cleared)
    e.runner.lease([("kv", cleared)], 1.0)
    e.runner.clear()  # the leased pages are dropped; their slots stay pinned until the lease ends
    kept = sequence(1, start=100)
    e.store(kept, [2])  # one slot is still free
    clock.advance(2.0)
    assert e.store(sequence(2, start=200), [4, 5]) == [True, True]  # the free slot and one the lease freed
    assert e.runner.exists("kv", kept) == [True]
    assert "kvcr_evicted_pages_total{pool=kv}" not in e.metrics.snapshot()
    stats = e.runner.stats().pools[0]
    assert (stats.ready, stats.free, stats.discarding) == (3, 1, 0)


# ---------------------------------------------------------------------------------------------- triaged survivors


def test_pool_stats_read_as_a_plain_dict(env):
    e = env()
    e.store(sequence(1))
    assert e.runner.stats().pools[0].as_dict() == {
        "pool": "kv",
        "slots": 8,
        "free": 7,
        "ready": 1,
        "filling": 0,
        "discarding": 0,
        "claimed": 0,
        "page_bytes": PAGE,
    }


def test_a_lease_carries_no_digest_without_verify_bytes_and_the_backup_digest_with_it(env):
    plain, verified = env(verify_bytes=False), env()  # verify_bytes is on by default
    page = sequence(1)
    plain.store(page)
    verified.store(page)
    assert plain.runner.lease([("kv", page)], 5.0).digests == ((b"",),)
    digest = verified.runner.lease([("kv", page)], 5.0).digests[0][0]
    assert digest == verified.runner.host_digest("kv", 0, page[0]) and len(digest) == 16


def test_a_page_digest_is_bound_to_the_model_namespace(env):
    import dataclasses

    from kvcr.domain.keys import NamespaceSpec
    from kvcr.runner import KvcrRunner

    ours, same = env(), env()
    config = dataclasses.replace(ours.runner.config, namespace=NamespaceSpec("other-model", 4, "bf16", "page_first"))
    other = KvcrRunner(
        config,
        memory=MockHostMemory(),
        clock=MonotonicClock(),
        metrics=InMemoryMetrics(),
        inventory=RecordingInventory(),
    )
    try:
        for runner in (same.runner, other):
            runner.register_host_pool("kv", ours.hosts["kv"].regions)  # the very same host bytes
        page = sequence(1)[0]
        ours.hosts["kv"].write_page(0, content(page, PAGE))
        digest = ours.runner.host_digest("kv", 0, page)
        assert same.runner.host_digest("kv", 0, page) == digest
        assert other.host_digest("kv", 0, page) != digest  # another model's replica never vouches for it
    finally:
        other.close()


def test_the_flat_copy_path_checks_what_it_delivers_with_verify_bytes(env):
    e = env(verify_bytes=True)
    pages = sequence(2)
    e.store(pages)
    out = ctypes.create_string_buffer(PAGE)
    base = ctypes.addressof(out)
    assert e.runner.load_page("kv", pages[0], [base, base + 256]) is True
    assert out.raw == content(pages[0], PAGE)
    ctypes.memset(e.runner.pool_arenas()["kv"][0].address(1), 0x33, 4)  # page 1 changes behind kvcr's back
    assert e.runner.load_page("kv", pages[1], [base, base + 256]) is False
    assert e.runner.exists("kv", pages) == [True, False]
    assert e.value("kvcr_verification_failures_total{path=local_restore}") == 1
    assert e.value("kvcr_pages_total{outcome=failed,path=local_restore}") == 1


def test_the_flat_store_path_needs_one_source_per_component(env):
    e = env()
    with pytest.raises(LayoutError) as err:
        e.runner.store_page("kv", sequence(1)[0], [0])
    assert str(err.value) == "pool 'kv' has 2 components, 1 sources given"


def test_two_corrupt_pages_two_readers_hold_are_both_counted_discarding(env):
    memory = GatedMemory()
    e = env(memory=memory, verify_bytes=True)
    pages = sequence(2)
    e.store(pages)
    for slot in (0, 1):
        ctypes.memset(e.runner.pool_arenas()["kv"][0].address(slot), 0x44, 4)
    memory.armed = True
    slow = threading.Thread(target=lambda: e.runner.restore("kv", pages, [20, 21]))
    slow.start()
    try:
        assert memory.entered.wait(5)
        assert [o.outcome for o in e.runner.restore("kv", pages, [22, 23])] == [Outcome.FAILED] * 2
        assert e.runner.stats().pools[0].discarding == 2
    finally:
        memory.gate.set()
        slow.join(5)
    stats = e.runner.stats().pools[0]
    assert (stats.discarding, stats.free) == (0, 8)


def test_a_dropped_corrupt_page_leaves_the_eviction_order(env):
    e = env(slots=2, verify_bytes=True)
    pages = sequence(2)
    e.store(pages)
    ctypes.memset(e.runner.pool_arenas()["kv"][0].address(0), 0x22, 4)
    e.runner.restore("kv", pages, [10, 11])  # page 0 is dropped; page 1 is the only victim left
    assert e.store(sequence(3, start=300), [20, 21, 22]) == [True, True, False]


def test_held_pages_of_a_batch_are_refreshed_before_its_copy(env):
    memory = GatedMemory()
    e = env(memory=memory, slots=3)
    held, older = sequence(1), sequence(1, start=100)
    e.store(held, [0])
    e.store(older, [1])  # `held` is now the least recent page
    memory.armed = True
    batch = threading.Thread(target=lambda: e.store([held[0], sequence(1, start=200)[0]], [0, 2]))
    batch.start()
    try:
        assert memory.entered.wait(5)  # the batch is copying its new page; `held` was used by it
        assert e.store(sequence(1, start=300), [3]) == [True]  # another caller needs a slot meanwhile
    finally:
        memory.gate.set()
        batch.join(5)
    assert e.runner.exists("kv", held + older) == [True, False]


def test_a_batch_keeps_its_own_order_over_parent_links(env):
    e = env(slots=3)
    root, child = sequence(2)
    e.store([root, child], [0, 1])  # child's parent is root
    other = sequence(1, start=100)
    e.store(other, [2])
    e.runner.restore("kv", [child, root], [10, 11])  # child listed first: it is touched as the shallowest
    e.store(sequence(2, start=200), [3, 4])
    assert e.runner.exists("kv", [root, child]) == [False, True]


def test_a_loop_in_the_parent_links_is_walked_once(env):
    e = env(slots=4, max_alignment_depth=3)
    b, c, a, d = sequence(4)
    e.store([c], [0], parent=b)
    e.store([b], [1], parent=c)  # c and b are each other's parent
    e.store([a], [2], parent=b)  # refreshes b then c: c ends up the more recent
    e.store([d], [3])
    e.store(sequence(2, start=200), [4, 5])
    assert e.runner.exists("kv", [a, b, c, d]) == [False, False, True, True]


def test_the_wait_for_leases_gives_up_at_its_timeout_not_a_poll_slice_later(env):
    e = env(timing=Timing(lease_s=60.0, lease_margin_s=0.5))
    e.store(sequence(1))
    e.runner.lease([("kv", sequence(1))], 60.0)
    started = time.monotonic()
    assert e.runner.wait_for_leases(0.002) == 1  # the lease outlives the wait
    # The last wait is cut to the time left: a shutdown with a short grace waits that long, not
    # a 50 ms polling slice beyond it.
    assert time.monotonic() - started < 0.045


def test_leases_expiring_on_the_clock_during_the_wait_are_not_waited_for(env):
    clock = FakeClock()
    e = env(clock=clock, timing=Timing(lease_s=2.0, lease_margin_s=0.5))
    e.store(sequence(1))
    e.runner.lease([("kv", sequence(1))], 1.0)
    later = threading.Timer(0.1, clock.advance, args=(2.0,))
    later.start()
    try:
        assert e.runner.wait_for_leases(0.8) == 0
    finally:
        later.join(5)
