"""Edges of the per-peer quota, the planned copies of a batch, the DRAM gauges and the quota settings.

The quota tests drive ``PeerQuota`` directly and read only what it answers (may/try pin, may
lease, holders); a holder keeps a second lease live where a count must be seen to go down, since
a holder whose leases all ended is forgotten anyway.
"""

import ctypes

import pytest

from kvcr.adapters.local import InMemoryMetrics, MonotonicClock, RecordingInventory
from kvcr.adapters.mock import MockHostMemory
from kvcr.domain.errors import ConfigError
from kvcr.domain.layout import ComponentSpec, RegionDescriptor
from kvcr.domain.pools import PoolSpec
from kvcr.ports.memory import Move
from kvcr.runner.pool_state import merged_moves
from kvcr.runner.quota import PeerQuota
from tests.support import HostPool, content, kv_pool, make_runner, runner_config, sequence

MINE, THEIRS = 11, 22


def leased(quota, holder, pins, cap=8):
    """One granted lease of ``holder`` pinning ``pins`` ((pool, page)); the pins it may not take are skipped."""
    taken = [(pool, page) for pool, page in pins if quota.try_pin(holder, pool, page, cap)]
    quota.add_lease(holder)
    return taken


# ---------------------------------------------------------------------------------------------- the quota model


def test_a_page_pinned_twice_counts_once_toward_the_share():
    quota = PeerQuota(max_leases=4)
    assert quota.try_pin(MINE, "kv", "p", cap=2) and quota.try_pin(MINE, "kv", "p", cap=2)
    assert quota.try_pin(MINE, "kv", "q", cap=2)  # p is one page of the two
    assert not quota.try_pin(MINE, "kv", "r", cap=2)


def test_ending_one_lease_gives_back_exactly_its_pages_while_another_lease_lives():
    quota = PeerQuota(max_leases=4)
    first = leased(quota, MINE, [("kv", "p")], cap=2)
    leased(quota, MINE, [("kv", "q")], cap=2)
    quota.end(MINE, first)
    assert quota.try_pin(MINE, "kv", "r", cap=2)  # p's place is free again, q still holds one
    assert not quota.try_pin(MINE, "kv", "s", cap=2)


def test_ending_one_of_three_pages_leaves_two_pinned():
    quota = PeerQuota(max_leases=4)
    first = leased(quota, MINE, [("kv", "p")], cap=3)
    leased(quota, MINE, [("kv", "q"), ("kv", "r")], cap=3)
    quota.end(MINE, first)
    assert quota.try_pin(MINE, "kv", "s", cap=3)
    assert not quota.try_pin(MINE, "kv", "t", cap=3)


def test_ending_a_holders_last_page_of_a_pool_frees_that_pool_while_it_leases_another():
    quota = PeerQuota(max_leases=4)
    first = leased(quota, MINE, [("kv", "p")], cap=1)
    leased(quota, MINE, [("state", "s")], cap=1)
    quota.end(MINE, first)
    assert quota.may_pin(MINE, "kv", "q", cap=1)
    assert not quota.may_pin(MINE, "state", "t", cap=1)  # the live lease still holds its share there


def test_a_page_ended_more_often_than_it_was_pinned_is_ignored_past_its_claims():
    quota = PeerQuota(max_leases=4)
    leased(quota, MINE, [("kv", "p")], cap=2)
    leased(quota, MINE, [("kv", "q")], cap=2)
    quota.end(MINE, [("kv", "p"), ("kv", "p")])
    assert quota.try_pin(MINE, "kv", "r", cap=2)
    assert not quota.try_pin(MINE, "kv", "s", cap=2)  # q is still pinned


def test_leases_count_toward_max_leases_whether_or_not_they_pin_pages():
    quota = PeerQuota(max_leases=2)
    quota.add_lease(MINE)
    quota.add_lease(MINE)
    quota.end(MINE, [])
    assert quota.holders() == 1 and quota.may_lease(MINE)
    quota.add_lease(MINE)
    assert not quota.may_lease(MINE) and quota.may_lease(THEIRS)


def test_holders_count_only_holders_with_a_granted_lease():
    quota = PeerQuota(max_leases=4)
    assert quota.try_pin(MINE, "kv", "p", cap=2)  # pinned for a lease not granted yet
    assert quota.holders() == 0
    quota.add_lease(MINE)
    assert quota.holders() == 1


def test_a_new_holder_may_pin_nothing_under_a_share_of_zero():
    quota = PeerQuota(max_leases=4)
    assert not quota.may_pin(MINE, "kv", "p", cap=0)
    assert quota.may_pin(MINE, "kv", "p", cap=1)


def test_a_holder_pinning_one_pool_may_still_pin_a_pool_it_never_touched():
    quota = PeerQuota(max_leases=4)
    leased(quota, MINE, [("kv", "p")], cap=1)
    assert quota.may_pin(MINE, "state", "s", cap=1)
    assert not quota.may_pin(MINE, "kv", "q", cap=1)


