"""A DeepSeek-V4-shaped pool set on SGLang's real V4 host pools: hit queries and reads agree page for page.

V4's KV anchor is logical (``LogicalHostPool``: no bytes). Its bytes live in KV-derived ALL_PAGES
sidecars (``deepseek_v4_c4``, ``deepseek_v4_c4_indexer``: every page of a prefix) and in trailing
pools that SGLang backs up only for a window of trailing pages (``swa`` and the ``*_state``
compress-state pools, which ride the SWA pool's host indices). SGLang reads the anchor with
``batch_get_v1`` and takes its leading run, so the anchor's answer must stand on the same pools the
hit query counted: the ALL_PAGES ones, never a trailing pool's window.
"""

import ctypes

import pytest
import torch
from sglang.srt.mem_cache.deepseek_v4_compress_state import CompressStatePool
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
from sglang.srt.mem_cache.memory_pool_host import DeepSeekV4PagedHostPool, DeepSeekV4StateHostPool, LogicalHostPool

from kvcr.integrations.sglang import KvcrHiCacheStorage
from kvcr.integrations.shared import hints_bridge
from tests.integration.sglang import sg
from tests.integration.sglang.test_remote import hint

PAGES = 17
ALL = ("deepseek_v4_c4", "deepseek_v4_c4_indexer")  # KV-derived: the anchor's host indices
TRAILING = ("swa", "deepseek_v4_c4_state", "deepseek_v4_c128_state")  # the SWA pool's host indices


def paged(name):
    buffers = [torch.zeros(64, 96, dtype=torch.uint8) for _ in range(2)]
    return DeepSeekV4PagedHostPool(
        name, buffers, item_bytes=96, num_host_pages=PAGES, slot_page_size=sg.P, layout="page_first", pin_memory=False
    )


def state(name):
    rings = [
        CompressStatePool(
            size=64,
            ring_size=4,
            overlap=False,
            head_dim=8,
            dtype=torch.float32,
            device="cpu",
            enable_memory_saver=False,
            ratio=4,
            swa_page_size=sg.P,
        )
        for _ in range(2)
    ]
    return DeepSeekV4StateHostPool(
        name, rings, num_host_pages=PAGES, swa_page_size=sg.P, layout="page_first", pin_memory=False
    )


def v4_store(**settings):
    """One rank of a V4-shaped stack, registered the way SGLang's hybrid controller does it."""
    pools = {"kv": LogicalHostPool(PAGES * sg.P, sg.P, layout="page_first")}
    pools.update({name: paged(name) for name in (*ALL, "swa")})
    pools.update({name: state(name) for name in TRAILING[1:]})
    store = KvcrHiCacheStorage(sg.storage_config(mla=True, **settings), {})  # V4's KV is rank-replicated
    store.register_mem_pool_host(pools["kv"])
    for name, pool in pools.items():
        store.register_mem_host_pool_v2(pool, name)
    store.on_host_pools_registered()
    return store, pools


def page_indices(pages, first=0):
    """Token indices of ``pages`` host pages from page ``first`` (every pool here has 16-token pages)."""
    return torch.arange(first * sg.P, (first + pages) * sg.P, dtype=torch.int64)


def fill(pool, first, pages, value):
    ptrs, sizes = pool.get_page_buffer_meta(page_indices(pages, first))
    for k, (ptr, size) in enumerate(zip(ptrs, sizes, strict=True)):
        ctypes.memset(int(ptr), value + k, int(size))


def page_bytes(pool, first, pages):
    ptrs, sizes = pool.get_page_buffer_meta(page_indices(pages, first))
    return [ctypes.string_at(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True)]


def back_up(store, pools, keys, *, trailing_at, all_pages=None):
    """Back up a prefix as SGLang does: ALL_PAGES sidecars per page, trailing pools at the pages given."""
    for n, name in enumerate(ALL):
        held = all_pages if all_pages is not None else range(len(keys))
        for page in held:
            fill(pools[name], page, 1, 0x10 * (n + 1) + page)
            done = store.batch_set_v2([PoolTransfer(name=name, keys=[keys[page]], host_indices=page_indices(1, page))])
            assert done == {name: [True]}
    for page in trailing_at:  # a checkpoint: the window (one page) ending at this page
        transfers = []
        for n, name in enumerate(TRAILING):
            fill(pools[name], page, 1, 0x80 + 0x10 * n + page)
            transfers.append(PoolTransfer(name=name, keys=[keys[page]], host_indices=page_indices(1, page)))
        assert store.batch_set_v2(transfers) == {name: [True] for name in TRAILING}
    assert store.batch_set_v1(keys, page_indices(len(keys))) == [True] * len(keys)  # the anchor: no bytes


def v2_query(keys, window_end):
    """SGLang's V4 hit query: the ALL_PAGES sidecars over the prefix, the trailing pools over their window."""
    window = keys[window_end - 1 : window_end]
    return [PoolTransfer(name=n, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES) for n in ALL] + [
        PoolTransfer(name=n, keys=window, hit_policy=PoolHitPolicy.TRAILING_PAGES) for n in TRAILING
    ]


