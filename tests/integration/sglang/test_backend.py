"""kvcr as SGLang's storage backend, driven through SGLang 0.5.23's real factory, pools and controller."""

import logging

import pytest
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer

from kvcr.domain.errors import ConfigError, LayoutError
from kvcr.integrations.sglang import KvcrHiCacheStorage
from tests.integration.sglang import sg


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
@pytest.mark.parametrize("make_host", [sg.mha_host, sg.mla_host], ids=["mha", "mla"])
def test_set_exists_get_round_trip_through_the_dynamic_factory(make_host, layout):
    host = make_host(layout)
    store = sg.backend(host, sg.storage_config(mla=make_host is sg.mla_host))
    try:
        assert isinstance(store, KvcrHiCacheStorage)
        keys = sg.hashes(4)
        src = host.alloc(4 * sg.P)
        sg.fill(host, src, seed=1)
        assert store.batch_set_v1(keys, src) == [True] * 4
        assert store.batch_exists(keys) == 4
        assert store.batch_exists([*keys[:2], *sg.hashes(1, start=9999), keys[3]]) == 2
        assert store.exists(keys[0]) and not store.exists(sg.hashes(1, start=777)[0])
        dst = host.alloc(4 * sg.P)
        assert store.batch_get_v1(keys, dst) == [True] * 4
        assert sg.pages_equal(host, src, host, dst)
        missing = sg.hashes(2, start=5000)
        assert store.batch_get_v1([keys[0], missing[0]], host.alloc(2 * sg.P)) == [True, False]
    finally:
        store.close()


@pytest.mark.ucx
def test_transport_ucx_is_accepted_and_serves_pages_like_nixl():
    host = sg.mha_host("page_first")
    store = sg.backend(host, sg.storage_config(transport="ucx"))
    try:
        keys = sg.hashes(3)
        src = host.alloc(3 * sg.P)
        sg.fill(host, src, seed=5)
        assert store.batch_set_v1(keys, src) == [True] * 3
        dst = host.alloc(3 * sg.P)
        assert store.batch_get_v1(keys, dst) == [True] * 3
        assert sg.pages_equal(host, src, host, dst)
    finally:
        store.close()


def test_the_legacy_copy_path_round_trips_flat_pages():
    host = sg.mha_host("page_first")
    store = sg.backend(host, sg.storage_config())
    try:
        key = sg.hashes(1)[0]
        src = host.alloc(sg.P)
        sg.fill(host, src, seed=3)
        flat = host.get_data_page(int(src[0]), flat=True)
        assert store.set(key, flat)
        out = store.get(key, host.get_dummy_flat_data_page())
        assert out is not None and torch.equal(out, flat)
        assert store.get(sg.hashes(1, start=42)[0]) is None
        assert store.batch_set([key], [flat]) and store.batch_get([key])[0] is not None
    finally:
        store.close()


def test_layer_first_is_refused_at_registration_with_a_clear_error():
    host = sg.mha_host("layer_first")
    with pytest.raises(LayoutError, match="page_first"):
        sg.backend(host, sg.storage_config())


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"dram_byte": "1GiB"}, "unknown kvcr setting 'dram_byte'"),
        ({"control_port": "32100"}, "'control_port' must be int"),
        ({"verify_bytes": 1}, "'verify_bytes' must be bool"),
        ({"lease_ms": True}, "'lease_ms' must be int"),
        ({"transport": "rdma"}, "transport must be one of"),
        ({"dram_bytes": "lots"}, "dram_bytes"),
        ({"policy": "random"}, "policy"),
        ({"abandon_timeout_ms": 10, "operation_timeout_ms": 100}, "abandon_timeout_ms"),
        ({"enable_remote_hint": True, "control_port": 0}, "enable_remote_hint"),
        ({"transport": "UCX"}, "transport must be one of"),
        ({"interface_v1": 0}, "interface_v1"),
        ({"auth_token_file": "/nonexistent/token"}, "auth_token_file"),
    ],
)
def test_bad_settings_fail_construction_naming_the_key(settings, match):
    with pytest.raises(ConfigError, match=match):
        KvcrHiCacheStorage(sg.storage_config(**settings), {})