# ------------------------------------------------------------------------------------------------ planned copies


def region(base, stride, piece=16, count=8):
    return RegionDescriptor("r", base, stride, count, piece)


def test_merged_moves_coalesce_a_run_between_dense_regions_at_its_offsets():
    moves = merged_moves([region(1000, 16)], [region(5000, 16)], [(2, 5), (3, 6)])
    assert moves == [Move(1000 + 2 * 16, 5000 + 5 * 16, 2 * 16)]


def test_merged_moves_go_piece_by_piece_when_one_side_is_strided():
    dst, src = region(1000, 48), region(5000, 16)  # dst pieces are 16 bytes every 48: not dense
    moves = merged_moves([dst], [src], [(2, 5), (3, 6)])
    assert moves == [Move(1000 + 2 * 48, 5000 + 5 * 16, 16), Move(1000 + 3 * 48, 5000 + 6 * 16, 16)]
    back = merged_moves([src], [dst], [(5, 2), (6, 3)])
    assert back == [Move(5000 + 5 * 16, 1000 + 2 * 48, 16), Move(5000 + 6 * 16, 1000 + 3 * 48, 16)]


def test_unverified_copies_between_strided_host_pages_and_dram_keep_every_byte():
    pool = PoolSpec("kv", (ComponentSpec("k", 64), ComponentSpec("v", 64)), anchor=True)
    runner = make_runner(
        (pool,), 8, MockHostMemory(), MonotonicClock(), InMemoryMetrics(strict=True), RecordingInventory(),
        verify_bytes=False,
    )  # fmt: skip
    try:
        buffer = ctypes.create_string_buffer(128 * 16)
        base = ctypes.addressof(buffer)
        # K and V interleaved per page (neither host region is dense); kvcr's DRAM is dense.
        runner.register_host_pool(
            "kv", [RegionDescriptor("k", base, 128, 16, 64), RegionDescriptor("v", base + 64, 128, 16, 64)]
        )
        pages = sequence(3)
        for i, page in enumerate(pages):
            ctypes.memmove(base + 128 * (2 + i), content(page, 128), 128)
        assert runner.backup("kv", pages, [2, 3, 4]) == [True] * 3
        assert all(o.restored for o in runner.restore("kv", pages, [9, 10, 11]))
        for i, page in enumerate(pages):
            assert ctypes.string_at(base + 128 * (9 + i), 128) == content(page, 128)
    finally:
        runner.close()


# ---------------------------------------------------------------------------------------------- runner level


@pytest.fixture
def local():
    made = []

    def make(slots, **changes):
        metrics = InMemoryMetrics(strict=True)
        runner = make_runner(
            (kv_pool(),), slots, MockHostMemory(), MonotonicClock(), metrics, RecordingInventory(), **changes
        )
        host = HostPool(kv_pool(), 64)
        runner.register_host_pool("kv", host.regions)
        made.append(runner)
        return runner, host, metrics

    yield make
    for runner in made:
        runner.close()


def test_the_dram_capacity_gauge_is_the_pools_slots_in_bytes(local):
    runner, host, metrics = local(4)
    page = kv_pool().page_bytes
    assert metrics.snapshot()["kvcr_dram_capacity_bytes{pool=kv}"] == 4 * page
    pages = sequence(2)
    for slot, key in enumerate(pages):
        host.write_page(slot, content(key, page))
    assert runner.backup("kv", pages, [0, 1]) == [True, True]
    assert metrics.snapshot()["kvcr_dram_capacity_bytes{pool=kv}"] == 4 * page


def test_a_released_lease_gives_back_its_share_while_the_holders_other_lease_lives(local):
    runner, host, _ = local(32)  # lease cap 16; a holder's share 8
    pages = sequence(16)
    for slot, key in enumerate(pages):
        host.write_page(slot, content(key, host.pool.page_bytes))
    assert all(runner.backup("kv", pages, list(range(16))))
    first = runner.lease([("kv", pages[:8])], 5.0, holder=MINE)
    assert runner.lease([("kv", pages[:1])], 5.0, holder=MINE).lease_id  # still pins page 0
    assert runner.release_lease(first.lease_id)
    grant = runner.lease([("kv", pages[8:15])], 5.0, holder=MINE)  # 1 pinned + 7 = the share
    assert sum(slot >= 0 for slot in grant.slots[0]) == 7 and grant.over_quota == 0


# ---------------------------------------------------------------------------------------------- settings


@pytest.mark.parametrize("leases", [1, 1 << 20])
def test_max_peer_leases_takes_both_ends_of_its_range(leases):
    assert runner_config((kv_pool(),), 16, max_peer_leases=leases).max_peer_leases == leases


def test_max_peer_leases_past_its_range_is_refused_by_name():
    with pytest.raises(ConfigError) as err:
        runner_config((kv_pool(),), 16, max_peer_leases=(1 << 20) + 1)
    assert str(err.value) == "max_peer_leases must be in 1..1048576, got 1048577"
