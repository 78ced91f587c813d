"""The backend in the topologies SGLang runs: MLA with sharded sidecars, DP replicas, late pools, leases."""

import ctypes
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolTransfer
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

from kvcr.domain.errors import ConfigError
from kvcr.integrations.sglang import KvcrHiCacheStorage
from kvcr.integrations.shared import hints_bridge
from tests.integration.sglang import sg
from tests.integration.sglang.test_remote import hint, no_peer_traffic

REPO = Path(__file__).resolve().parents[3]
MAMBA_SLOTS = 9


def mamba_host():
    """SGLang's real Mamba state host pool (one checkpoint per slot), on the CPU."""
    temporal = torch.zeros(2, MAMBA_SLOTS, 4, 8, dtype=torch.float32)
    conv = (torch.zeros(2, MAMBA_SLOTS, 3, 16, dtype=torch.bfloat16),)
    info = MambaStateBufferInfo(temporal=temporal, conv=conv)
    return MambaPoolHost(info, 2.0, 0, device_capacity=MAMBA_SLOTS, pin_memory=False, device="cpu", layout="page_first")


def fill_mamba(pool, slots, value):
    for slot in slots:
        ptrs, sizes = pool.get_page_buffer_meta(torch.tensor([slot], dtype=torch.int64))
        for ptr, size in zip(ptrs, sizes, strict=True):
            ctypes.memset(int(ptr), value, int(size))


def mamba_bytes(pool, slot):
    ptrs, sizes = pool.get_page_buffer_meta(torch.tensor([slot], dtype=torch.int64))
    return b"".join(ctypes.string_at(int(p), int(s)) for p, s in zip(ptrs, sizes, strict=True))


def mla_mamba_rank(rank, base):
    kv, mamba = sg.mla_host("page_first"), mamba_host()
    store = KvcrHiCacheStorage(sg.storage_config(mla=True, tp_rank=rank, tp_size=2, control_port=base), {})
    store.register_mem_pool_host(kv)
    store.register_mem_host_pool_v2(kv, "kv")
    store.register_mem_host_pool_v2(mamba, "mamba")
    store.on_host_pools_registered()
    return store, kv, mamba


