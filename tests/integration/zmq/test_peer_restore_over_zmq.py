"""Peer restore with the runner's real codec over real ZMQ sockets (the data plane stays the mock)."""

import pytest

from kvcr.adapters.local import MonotonicClock
from kvcr.adapters.zmq import ZmqControlChannel
from kvcr.domain.outcomes import Outcome
from kvcr.runner.peer_client import PeerSettings, PoolRead
from tests.contract.zmq_kind import free_port
from tests.support import Cluster, content, seed, sequence

pytestmark = pytest.mark.zmq

SETTINGS = PeerSettings(operation_s=2.0, abandon_s=4.0, lease_s=5.0, lease_margin_s=0.5, retry_after_s=1.0)


class ZmqCluster(Cluster):
    """Runner nodes on one mock fabric whose control channels are real ZMQ sockets on loopback."""

    def __init__(self):
        super().__init__(MonotonicClock(), lambda fabric, clock, port: ZmqControlChannel("127.0.0.1", port))

    def node(self, name, *, token=None, slots=16):
        return super().node(name, free_port(), token=token, slots=slots, settings=SETTINGS)


@pytest.fixture
def cluster():
    c = ZmqCluster()
    yield c
    c.close()


def outcomes_of(result):
    return [o.outcome for o in result["kv"]]


def test_a_target_restores_a_sources_pages_byte_equal(cluster):
    a, b = cluster.node("A", token=b"cluster-secret"), cluster.node("B", token=b"cluster-secret")
    assert a.endpoint.startswith("tcp://127.0.0.1:")
    pages = sequence(8)
    seed(a, pages, range(8))
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, list(range(20, 28)))])
    assert outcomes_of(result) == [Outcome.RESTORED] * 8
    for i, page in enumerate(pages):
        assert b.hosts["kv"].read_page(20 + i) == content(page, 512)
    assert a.runner.active_leases == 0  # RELEASE travelled over ZMQ too
    # A second restore reuses the HELLO link and the pooled connection.
    b.hosts["kv"].zero_page(20)
    assert outcomes_of(b.client.restore(a.endpoint, [PoolRead("kv", pages[:1], [20])])) == [Outcome.RESTORED]
    assert b.hosts["kv"].read_page(20) == content(pages[0], 512)


def test_a_wrong_cluster_token_is_refused(cluster):
    a = cluster.node("A", token=b"cluster-secret")
    b = cluster.node("B", token=b"wrong")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])
    assert outcomes_of(result) == [Outcome.MISS, Outcome.MISS]
    assert b.hosts["kv"].read_page(5) == bytes(512)
    assert not b.client._links  # never got HELLO_REPLY, so never learnt A's data-plane metadata
    assert a.runner.stats().counters["kvcr_peer_refused_total{reason=auth}"] == 1
    assert b.runner.stats().counters["kvcr_peer_refusals_total"] == 1
    assert a.runner.active_leases == 0


def test_a_dead_source_is_a_quick_miss(cluster):
    a, b = cluster.node("A"), cluster.node("B")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    endpoint = a.endpoint
    a.close()
    result = b.client.restore(endpoint, [PoolRead("kv", pages, [5, 6])])
    assert outcomes_of(result) == [Outcome.MISS, Outcome.MISS]
    assert b.runner.stats().counters["kvcr_peer_failures_total"] == 1
