"""Peer restore over real ZMQ sockets with CURVE (the data plane stays the mock): the fabric's auth."""

import time

import pytest

from kvcr.adapters.local import MonotonicClock
from kvcr.domain.deadlines import Timing
from kvcr.domain.outcomes import Outcome
from kvcr.runner.peer_client import PoolRead
from tests.support import Cluster, content, seed, sequence

pytestmark = pytest.mark.zmq

TIMING = Timing(operation_s=2.0, abandon_s=4.0, control_s=1.0, lease_s=5.0, lease_margin_s=0.5, retry_after_s=1.0)
TOKEN = b"cluster-secret-0123456789"


class ZmqCluster(Cluster):
    """Runner nodes on one mock fabric whose control channels are real ZMQ sockets on loopback."""

    def __init__(self):
        super().__init__(MonotonicClock(), control="zmq")

    def node(self, name, *, token=None, slots=16):
        return super().node(name, token=token, slots=slots, timing=TIMING)


@pytest.fixture
def cluster():
    c = ZmqCluster()
    yield c
    c.close()


def outcomes_of(result):
    return [o.outcome for o in result["kv"]]


def test_a_target_restores_a_sources_pages_byte_equal(cluster):
    a, b = cluster.node("A", token=TOKEN), cluster.node("B", token=TOKEN)
    assert a.endpoint.startswith("tcp://127.0.0.1:")
    pages = sequence(8)
    seed(a, pages, range(8))
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, list(range(20, 28)))])
    assert outcomes_of(result) == [Outcome.RESTORED] * 8
    for i, page in enumerate(pages):
        assert b.hosts["kv"].read_page(20 + i) == content(page, 512)
    deadline = time.monotonic() + 2
    while a.runner.active_leases and time.monotonic() < deadline:  # RELEASE is one-way over ZMQ
        time.sleep(0.01)
    assert a.runner.active_leases == 0
    # A second restore reuses the HELLO link and the pooled connection.
    b.hosts["kv"].zero_page(20)
    assert outcomes_of(b.client.restore(a.endpoint, [PoolRead("kv", pages[:1], [20])])) == [Outcome.RESTORED]
    assert b.hosts["kv"].read_page(20) == content(pages[0], 512)


@pytest.mark.parametrize("their_token", [b"another-cluster-0123456789", None])
def test_a_peer_without_the_cluster_token_gets_nothing_at_all(cluster, their_token):
    a = cluster.node("A", token=TOKEN)
    b = cluster.node("B", token=their_token)
    pages = sequence(2)
    seed(a, pages, [0, 1])
    started = time.monotonic()
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])
    assert time.monotonic() - started < TIMING.control_s + 0.5
    assert outcomes_of(result) == [Outcome.MISS, Outcome.MISS]
    assert b.hosts["kv"].read_page(5) == bytes(512)
    assert b.client.links == 0  # never got a HELLO reply, so never learnt A's data-plane description
    assert a.runner.active_leases == 0
    deadline = time.monotonic() + 3  # the server counts when its socket monitor reports the failure
    while not sum(a.control.refusals.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sum(a.control.refusals.values()) >= 1  # CURVE refused it, and counted it
    refused = {k: v for k, v in a.metrics.snapshot().items() if k.startswith("kvcr_peer_requests_refused_total")}
    assert sum(refused.values()) >= 1, refused


def test_a_dead_source_is_a_quick_miss(cluster):
    a, b = cluster.node("A"), cluster.node("B")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    endpoint = a.endpoint
    a.close()
    started = time.monotonic()
    result = b.client.restore(endpoint, [PoolRead("kv", pages, [5, 6])])
    assert outcomes_of(result) == [Outcome.MISS, Outcome.MISS]
    assert time.monotonic() - started < TIMING.control_s + 0.5
    assert b.metrics.snapshot()["kvcr_failures_total{path=remote_restore,reason=peer_unavailable}"] == 1


def test_a_target_whose_control_connection_was_replaced_says_hello_again_and_restores(cluster):
    """Sessions are bound to the connection that opened them: a new connection finds the old session
    refused (as unknown) and the target opens a fresh one, without a miss."""
    a, b = cluster.node("A", token=TOKEN), cluster.node("B", token=TOKEN)
    pages = sequence(2)
    seed(a, pages, [0, 1])
    assert outcomes_of(b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])) == [Outcome.RESTORED] * 2
    b.control.forget(a.endpoint)  # its connection closes; the peer link (and its session id) stays
    b.hosts["kv"].zero_page(5)
    assert outcomes_of(b.client.restore(a.endpoint, [PoolRead("kv", pages[:1], [5])])) == [Outcome.RESTORED]
    assert b.hosts["kv"].read_page(5) == content(pages[0], 512)
    snapshot = a.metrics.snapshot()
    assert snapshot.get("kvcr_peer_requests_refused_total{reason=foreign_session}", 0) == 1
