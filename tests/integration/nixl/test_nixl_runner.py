"""The runner's peer restore over real NIXL data planes (control messages over the mock fabric).

Nodes are built through the composition root with the NIXL transport; the two agents live in
this process (CMA between them), or are limited to tcp, where reads from the peer have late
writes and the runner lands them in its staging memory before copying them into host pages.
"""

import contextlib
import os

import pytest

from kvcr.domain.keys import NamespaceSpec
from kvcr.domain.outcomes import Outcome
from kvcr.runner import RunnerConfig
from kvcr.runner.peer_client import PoolRead
from tests.integration.nixl.support import LOOPBACK
from tests.support import HostPool, content, free_port, kv_pool, seed, sequence

pytestmark = pytest.mark.nixl

PIECE = 16 * 1024


@contextlib.contextmanager
def ucx_tls(value):
    """UCX reads UCX_TLS when an agent is built: limit the agents built inside to ``value``."""
    before = os.environ.get("UCX_TLS")
    if value is not None:
        os.environ["UCX_TLS"] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("UCX_TLS", None)
        else:
            os.environ["UCX_TLS"] = before


@pytest.fixture
def nodes():
    from kvcr.adapters.mock import MockFabric
    from kvcr.adapters.nixl import NixlDataPlane
    from kvcr.container import build_container
    from kvcr.runner.node import NodeSettings

    fabric, made = MockFabric(), []

    def make(name):
        pools = (kv_pool(PIECE),)
        namespace = NamespaceSpec("m", 4, "bf16", "page_first")
        # One peer restores up to the pool's lease cap here (8 of 16 slots): no per-peer share below it.
        config = RunnerConfig(name, namespace, pools, dram_bytes=16 * pools[0].page_bytes, max_peer_leased_fraction=1.0)
        settings = NodeSettings("127.0.0.1", free_port(), close_lease_wait_s=0.2)
        container = build_container(config, node=settings, transport="nixl", control="mock", memory="mock")
        container.fabric.override(fabric)
        plane = NixlDataPlane(name, backend_params=LOOPBACK)
        assert plane.transport_report is not None  # probed under the UCX_TLS the agent was built with
        container.data_plane.override(plane)
        node = container.node()
        node.plane = plane
        node.hosts = {p.name: HostPool(p, 32) for p in pools}
        for pool, host in node.hosts.items():
            node.register_host_pool(pool, host.regions)
        made.append(node)
        return node

    yield make
    for node in made:
        with contextlib.suppress(Exception):
            node.close()


@pytest.mark.parametrize("tls", [None, "tcp"], ids=["cma", "tcp"])
def test_a_restore_over_nixl_lands_the_source_pages_in_host_pages(nodes, tls):
    with ucx_tls(tls):
        a, b = nodes("A"), nodes("B")
    pages = sequence(8)
    seed(a, pages, range(8))
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, list(range(20, 28)))])
    assert [o.outcome for o in result["kv"]] == [Outcome.RESTORED] * 8
    page_bytes = b.hosts["kv"].pool.page_bytes
    for i, page in enumerate(pages):
        assert b.hosts["kv"].read_page(20 + i) == content(page, page_bytes)
    # What made the runner stage (tcp) or read straight into host pages (CMA):
    assert b.plane.connect(a.plane.describe(), 5.0).late_writes is (tls == "tcp")
    assert a.runner.active_leases == 0
