"""KvcrHiCacheStorage (SGLang's real host pools) publishing its kvcr DRAM residency as KV events."""

import pytest

from kvcr.domain.errors import ConfigError
from kvcr.domain.keys import router_id_signed
from kvcr.integrations.dynamo import control_endpoints_for, default_registry
from kvcr.integrations.sglang import KvcrHiCacheStorage
from tests.integration.dynamo.conftest import free_port
from tests.integration.kv_events import next_batch, subscribed, subscribers
from tests.integration.sglang import sg


@pytest.fixture
def backends():
    made = []

    def make(**settings):
        host = sg.mha_host("page_first")
        store = KvcrHiCacheStorage(sg.storage_config(**settings), {})
        store.register_mem_pool_host(host)
        store.register_mem_host_pool_v2(host, "kv")
        store.on_host_pools_registered()
        made.append(store)
        return store, host

    yield make
    for store in made:
        store.close()


@pytest.fixture
def sub():
    yield from subscribers()


def test_backups_clears_and_close_are_published_as_dynamo_events(backends, sub):
    port = free_port()
    store, host = backends(kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_topic="kvcr-a")
    assert default_registry().enabled
    sock = sub(f"tcp://127.0.0.1:{port}")
    assert subscribed(store, sock)
    tokens = list(range(700, 700 + 3 * sg.P))
    keys = sg.get_hash_str(tokens, None, page_size=sg.P)
    default_registry().record(keys, tokens, sg.P)  # what the plugin's backup hook does
    src = host.alloc(3 * sg.P)
    sg.fill(host, src, seed=5)
    assert store.batch_set_v1(keys, src) == [True] * 3
    topic, seq, (_, events, dp_rank) = next_batch(sock)
    assert (topic, seq, dp_rank) == (b"kvcr-a", 0, 0)
    assert events == [
        {
            "type": "BlockStored",
            "block_hashes": [router_id_signed(k) for k in keys],
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": sg.P,
            "lora_id": None,
            "medium": "CPU_TIER1",
        }
    ]
    assert store.batch_set_v1(keys, src) == [True] * 3  # already held: no second event
    store.clear()
    _, seq, (_, events, _) = next_batch(sock)
    assert (seq, events) == (1, [{"type": "AllBlocksCleared"}])
    assert store.kvcr_stats()["kv_events"]["stored_pages"] == 3
    store.close()  # the replica's DRAM is gone: the router is told so before the socket closes
    _, seq, (_, events, _) = next_batch(sock)
    assert (seq, events) == (2, [{"type": "AllBlocksCleared"}])
    assert store.kv_events.publisher.dropped == 0


def test_only_rank_zero_of_each_dp_replica_publishes_on_its_own_port(backends, sub):
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    store, _ = backends(kv_events_endpoint=endpoint, tp_rank=1, tp_size=2)
    assert store.kv_events is None
    replica, _ = backends(kv_events_endpoint=endpoint, tp_rank=0, tp_size=2, dp_rank=3)
    assert replica.kv_events.publisher.endpoint == f"tcp://127.0.0.1:{port + 3}"
    sock = sub(f"tcp://127.0.0.1:{port + 3}")
    assert subscribed(replica, sock)
    replica.clear()
    assert next_batch(sock)[2][1:] == [[{"type": "AllBlocksCleared"}], 3]


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:0", "127.0.0.1:5557", "tcp://127.0.0.1"])
def test_a_bad_kv_events_endpoint_fails_start_up(endpoint):
    with pytest.raises(ConfigError, match="kv_events_endpoint"):
        KvcrHiCacheStorage(sg.storage_config(kv_events_endpoint=endpoint), {})


def test_a_mistyped_kv_events_topic_fails_start_up():
    with pytest.raises(ConfigError, match="kv_events_topic"):
        KvcrHiCacheStorage(sg.storage_config(kv_events_topic=5), {})


def test_control_endpoints_match_the_ports_the_backend_binds():
    dp, tp = 3, 2
    bound = {
        d: KvcrHiCacheStorage(sg.storage_config(tp_rank=0, tp_size=tp, dp_rank=d, control_port=41000), {}).control_port
        for d in range(dp)
    }
    advertised = control_endpoints_for(sg.extra_config(control_port=41000), dp_size=dp, tp_size=tp)
    assert advertised == {d: f"tcp://127.0.0.1:{port}" for d, port in bound.items()}


def test_a_failed_start_frees_the_kv_events_port(backends):
    control, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
    backends(control_port=control)
    clash = KvcrHiCacheStorage(sg.storage_config(control_port=control, kv_events_endpoint=events), {})
    host = sg.mha_host("page_first")
    clash.register_mem_pool_host(host)
    clash.register_mem_host_pool_v2(host, "kv")
    with pytest.raises(Exception, match="already served"):
        clash.on_host_pools_registered()  # the control endpoint is taken: start-up fails
    assert clash.kv_events is None
    store, _ = backends(control_port=free_port(), kv_events_endpoint=events)  # the same events port binds again
    assert store.kv_events.publisher.endpoint == events
