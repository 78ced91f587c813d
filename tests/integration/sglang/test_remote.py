"""Hinted remote restore, replicated-MLA sharing and fail-stop, with the in-process mock fabric.

The same flows over real NIXL between two processes are in ``test_two_replicas_nixl.py``.
"""

import subprocess
import sys
import textwrap
import time

import pytest
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

from kvcr.adapters.mock import Faults
from kvcr.domain.keys import router_id
from kvcr.integrations.sglang import KvcrHiCacheStorage
from tests.integration.sglang import sg


def hint(port, keys):
    return HiCacheStorageExtraInfo(
        extra_info={
            "kv_hints": {
                "protocol_version": "0.1",
                "message_id": "req-1",
                "actions": [
                    {
                        "action_id": "a1",
                        "action_type": "kv.fetch",
                        "action_version": "1.0",
                        "payload": {
                            "source_control_endpoint": f"tcp://127.0.0.1:{port}",
                            "block_hashes": [router_id(k) for k in keys],
                        },
                    }
                ],
            }
        }
    )


@pytest.fixture
def replicas():
    made = []

    def make(cls=KvcrHiCacheStorage, **settings):
        port = sg.free_port()
        host = sg.mha_host("page_first")
        config = sg.storage_config(control_port=port, **settings)
        store = cls(config, {})
        store.register_mem_pool_host(host)
        store.register_mem_host_pool_v2(host, "kv")
        store.on_host_pools_registered()
        made.append(store)
        return store, host, port

    yield make
    for store in made:
        store.close()


def test_a_hinted_replica_restores_the_sources_pages_into_its_own_host_pool(replicas):
    a, host_a, port_a = replicas()
    b, host_b, _ = replicas(enable_remote_hint=True)
    keys = sg.hashes(6)
    src = host_a.alloc(6 * sg.P)
    sg.fill(host_a, src, seed=21)
    assert a.batch_set_v1(keys, src) == [True] * 6
    info = hint(port_a, keys)
    assert b.batch_exists(keys) == 0  # no hint: B's own tier is empty
    assert b.batch_exists(keys, info) == 6  # leased from A at hit-query time
    dst = host_b.alloc(6 * sg.P)
    assert b.batch_get_v1(keys[:4], dst[: 4 * sg.P], info) == [True] * 4  # prefetch batch 1
    assert b.batch_get_v1(keys[4:], dst[4 * sg.P :], info) == [True] * 2  # batch 2, same lease
    assert sg.pages_equal(host_a, src, host_b, dst)
    assert a.runner.active_leases == 0  # released once every leased page was read
    assert b.kvcr_stats()["held_remote_pages"] == 0


@pytest.mark.parametrize(("source_digest", "restored"), [("blake3", [True] * 3), ("xxh3", [False] * 3)])
def test_a_blake3_replica_restores_from_a_blake3_source_and_nothing_from_an_xxh3_one(replicas, source_digest, restored):
    a, host_a, port_a = replicas(page_digest=source_digest)
    b, host_b, _ = replicas(enable_remote_hint=True, page_digest="blake3")
    keys = sg.hashes(3)
    src = host_a.alloc(3 * sg.P)
    sg.fill(host_a, src, seed=23)
    assert a.batch_set_v1(keys, src) == [True] * 3
    info = hint(port_a, keys)
    assert b.batch_exists(keys, info) == 3  # leased: the digest is checked when the bytes land
    dst = host_b.alloc(3 * sg.P)
    assert b.batch_get_v1(keys, dst, info) == restored
    if all(restored):
        assert sg.pages_equal(host_a, src, host_b, dst)
    assert a.runner.active_leases == 0


def test_the_hint_bounds_what_is_leased_and_local_pages_come_first(replicas):
    a, host_a, port_a = replicas()
    b, host_b, _ = replicas(enable_remote_hint=True)
    keys = sg.hashes(5)
    src = host_a.alloc(5 * sg.P)
    sg.fill(host_a, src, seed=22)
    a.batch_set_v1(keys, src)
    own = host_b.alloc(sg.P)
    sg.fill(host_b, own, seed=22)  # B holds page 0 itself (same bytes: same page)
    b.batch_set_v1(keys[:1], own)
    assert b.batch_exists(keys, hint(port_a, keys[:3])) == 3  # 1 local + 2 leased; the hint stops there
    dst = host_b.alloc(5 * sg.P)
    assert b.batch_get_v1(keys, dst, hint(port_a, keys[:3]))[:3] == [True, True, True]


