"""The SGLang backend at its edges: where hints come from and how they are refused, storage metrics, the
v2 refusals, the copy path, the stats page, pool hit policies and the hint bridge."""

import logging
from dataclasses import dataclass

import pytest
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer

from kvcr.adapters.local import InMemoryMetrics
from kvcr.domain.hints import Endpoint
from kvcr.domain.keys import router_id
from kvcr.domain.pools import HitPolicy
from kvcr.integrations.sglang import KvcrHiCacheStorage
from kvcr.integrations.sglang.hints import HintReader
from kvcr.integrations.sglang.startup import hit_policy
from kvcr.integrations.sglang.stats import MAX_SAMPLES, StorageStats, storage_metrics
from kvcr.integrations.shared import hints_bridge
from kvcr.integrations.shared.settings import KvcrSettings
from tests.integration.sglang import sg

KEY = sg.hashes(1)[0]


def payload(host="10.0.0.1", port=25000):
    return {"source_control_endpoint": f"tcp://{host}:{port}", "block_hashes": [router_id(KEY)]}


def envelope(**changes):
    action = {"action_type": "kv.fetch", "action_version": "1.0", "payload": payload(**changes)}
    return {"protocol_version": "0.1", "actions": [action]}


def info(**extra):
    return HiCacheStorageExtraInfo(extra_info=extra)


@pytest.fixture
def reader():
    metrics = InMemoryMetrics(strict=True)
    hints = HintReader(KvcrSettings(peer_allowlist=("10.0.0.0/8",)), metrics)
    hints.metrics = metrics
    return hints


# ---------------------------------------------------------------------------------------------- hints


def test_a_hint_is_read_from_kv_hints_in_any_encoding(reader):
    import json

    for raw in (envelope(), json.dumps(envelope()), json.dumps(envelope()).encode()):
        hint = reader.read(info(kv_hints=raw))
        assert hint is not None and hint.source == Endpoint("10.0.0.1", 25000)
    assert reader.rejected == {}


def test_a_structured_hint_object_is_read_through_its_fields(reader):
    @dataclass
    class Payload:
        source_control_endpoint: str
        block_hashes: list

    @dataclass
    class Action:
        action_type: str
        action_version: str
        payload: Payload

    @dataclass
    class Envelope:
        protocol_version: str
        actions: list

    structured = Envelope("0.1", [Action("kv.fetch", "1.0", Payload("tcp://10.0.0.2:1", [router_id(KEY)]))])
    assert reader.read(info(kv_hints=structured)).source == Endpoint("10.0.0.2", 1)
    assert reader.read(info(kv_hints=object())) is None  # not convertible: no hint, nothing to count
    assert reader.rejected == {}


def test_the_legacy_key_is_read_as_a_wrapped_payload_and_kv_hints_comes_first(reader):
    legacy = {"source_control_endpoint": "10.0.0.3:7", "block_hashes": [1]}
    assert reader.read(info(kvcr_router_hint=legacy)).source == Endpoint("10.0.0.3", 7)
    both = reader.read(info(kv_hints=envelope(), kvcr_router_hint=legacy))
    assert both.source == Endpoint("10.0.0.1", 25000)


def test_the_legacy_key_holds_a_payload_never_an_envelope(reader):
    assert reader.read(info(kvcr_router_hint=envelope())) is None
    assert reader.rejected == {"bad_endpoint": 1}  # read as a payload: it has no source endpoint


def test_without_a_hint_in_the_call_the_bridge_supplies_the_requests(reader):
    assert reader.read(None) is None and reader.read(info(other=1)) is None
    hints_bridge.remember("req-77", envelope(host="10.0.0.4"))
    with hints_bridge.active("req-77"):
        assert hints_bridge.current_request() == "req-77"
        assert reader.read(info()).source == Endpoint("10.0.0.4", 25000)
    assert hints_bridge.current() is None and hints_bridge.current_request() is None
    with hints_bridge.active(None):
        assert reader.read(info()) is None
    assert reader.rejected == {}


def test_refused_hints_are_counted_by_reason_and_logged_once_per_interval(reader, caplog):
    with caplog.at_level(logging.INFO, logger="kvcr.integrations.sglang.hints"):
        assert reader.read(info(kv_hints="{nope")) is None
        assert reader.read(info(kv_hints={"hello": 1})) is None
        assert reader.read(info(kv_hints=envelope(host="192.168.0.9"))) is None  # outside peer_allowlist
    assert reader.rejected == {"not_json": 1, "not_envelope": 1, "source_not_allowed": 1}
    snapshot = reader.metrics.snapshot()
    assert snapshot["kvcr_hints_rejected_total{reason=not_json}"] == 1
    assert snapshot["kvcr_hints_rejected_total{reason=source_not_allowed}"] == 1
    lines = [m for m in caplog.messages if m.startswith("kvcr: ignoring a hint")]
    assert lines == ["kvcr: ignoring a hint (hint is not valid JSON); serving from local DRAM only"]


