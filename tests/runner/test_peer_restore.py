"""Peer restore over the mock fabric: LEASE + one-sided READ + RELEASE, and every failure rule."""

import pytest

from kvcr.adapters.mock import (
    ControlFaults,
    Faults,
    MockControlChannel,
)
from kvcr.domain.outcomes import Outcome
from kvcr.runner.peer_client import PeerSettings, PoolRead
from tests.support import Cluster as SharedCluster
from tests.support import content, indexer_pool, kv_pool, seed, sequence

SETTINGS = PeerSettings(operation_s=2.0, abandon_s=4.0, lease_s=5.0, lease_margin_s=0.5, retry_after_s=1.0)


class Cluster(SharedCluster):
    """The shared mock cluster with this module's peer timing by default."""

    def node(self, name, port, *, settings=SETTINGS, **kwargs):
        return super().node(name, port, settings=settings, **kwargs)


@pytest.fixture
def cluster():
    c = Cluster()
    yield c
    c.close()


def outcomes_of(result, pool="kv"):
    return [o.outcome for o in result[pool]]


def test_target_restores_source_pages_into_its_own_host_pages(cluster):
    a, b = cluster.node("A", 9000), cluster.node("B", 9100)
    pages = sequence(8)
    seed(a, pages, range(8))
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, list(range(20, 28)))])
    assert outcomes_of(result) == [Outcome.RESTORED] * 8
    for i, page in enumerate(pages):
        assert b.hosts["kv"].read_page(20 + i) == content(page, 512)
    assert a.runner.active_leases == 0  # released after the read
    assert b.runner.query("kv", pages).prefix == 0  # delivery lands in host pages, not in B's tier


def test_multi_pool_restore_in_one_transfer(cluster):
    pools = (kv_pool(), indexer_pool())
    a, b = cluster.node("A", 9000, pools=pools), cluster.node("B", 9100, pools=pools)
    pages = sequence(4)
    seed(a, pages, range(4))
    seed(a, pages[:3], range(3), pool="indexer", salt="i")
    result = b.client.restore(
        a.endpoint, [PoolRead("kv", pages, [10, 11, 12, 13]), PoolRead("indexer", pages, [10, 11, 12, 13])]
    )
    assert outcomes_of(result) == [Outcome.RESTORED] * 4
    assert outcomes_of(result, "indexer") == [Outcome.RESTORED] * 3 + [Outcome.MISS]
    assert b.hosts["indexer"].read_page(12) == content(pages[2], 64, "i")


def test_stale_hint_pages_the_source_evicted_are_misses(cluster):
    a, b = cluster.node("A", 9000, slots=4), cluster.node("B", 9100)
    old = sequence(4)
    seed(a, old, range(4))
    seed(a, sequence(2, start=999), [4, 5])  # evicts old[3] and old[2]
    result = b.client.restore(a.endpoint, [PoolRead("kv", old, [10, 11, 12, 13])])
    assert outcomes_of(result) == [Outcome.RESTORED, Outcome.RESTORED, Outcome.MISS, Outcome.MISS]


def test_namespace_mismatch_is_an_incompatible_peer(cluster):
    a, b = cluster.node("A", 9000), cluster.node("B", 9100, model="other-model")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])
    assert outcomes_of(result) == [Outcome.MISS, Outcome.MISS]
    assert b.hosts["kv"].read_page(5) == bytes(512)
    assert a.runner.stats().counters["kvcr_peer_refused_total{reason=namespace}"] == 1


def test_wrong_token_is_refused_and_learns_no_metadata(cluster):
    a = cluster.node("A", 9000, token=b"cluster-secret")
    b = cluster.node("B", 9100, token=b"wrong")
    c = cluster.node("C", 9200)  # no token at all
    pages = sequence(2)
    seed(a, pages, [0, 1])
    for target in (b, c):
        result = target.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])
        assert outcomes_of(result) == [Outcome.MISS, Outcome.MISS]
        assert not target.client._links  # never got HELLO_REPLY, so never connected A's data plane
    assert a.runner.stats().counters["kvcr_peer_refused_total{reason=auth}"] == 2
    assert a.runner.active_leases == 0
    good = cluster.node("D", 9300, token=b"cluster-secret")
    assert outcomes_of(good.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])) == [Outcome.RESTORED] * 2


def test_dead_peer_is_a_miss_and_is_not_dialled_again_at_once(cluster):
    a, b = cluster.node("A", 9000), cluster.node("B", 9100)
    pages = sequence(2)
    seed(a, pages, [0, 1])
    cluster.fabric.kill("A")
    cluster.fabric.kill(a.endpoint)
    assert outcomes_of(b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])) == [Outcome.MISS] * 2
    served = b.runner.stats().counters["kvcr_peer_failures_total"]
    b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])
    assert b.runner.stats().counters["kvcr_peer_failures_total"] == served  # skipped during retry_after


def test_source_dies_between_lease_and_read(cluster):
    a, b = cluster.node("A", 9000), cluster.node("B", 9100)
    pages = sequence(3)
    seed(a, pages, range(3))
    lease = b.client.lease(a.endpoint, [("kv", p) for p in pages])
    assert lease is not None and len(lease.slots) == 3
    cluster.fabric.kill("A")
    result = b.client.read(lease, [PoolRead("kv", pages, [5, 6, 7])])
    assert outcomes_of(result) == [Outcome.MISS] * 3
    b.client.release(lease)


def test_a_stalled_read_times_out_as_failure_within_the_deadline(cluster):
    a = cluster.node("A", 9000, faults=Faults(stall=True))
    b = cluster.node("B", 9100)
    pages = sequence(2)
    seed(a, pages, [0, 1])
    start = cluster.clock.now()
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])
    assert outcomes_of(result) == [Outcome.FAILED] * 2
    assert cluster.clock.now() - start <= SETTINGS.operation_s + 0.01
    assert b.client.quarantined == 0