def test_stale_hints_dead_peers_and_hints_without_the_flag_are_misses(replicas):
    a, host_a, port_a = replicas()
    b, host_b, _ = replicas(enable_remote_hint=True)
    c, _, _ = replicas()  # enable_remote_hint off: ignores hints
    keys = sg.hashes(3)
    a.batch_set_v1(keys, host_a.alloc(3 * sg.P))
    assert c.batch_exists(keys, hint(port_a, keys)) == 0
    a.clear()  # the source no longer holds the pages the router told B about
    assert b.batch_exists(keys, hint(port_a, keys)) == 0
    assert b.batch_get_v1(keys, host_b.alloc(3 * sg.P), hint(port_a, keys)) == [False] * 3
    a.close()
    assert b.batch_exists(keys, hint(port_a, keys)) == 0
    assert b.batch_get_v1(keys, host_b.alloc(3 * sg.P), hint(port_a, keys)) == [False] * 3


def test_replicated_mla_only_the_writer_stores_and_other_ranks_read_from_it(replicas):
    base = sg.free_port(2)  # rank 0 and rank 1 bind base and base + 1
    stores = []
    hosts = []
    for rank in range(2):
        host = sg.mla_host("page_first")
        store = KvcrHiCacheStorage(sg.storage_config(mla=True, tp_rank=rank, tp_size=2, control_port=base), {})
        store.register_mem_pool_host(host)
        store.register_mem_host_pool_v2(host, "kv")
        store.on_host_pools_registered()
        stores.append(store)
        hosts.append(host)
    try:
        assert stores[0].control_port == base and stores[1].control_port == base + 1
        assert stores[0].runner.namespace == stores[1].runner.namespace  # replicated KV: one key space
        keys = sg.hashes(3)
        src = hosts[0].alloc(3 * sg.P)
        sg.fill(hosts[0], src, seed=31)
        assert stores[0].batch_set_v1(keys, src) == [True] * 3  # SGLang backs up on the writer only
        assert stores[1].batch_exists(keys) == 3  # rank 1 holds nothing itself and leases from rank 0
        dst = hosts[1].alloc(3 * sg.P)
        assert stores[1].batch_get_v1(keys, dst) == [True] * 3
        assert sg.pages_equal(hosts[0], src, hosts[1], dst)
    finally:
        for store in stores:
            store.close()


def test_sharded_ranks_dial_their_own_rank_on_the_source():
    configs = [sg.storage_config(tp_rank=r, tp_size=4, dp_rank=1, control_port=50000) for r in range(4)]
    ports = [KvcrHiCacheStorage(c, {}).control_port for c in configs]
    assert ports == [50004, 50005, 50006, 50007]  # base + dp_rank * tp_size + tp_rank


REASONS: list[str] = []
FAST = dict(operation_timeout_ms=100, abandon_timeout_ms=200, control_timeout_ms=50)


class Recorded(KvcrHiCacheStorage):
    """Records fail-stop instead of ending the test process."""

    @staticmethod
    def terminate(reason: str) -> None:
        REASONS.append(reason)


def test_an_unconfirmed_read_terminates_the_worker(replicas):
    a, host_a, port_a = replicas()
    b, host_b, _ = replicas(cls=Recorded, enable_remote_hint=True, landing="direct", **FAST)
    keys = sg.hashes(2)
    a.batch_set_v1(keys, host_a.alloc(2 * sg.P))
    a.node.data_plane.set_faults(Faults(stall=True, late_writes=True))
    with pytest.raises(BaseException, match="could not be confirmed stopped"):
        b.batch_get_v1(keys, host_b.alloc(2 * sg.P), hint(port_a, keys))
    assert REASONS and "could not be confirmed stopped" in REASONS[-1]
    a.node.data_plane.set_faults(Faults())  # let the stuck read land so both sides can close
    assert b.node.client.reap() == 0