def test_a_source_inside_the_allowlist_is_used(reader):
    assert reader.read(info(kv_hints=envelope(host="10.200.0.1"))) is not None


def test_the_bridge_forgets_the_oldest_requests_first():
    limit = hints_bridge.MAX_TRACKED_REQUESTS
    for rid in ("r1", "r2", *(f"fill-{i}" for i in range(limit - 2)), "r3"):
        hints_bridge.remember(rid, {"rid": rid})
    assert hints_bridge.lookup("r1") is None
    assert hints_bridge.lookup("r2") == {"rid": "r2"} and hints_bridge.lookup("r3") == {"rid": "r3"}
    hints_bridge.remember("r2", {"rid": "r2b"})  # remembering again makes it the newest
    hints_bridge.remember("r4", {"rid": "r4"})
    assert hints_bridge.lookup("fill-0") is None and hints_bridge.lookup("r2") == {"rid": "r2b"}
    assert hints_bridge.lookup(None) is None


# ---------------------------------------------------------------------------------------------- storage metrics


def test_storage_metrics_are_recorded_only_when_enabled():
    off = StorageStats(False)
    off.prefetch(3, 3000, 1.0)
    assert off.pending() == 0 and off.drain() == ([], [], [], [])


def test_storage_metrics_keep_pages_and_gigabytes_per_second_until_drained():
    stats = StorageStats(True)
    stats.prefetch(4, 2_000_000_000, 0.5)
    stats.prefetch(1, 5, 0.0)  # no measurable time: no bandwidth
    stats.backup(2, 3_000_000_000, 2.0)
    assert stats.pending() == 3
    assert stats.drain() == ([4, 1], [2], [4.0, 0.0], [1.5])
    assert stats.pending() == 0 and stats.drain() == ([], [], [], [])


def test_storage_metrics_are_bounded_between_drains():
    stats = StorageStats(True)
    for i in range(MAX_SAMPLES + 3):
        stats.backup(i, 0, 1.0)
    backup = stats.drain()[1]
    assert len(backup) == MAX_SAMPLES and backup[0] == 3


def test_storage_metrics_drain_into_sglangs_own_type():
    stats = StorageStats(True)
    stats.prefetch(2, 1_000_000_000, 1.0)
    metrics = storage_metrics(stats)
    assert metrics.prefetch_pgs == [2] and metrics.prefetch_bandwidth == [1.0]
    assert metrics.backup_pgs == [] and metrics.backup_bandwidth == []


# ---------------------------------------------------------------------------------------------- the backend


@pytest.fixture
def store():
    host = sg.mha_host("page_first")
    backend = sg.backend(host, sg.storage_config())
    backend.host = host
    yield backend
    backend.close()


def test_v2_queries_for_pools_kvcr_does_not_serve_answer_nothing(store, caplog):
    keys = sg.hashes(2)
    store.batch_set_v1(keys, store.host.alloc(2 * sg.P))
    unknown = PoolTransfer(name=PoolName.MAMBA, keys=None, host_indices=None, hit_policy=PoolHitPolicy.TRAILING_PAGES)
    with caplog.at_level(logging.WARNING):
        result = store.batch_exists_v2(keys, [unknown])
    assert (result.kv_hit_pages, result.extra_pool_hit_pages, result.restorable_prefix_pages) == (0, {}, [])
    assert "refusing a hit query: pool 'mamba' or its hit policy 'trailing_pages' is not served" in caplog.text
    bad_policy = PoolTransfer(name=PoolName.KV, keys=None, host_indices=None, hit_policy="sometimes")
    assert store.batch_exists_v2(keys, [bad_policy]).kv_hit_pages == 2  # the KV pool's own entry is ignored
    plain = store.batch_exists_v2(keys, [])
    assert (plain.kv_hit_pages, plain.extra_pool_hit_pages, plain.restorable_prefix_pages) == (2, {"kv": 2}, [1, 2])
    none = store.batch_exists_v2(sg.hashes(2, start=900), None)
    assert (none.kv_hit_pages, none.extra_pool_hit_pages, none.restorable_prefix_pages) == (0, {}, [])


