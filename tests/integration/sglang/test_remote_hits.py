"""Hit queries that mix local and hinted remote pages: holes in a hint, side pools a peer completes.

Two replicas on the in-process mock fabric, each with SGLang's real host pools: A is the source, B
the hinted target.
"""

import pytest
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from kvcr.domain.keys import router_id
from kvcr.integrations.sglang import KvcrHiCacheStorage
from kvcr.integrations.shared import hints_bridge
from tests.integration.sglang import sg


def hint(port, keys):
    payload = {"source_control_endpoint": f"tcp://127.0.0.1:{port}", "block_hashes": [router_id(k) for k in keys]}
    action = {"action_type": "kv.fetch", "action_version": "1.0", "payload": payload}
    return HiCacheStorageExtraInfo(extra_info={"kv_hints": {"protocol_version": "0.1", "actions": [action]}})


def transfer(name, policy, keys=None, host_indices=None):
    return PoolTransfer(name=name, keys=keys, host_indices=host_indices, hit_policy=policy)


@pytest.fixture
def replicas():
    """make(side=None | PoolName) -> (store, {pool: host}, port); every store is closed afterwards."""
    made = []

    def make(side=None, **settings):
        port = sg.free_port()
        hosts = {"kv": sg.mha_host("page_first")}
        store = KvcrHiCacheStorage(sg.storage_config(control_port=port, enable_remote_hint=True, **settings), {})
        store.register_mem_pool_host(hosts["kv"])
        store.register_mem_host_pool_v2(hosts["kv"], PoolName.KV)
        if side is not None:
            hosts[str(side.value)] = sg.mla_host("page_first")
            store.register_mem_host_pool_v2(hosts[str(side.value)], side)
        store.on_host_pools_registered()
        made.append(store)
        return store, hosts, port

    yield make
    for store in made:
        store.close()


def test_a_hint_with_a_hole_hits_only_up_to_the_hole(replicas):
    a, hosts_a, port_a = replicas()
    b, hosts_b, _ = replicas()
    keys = sg.hashes(3)
    src = hosts_a["kv"].alloc(3 * sg.P)
    sg.fill(hosts_a["kv"], src, seed=41)
    assert a.batch_set_v1(keys, src) == [True] * 3  # A holds all three pages
    holed = hint(port_a, [keys[0], keys[2]])  # ... but the router names pages 0 and 2 only
    with hints_bridge.active("req-holed"):  # the plugin names the request: leases are booked for its read
        assert b.batch_exists(keys, holed) == 1
        assert a.runner.active_leases == 1  # page 0 only: nothing past the hole is pinned
        assert b.kvcr_stats()["held_remote_pages"] == 1
        dst = hosts_b["kv"].alloc(sg.P)  # SGLang allocates host pages for the hit only
        assert b.batch_get_v1(keys[:1], dst, holed) == [True]
    assert sg.pages_equal(hosts_a["kv"], src[: sg.P], hosts_b["kv"], dst)
    assert a.runner.active_leases == 0


def test_a_read_never_goes_past_the_first_page_available_nowhere(replicas):
    a, hosts_a, port_a = replicas()
    b, hosts_b, _ = replicas()
    keys = sg.hashes(3)
    a.batch_set_v1(keys, hosts_a["kv"].alloc(3 * sg.P))
    holed = hint(port_a, [keys[0], keys[2]])
    assert b.batch_get_v1(keys, hosts_b["kv"].alloc(3 * sg.P), holed) == [True, False, False]


def test_v2_a_peer_completes_a_local_side_pool_run_shorter_than_the_local_kv_run(replicas):
    a, hosts_a, port_a = replicas(side=PoolName.INDEXER)
    b, hosts_b, _ = replicas(side=PoolName.INDEXER)
    keys = sg.hashes(4)
    kv_a, ix_a = hosts_a["kv"].alloc(4 * sg.P), hosts_a["indexer"].alloc(4 * sg.P)
    sg.fill(hosts_a["kv"], kv_a, seed=42)
    sg.fill(hosts_a["indexer"], ix_a, seed=43)
    a.batch_set_v1(keys, kv_a)
    assert a.batch_set_v2([transfer(PoolName.INDEXER, PoolHitPolicy.ALL_PAGES, keys, ix_a)]) == {"indexer": [True] * 4}
    # B holds all four KV pages and the first two indexer pages itself (the same bytes: the same pages).
    kv_b, ix_b = hosts_b["kv"].alloc(4 * sg.P), hosts_b["indexer"].alloc(2 * sg.P)
    sg.fill(hosts_b["kv"], kv_b, seed=42)
    sg.fill(hosts_b["indexer"], ix_b, seed=43)
    b.batch_set_v1(keys, kv_b)
    b.batch_set_v2([transfer(PoolName.INDEXER, PoolHitPolicy.ALL_PAGES, keys[:2], ix_b)])
    side = transfer(PoolName.INDEXER, PoolHitPolicy.ALL_PAGES)
    assert b.batch_exists_v2(keys, [side]).kv_hit_pages == 2  # without a hint the side pool cuts the hit
    with hints_bridge.active("req-side"):
        result = b.batch_exists_v2(keys, [side], hint(port_a, keys))
        assert result.kv_hit_pages == 4
        assert result.restorable_prefix_pages == [1, 2, 3, 4]
        assert b.kvcr_stats()["held_remote_pages"] == 2  # only the indexer pages B lacks were leased
        dst = hosts_b["indexer"].alloc(2 * sg.P)
        read = [transfer(PoolName.INDEXER, PoolHitPolicy.ALL_PAGES, keys[2:], dst)]
        got = b.batch_get_v2(read, hint(port_a, keys))
    assert got == {"indexer": [True, True]}
    assert sg.pages_equal(hosts_a["indexer"], ix_a[2 * sg.P :], hosts_b["indexer"], dst)
    assert a.runner.active_leases == 0


def test_v2_the_only_trailing_checkpoint_may_sit_on_the_peer(replicas):
    a, hosts_a, port_a = replicas(side=PoolName.SWA)
    b, hosts_b, _ = replicas(side=PoolName.SWA)
    keys = sg.hashes(4)
    for store, host in ((a, hosts_a), (b, hosts_b)):
        kv = host["kv"].alloc(4 * sg.P)
        sg.fill(host["kv"], kv, seed=44)
        store.batch_set_v1(keys, kv)  # both hold every KV page
    checkpoint = hosts_a["swa"].alloc(sg.P)
    sg.fill(hosts_a["swa"], checkpoint, seed=45)
    a.batch_set_v2([transfer(PoolName.SWA, PoolHitPolicy.TRAILING_PAGES, [keys[3]], checkpoint)])  # at page 4 only
    trailing = transfer(PoolName.SWA, PoolHitPolicy.TRAILING_PAGES, keys=[keys[-1]])
    assert b.batch_exists_v2(keys, [trailing]).kv_hit_pages == 0  # B has no checkpoint to resume from
    result = b.batch_exists_v2(keys, [trailing], hint(port_a, keys))
    assert result.kv_hit_pages == 4
    assert result.restorable_prefix_pages == [4]
    dst = hosts_b["swa"].alloc(sg.P)
    got = b.batch_get_v2([transfer(PoolName.SWA, PoolHitPolicy.TRAILING_PAGES, [keys[3]], dst)], hint(port_a, keys))
    assert got == {"swa": [True]}
    assert sg.pages_equal(hosts_a["swa"], checkpoint, hosts_b["swa"], dst)