def test_a_frozen_source_costs_misses_not_the_worker(replicas):
    a, host_a, port_a = replicas()
    b, host_b, _ = replicas(cls=Recorded, enable_remote_hint=True, **FAST)  # landing auto
    keys = sg.hashes(2)
    src = host_a.alloc(2 * sg.P)
    sg.fill(host_a, src, seed=41)
    a.batch_set_v1(keys, src)
    a.node.data_plane.set_faults(Faults(late_writes=True))  # a transport that cannot fence a read
    assert b.batch_exists(keys, hint(port_a, keys)) == 2
    a.node.data_plane.set_faults(Faults(late_writes=True, stall=True))  # the source freezes mid-flow
    before = len(REASONS)
    dst = host_b.alloc(2 * sg.P)
    assert b.batch_get_v1(keys, dst, hint(port_a, keys)) == [False, False]
    assert len(REASONS) == before  # no fail-stop: the read landed in kvcr's staging memory
    assert b.node.staging.quarantined == 1
    a.node.data_plane.set_faults(Faults(late_writes=True))  # it resumes: the late bytes land in staging
    assert b.node.client.reap() == 0 and b.node.staging.quarantined == 0
    assert not sg.pages_equal(host_a, src, host_b, dst)  # never in SGLang's host pages


def test_fail_stop_really_ends_the_process_with_a_log_line(tmp_path):
    script = textwrap.dedent(
        """
        import logging, sys
        sys.path.insert(0, %r)
        import tests.integration.sglang.conftest  # cache dirs and the torchvision stub
        from sglang.srt.runtime_context import get_parallel
        get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1, pp_rank=0,
                                            pp_size=1)
        logging.basicConfig(level=logging.INFO)
        from kvcr.adapters.mock import Faults
        from kvcr.integrations.sglang import KvcrHiCacheStorage
        from tests.integration.sglang import sg
        from tests.integration.sglang.test_remote import hint

        def make(**settings):
            host = sg.mha_host("page_first")
            port = settings.pop("port")
            store = KvcrHiCacheStorage(sg.storage_config(control_port=port, **settings), {})
            store.register_mem_pool_host(host); store.register_mem_host_pool_v2(host, "kv")
            store.on_host_pools_registered()
            return store, host
        port_a = sg.free_port()
        a, host_a = make(port=port_a)
        b, host_b = make(port=sg.free_port(), enable_remote_hint=True, operation_timeout_ms=100,
                         abandon_timeout_ms=200, control_timeout_ms=50, landing="direct")
        keys = sg.hashes(2)
        a.batch_set_v1(keys, host_a.alloc(2 * sg.P))
        a.node.data_plane.set_faults(Faults(stall=True, late_writes=True))
        b.batch_get_v1(keys, host_b.alloc(2 * sg.P), hint(port_a, keys))
        print("still alive")
        """
    ) % str(sg.__file__.rsplit("/tests/", 1)[0])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 75, done.stderr[-2000:]
    assert "still alive" not in done.stdout
    assert "terminating this worker" in done.stderr and "could not be confirmed stopped" in done.stderr


def test_a_hinted_mla_rank_reads_replicated_kv_from_the_sources_writer_rank():
    base = sg.free_port(4)  # replica 0 binds base, base + 1; replica 1 binds base + 2, base + 3
    made = []

    def rank(dp, tp_rank, **settings):
        host = sg.mla_host("page_first")
        config = sg.storage_config(mla=True, tp_rank=tp_rank, tp_size=2, dp_rank=dp, control_port=base, **settings)
        made.append(sg.backend(host, config))
        return made[-1], host

    try:
        source, source_host = rank(1, 0)
        rank(1, 1)  # the source's rank 1 holds no replicated KV
        reader, reader_host = rank(0, 1, enable_remote_hint=True)
        keys = sg.hashes(2)
        src = source_host.alloc(2 * sg.P)
        sg.fill(source_host, src, seed=61)
        assert source.batch_set_v1(keys, src) == [True, True]
        dst = reader_host.alloc(2 * sg.P)
        assert reader.batch_get_v1(keys, dst, hint(base + 2, keys)) == [True, True]
        assert sg.pages_equal(source_host, src, reader_host, dst)
    finally:
        for store in made:
            store.close()