def test_v2_writes_skip_pools_kvcr_does_not_serve_and_store_the_rest(store):
    keys = sg.hashes(2)
    transfers = [
        PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=store.host.alloc(2 * sg.P)),
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=store.host.alloc(2 * sg.P)),
    ]
    assert store.batch_set_v2(transfers) == {"mamba": [False, False], "kv": [True, True]}
    assert store.batch_exists(keys) == 2


def test_a_v2_read_that_fails_inside_reports_misses(store):
    keys = sg.hashes(2)
    store.batch_set_v1(keys, store.host.alloc(2 * sg.P))
    store._ready().runner.close()  # under the backend: every read inside now raises (ClosedError)
    assert store.batch_get_v1(keys, store.host.alloc(2 * sg.P)) == [False, False]
    got = store.batch_get_v2([PoolTransfer(name=PoolName.KV, keys=keys, host_indices=store.host.alloc(2 * sg.P))])
    assert got == {"kv": [False, False]}


def test_hit_queries_that_fail_inside_answer_no_hits(store):
    keys = sg.hashes(1)
    store.batch_set_v1(keys, store.host.alloc(sg.P))
    store._ready().runner.close()  # under the backend: every query inside now raises (ClosedError)
    assert store.batch_exists(keys) == 0
    result = store.batch_exists_v2(keys, [])
    assert (result.kv_hit_pages, result.extra_pool_hit_pages, result.restorable_prefix_pages) == (0, {}, [])


def test_the_copy_path_refuses_pages_of_the_wrong_size_and_none_values(store):
    import torch

    key = sg.hashes(1)[0]
    assert not store.set(key, None)
    assert not store.set(key, torch.zeros(3, dtype=torch.uint8))  # not one page
    assert not store.batch_set([key], None)
    assert store.get(key, torch.zeros(3, dtype=torch.uint8)) is None
    page = store.host.get_data_page(int(store.host.alloc(sg.P)[0]), flat=True)
    assert store.set(key, page) and store.exists(key)
    assert store.batch_get([key, sg.hashes(1, start=99)[0]])[1] is None
    got = store.batch_get([key], [store.host.get_dummy_flat_data_page()])
    assert got[0] is not None and torch.equal(got[0], page)


def test_the_copy_path_answers_misses_for_as_many_pages_as_keys_when_the_counts_differ(store):
    keys = sg.hashes(2)
    page = store.host.get_data_page(int(store.host.alloc(sg.P)[0]), flat=True)
    assert store.batch_get(keys, [store.host.get_dummy_flat_data_page()]) == [None, None]  # never raises
    assert store.batch_set(keys, [page]) is False
    assert not store.exists(keys[0])  # nothing stored
    assert store.batch_set(keys[:1], [page]) is True and store.exists(keys[0])


def test_exists_of_a_malformed_key_is_false(store):
    assert store.exists("not-a-page-hash") is False


def test_the_stats_page_names_what_an_operator_looks_for(store):
    stats = store.kvcr_stats()
    names = {"namespace", "endpoint", "pools", "counters", "hints_rejected", "held_remote_pages", "kv_events"}
    names |= {"hinted_by_source"}
    assert set(stats) == names
    assert stats["namespace"] == store.runner.namespace and stats["endpoint"] is None  # no control port
    assert stats["pools"][0]["pool"] == "kv" and stats["hints_rejected"] == {} and stats["kv_events"] is None
    assert stats["held_remote_pages"] == 0 and stats["hinted_by_source"] == {}


def test_a_served_rank_shows_its_endpoint(tmp_path):
    port = sg.free_port()
    host = sg.mha_host("page_first")
    backend = sg.backend(host, sg.storage_config(control_port=port))
    try:
        assert backend.kvcr_stats()["endpoint"] == f"tcp://127.0.0.1:{port}"
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("pool", "policy"),
    [
        ("mamba", HitPolicy.TRAILING_PAGES),
        ("swa", HitPolicy.TRAILING_PAGES),
        ("draft_swa", HitPolicy.TRAILING_PAGES),
        ("kda_state", HitPolicy.TRAILING_PAGES),
        ("kv", HitPolicy.ALL_PAGES),
        ("indexer", HitPolicy.ALL_PAGES),
        ("state_dict", HitPolicy.ALL_PAGES),
    ],
)
def test_pools_named_for_state_or_windows_need_only_a_trailing_window(pool, policy):
    assert hit_policy(pool) is policy