def test_pipeline_parallel_and_head_splitting_are_refused():
    with pytest.raises(ConfigError, match="pipeline"):
        KvcrHiCacheStorage(sg.storage_config(pp_size=2), {})
    with pytest.raises(ConfigError, match="head splitting"):
        KvcrHiCacheStorage(sg.storage_config(split_heads=True), {})


def test_malformed_calls_degrade_to_misses_and_never_raise():
    host = sg.mha_host("page_first")
    store = sg.backend(host, sg.storage_config())
    try:
        keys = sg.hashes(2)
        misaligned = torch.arange(3, 3 + 2 * sg.P)
        assert store.batch_set_v1(keys, misaligned) == [False, False]
        assert store.batch_get_v1(keys, misaligned) == [False, False]
        assert store.batch_set_v1(["not-a-hash", keys[1]], host.alloc(2 * sg.P)) == [False, False]
        assert store.batch_exists(["zz"]) == 0
        assert store.batch_get_v1(keys, host.alloc(sg.P)) == [False, False]  # one page for two keys
    finally:
        store.close()


def test_malformed_hints_mean_local_only(caplog):
    host = sg.mha_host("page_first")
    port = sg.free_port()
    store = sg.backend(host, sg.storage_config(control_port=port, enable_remote_hint=True))
    try:
        keys = sg.hashes(2)
        src = host.alloc(2 * sg.P)
        store.batch_set_v1(keys[:1], src[: sg.P])
        for bad in ({"actions": "x", "protocol_version": "0.1"}, "{json", {"source_control_endpoint": 5}, 42):
            info = HiCacheStorageExtraInfo(extra_info={"kv_hints": bad})
            with caplog.at_level(logging.INFO):
                assert store.batch_exists(keys, info) == 1
                assert store.batch_get_v1(keys, host.alloc(2 * sg.P), info) == [True, False]
        assert sum(store.kvcr_stats()["hints_rejected"].values()) == 8
    finally:
        store.close()


def test_real_controller_backs_up_queries_and_prefetches_through_kvcr():
    from sglang.srt.mem_cache.utils import get_hash_str

    host = sg.mha_host("page_first")
    ctrl, group = sg.controller(host, storage_metrics=True)
    try:
        store = ctrl.storage_backend
        assert isinstance(store, KvcrHiCacheStorage)
        assert ctrl.page_get_func.__name__ == "_page_get_zero_copy"
        tokens = list(range(500, 500 + 5 * sg.P))
        hashes = get_hash_str(tokens, None, page_size=sg.P)
        src = group.alloc(5 * sg.P)
        sg.fill(host, src, seed=11)
        ctrl.write_storage(src, tokens, hash_value=hashes, prefix_keys=None)
        assert ctrl.ack_backup_queue.get(timeout=10).completed_tokens == 5 * sg.P

        op, dst, completed = sg.prefetch(ctrl, "r1", tokens, timeout=10)
        assert op.storage_hit_count == 5 * sg.P
        assert completed == 5 * sg.P
        assert sg.pages_equal(host, src, host, dst)
        metrics = store.get_stats()
        assert metrics.backup_pgs == [5] and metrics.prefetch_pgs == [5]
    finally:
        ctrl.detach_storage_backend()


def _pool_transfer(name, policy, keys=None, host_indices=None):
    return PoolTransfer(name=name, keys=keys, host_indices=host_indices, hit_policy=policy)