def test_a_read_that_cannot_be_cancelled_is_uncertain_and_quarantined(cluster):
    a = cluster.node("A", 9000, faults=Faults(stall=True, uncertain_cancel=True))
    b = cluster.node("B", 9100)
    pages = sequence(2)
    seed(a, pages, [0, 1])
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])
    assert outcomes_of(result) == [Outcome.UNCERTAIN] * 2
    assert b.client.quarantined == 1
    with pytest.raises(Exception, match="not terminal"):
        b.close()  # the destination may still be written: kvcr keeps its memory


def test_a_read_finishing_after_the_lease_is_not_accepted(cluster):
    slow = PeerSettings(operation_s=10.0, abandon_s=20.0, lease_s=2.0, lease_margin_s=0.5)
    a = cluster.node("A", 9000, faults=Faults(latency_s=1.8), settings=slow)
    b = cluster.node("B", 9100, settings=slow)
    pages = sequence(1)
    seed(a, pages, [0])
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [5])])
    assert outcomes_of(result) == [Outcome.FAILED]
    assert "lease" in result["kv"][0].reason


def test_partial_and_corrupt_reads(cluster):
    a = cluster.node("A", 9000, faults=Faults(partial_runs=1))
    b = cluster.node("B", 9100)
    pages = sequence(2)
    seed(a, pages, [0, 1])
    assert outcomes_of(b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])) == [Outcome.FAILED] * 2

    verify = PeerSettings(operation_s=2.0, abandon_s=4.0, lease_s=5.0, verify_bytes=True)
    c = cluster.node("C", 9200, faults=Faults(corrupt=True), settings=verify)
    d = cluster.node("D", 9300, settings=verify)
    seed(c, pages, [0, 1])
    result = d.client.restore(c.endpoint, [PoolRead("kv", pages, [5, 6])])
    # The fault flips the first byte of each merged run: page 0 is damaged, page 1 arrives intact.
    assert outcomes_of(result) == [Outcome.FAILED, Outcome.RESTORED]
    assert "checksum" in result["kv"][0].reason
    c.data_plane.set_faults(Faults())
    assert outcomes_of(d.client.restore(c.endpoint, [PoolRead("kv", pages, [5, 6])])) == [Outcome.RESTORED] * 2


def test_leases_pin_pages_until_released_or_expired(cluster):
    a, b = cluster.node("A", 9000, slots=2), cluster.node("B", 9100)
    pages = sequence(2)
    seed(a, pages, [0, 1])
    lease = b.client.lease(a.endpoint, [("kv", p) for p in pages])
    newer = sequence(2, start=5000)
    for page, slot in zip(newer, [2, 3], strict=True):
        a.hosts["kv"].write_page(slot, content(page, 512))
    assert a.runner.backup("kv", newer, [2, 3]) == [False, False]  # leased pages cannot be evicted
    cluster.clock.advance(SETTINGS.lease_s)
    assert a.runner.backup("kv", newer, [2, 3]) == [True, True]  # expired on the source's clock
    result = b.client.read(lease, [PoolRead("kv", pages, [5, 6])])
    assert outcomes_of(result) == [Outcome.MISS] * 2  # the target's lease rule refuses the late read
    b.client.release(lease)


def test_control_timeouts_and_garbage_are_misses(cluster):
    a, b = cluster.node("A", 9000), cluster.node("B", 9100)
    seed(a, sequence(1), [0])
    channel = MockControlChannel(cluster.fabric, a.endpoint, cluster.clock, ControlFaults(stall=True))
    result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])
    assert outcomes_of(result) == [Outcome.MISS]
    cluster.clock.advance(SETTINGS.retry_after_s)
    channel.set_faults(ControlFaults(garble=True))
    assert outcomes_of(b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])) == [Outcome.MISS]
    channel.set_faults(ControlFaults())
    cluster.clock.advance(SETTINGS.retry_after_s)
    assert outcomes_of(b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])) == [Outcome.RESTORED]


def test_a_restarted_source_is_reconnected(cluster):
    a, b = cluster.node("A", 9000), cluster.node("B", 9100)
    pages = sequence(2)
    seed(a, pages, [0, 1])
    assert outcomes_of(b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])) == [Outcome.RESTORED] * 2
    a.close()
    a2 = cluster.node("A", 9000)
    seed(a2, pages, [2, 3])
    b.hosts["kv"].zero_page(5)
    assert outcomes_of(b.client.restore(a2.endpoint, [PoolRead("kv", pages, [5, 6])])) == [Outcome.RESTORED] * 2
    assert b.hosts["kv"].read_page(5) == content(pages[0], 512)


def test_reads_are_split_into_batches_and_stop_after_a_failed_one(cluster):
    small = PeerSettings(operation_s=2.0, abandon_s=4.0, lease_s=5.0, max_pages_per_read=3)
    a, b = cluster.node("A", 9000, settings=small), cluster.node("B", 9100, settings=small)
    pages = sequence(7)
    seed(a, pages, range(7))
    lease = b.client.lease(a.endpoint, [("kv", p) for p in pages])
    result = b.client.read(lease, [PoolRead("kv", pages, list(range(20, 27)))])
    assert outcomes_of(result) == [Outcome.RESTORED] * 7
    assert all(b.hosts["kv"].read_page(20 + i) == content(p, 512) for i, p in enumerate(pages))
    a.data_plane.set_faults(Faults(partial_runs=0))  # every transfer from now on fails
    b.client.release(lease)
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, list(range(30, 37)))])
    assert outcomes_of(result) == [Outcome.FAILED] * 3 + [Outcome.MISS] * 4