def test_a_closed_backend_is_quiet_and_its_listener_is_gone():
    host = sg.mha_host("page_first")
    backend = KvcrHiCacheStorage(sg.storage_config(), {})
    backend.close()  # never started: nothing to close
    backend = sg.backend(host, sg.storage_config())
    backend.close()
    hints_bridge.prefetch_finished("nobody")  # no listener left to call


# ---------------------------------------------------------------------------------------------- more edges


def test_a_source_outside_the_allowlist_is_logged_saying_so(caplog):
    fresh = HintReader(KvcrSettings(peer_allowlist=("10.0.0.0/8",)), InMemoryMetrics(strict=True))
    with caplog.at_level(logging.INFO, logger="kvcr.integrations.sglang.hints"):
        assert fresh.read(info(kv_hints=envelope(host="192.168.0.9"))) is None
    assert "kvcr: ignoring a hint (source is not in peer_allowlist); serving from local DRAM only" in caplog.messages


def test_every_storage_metric_is_bounded():
    stats = StorageStats(True)
    for i in range(MAX_SAMPLES + 1):
        stats.prefetch(i, 1_000_000_000, 1.0)
        stats.backup(i, 1_000_000_000, 1.0)
    drained = stats.drain()
    assert [len(samples) for samples in drained] == [MAX_SAMPLES] * 4


def test_a_continuation_keeps_its_prefix_resident_under_pressure():
    host = sg.mha_host("page_first")
    backend = sg.backend(host, sg.storage_config(dram_bytes=4 * 4096))  # four 4 KiB pages
    try:
        keys = sg.hashes(4)
        others = sg.hashes(1, start=9000)
        assert backend.batch_set_v1(keys[:3], host.alloc(3 * sg.P)) == [True] * 3
        assert backend.batch_set_v1(others, host.alloc(sg.P)) == [True]  # DRAM is full, the prefix is the oldest
        continuation = HiCacheStorageExtraInfo(prefix_keys=keys[:3])
        assert backend.batch_set_v1(keys[3:], host.alloc(sg.P), continuation) == [True]
        assert backend.batch_exists(keys) == 4  # the other page made room, not the prefix this batch extends
    finally:
        backend.close()


def test_a_backend_without_the_zero_copy_interface_is_refused_saying_what_to_add():
    config = sg.storage_config(interface_v1=0)
    with pytest.raises(Exception) as err:
        KvcrHiCacheStorage(config, {})
    assert str(err.value) == (
        'kvcr needs the zero-copy interface: add "interface_v1": 1 to --hicache-storage-backend-extra-config'
    )


def test_without_a_control_port_the_backend_serves_no_port(store):
    assert store.control_port == 0


def test_v2_queries_may_name_the_kv_pool_itself_before_side_pools():
    kv, indexer = sg.mha_host("page_first"), sg.mla_host("page_first")
    backend = KvcrHiCacheStorage(sg.storage_config(), {})
    backend.register_mem_pool_host(kv)
    backend.register_mem_host_pool_v2(kv, PoolName.KV)
    backend.register_mem_host_pool_v2(indexer, PoolName.INDEXER)
    backend.on_host_pools_registered()
    try:
        keys = sg.hashes(2)
        backend.batch_set_v1(keys, kv.alloc(2 * sg.P))
        backend.batch_set_v2([PoolTransfer(name=PoolName.INDEXER, keys=keys[:1], host_indices=indexer.alloc(sg.P))])
        both = [
            PoolTransfer(name=PoolName.KV, keys=None, host_indices=None, hit_policy=PoolHitPolicy.ALL_PAGES),
            PoolTransfer(name=PoolName.INDEXER, keys=None, host_indices=None, hit_policy=PoolHitPolicy.ALL_PAGES),
        ]
        assert backend.batch_exists_v2(keys, both).kv_hit_pages == 1  # the indexer still gates the hit
    finally:
        backend.close()


def test_the_flat_copy_path_of_a_one_component_pool():
    import torch

    host = sg.mla_host("page_first")
    backend = sg.backend(host, sg.storage_config(mla=True))
    try:
        key = sg.hashes(1)[0]
        src = host.alloc(sg.P)
        sg.fill(host, src, seed=8)
        page = host.get_data_page(int(src[0]), flat=True)
        assert backend.set(key, page)
        target = host.get_dummy_flat_data_page()
        assert backend.get(key, target) is target and torch.equal(target, page)
    finally:
        backend.close()