def leading(results):
    run = 0
    for ok in results:
        if not ok:
            break
        run += 1
    return run


@pytest.fixture
def v4():
    store, pools = v4_store()
    yield store, pools
    store.close()


def test_the_anchor_reads_every_page_the_hit_query_counted_though_trailing_pools_hold_a_window(v4):
    store, pools = v4
    keys = sg.hashes(4)
    back_up(store, pools, keys, trailing_at=[1, 3])  # checkpoints after pages 2 and 4
    result = store.batch_exists_v2(keys, v2_query(keys, 4))
    assert result.kv_hit_pages == 4 and result.restorable_prefix_pages == [2, 4]
    # SGLang reads the anchor first and keeps its leading run: every page the query counted.
    anchor = store.batch_get_v1(keys, page_indices(4, 8))
    assert anchor == [True] * 4
    derived = [PoolTransfer(name=n, keys=keys, host_indices=page_indices(4, 8)) for n in ALL]
    assert store.batch_get_v2(derived) == {n: [True] * 4 for n in ALL}
    window = [PoolTransfer(name=n, keys=keys[3:], host_indices=page_indices(1, 12)) for n in TRAILING]
    assert store.batch_get_v2(window) == {n: [True] for n in TRAILING}
    for name in ALL:
        assert page_bytes(pools[name], 8, 4) == page_bytes(pools[name], 0, 4)
    for name in TRAILING:
        assert page_bytes(pools[name], 12, 1) == page_bytes(pools[name], 3, 1)


def test_the_anchor_ends_where_an_all_pages_sidecar_lacks_a_page_and_the_hit_query_agrees(v4):
    store, pools = v4
    keys = sg.hashes(4)
    back_up(store, pools, keys, trailing_at=[1, 3], all_pages=[0, 1, 3])  # the sidecars lack page 2
    result = store.batch_exists_v2(keys, v2_query(keys, 2))
    assert result.kv_hit_pages == 2 and result.restorable_prefix_pages == [2]
    anchor = store.batch_get_v1(keys, page_indices(4, 8))
    derived = store.batch_get_v2([PoolTransfer(name=n, keys=keys, host_indices=page_indices(4, 8)) for n in ALL])
    assert derived == {n: [True, True, False, True] for n in ALL}  # local pages past the hole are read too ...
    assert anchor == [True, True, False, True]  # ... and the anchor says so, page for page
    assert leading(anchor) == result.kv_hit_pages  # SGLang keeps the leading run: the hit


def test_the_v1_hit_query_counts_what_the_anchor_read_restores(v4):
    # SGLang asks batch_exists (no pool transfers) when an operation carries no sidecar transfers;
    # the anchor read that follows answers from the ALL_PAGES sidecars, so the query must too.
    store, pools = v4
    keys = sg.hashes(4)
    back_up(store, pools, keys, trailing_at=[3], all_pages=[0, 1, 3])
    hits = store.batch_exists(keys)
    anchor = store.batch_get_v1(keys, page_indices(4, 8))
    assert hits == leading(anchor) == 2
    back_up(store, pools, keys, trailing_at=[3])
    assert store.batch_exists(keys) == leading(store.batch_get_v1(keys, page_indices(4, 8))) == 4


@pytest.mark.parametrize("request_id", [None, "req-v4"])  # without and with the plugin naming the request
def test_a_hinted_v4_replica_counts_and_reads_the_same_pages_from_its_source(request_id):
    source, source_pools = v4_store(control_port=sg.free_port())
    reader, pools = v4_store(control_port=sg.free_port(), enable_remote_hint=True)
    try:
        keys = sg.hashes(4)
        back_up(source, source_pools, keys, trailing_at=[1, 3])
        info = hint(source.control_port, keys)
        with hints_bridge.active(request_id):
            assert reader.batch_exists(keys, info) == 4
            result = reader.batch_exists_v2(keys, v2_query(keys, 4), info)
            assert result.kv_hit_pages == 4 and result.restorable_prefix_pages == [2, 4]
            assert reader.batch_get_v1(keys, page_indices(4, 8), info) == [True] * 4
            derived = [PoolTransfer(name=n, keys=keys, host_indices=page_indices(4, 8)) for n in ALL]
            assert reader.batch_get_v2(derived, info) == {n: [True] * 4 for n in ALL}
            window = [PoolTransfer(name=n, keys=keys[3:], host_indices=page_indices(1, 12)) for n in TRAILING]
            assert reader.batch_get_v2(window, info) == {n: [True] for n in TRAILING}
        if request_id is not None:
            hints_bridge.prefetch_finished(request_id)  # the plugin, when the prefetch ends
        for name in ALL:
            assert page_bytes(pools[name], 8, 4) == page_bytes(source_pools[name], 0, 4)
        for name in TRAILING:
            assert page_bytes(pools[name], 12, 1) == page_bytes(source_pools[name], 3, 1)
        assert source.runner.active_leases == 0 and reader.kvcr_stats()["held_remote_pages"] == 0
    finally:
        reader.close()
        source.close()