def test_a_sharded_rank_never_reads_its_pages_from_the_writer():
    base = sg.free_port(2)
    hosts = [sg.mha_host("page_first") for _ in range(2)]
    stores = [sg.backend(hosts[r], sg.storage_config(tp_rank=r, tp_size=2, control_port=base)) for r in range(2)]
    try:
        keys = sg.hashes(2)
        assert stores[0].batch_set_v1(keys, hosts[0].alloc(2 * sg.P)) == [True, True]  # rank 0's own shard
        assert stores[1].batch_exists(keys) == 0
        assert stores[1].batch_get_v1(keys, hosts[1].alloc(2 * sg.P)) == [False, False]
        assert stores[1].kvcr_stats()["held_remote_pages"] == 0
        assert no_peer_traffic(stores)  # it never asked: a writer would refuse another shard's namespace
    finally:
        for store in stores:
            store.close()


def no_peer_traffic(stores):
    """No store failed a peer request or refused one."""
    names = [name for store in stores for name in store.kvcr_stats()["counters"]]
    return not [n for n in names if n.startswith(("kvcr_failures_total", "kvcr_peer_requests_refused_total"))]


def test_a_replica_links_to_its_connect_ahead_peers_at_start_up_before_any_hint(replicas):
    a, host_a, port_a = replicas()
    b, host_b, _ = replicas(enable_remote_hint=True, connect_ahead=[f"tcp://127.0.0.1:{port_a}"])
    deadline = time.monotonic() + 10
    while b.node.client.links == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert b.node.client.links == 1  # linked before any hint named A
    keys = sg.hashes(3)
    src = host_a.alloc(3 * sg.P)
    sg.fill(host_a, src, seed=23)
    assert a.batch_set_v1(keys, src) == [True] * 3
    assert b.batch_exists(keys, hint(port_a, keys)) == 3
    dst = host_b.alloc(3 * sg.P)
    assert b.batch_get_v1(keys, dst, hint(port_a, keys)) == [True] * 3
    assert sg.pages_equal(host_a, src, host_b, dst)
    assert b.node.client.links == 1  # the hinted restore used the link made ahead


@pytest.mark.parametrize(("threshold_pages", "hit"), [(4, 0), (3, 3)])
def test_a_hinted_hit_below_sglangs_prefetch_threshold_leases_nothing(replicas, threshold_pages, hit):
    a, host_a, port_a = replicas()
    b, _, _ = replicas(enable_remote_hint=True, prefetch_threshold=threshold_pages * sg.P)
    keys = sg.hashes(3)
    src = host_a.alloc(3 * sg.P)
    sg.fill(host_a, src, seed=29)
    assert a.batch_set_v1(keys, src) == [True] * 3
    answered = b.batch_exists(keys, hint(port_a, keys))
    served = a._ready().metrics.snapshot().get("kvcr_pages_total{outcome=ok,path=served}", 0)
    if threshold_pages <= 3:
        assert answered == hit and served == 3
    else:  # SGLang would prefetch none of it: A is not asked at all
        assert answered == 0 and served == 0


def test_sglang_parses_prefetch_threshold_where_kvcr_reads_it_again():
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController

    from kvcr.integrations.sglang.storage import engine_prefetch_threshold

    parsed = HybridCacheController.parse_storage_backend_extra_config('{"prefetch_threshold": 64, "x": 1}')
    assert parsed[1] == 64  # the tuple position kvcr reads in a scheduler
    assert HybridCacheController.parse_storage_backend_extra_config("{}")[1] == 256  # SGLang's default
    assert engine_prefetch_threshold({"prefetch_threshold": 48}) == 48  # outside a scheduler: the dict's
    assert engine_prefetch_threshold({}) == 0