def test_backups_and_prefetches_report_a_plausible_bandwidth():
    host = sg.mha_host("page_first")
    backend = sg.backend(host, sg.storage_config(storage_metrics=True))
    try:
        keys = sg.hashes(4)
        backend.batch_set_v1(keys, host.alloc(4 * sg.P))
        backend.batch_get_v1(keys, host.alloc(4 * sg.P))
        metrics = backend.get_stats()
        assert metrics.backup_pgs == [4] and metrics.prefetch_pgs == [4]
        assert len(metrics.backup_bandwidth) == len(metrics.prefetch_bandwidth) == 1
        for gbps in (*metrics.backup_bandwidth, *metrics.prefetch_bandwidth):
            assert 1e-6 < gbps < 1e6  # 16 KiB moved in well under 16 s
    finally:
        backend.close()


def _backup_pages_on_the_engine_registry():
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("kvcr_pages_total", {"path": "backup", "outcome": "ok"}) or 0.0


@pytest.mark.parametrize("storage_metrics", [True, False])
def test_kvcr_series_reach_the_engines_registry_only_with_sglangs_metrics_on(storage_metrics):
    """With SGLang's metrics on, kvcr emits where SGLang's /metrics collects (prometheus_client's
    registry; multiprocess files inside a server); with them off, only kvcr_stats() counts."""
    host = sg.mha_host("page_first")
    backend = sg.backend(host, sg.storage_config(storage_metrics=storage_metrics))
    try:
        before = _backup_pages_on_the_engine_registry()
        assert all(backend.batch_set_v1(sg.hashes(3, start=7000), host.alloc(3 * sg.P)))
        assert _backup_pages_on_the_engine_registry() - before == (3 if storage_metrics else 0)
        assert backend.kvcr_stats()["counters"]["kvcr_pages_total{outcome=ok,path=backup}"] >= 3
    finally:
        backend.close()


def test_v2_reads_skip_pools_kvcr_does_not_serve_and_read_the_rest(store):
    keys = sg.hashes(2)
    store.batch_set_v1(keys, store.host.alloc(2 * sg.P))
    transfers = [
        PoolTransfer(name=PoolName.MAMBA, keys=keys, host_indices=store.host.alloc(2 * sg.P)),
        PoolTransfer(name=PoolName.KV, keys=keys, host_indices=store.host.alloc(2 * sg.P)),
    ]
    assert store.batch_get_v2(transfers) == {"mamba": [False, False], "kv": [True, True]}


def test_the_copy_path_fills_the_targets_it_is_given_or_the_pools_own_page(store):
    key = sg.hashes(1)[0]
    page = store.host.get_data_page(int(store.host.alloc(sg.P)[0]), flat=True)
    assert store.set(key, page)
    target = store.host.get_dummy_flat_data_page()
    assert store.batch_get([key], [target])[0] is target
    assert store.get(key) is not None  # no target: the host pool's own spare page


def test_a_closed_backend_leaves_the_bridge_and_its_port():
    port = sg.free_port()
    backend = sg.backend(sg.mha_host("page_first"), sg.storage_config(control_port=port))
    assert backend in hints_bridge.listeners()
    backend.close()
    assert backend not in hints_bridge.listeners()
    again = sg.backend(sg.mha_host("page_first"), sg.storage_config(control_port=port))  # the port is free again
    again.close()


def test_a_thread_that_serves_no_request_has_no_current_hint():
    import threading

    seen = []
    worker = threading.Thread(target=lambda: seen.append((hints_bridge.current(), hints_bridge.current_request())))
    worker.start()
    worker.join(5)
    assert seen == [(None, None)]


def test_the_base_class_keeps_the_pools_sglang_registered():
    host, side = sg.mha_host("page_first"), sg.mha_host("page_first")
    store = KvcrHiCacheStorage(sg.storage_config(), {})
    store.register_mem_pool_host(host)
    store.register_mem_host_pool_v2(host, "kv")
    store.register_mem_host_pool_v2(side, PoolName.SWA)
    store.on_host_pools_registered()
    try:
        assert store.mem_pool_host is host and store.registered_pools == {"kv": host, PoolName.SWA: side}
    finally:
        store.close()


def test_the_anchor_registered_alone_the_v1_way_is_served():
    host = sg.mha_host("page_first")
    store = KvcrHiCacheStorage(sg.storage_config(), {})
    store.register_mem_pool_host(host)
    store.on_host_pools_registered()
    try:
        keys = sg.hashes(2)
        assert store.batch_set_v1(keys, host.alloc(2 * sg.P)) == [True, True]
        assert store.batch_exists(keys) == 2
    finally:
        store.close()
