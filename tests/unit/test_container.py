"""The composition root wires real adapters by config and lets tests override them."""

import pytest
from dependency_injector import errors as di_errors

from kvcr.adapters.local import MmapHostMemory, NullInventory, RecordingInventory
from kvcr.adapters.mock import FakeClock, MockHostMemory
from kvcr.container import Container, build_container
from kvcr.runner import KvcrRunner
from tests.support import kv_pool, runner_config


def test_defaults_build_a_runner_on_real_memory():
    container = build_container(runner_config((kv_pool(),), 4))
    runner = container.runner()
    assert isinstance(runner, KvcrRunner)
    assert isinstance(container.memory(), MmapHostMemory)
    assert isinstance(container.inventory(), NullInventory)
    assert container.runner() is runner
    runner.close()


def test_selectors_pick_adapters_by_name():
    container = build_container(runner_config((kv_pool(),), 4), memory="mock", clock="fake", inventory="recording")
    assert isinstance(container.memory(), MockHostMemory)
    assert isinstance(container.clock(), FakeClock)
    assert isinstance(container.inventory(), RecordingInventory)
    container.runner().close()


def test_override_swaps_an_adapter():
    container = build_container(runner_config((kv_pool(),), 4))
    memory = MockHostMemory()
    with container.memory.override(memory):
        runner = container.runner()
    assert memory.live_allocations == 1
    runner.close()
    assert memory.live_allocations == 0


def test_strict_config_refuses_missing_keys_and_wrong_types():
    container = Container()
    container.config.from_dict({"memory": "mock", "clock": "fake", "inventory": "none"})
    with pytest.raises(di_errors.Error):
        container.runner()
    bad = build_container(runner_config((kv_pool(),), 4))
    bad.runner_config.override({"name": "not a RunnerConfig"})
    with pytest.raises(di_errors.Error, match="RunnerConfig"):
        bad.runner()  # typed: nothing downstream ever sees the wrong type


@pytest.fixture
def mock_pair():
    """Containers A (16 slots, holding ``pages`` backed up in slots 0..) and B (8) on one mock fabric."""
    from types import SimpleNamespace

    from kvcr.runner.node import NodeSettings
    from tests.support import HostPool, content, sequence

    pool = kv_pool()
    choices = dict(memory="mock", transport="mock", control="mock")
    # 16 slots: a peer may pin a quarter of a pool (half of its lease cap), here 4 pages
    a = build_container(runner_config((pool,), 16, name="A"), node=NodeSettings("127.0.0.1", 7000), **choices)
    b = build_container(runner_config((pool,), 8, name="B"), node=NodeSettings("127.0.0.1", 7100), **choices)
    b.fabric.override(a.fabric())
    node_a, node_b = a.node(), b.node()
    host_a, host_b = HostPool(pool, 8), HostPool(pool, 8)
    node_a.register_host_pool("kv", host_a.regions)
    node_b.register_host_pool("kv", host_b.regions)

    def seed(n):
        pages = sequence(n)
        for i, page in enumerate(pages):
            host_a.write_page(i, content(page, pool.page_bytes))
        assert all(node_a.runner.backup("kv", pages, list(range(n))))
        return pages

    try:
        yield SimpleNamespace(pool=pool, a=a, b=b, node_a=node_a, node_b=node_b, host_b=host_b, seed=seed)
    finally:
        node_a.close()
        node_b.close()


def test_two_nodes_on_one_mock_fabric_restore_through_the_container(mock_pair):
    from kvcr.domain.outcomes import Outcome
    from kvcr.runner.peer_client import PoolRead
    from tests.support import content

    pages = mock_pair.seed(3)
    result = mock_pair.node_b.client.restore(mock_pair.node_a.endpoint, [PoolRead("kv", pages, [5, 6, 7])])
    assert [o.outcome for o in result["kv"]] == [Outcome.RESTORED] * 3
    assert mock_pair.host_b.read_page(7) == content(pages[2], mock_pair.pool.page_bytes)


def test_node_settings_refuse_undialable_endpoints():
    from kvcr.domain.errors import ConfigError
    from kvcr.runner.node import NodeSettings

    with pytest.raises(ConfigError, match="control_port"):
        NodeSettings("127.0.0.1", 0)
    with pytest.raises(ConfigError, match="control_advertise_host"):
        NodeSettings("0.0.0.0", 5000, token=b"t" * 16)
    assert NodeSettings("0.0.0.0", 5000, advertise_host="10.1.2.3", token=b"t" * 16).endpoint == "tcp://10.1.2.3:5000"


def test_a_routable_bind_without_a_token_needs_an_explicit_opt_in():
    from kvcr.domain.errors import ConfigError
    from kvcr.runner.node import NodeSettings

    with pytest.raises(ConfigError, match="allow_unauthenticated"):
        NodeSettings("0.0.0.0", 5000, advertise_host="10.1.2.3")
    with pytest.raises(ConfigError, match="allow_unauthenticated"):
        NodeSettings("10.1.2.3", 5000)
    NodeSettings("10.1.2.3", 5000, allow_unauthenticated=True)
    NodeSettings("127.0.0.1", 5000)
    NodeSettings("::1", 5000)


def test_the_restorer_the_container_builds_reads_from_peers_and_the_local_one_does_not(mock_pair):
    from kvcr.runner.restore import Source
    from tests.support import content

    pages = mock_pair.seed(2)
    b = mock_pair.b
    source = {"kv": Source(mock_pair.node_a.endpoint)}
    restorer = b.restorer()
    assert restorer is b.restorer() and b.prefetch_book() is b.prefetch_book()
    assert b.local_restorer().presence(pages, ["kv"], source) == {"kv": [False, False]}
    assert restorer.presence(pages, ["kv"], source, request="r1") == {"kv": [True, True]}
    assert restorer.read({"kv": (pages, [3, 4])}, source).restored == {"kv": [True, True]}
    assert mock_pair.host_b.read_page(4) == content(pages[1], mock_pair.pool.page_bytes)