def test_mla_kv_comes_from_the_writer_and_sharded_mamba_state_from_the_rank_itself():
    base = sg.free_port(2)
    ranks = [mla_mamba_rank(r, base) for r in range(2)]
    try:
        keys = sg.hashes(3)
        (w, kv0, m0), (r1, kv1, m1) = ranks
        src = kv0.alloc(3 * sg.P)
        sg.fill(kv0, src, seed=51)
        assert w.batch_set_v1(keys, src) == [True] * 3  # replicated KV: the writer only
        for store, pool, value in ((w, m0, 0xA0), (r1, m1, 0xA1)):  # Mamba: every rank its own shard
            fill_mamba(pool, [1], value)
            transfer = PoolTransfer(name="mamba", keys=keys[2:], host_indices=torch.tensor([1]))
            assert store.batch_set_v2([transfer])["mamba"] == [True]
        query = [PoolTransfer(name="mamba", keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        result = r1.batch_exists_v2(keys, query)
        assert result.kv_hit_pages == 3 and result.restorable_prefix_pages == [3]
        dst = kv1.alloc(3 * sg.P)
        got = r1.batch_get_v2(
            [
                PoolTransfer(name="kv", keys=keys, host_indices=dst),
                PoolTransfer(name="mamba", keys=keys[2:], host_indices=torch.tensor([4])),
            ]
        )
        assert got == {"kv": [True] * 3, "mamba": [True]}
        assert sg.pages_equal(kv0, src, kv1, dst)  # rank 0's replicated KV
        assert mamba_bytes(m1, 4) == mamba_bytes(m1, 1)  # rank 1's own Mamba shard ...
        assert mamba_bytes(m1, 4) != mamba_bytes(m0, 1)  # ... never rank 0's
        assert r1.runner.namespaces["kv"] == w.runner.namespaces["kv"]
        assert r1.runner.namespaces["mamba"] != w.runner.namespaces["mamba"]
    finally:
        for store, *_ in ranks:
            store.close()


def test_sharded_mamba_state_a_rank_lacks_is_a_miss_though_the_writer_holds_its_own():
    base = sg.free_port(2)
    ranks = [mla_mamba_rank(r, base) for r in range(2)]
    try:
        keys = sg.hashes(3)
        (w, kv0, m0), (r1, kv1, _) = ranks
        assert w.batch_set_v1(keys, kv0.alloc(3 * sg.P)) == [True] * 3
        fill_mamba(m0, [1], 0xA0)
        assert w.batch_set_v2([PoolTransfer(name="mamba", keys=keys[2:], host_indices=torch.tensor([1]))]) == {
            "mamba": [True]
        }
        query = [PoolTransfer(name="mamba", keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)]
        assert r1.batch_exists_v2(keys, query).kv_hit_pages == 0  # KV alone is no resumable prefix
        got = r1.batch_get_v2(
            [
                PoolTransfer(name="kv", keys=keys, host_indices=kv1.alloc(3 * sg.P)),
                PoolTransfer(name="mamba", keys=keys[2:], host_indices=torch.tensor([4])),
            ]
        )
        assert got == {"kv": [True] * 3, "mamba": [False]}  # rank 0's shard is not rank 1's state
        assert no_peer_traffic([w, r1])  # nor was it asked for
    finally:
        for store, *_ in ranks:
            store.close()


def test_mla_at_tp2_without_a_control_port_is_refused_naming_it():
    with pytest.raises(ConfigError, match="control_port"):
        KvcrHiCacheStorage(sg.storage_config(mla=True, tp_rank=1, tp_size=2, control_port=0), {})
    KvcrHiCacheStorage(sg.storage_config(mla=True, tp_rank=0, tp_size=1, control_port=0), {})


def test_a_pool_registered_after_start_is_refused_with_one_error_and_serving_goes_on(caplog):
    host = sg.mha_host("page_first")
    store = sg.backend(host, sg.storage_config())
    try:
        with caplog.at_level("ERROR"):
            store.register_mem_host_pool_v2(mamba_host(), "mamba")  # must not raise into SGLang
            store.register_mem_host_pool_v2(mamba_host(), "mamba")
        assert sum("registered after start-up" in r.message for r in caplog.records) == 1
        keys = sg.hashes(2)
        assert store.batch_set_v1(keys, host.alloc(2 * sg.P)) == [True, True]
        transfer = PoolTransfer(name="mamba", keys=keys, host_indices=torch.tensor([1, 2]))
        assert store.batch_set_v2([transfer])["mamba"] == [False, False]
    finally:
        store.close()


def test_repeated_and_concurrent_hit_queries_lease_each_page_once():
    made = []
    try:
        port_a = sg.free_port()
        host_a = sg.mha_host("page_first")
        a = KvcrHiCacheStorage(sg.storage_config(control_port=port_a), {})
        made.append(a)
        for call in (a.register_mem_pool_host, lambda h: a.register_mem_host_pool_v2(h, "kv")):
            call(host_a)
        a.on_host_pools_registered()
        host_b = sg.mha_host("page_first")
        b = KvcrHiCacheStorage(sg.storage_config(control_port=sg.free_port(), enable_remote_hint=True), {})
        made.append(b)
        b.register_mem_pool_host(host_b)
        b.register_mem_host_pool_v2(host_b, "kv")
        b.on_host_pools_registered()
        keys = sg.hashes(4)
        a.batch_set_v1(keys, host_a.alloc(4 * sg.P))
        info = hint(port_a, keys)

        def query():
            with hints_bridge.active("req-repeat"):  # the plugin names the request on every thread
                return b.batch_exists(keys, info)

        for _ in range(5):
            assert query() == 4
        assert a.runner.active_leases == 1  # five queries, one lease
        threads = [threading.Thread(target=query) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert a.runner.active_leases == 1
        with hints_bridge.active("req-repeat"):
            assert b.batch_get_v1(keys, host_b.alloc(4 * sg.P), info) == [True] * 4
        assert a.runner.active_leases == 0  # read, then released: nothing orphaned
        assert b.kvcr_stats()["held_remote_pages"] == 0
    finally:
        for store in made:
            store.close()


def test_leases_the_engine_will_not_read_are_released_at_once(replicas_ab):
    a, b, host_b, keys, info = replicas_ab
    with hints_bridge.active("req-cut"):
        assert b.batch_exists(keys, info) == 4
    assert a.runner.active_leases == 1
    hints_bridge.prefetch_trimmed("req-cut", keys[:2])  # SGLang's MIN all-reduce cut the hit to 2 pages
    assert b.kvcr_stats()["held_remote_pages"] == 2
    assert b.batch_get_v1(keys[:2], host_b.alloc(2 * sg.P), info) == [True, True]
    assert a.runner.active_leases == 0  # the cut pages were never waited on
    with hints_bridge.active("req-revoked"):
        assert b.batch_exists(keys, info) == 4
    assert a.runner.active_leases == 1
    hints_bridge.prefetch_finished("req-revoked")  # revoked before any read
    assert a.runner.active_leases == 0
    assert b.kvcr_stats()["held_remote_pages"] == 0


@pytest.fixture
def replicas_ab():
    port_a = sg.free_port()
    host_a = sg.mha_host("page_first")
    a = sg.backend(host_a, sg.storage_config(control_port=port_a))
    host_b = sg.mha_host("page_first")
    b = sg.backend(host_b, sg.storage_config(control_port=sg.free_port(), enable_remote_hint=True))
    keys = sg.hashes(4)
    a.batch_set_v1(keys, host_a.alloc(4 * sg.P))
    yield a, b, host_b, keys, hint(port_a, keys)
    b.close()
    a.close()


def test_a_logical_anchor_answers_hits_and_reads_that_agree():
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    # DeepSeek-V4's shape: the KV anchor holds no bytes; a KV-derived sidecar holds them.
    anchor, indexer = LogicalHostPool(17 * sg.P, sg.P, layout="page_first"), sg.mha_host("page_first")
    store = KvcrHiCacheStorage(sg.storage_config(), {})
    store.register_mem_pool_host(anchor)
    store.register_mem_host_pool_v2(anchor, "kv")
    store.register_mem_host_pool_v2(indexer, "indexer")
    store.on_host_pools_registered()
    try:
        keys = sg.hashes(4)
        slots = indexer.alloc(3 * indexer.page_size)
        stored = store.batch_set_v2([PoolTransfer(name="indexer", keys=keys[:3], host_indices=slots)])
        assert stored == {"indexer": [True] * 3}
        assert store.batch_set_v1(keys[:3], anchor_indices(3)) == [True] * 3  # no bytes: nothing to fail
        assert store.batch_exists(keys) == 3  # no transfers named: the anchor stands on the indexer, as its reads do
        with_indexer = [PoolTransfer(name="indexer", keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
        assert store.batch_exists_v2(keys, with_indexer).kv_hit_pages == 3
        assert store.batch_get_v1(keys, anchor_indices(4)) == [True, True, True, False]  # agrees with the hit
    finally:
        store.close()


def logical_store(**settings):
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    anchor, indexer = LogicalHostPool(17 * sg.P, sg.P, layout="page_first"), sg.mha_host("page_first")
    store = KvcrHiCacheStorage(sg.storage_config(**settings), {})
    store.register_mem_pool_host(anchor)
    store.register_mem_host_pool_v2(anchor, "kv")
    store.register_mem_host_pool_v2(indexer, "indexer")
    store.on_host_pools_registered()
    return store, indexer


def test_pools_listed_after_a_logical_anchor_or_a_refused_pool_are_served():
    store, indexer = logical_store(control_port=sg.free_port())  # a node: its reads may also ask peers
    try:
        keys = sg.hashes(2)
        kv = PoolTransfer(name="kv", keys=keys, host_indices=anchor_indices(2))
        stored = store.batch_set_v2([kv, PoolTransfer(name="indexer", keys=keys[:1], host_indices=indexer.alloc(sg.P))])
        assert stored == {"kv": [True, True], "indexer": [True]}
        side = PoolTransfer(name="indexer", keys=keys, host_indices=indexer.alloc(2 * sg.P))
        assert store.batch_get_v2([kv, side]) == {"kv": [True, False], "indexer": [True, False]}
        short = PoolTransfer(name="indexer", keys=keys, host_indices=indexer.alloc(sg.P))  # 2 keys, 1 page
        assert store.batch_set_v2([short, kv]) == {"indexer": [False, False], "kv": [True, True]}
        assert store.batch_get_v2([short, kv]) == {"indexer": [False, False], "kv": [True, False]}
    finally:
        store.close()


def test_a_logical_anchors_pages_end_at_the_first_page_its_evidence_lacks():
    source, source_indexer = logical_store(control_port=sg.free_port())
    reader, indexer = logical_store(control_port=sg.free_port(), enable_remote_hint=True)
    try:
        keys = sg.hashes(3)
        one = PoolTransfer(name="indexer", keys=keys[2:], host_indices=source_indexer.alloc(sg.P))
        assert source.batch_set_v2([one])["indexer"] == [True]  # the source holds page 2 only
        own = PoolTransfer(name="indexer", keys=keys[:1], host_indices=indexer.alloc(sg.P))
        assert reader.batch_set_v2([own])["indexer"] == [True]  # the reader page 0
        query = [PoolTransfer(name="indexer", keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)]
        with hints_bridge.active("req-hole"):
            assert reader.batch_exists_v2(keys, query, hint(source.control_port, keys[1:])).kv_hit_pages == 1
            assert reader.kvcr_stats()["held_remote_pages"] == 1  # page 2, leased past the hole at page 1
            assert reader.batch_get_v1(keys, anchor_indices(3)) == [True, False, False]
    finally:
        reader.close()
        source.close()


def test_a_logical_anchor_alone_holds_no_page():
    from sglang.srt.mem_cache.memory_pool_host import LogicalHostPool

    anchor = LogicalHostPool(17 * sg.P, sg.P, layout="page_first")
    store = KvcrHiCacheStorage(sg.storage_config(), {})
    store.register_mem_pool_host(anchor)
    store.register_mem_host_pool_v2(anchor, "kv")
    store.on_host_pools_registered()
    try:
        keys = sg.hashes(2)
        assert store.batch_set_v1(keys, anchor_indices(2)) == [True, True]  # no bytes to keep
        assert store.batch_get_v1(keys, anchor_indices(2)) == [False, False]
        assert store.batch_exists(keys) == 0  # a bare logical anchor is no evidence: no hit, no traceback
    finally:
        store.close()


def anchor_indices(pages):
    return torch.arange(pages * sg.P, dtype=torch.int64)


def test_two_pure_dp_replicas_on_one_host_bind_distinct_ports():
    base = sg.free_port(2)
    script = (
        "import json, sys; import tests.integration.sglang.conftest\n"
        "from tests.integration.sglang import sg\n"
        "host = sg.mha_host('page_first')\n"
        f"store = sg.backend(host, sg.storage_config(control_port={base}))\n"
        "print('PORT ' + json.dumps(store.node.endpoint), flush=True)\n"
        "sys.stdin.read(); store.close()\n"
    )
    procs = []
    try:
        for replica in range(2):  # SGLang gives storage dp_rank 0 in both: the replica index is its own
            env = dict(os.environ, PYTHONPATH=str(REPO), SGLANG_DP_RANK=str(replica))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", script],
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        endpoints = []
        for proc in procs:
            line = proc.stdout.readline()
            assert line.startswith("PORT "), proc.stderr.read()[-2000:]
            endpoints.append(json.loads(line[5:]))
        assert endpoints == [f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}"]
    finally:
        for proc in procs:
            proc.communicate("", timeout=60)
