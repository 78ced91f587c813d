"""Runner and node settings at their limits, and the node's registration and shutdown order."""

import pytest

from kvcr.domain.errors import ConfigError
from kvcr.domain.keys import NamespaceSpec
from kvcr.runner import RunnerConfig
from kvcr.runner.config import MAX_DRAM_BYTES
from kvcr.runner.node import NodeSettings, is_loopback
from kvcr.runner.peer_client import PeerSettings
from tests.support import Cluster, HostPool, indexer_pool, kv_pool, seed, sequence

SPEC = NamespaceSpec("m", 4, "bf16", "page_first")
POOLS = (kv_pool(),)  # 512-byte pages


def config(**changes):
    base = dict(name="r", namespace=SPEC, pools=POOLS, dram_bytes=4096)
    base.update(changes)
    return RunnerConfig(**base)


def refusal(call, **kwargs):
    with pytest.raises(ConfigError) as err:
        call(**kwargs)
    return str(err.value)


# ---------------------------------------------------------------------------------------------- RunnerConfig


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(name=""), "runner name must not be empty"),
        (dict(dram_bytes=0), f"dram_bytes must be in 1..{1 << 50} (1 PiB), got 0"),
        (dict(dram_bytes=MAX_DRAM_BYTES + 1), f"dram_bytes must be in 1..{1 << 50} (1 PiB), got {(1 << 50) + 1}"),
        (dict(max_leased_fraction=0.0), "max_leased_fraction must be in (0, 1], got 0.0"),
        (dict(max_leased_fraction=1.5), "max_leased_fraction must be in (0, 1], got 1.5"),
    ],
)
def test_runner_settings_out_of_range_are_refused_naming_them(changes, message):
    assert refusal(config, **changes) == message


def test_runner_settings_at_their_limits_are_accepted():
    assert config(dram_bytes=1).dram_bytes == 1
    assert config(dram_bytes=MAX_DRAM_BYTES).dram_bytes == MAX_DRAM_BYTES
    assert config(max_leased_fraction=1.0).max_leased_fraction == 1.0


def test_dram_is_shared_by_page_size_and_explicit_shares_come_off_the_top():
    two = (kv_pool(), indexer_pool())  # 512 and 64 bytes a page
    assert config(pools=two, dram_bytes=576 * 10).slots_per_pool() == {"kv": 10, "indexer": 10}
    explicit = config(pools=two, dram_bytes=576 * 10, pool_dram_bytes={"indexer": 640})
    assert explicit.slots_per_pool() == {"kv": (5760 - 640) // 512, "indexer": 10}
    assert config(pools=two, dram_bytes=1152, pool_dram_bytes={"indexer": 640}).slots_per_pool()["kv"] == 1
    only = config(dram_bytes=4096, pool_dram_bytes={"kv": 1536})
    assert only.slots_per_pool() == {"kv": 3}  # 1536 // 512, not 1536 / 512
    assert type(only.slots_per_pool()["kv"]) is int


def test_explicit_shares_that_leave_nothing_for_the_others_are_refused():
    two = (kv_pool(), indexer_pool())
    whole = config(pools=two, dram_bytes=1000, pool_dram_bytes={"indexer": 1000})
    assert refusal(whole.slots_per_pool) == "pool_dram_bytes leaves no dram_bytes for the other pools"
    one_byte = config(pools=two, dram_bytes=1001, pool_dram_bytes={"indexer": 1000})
    assert refusal(one_byte.slots_per_pool) == "dram for pool 'kv' holds no page of 512 bytes; raise dram_bytes"


# ---------------------------------------------------------------------------------------------- NodeSettings


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        *[("localhost", True), ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True)],
        *[("10.0.0.1", False), ("node-1", False), ("0.0.0.0", False), ("[fe80::1]", False), ("LOCALHOST", False)],
        ("X127.0.0.1", False),  # only brackets are stripped
    ],
)
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(control_port=0), "control_port must be in 1..65535, got 0"),
        (dict(control_port=65536), "control_port must be in 1..65535, got 65536"),
        (
            dict(control_host="0.0.0.0"),
            "control_advertise_host must be a dialable address when control_host is '0.0.0.0'",
        ),
        (
            dict(control_host="10.0.0.5", advertise_host="*"),
            "control_advertise_host must be a dialable address when control_host is '10.0.0.5'",
        ),
        (
            dict(control_host="10.0.0.5"),
            "control_host '10.0.0.5' is not loopback and neither auth_token_file nor node_key_file is set: any "
            "process that reaches it could read kvcr DRAM. Set one of them (recommended), or allow_unauthenticated: "
            "true to accept that",
        ),
        (dict(peer=PeerSettings(landing="nowhere")), "landing must be one of auto, direct, staged, got 'nowhere'"),
        (dict(peer=PeerSettings(max_pages_per_read=0)), "read_batch_pages must be positive, got 0"),
    ],
)
def test_node_settings_are_refused_naming_the_setting(changes, message):
    base = dict(control_host="127.0.0.1", control_port=5000)
    base.update(changes)
    assert refusal(NodeSettings, **base) == message