def test_v2_trailing_pool_with_holes_reports_the_intersection():
    kv = sg.mha_host("page_first")
    swa = sg.mla_host("page_first")  # any page-first pool can play the trailing sidecar
    store = KvcrHiCacheStorage(sg.storage_config(), {})
    store.register_mem_pool_host(kv)
    store.register_mem_host_pool_v2(kv, PoolName.KV)
    store.register_mem_host_pool_v2(swa, PoolName.SWA)
    store.on_host_pools_registered()
    try:
        keys = sg.hashes(8)
        kv_idx = kv.alloc(8 * sg.P)
        sg.fill(kv, kv_idx, seed=5)
        assert store.batch_set_v1(keys, kv_idx) == [True] * 8
        # Trailing checkpoints (window 1) at pages 3, 5 and 8 only: ends {3, 5, 8}.
        for end in (3, 5, 8):
            idx = swa.alloc(sg.P)
            written = store.batch_set_v2(
                [_pool_transfer(PoolName.SWA, PoolHitPolicy.TRAILING_PAGES, [keys[end - 1]], idx)]
            )
            assert written == {"swa": [True]}
        trailing = _pool_transfer(PoolName.SWA, PoolHitPolicy.TRAILING_PAGES, keys=[keys[-1]])
        result = store.batch_exists_v2(keys, [trailing])
        assert result.restorable_prefix_pages == [3, 5, 8]
        assert result.kv_hit_pages == 8
        # Break KV at page 7: the KV boundaries are {1..6}, so the intersection is {3, 5}.
        store.runner.clear()
        store.batch_set_v1(keys[:6], kv_idx[: 6 * sg.P])
        for end in (3, 5, 8):
            store.batch_set_v2(
                [_pool_transfer(PoolName.SWA, PoolHitPolicy.TRAILING_PAGES, [keys[end - 1]], swa.alloc(sg.P))]
            )
        result = store.batch_exists_v2(keys, [trailing])
        assert result.restorable_prefix_pages == [3, 5]
        assert result.kv_hit_pages == 5
        assert result.extra_pool_hit_pages["kv"] == 6
        # Read the trailing checkpoint back with v2, and an unknown pool gets a per-key False list.
        got = store.batch_get_v2(
            [
                _pool_transfer(PoolName.SWA, PoolHitPolicy.TRAILING_PAGES, [keys[4]], swa.alloc(sg.P)),
                _pool_transfer(PoolName.MAMBA, PoolHitPolicy.TRAILING_PAGES, [keys[4]], swa.alloc(sg.P)),
            ]
        )
        assert got == {"swa": [True], "mamba": [False]}
    finally:
        store.close()


def test_v2_all_pages_sidecar_gates_the_kv_hit():
    kv = sg.mha_host("page_first")
    indexer = sg.mla_host("page_first")
    store = KvcrHiCacheStorage(sg.storage_config(), {})
    store.register_mem_pool_host(kv)
    store.register_mem_host_pool_v2(kv, PoolName.KV)
    store.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    store.on_host_pools_registered()
    try:
        keys = sg.hashes(4)
        store.batch_set_v1(keys, kv.alloc(4 * sg.P))
        store.batch_set_v2(
            [_pool_transfer(PoolName.INDEXER, PoolHitPolicy.ALL_PAGES, keys[:2], indexer.alloc(2 * sg.P))]
        )
        result = store.batch_exists_v2(keys, [_pool_transfer(PoolName.INDEXER, PoolHitPolicy.ALL_PAGES)])
        assert result.kv_hit_pages == 2
        assert result.restorable_prefix_pages == [1, 2]
    finally:
        store.close()


@pytest.mark.nixl
@pytest.mark.multiprocess
def test_the_sglang_benchmark_command_runs_and_verifies_bytes(tmp_path, capsys):
    import json

    from kvcr.cli import main

    out = tmp_path / "sglang.json"
    args = ["bench", "sglang", "--page-sizes", "256KiB", "--pages", "4", "--reps", "1", "--json", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "batch_set_v1" in printed and "hinted batch_get_v1" in printed
    results = json.loads(out.read_text())
    [local], remotes = results["local"], results["remote"]
    assert local["verified"] is True and local["page_bytes"] == 256 * 1024
    assert [r["transport"] for r in remotes] == ["nixl", "auto"]  # the default: NIXL, and auto (shm here)
    assert all(r["verified"] is True and r["pages"] == 4 for r in remotes)


@pytest.mark.parametrize("storage_metrics", [False, True])
def test_storage_metrics_stay_bounded_without_get_stats(storage_metrics):
    import tracemalloc

    from kvcr.integrations.sglang.stats import MAX_SAMPLES

    host = sg.mha_host("page_first")
    store = sg.backend(host, sg.storage_config(storage_metrics=storage_metrics))
    try:
        keys = sg.hashes(1)
        src = host.alloc(sg.P)
        store.batch_set_v1(keys, src)
        tracemalloc.start()
        for _ in range(2000):
            store.batch_set_v1(keys, src)
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20000):
            store.batch_set_v1(keys, src)
        grown = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        assert store._stats.pending() <= (MAX_SAMPLES if storage_metrics else 0)
        assert grown < 256 * 1024, f"{grown} bytes kept for 20,000 calls"
    finally:
        store.close()
