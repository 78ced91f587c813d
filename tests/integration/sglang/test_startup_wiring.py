"""What start-up hands the runner, the node and the KV-event publisher: every setting arrives where it is used,
and each DP replica's rank 0 publishes its pages on its own port (pyzmq sockets on loopback)."""

import os
import re
import socket

import pytest

from kvcr.domain.errors import ConfigError
from kvcr.domain.keys import NamespaceSpec, router_id_signed
from kvcr.integrations.sglang import startup
from kvcr.integrations.shared.page_tokens import default_registry
from kvcr.integrations.shared.settings import parse_settings
from kvcr.runner.node import NodeSettings
from kvcr.runner.peer_client import PeerSettings
from tests.integration.kv_events import next_batch, subscribed, subscribers
from tests.integration.sglang import sg


@pytest.fixture
def stores():
    made = []

    def make(**settings):
        host = sg.mha_host("page_first")
        store = sg.backend(host, sg.storage_config(**settings))
        made.append(store)
        return store, host

    yield make
    for store in made:
        store.close()


def token_file(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return str(path)


def test_the_runner_and_the_node_run_with_the_configured_settings(stores, tmp_path):
    port = sg.free_port()
    settings = {
        "control_port": port,
        "control_advertise_host": "127.0.0.9",
        "auth_token_file": token_file(tmp_path, "token", b"token-0123456789abcdef"),
        "rotation_token_files": [token_file(tmp_path, "old", b"old-0123456789abcdef")],
        "allow_unauthenticated": True,
        "policy": "fifo",
        "verify_bytes": True,
        "page_digest": "blake3",
        "operation_timeout_ms": 3000,
        "lease_ms": 7000,
        "read_batch_pages": 7,
        "landing": "staged",
        "recompute_tokens_per_s": 1000.0,
        "max_peer_links": 3,
        "control_handshake_ms": 1500,
        "peer_lease_share": 0.25,
    }
    store, host = stores(**settings)
    parsed = parse_settings(sg.extra_config(**settings))
    config = store.runner.config
    assert config.namespace == NamespaceSpec("test-model", sg.P, str(host.dtype), "page_first")
    assert (config.policy, config.timing, config.verify_bytes) == ("fifo", parsed.timing(), True)
    assert config.max_peer_leased_fraction == 0.25
    assert config.page_digest == "blake3"  # and the memory adapter digests with it (the runner refuses otherwise)
    # NIXL agent names are unique across the cluster: host, process, rank and 8 random hex digits
    name = rf"kvcr-{re.escape(socket.gethostname())}-{os.getpid()}-dp0-r0-[0-9a-f]{{8}}"
    assert re.fullmatch(name, config.name)
    assert store.node.settings == NodeSettings(
        "127.0.0.1",
        port,
        advertise_host="127.0.0.9",
        token=b"token-0123456789abcdef",
        rotation_tokens=(b"old-0123456789abcdef",),
        allow_unauthenticated=True,
        handshake_timeout_s=1.5,
        peer=PeerSettings(
            max_pages_per_read=7, landing="staged", recompute_tokens_per_s=1000.0, tokens_per_page=sg.P, max_links=3
        ),
    )
    assert store.kvcr_stats()["endpoint"] == f"tcp://127.0.0.9:{port}"


def _node_key(tmp_path, port, listed=True):
    from kvcr.adapters.zmq.identity import write_node_key

    key = tmp_path / "node.key"
    public = write_node_key(str(key)).decode()
    directory = tmp_path / "peers"
    directory.write_text(f"tcp://127.0.0.1:{port if listed else port + 1} {public}\n")
    # A real control channel (the mock one has no credentials): NIXL's transport picks ZMQ.
    return {"transport": "nixl", "control_port": port, "node_key_file": str(key), "peer_directory_file": str(directory)}


def test_per_node_identities_reach_the_node_and_its_control_channel_authenticates_with_them(stores, tmp_path):
    port = sg.free_port()
    settings = _node_key(tmp_path, port)
    store, _ = stores(**settings)
    node = store._ready().node
    assert node is not None and node.control.authenticated
    assert node.settings.token is None and node.settings.peer_directory_file == settings["peer_directory_file"]
    assert node.settings.node_secret_key.strip() == (tmp_path / "node.key").read_bytes().strip()
    assert store.runner.config.page_digest == "blake3"  # page_digest auto: a digest no listed node can keep


def test_a_directory_that_does_not_list_this_node_stops_start_up_with_the_line_to_add(stores, tmp_path):
    with pytest.raises(ConfigError, match=r"does not list it: this node serves tcp://127\.0\.0\.1:.*add the line"):
        stores(**_node_key(tmp_path, sg.free_port(), listed=False))  # SGLang registers its pools: kvcr starts


def test_a_model_without_a_name_is_keyed_as_unknown(stores):
    store, host = stores(model="")
    assert store.runner.config.namespace == NamespaceSpec("unknown", sg.P, str(host.dtype), "page_first")


@pytest.mark.parametrize(("transport", "control"), [("mock", "mock"), ("ucx", "zmq"), ("nixl", "zmq")])
def test_a_real_transport_gets_the_zmq_control_plane(transport, control):
    assert startup.control_plane(transport) == control


def test_a_started_mock_node_talks_over_the_mock_control_channel(stores):
    from kvcr.adapters.mock import MockControlChannel

    store, _ = stores(control_port=sg.free_port())
    node = store._ready().node
    assert node is not None and isinstance(node.control, MockControlChannel)


# ---------------------------------------------------------------------------------------------- KV events


@pytest.fixture
def sub():
    yield from subscribers()


def test_a_dp_replica_publishes_its_pages_with_their_tokens_on_its_own_port(stores, sub):
    port = sg.free_port()
    store, host = stores(kv_events_endpoint=f"tcp://127.0.0.1:{port}", kv_events_topic="kvcr-b", dp_rank=2)
    assert store.kv_events.publisher.endpoint == f"tcp://127.0.0.1:{port + 2}"
    sock = sub(f"tcp://127.0.0.1:{port + 2}")
    assert subscribed(store, sock)
    tokens = list(range(900, 900 + 2 * sg.P))
    keys = sg.get_hash_str(tokens, None, page_size=sg.P)
    default_registry().record(keys, tokens, sg.P)  # what the plugin's backup hook does
    src = host.alloc(2 * sg.P)
    sg.fill(host, src, seed=3)
    assert store.batch_set_v1(keys, src) == [True, True]
    topic, _, (_, events, dp_rank) = next_batch(sock)
    assert (topic, dp_rank) == (b"kvcr-b", 2)
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
    assert store.kvcr_stats()["kv_events"]["stored_pages"] == 2


def test_only_attention_rank_zero_publishes(stores):
    store, _ = stores(kv_events_endpoint=f"tcp://127.0.0.1:{sg.free_port()}", tp_rank=1, tp_size=2)
    assert store.kv_events is None and store.kvcr_stats()["kv_events"] is None
    first, _ = stores(kv_events_endpoint=f"tcp://127.0.0.1:{sg.free_port()}", tp_rank=0, tp_size=2)
    assert first.kv_events is not None


def test_the_last_dp_replica_may_publish_on_port_65535_and_none_past_it(stores):
    last, _ = stores(kv_events_endpoint="tcp://127.0.0.1:65534", dp_rank=1)
    assert last.kv_events.publisher.endpoint == "tcp://127.0.0.1:65535"
    with pytest.raises(ConfigError) as err:
        stores(kv_events_endpoint="tcp://127.0.0.1:65535", dp_rank=1)
    assert str(err.value) == "kv_events_endpoint port 65535 + dp rank 1 runs past 65535"


@pytest.mark.nixl
def test_a_control_port_in_use_names_control_port_the_rank_offset_and_what_to_do(stores):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError) as caught:
            stores(transport="nixl", control_port=port - 1, tp_rank=1, tp_size=2)
    message = str(caught.value)
    assert message.startswith(f"control_port {port - 1} + this rank's offset 1 = port {port} on 127.0.0.1 is in use")
    assert "give each server its own control_port range" in message