def test_node_settings_at_their_limits_are_accepted():
    for port in (1, 65535):
        assert NodeSettings("127.0.0.1", port).endpoint == f"tcp://127.0.0.1:{port}"
    assert NodeSettings("0.0.0.0", 5000, advertise_host="10.0.0.5", token=b"t").endpoint == "tcp://10.0.0.5:5000"
    assert NodeSettings("10.0.0.5", 5000, token=b"secret").token == b"secret"
    assert NodeSettings("10.0.0.5", 5000, allow_unauthenticated=True).allow_unauthenticated
    assert NodeSettings("127.0.0.1", 5000, peer=PeerSettings(max_pages_per_read=1)).peer.max_pages_per_read == 1


# ---------------------------------------------------------------------------------------------- RunnerNode


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def test_host_pools_are_registered_privately_once_and_again_only_when_they_change(cluster):
    node = cluster.node("A")
    calls = []
    real_register, real_deregister = node.data_plane.register, node.data_plane.deregister

    def register(regions, *, exposed):
        calls.append(("register", exposed))
        return real_register(regions, exposed=exposed)

    def deregister(ids):
        calls.append(("deregister", tuple(ids)))
        real_deregister(ids)

    node.data_plane.intercept("register", register)
    node.data_plane.intercept("deregister", deregister)
    ids = node.host_regions.ids("kv")
    assert len(ids) == 2
    node.register_host_pool("kv", node.hosts["kv"].regions)  # the same geometry: nothing happens
    assert calls == [] and node.host_regions.ids("kv") == ids
    moved = HostPool(kv_pool(), 32)
    node.register_host_pool("kv", moved.regions)
    assert calls == [("deregister", ids), ("register", False)]
    assert node.host_regions.ids("kv") != ids
    assert node.host_regions.ids("indexer") == ()


def test_a_node_closes_once_and_deregisters_only_when_quiescent(cluster):
    a = cluster.node("A")
    seed(a, sequence(1), [0])
    closed = []
    real_close, real_control = a.data_plane.close, a.control.close
    a.data_plane.intercept("close", lambda: closed.append("data plane") or real_close())
    a.control.intercept("close", lambda: closed.append("control") or real_control())
    a.close()
    a.close()
    assert closed == ["control", "data plane"]
    with pytest.raises(Exception, match="closed"):
        a.runner.exists("kv", sequence(1))


def test_staging_buffers_hold_read_batch_pages_and_their_number_is_bounded(cluster):
    node = cluster.node("B", peer=PeerSettings(max_pages_per_read=3, staging_buffers=1))
    assert node.staging.pages == 3
    first = node.staging.take(kv_pool())
    assert first is not None and first.regions[0].count == 3
    assert node.staging.take(kv_pool()) is None  # one buffer per pool at most
    node.staging.give_back(first)
