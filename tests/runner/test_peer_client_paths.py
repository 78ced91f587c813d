"""The target side, path by path: every way a peer fails, what the caller gets, what is counted, who is skipped.

Two nodes (or a node and a scripted "rogue" control endpoint) on the mock fabric with a fake clock.
Each failure must be a miss with its own reason, counted under its own failure reason, and must
skip the peer for ``retry_after_s`` (an operator reads why in one log line).
"""

import logging
import secrets
import threading
import time

import pytest

from kvcr.adapters.mock import ControlFaults, FakeClock, Faults, MockControlChannel
from kvcr.domain.deadlines import Timing
from kvcr.domain.layout import ComponentSpec
from kvcr.domain.outcomes import Outcome
from kvcr.domain.pools import PoolSpec
from kvcr.ports.errors import TransportError
from kvcr.runner import protocol
from kvcr.runner.peer_client import PeerSettings, PoolRead, RemoteLease
from kvcr.runner.protocol import HelloReply, LeaseReply, RefusalCode, Refused
from tests.support import Cluster, content, indexer_pool, kv_pool, seed, sequence

TIMING = Timing(operation_s=2.0, abandon_s=4.0, control_s=0.25, lease_s=5.0, lease_margin_s=0.5, retry_after_s=1.0)
KV = kv_pool()


@pytest.fixture
def cluster():
    c = Cluster()
    c.make = lambda name, **kw: c.node(name, timing=kw.pop("timing", TIMING), **kw)
    yield c
    c.close()


class CoarseClock(FakeClock):
    """A fake clock whose every sleep moves it a quarter second: each time a read takes is exact."""

    def sleep(self, seconds):
        self.advance(0.25)


@pytest.fixture
def coarse():
    c = Cluster(clock=CoarseClock())
    c.make = lambda name, **kw: c.node(name, timing=kw.pop("timing", TIMING), **kw)
    yield c
    c.close()


def counter(node, key):
    return node.metrics.snapshot().get(key, 0)


def failures(node, reason):
    return counter(node, f"kvcr_failures_total{{path=remote_restore,reason={reason}}}")


def misses(node):
    return counter(node, "kvcr_pages_total{outcome=miss,path=remote_restore}")


def reasons(result, pool="kv"):
    return [o.reason for o in result[pool]]


def skipped(caplog, endpoint):
    """The reasons logged for skipping ``endpoint``, in order."""
    prefix = f"kvcr: peer {endpoint} skipped for 1.0s: "
    return [m[len(prefix) :] for m in caplog.messages if m.startswith(prefix)]


class Rogue:
    """A scripted control endpoint: ``answer(request) -> reply frame | None`` sees every decoded request."""

    def __init__(self, cluster, answer, port=1990):
        self.calls = []
        self.channel = MockControlChannel(cluster.fabric, f"tcp://127.0.0.1:{port}", cluster.clock)
        self.endpoint = self.channel.endpoint

        def serve(frame):
            request = protocol.decode(frame)
            self.calls.append(request)
            return answer(request)

        self.channel.serve(serve)


def proxy(source, change_hello=None, change_lease=None):
    """Answer the way ``source`` does, then let the test change HELLO or LEASE replies."""

    def answer(request):
        frame = source.server.handle(protocol.encode(request))
        if frame is None:  # RELEASE is one-way
            return None
        reply = protocol.decode(frame)
        if isinstance(reply, HelloReply) and change_hello:
            reply = change_hello(reply)
        if isinstance(reply, LeaseReply) and change_lease:
            reply = change_lease(reply)
        return protocol.encode(reply)

    return answer


# ---------------------------------------------------------------------------------------------- control failures


def refuse(code):
    return lambda request: protocol.encode(Refused(request.nonce, code))


def silent(request):
    return None  # the mock control channel turns this into PeerRefused


def unbound(request):
    return protocol.encode(HelloReply(secrets.token_bytes(16), 1, "x", b"{}", [], 1000))  # answers another nonce


@pytest.mark.parametrize(
    ("answer", "why", "reason"),
    [
        (lambda r: b"\x00garbage", ["unreadable reply"], "peer_unavailable"),
        (silent, ["refused: {endpoint} sent no reply to a request"], "peer_unavailable"),
        (refuse(int(RefusalCode.CLOSING)), ["refused (closing)"], "peer_refused"),
        (refuse(99), ["refused (unknown)"], "peer_refused"),
        (refuse(int(RefusalCode.NAMESPACE)), ["refused (namespace)", "no pool namespace in common"], "peer_refused"),
        (unbound, ["reply does not answer our request"], "unbound_reply"),
        (lambda r: protocol.encode(protocol.Release(1, [])), ["reply does not answer our request"], "unbound_reply"),
        (
            lambda r: protocol.encode(
                HelloReply(r.nonce, 1, "x", b"{}", [protocol.PoolWire(0, "kv", "0" * 16, [1, 2], [256, 256], 4)], 1000)
            ),
            ["no pool namespace in common"],
            "peer_unavailable",
        ),
    ],
)
def test_a_failing_hello_is_a_miss_and_skips_the_peer_for_the_retry_window(cluster, caplog, answer, why, reason):
    b = cluster.make("B")
    rogue = Rogue(cluster, answer)
    with caplog.at_level(logging.INFO, logger="kvcr.runner"):
        result = b.client.restore(rogue.endpoint, [PoolRead("kv", sequence(2), [5, 6])])
    assert reasons(result) == ["peer unavailable"] * 2
    assert skipped(caplog, rogue.endpoint) == [w.format(endpoint=rogue.endpoint) for w in why]
    assert failures(b, reason) == 1 or reason == "peer_unavailable"
    assert failures(b, "peer_unavailable") == len(why)  # one per skip
    assert counter(b, "kvcr_peers_quarantined") == 1
    assert b.client.links == 0
    b.client.restore(rogue.endpoint, [PoolRead("kv", sequence(2), [5, 6])])
    assert len(rogue.calls) == 1  # skipped: not dialled again inside the window
    cluster.clock.advance(TIMING.retry_after_s)
    b.client.restore(rogue.endpoint, [PoolRead("kv", sequence(2), [5, 6])])
    assert len(rogue.calls) == 2  # dialled again once it ended


@pytest.mark.parametrize(
    ("faults", "why"),
    [
        (ControlFaults(down=True), "nothing answers at {endpoint}"),
        (ControlFaults(stall=True), "{endpoint} did not answer within 0.25s"),
        (ControlFaults(garble=True), "unreadable reply"),
    ],
)
def test_an_unreachable_stalled_or_garbling_peer_is_skipped_saying_why(cluster, caplog, faults, why):
    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(1), [0])
    a.control.set_faults(faults)
    with caplog.at_level(logging.INFO, logger="kvcr.runner"):
        result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])
    assert reasons(result) == ["peer unavailable"]
    assert skipped(caplog, a.endpoint) == [why.format(endpoint=a.endpoint)]
    assert failures(b, "peer_unavailable") == 1


def test_a_peer_whose_data_plane_cannot_be_reached_is_skipped(cluster, caplog):
    a, b = cluster.make("A"), cluster.make("B")
    rogue = Rogue(cluster, proxy(a, change_hello=lambda r: HelloReply(r.nonce, r.session, "x", b"{}", r.pools, 1000)))
    with caplog.at_level(logging.INFO, logger="kvcr.runner"):
        assert b.client.lease(rogue.endpoint, [("kv", sequence(1))]) is None
    (why,) = skipped(caplog, rogue.endpoint)
    assert why.startswith("cannot connect its data plane: unreadable peer description")
    assert b.client.links == 0


def test_connecting_a_data_plane_gets_the_rest_of_the_deadline_at_most_connect_s(cluster):
    a = cluster.make("A")
    b = cluster.make("B", timing=Timing(operation_s=2.0, abandon_s=4.0, control_s=0.25, connect_s=1.5))
    seen = []
    real = b.data_plane.connect

    def connect(description, timeout_s):
        seen.append(timeout_s)
        return real(description, timeout_s)

    b.data_plane.intercept("connect", connect)
    b.client.lease(a.endpoint, [("kv", sequence(1))])
    assert seen == [1.5]
    slow = cluster.make("C", timing=Timing(operation_s=0.6, abandon_s=4.0, control_s=0.25, connect_s=1.5))
    slow.data_plane.intercept("connect", connect)
    slow.client.lease(a.endpoint, [("kv", sequence(1))])
    assert seen[1] == pytest.approx(0.6)  # the operation deadline is the tighter bound


def test_a_restarted_source_is_asked_again_once_and_only_once(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(1), [0])
    answer = proxy(a)
    forgets = Rogue(
        cluster,
        lambda r: (
            protocol.encode(Refused(r.nonce, int(RefusalCode.UNKNOWN_SESSION)))
            if isinstance(r, protocol.Lease)
            else answer(r)
        ),
    )
    assert b.client.lease(forgets.endpoint, [("kv", sequence(1))]) is None
    kinds = [type(c).__name__ for c in forgets.calls]
    assert kinds == ["Hello", "Lease", "Hello", "Lease"]  # one fresh HELLO after UNKNOWN_SESSION, no third
    assert failures(b, "peer_refused") == 2 and failures(b, "peer_unavailable") == 0  # not skipped for it


def restarted(cluster, a, pages):
    """A new process at A's address (A goes away, another starts: a new incarnation, other bytes)."""
    a.close()
    a2 = cluster.make("A", port=int(a.endpoint.rsplit(":", 1)[1]))
    seed(a2, pages, range(len(pages)), salt="restarted")
    return a2


def test_a_lease_of_the_old_incarnation_is_a_miss_and_the_new_one_that_answered_hello_is_not_skipped(cluster, caplog):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    old = b.client.lease(a.endpoint, [("kv", pages[:1])])  # booked at hit-query time, not read yet
    a2 = restarted(cluster, a, pages)
    with caplog.at_level(logging.INFO):
        new = b.client.lease(a2.endpoint, [("kv", pages[1:])])  # UNKNOWN_SESSION, then HELLO: the new process
        assert new is not None and new.link.incarnation != old.link.incarnation
        stale = b.client.read(old, [PoolRead("kv", pages[:1], [5])])
        assert reasons(stale) == ["the source restarted since the lease"]
        assert b.hosts["kv"].read_page(5) == bytes(512)  # nothing was read under the old slots
        fresh = b.client.read(new, [PoolRead("kv", pages[1:], [6])])
    assert [o.outcome for o in fresh["kv"]] == [Outcome.RESTORED]
    assert b.hosts["kv"].read_page(6) == content(pages[1], 512, "restarted")
    assert skipped(caplog, a2.endpoint) == [] and failures(b, "peer_unavailable") == 0
    assert b.client.lease(a2.endpoint, [("kv", pages)]) is not None


def test_an_old_incarnations_read_failing_after_the_new_one_answered_hello_skips_nothing(cluster, caplog):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    old = b.client.lease(a.endpoint, [("kv", pages[:1])])
    later = {}
    real = b.data_plane.read

    def restart_while_reading(*args, **kwargs):
        handle = real(*args, **kwargs)  # posted to the old process ...
        if not later:  # ... which dies; another request's hit query meets the new one
            later["a2"] = restarted(cluster, a, pages)
            later["lease"] = b.client.lease(a.endpoint, [("kv", pages[1:])])
        return handle

    b.data_plane.intercept("read", restart_while_reading)
    with caplog.at_level(logging.INFO):
        stale = b.client.read(old, [PoolRead("kv", pages[:1], [5])])
        assert not any(o.restored for o in stale["kv"])
        assert later["lease"] is not None
        fresh = b.client.read(later["lease"], [PoolRead("kv", pages[1:], [6])])
    assert [o.outcome for o in fresh["kv"]] == [Outcome.RESTORED]  # its link was not dropped for the old read
    assert b.hosts["kv"].read_page(6) == content(pages[1], 512, "restarted")
    assert skipped(caplog, a.endpoint) == [] and failures(b, "peer_unavailable") == 0
    assert b.client.lease(a.endpoint, [("kv", pages)]) is not None  # not skipped for peer_retry_ms


# ---------------------------------------------------------------------------------------------- lease replies


def test_a_lease_asks_for_our_lease_length_and_keeps_the_sources_ttl(cluster):
    a = cluster.make("A", timing=Timing(lease_s=10.0))
    b = cluster.make("B")
    seed(a, sequence(1), [0])
    rogue = Rogue(cluster, proxy(a))
    lease = b.client.lease(rogue.endpoint, [("kv", sequence(1))])
    assert rogue.calls[-1].lease_ms == 5000
    assert lease.ttl_s == 5.0 and lease.usable_until(0.5) == lease.sent_at + 4.5


@pytest.mark.parametrize(
    "mangle",
    [
        lambda r: LeaseReply(r.nonce, r.lease_id, r.ttl_ms, [*r.slots, [1]], r.digests),
        lambda r: LeaseReply(r.nonce, r.lease_id, r.ttl_ms, r.slots, [*r.digests, [b"x"]]),
        lambda r: LeaseReply(r.nonce, r.lease_id, r.ttl_ms, [r.slots[0][:1]], r.digests),
        lambda r: LeaseReply(r.nonce, r.lease_id, r.ttl_ms, r.slots, [r.digests[0][:1]]),
    ],
    ids=["extra pool", "extra digests", "short slots", "short digests"],
)
def test_a_lease_reply_of_the_wrong_shape_is_released_and_counted(cluster, mangle):
    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(2), [0, 1])
    rogue = Rogue(cluster, proxy(a, change_lease=mangle))
    assert b.client.lease(rogue.endpoint, [("kv", sequence(2))]) is None
    assert a.runner.active_leases == 0  # the source was told to let go
    assert failures(b, "malformed_reply") == 1 and misses(b) == 2


def test_slots_outside_the_sources_arena_are_not_taken(cluster):
    a, b = cluster.make("A", slots=4), cluster.make("B")
    seed(a, sequence(3), [0, 1, 2])
    bad = lambda r: LeaseReply(r.nonce, r.lease_id, r.ttl_ms, [[3, 4, -1]], r.digests)  # noqa: E731
    lease = b.client.lease(Rogue(cluster, proxy(a, change_lease=bad)).endpoint, [("kv", sequence(3))])
    pages = sequence(3)
    assert lease.slots == {("kv", pages[0]): 3}  # 3 is the last slot of a 4-slot arena; 4 and -1 are not slots
    assert misses(b) == 2


def test_a_lease_that_grants_nothing_is_none_and_sends_nothing_back(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    served = a.control.requests_served
    assert b.client.lease(a.endpoint, [("kv", sequence(2))]) is None
    assert a.control.requests_served == served + 2  # HELLO and LEASE; a lease id of 0 needs no RELEASE
    assert misses(b) == 2
    assert b.client.lease(a.endpoint, [("kv", [])]) is None  # nothing asked: nothing sent
    assert a.control.requests_served == served + 2


def test_a_full_grant_counts_no_miss(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(2), [0, 1])
    assert b.client.lease(a.endpoint, [("kv", sequence(2))]) is not None
    assert "kvcr_pages_total{outcome=miss,path=remote_restore}" not in b.metrics.snapshot()


def test_asking_only_for_pools_the_source_does_not_share_is_incompatible(cluster):
    a = cluster.make("A")
    b = cluster.make("B", pools=(KV, indexer_pool()))
    seed(a, sequence(1), [0])
    assert b.client.lease(a.endpoint, [("indexer", sequence(3))]) is None
    assert failures(b, "incompatible") == 1 and misses(b) == 3


def test_a_released_lease_sends_one_release(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(1), [0])
    lease = b.client.lease(a.endpoint, [("kv", sequence(1))])
    served = a.control.requests_served
    b.client.release(lease)
    b.client.release(lease)
    assert lease.released and a.control.requests_served == served + 1


def test_a_stale_page_is_one_miss(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(3)
    seed(a, pages[:2], [0, 1])
    b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6, 7])])
    assert misses(b) == 1


def test_a_stale_page_ahead_of_held_ones_is_one_miss_and_the_rest_count_as_restored(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(3)
    seed(a, pages[1:], [1, 2])  # the first page is gone from the source
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6, 7])])
    assert reasons(result) == ["source does not hold it", None, None]
    assert misses(b) == 1
    assert counter(b, "kvcr_pages_total{outcome=ok,path=remote_restore}") == 2


def test_a_read_in_another_order_than_the_lease_lands_each_page_in_its_own_host_slot(cluster):
    """The lease's arrays serve a read in lease order; any other order (or a subset) looks pages up by key."""
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(3)
    seed(a, pages[1:], [1, 2])  # the first page is gone from the source
    lease = b.client.lease(a.endpoint, [("kv", pages)])
    assert lease is not None
    shuffled = (pages[2], pages[0], pages[1])  # a tuple, and not the leased order
    result = b.client.read(lease, [PoolRead("kv", shuffled, [7, 5, 6])])
    assert reasons(result) == [None, "source does not hold it", None]
    assert [
        b.hosts["kv"].read_page(slot) == content(page, KV.page_bytes) for slot, page in ((6, pages[1]), (7, pages[2]))
    ] == [True, True]
    assert b.hosts["kv"].read_page(5) == bytes(KV.page_bytes)
    assert misses(b) == 1  # the stale page, counted once (at the grant), not again at the read
    assert counter(b, "kvcr_pages_total{outcome=ok,path=remote_restore}") == 2


def test_slots_out_of_range_in_a_grant_are_not_read_even_in_lease_order(cluster):
    a, b = cluster.make("A", slots=4), cluster.make("B")
    pages = sequence(3)
    seed(a, pages, [0, 1, 2])
    bad = lambda r: LeaseReply(r.nonce, r.lease_id, r.ttl_ms, [[0, 4, -7]], r.digests)  # noqa: E731
    lease = b.client.lease(Rogue(cluster, proxy(a, change_lease=bad)).endpoint, [("kv", pages)])
    assert lease is not None
    result = b.client.read(lease, [PoolRead("kv", pages, [5, 6, 7])])
    assert reasons(result) == [None, "source does not hold it", "source does not hold it"]
    assert b.hosts["kv"].read_page(6) == b.hosts["kv"].read_page(7) == bytes(KV.page_bytes)


def test_pages_of_a_pool_the_source_lacks_are_counted_as_misses_at_read(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    lease = b.client.lease(a.endpoint, [("kv", pages)])
    b.client.read(lease, [PoolRead("kv", pages, [5, 6]), PoolRead("nothing", pages, [7, 8])])
    assert misses(b) == 2  # the two pages of the pool A does not have; the leased ones were read


# ---------------------------------------------------------------------------------------------- reads


def test_outcomes_and_bytes_are_counted_per_result(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6])])
    assert reasons(result) == [None, None]
    assert counter(b, "kvcr_pages_total{outcome=ok,path=remote_restore}") == 2
    assert counter(b, "kvcr_bytes_total{outcome=ok,path=remote_restore}") == 2 * KV.page_bytes
    assert counter(b, "kvcr_restore_seconds_count{path=remote_restore}") == 1
    assert counter(b, "kvcr_restore_seconds_sum{path=remote_restore}") < 1.0


def test_a_read_spends_its_time_in_the_restore_histogram(cluster):
    a = cluster.make("A", faults=Faults(latency_s=0.3))
    b = cluster.make("B")
    seed(a, sequence(1), [0])
    b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])
    assert counter(b, "kvcr_restore_seconds_sum{path=remote_restore}") == pytest.approx(0.3, abs=0.01)


def test_a_read_of_pools_the_source_lacks_or_has_in_another_shape_is_a_miss_for_those_only(cluster):
    pools = (KV, indexer_pool())
    a = cluster.make("A", pools=pools)
    b = cluster.make("B", pools=pools)
    pages = sequence(1)
    seed(a, pages, [0])
    seed(a, pages, [0], pool="indexer")

    def reshape(reply):
        wrong = [
            protocol.PoolWire(p.pool_id, p.name, p.namespace, p.regions, [q * 2 for q in p.pieces], p.slots)
            if p.name == "indexer"
            else p
            for p in reply.pools
        ]
        return HelloReply(reply.nonce, reply.session, reply.incarnation, reply.data_plane, wrong, reply.max_lease_ms)

    rogue = Rogue(cluster, proxy(a, change_hello=reshape))
    lease = b.client.lease(rogue.endpoint, [("indexer", pages), ("kv", pages)])
    reads = [PoolRead("indexer", pages, [3]), PoolRead("nothing", pages, [4]), PoolRead("kv", pages, [5])]
    result = b.client.read(lease, reads)
    # a pool described in another shape is not linked at HELLO, so it is neither leased nor read
    assert reasons(result, "indexer") == ["source has no such pool"]
    assert reasons(result, "nothing") == ["source has no such pool"]
    assert reasons(result, "kv") == [None]
    assert b.hosts["kv"].read_page(5) == content(pages[0], KV.page_bytes)


def test_a_lease_without_a_link_or_already_released_reads_nothing(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(1)
    orphan = RemoteLease(a.endpoint, 1, cluster.clock.now(), 5.0, {"kv": ([pages[0]], [0], [b""])})
    result = b.client.read(orphan, [PoolRead("kv", pages, [5]), PoolRead("indexer", pages, [6])])
    assert result == {"kv": [result["kv"][0]], "indexer": [result["indexer"][0]]}
    assert reasons(result) == ["lease released"] and reasons(result, "indexer") == ["lease released"]


def test_a_lease_past_its_usable_end_reads_nothing_and_posts_nothing(cluster):
    a, b = cluster.make("A"), cluster.make("B", peer=PeerSettings(max_pages_per_read=1))
    pages = sequence(2)
    seed(a, pages, [0, 1])
    lease = b.client.lease(a.endpoint, [("kv", pages)])
    cluster.clock.advance(lease.usable_until(TIMING.lease_margin_s) - cluster.clock.now())  # exactly its end
    assert not b.client.alive(lease)
    posted = []
    b.data_plane.intercept("read", lambda *args, **kw: posted.append(args) or 0)
    result = b.client.read(lease, [PoolRead("kv", pages, [5, 6])])
    assert reasons(result) == ["lease expired before the read", "source does not hold it"]
    assert posted == []


def test_a_failed_transfer_stops_the_read_and_posts_nothing_more(cluster):
    a = cluster.make("A", faults=Faults(error=True))
    b = cluster.make("B", peer=PeerSettings(max_pages_per_read=1))
    pages = sequence(3)
    seed(a, pages, [0, 1, 2])
    posted = []
    real = b.data_plane.read
    b.data_plane.intercept("read", lambda *args, **kw: posted.append(args) or real(*args, **kw))
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [5, 6, 7])])
    assert [o.outcome for o in result["kv"]] == [Outcome.FAILED, Outcome.MISS, Outcome.MISS]
    assert reasons(result)[0] == "read failed" and len(posted) == 1
    assert failures(b, "peer_unavailable") == 1  # a failing peer is skipped


def test_a_refused_read_is_a_miss_and_drops_the_link(cluster, caplog):
    a = cluster.make("A")
    b = cluster.make("B")
    seed(a, sequence(1), [0])
    lease = b.client.lease(a.endpoint, [("kv", sequence(1))])
    a.data_plane.set_faults(Faults(peer_down=True))
    with caplog.at_level(logging.INFO, logger="kvcr.runner"):
        result = b.client.read(lease, [PoolRead("kv", sequence(1), [5])])
    assert reasons(result) == ["peer unavailable"]
    assert skipped(caplog, a.endpoint) == ["read refused"]
    assert b.client.links == 0


def test_without_verification_every_delivered_page_is_restored(cluster):
    a = cluster.make("A", verify_bytes=False)
    b = cluster.make("B", verify_bytes=False)
    seed(a, sequence(2), [0, 1])
    result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(2), [5, 6])])
    assert [o.outcome for o in result["kv"]] == [Outcome.RESTORED] * 2


def test_a_verifying_target_serves_nothing_a_source_sent_without_digests(cluster, caplog):
    a = cluster.make("A", verify_bytes=False)  # an older source, or one an operator turned off
    b = cluster.make("B", verify_bytes=True)
    seed(a, sequence(2), [0, 1])
    with caplog.at_level(logging.ERROR, logger="kvcr.runner"):
        result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(2), [5, 6])])
    assert reasons(result) == ["the source sent no digest for the page (verify_bytes off there?)"] * 2
    assert counter(b, "kvcr_verification_failures_total{path=remote_restore}") == 2
    assert any("without a digest" in r.getMessage() for r in caplog.records)


def test_corrupt_pages_fail_verification_with_their_reason(cluster):
    a = cluster.make("A", faults=Faults(corrupt=True))
    b = cluster.make("B")
    seed(a, sequence(1), [0])
    result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])
    assert reasons(result) == ["bytes differ from the source's digest"]
    assert counter(b, "kvcr_verification_failures_total{path=remote_restore}") == 1
    assert failures(b, "verification") == 1


# ---------------------------------------------------------------------------------------------- stalls


def test_a_stall_within_the_lease_is_a_timeout_and_past_it_a_lease_expiry(cluster):
    a = cluster.make("A", faults=Faults(stall=True))
    b = cluster.make("B")
    seed(a, sequence(1), [0])
    assert reasons(b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])) == ["read timed out"]
    assert failures(b, "timeout") == 1 and failures(b, "lease_expired") == 0
    short = Timing(operation_s=5.0, abandon_s=10.0, lease_s=2.0, lease_margin_s=0.5)
    c = cluster.make("C", faults=Faults(stall=True), timing=short)
    d = cluster.make("D", timing=short)
    seed(c, sequence(1), [0])
    assert reasons(d.client.restore(c.endpoint, [PoolRead("kv", sequence(1), [5])])) == ["read would outlive the lease"]
    assert failures(d, "lease_expired") == 1 and failures(d, "timeout") == 0


def test_an_unstoppable_direct_read_gets_half_a_second_to_fence_and_a_staged_one_none(cluster):
    a = cluster.make("A", faults=Faults(stall=True, late_writes=True))
    direct = cluster.make("B", peer=PeerSettings(landing="direct"))
    staged = cluster.make("C")  # auto: late writes mean staged
    seed(a, sequence(1), [0])
    start = cluster.clock.now()
    result = direct.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])
    assert reasons(result) == ["transfer could not be confirmed stopped"]
    assert cluster.clock.now() - start == pytest.approx(TIMING.operation_s + 0.5, abs=0.01)
    assert failures(direct, "uncertain") == 1
    cluster.clock.advance(TIMING.retry_after_s)
    start = cluster.clock.now()
    result = staged.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [6])])
    assert reasons(result) == ["read stalled (staged, quarantined)"]
    assert cluster.clock.now() - start == pytest.approx(TIMING.operation_s, abs=0.01)
    assert staged.staging.quarantined == 1


# ---------------------------------------------------------------------------------------------- staging


def test_a_staged_read_lands_every_chunk_and_copies_only_verified_pages(cluster):
    a = cluster.make("A")
    b = cluster.make("B", peer=PeerSettings(landing="staged", max_pages_per_read=2))
    pages = sequence(4)
    seed(a, pages, range(4))
    arena = a.runner.pool_arenas()["kv"]
    import ctypes

    ctypes.memset(arena[0].address(0), 0xAB, 8)  # page 0 changes in A's arena behind its back
    result = b.client.restore(a.endpoint, [PoolRead("kv", pages, [10, 11, 12, 13])])
    assert [o.outcome for o in result["kv"]] == [Outcome.FAILED] + [Outcome.RESTORED] * 3
    assert b.hosts["kv"].read_page(10) == bytes(KV.page_bytes)  # the bad page never reached the host
    assert [b.hosts["kv"].read_page(s) for s in (11, 12, 13)] == [content(p, KV.page_bytes) for p in pages[1:]]


def test_a_failed_copy_out_of_staging_fails_the_chunk(cluster):
    a = cluster.make("A")
    b = cluster.make("B", peer=PeerSettings(landing="staged"))
    seed(a, sequence(2), [0, 1])
    b.container.memory().fail_after_moves = 0  # every copy of B's now fails, as its staged copy will
    result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(2), [5, 6])])
    assert reasons(result) == ["staged copy failed"] * 2


def test_without_a_free_staging_buffer_a_staged_read_is_a_counted_miss(cluster):
    a = cluster.make("A")
    b = cluster.make("B", peer=PeerSettings(landing="staged", staging_buffers=0, max_pages_per_read=1))
    seed(a, sequence(2), [0, 1])
    result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(2), [5, 6])])
    assert reasons(result) == ["no staging memory free", "source does not hold it"]
    assert failures(b, "no_staging") == 1


def test_a_pool_short_of_staging_gives_back_the_buffers_the_other_pools_took(cluster):
    pools = (KV, indexer_pool())
    frozen = cluster.make("A", pools=pools, faults=Faults(stall=True, late_writes=True))
    healthy = cluster.make("C", pools=pools)
    b = cluster.make("B", pools=pools, peer=PeerSettings(landing="staged", staging_buffers=1))
    pages = sequence(1)
    for source in (frozen, healthy):
        seed(source, pages, [0])
        seed(source, pages, [0], pool="indexer")
    b.client.restore(frozen.endpoint, [PoolRead("indexer", pages, [5])])  # never ends: its buffer is quarantined
    assert b.staging.quarantined == 1
    both = b.client.restore(healthy.endpoint, [PoolRead("kv", pages, [6]), PoolRead("indexer", pages, [7])])
    assert reasons(both) == ["no staging memory free"] and reasons(both, "indexer") == ["no staging memory free"]
    kv_only = b.client.restore(healthy.endpoint, [PoolRead("kv", pages, [8])])
    assert reasons(kv_only) == [None]  # the kv buffer came back to the pool


# ---------------------------------------------------------------------------------------------- links


def test_links_beyond_max_links_close_the_least_recently_used(cluster):
    sources = [cluster.make(n) for n in ("A", "C", "D")]
    b = cluster.make("B", peer=PeerSettings(max_links=2))
    dropped, disconnected = [], []
    b.control.intercept("forget", dropped.append)
    real = b.data_plane.disconnect
    b.data_plane.intercept("disconnect", lambda peer: disconnected.append(peer) or real(peer))
    for s in sources[:2]:
        seed(s, sequence(1), [0])
        b.client.lease(s.endpoint, [("kv", sequence(1))])
    assert b.client.links == 2 and dropped == [] and disconnected == []
    b.client.lease(sources[0].endpoint, [("kv", sequence(1))])  # A is now the most recent
    seed(sources[2], sequence(1), [0])
    b.client.lease(sources[2].endpoint, [("kv", sequence(1))])
    # The evicted link closes both halves: its control connection and its data-plane peer (a NIXL
    # remote agent, a UCX endpoint), so a target hinted towards many sources holds at most max_links.
    assert b.client.links == 2 and dropped == [sources[1].endpoint] and disconnected == ["C"]


def test_idle_links_close_once_idle_for_link_idle_s(cluster):
    a, c = cluster.make("A"), cluster.make("C")
    b = cluster.make("B", peer=PeerSettings(link_idle_s=30.0))
    for s in (a, c):
        seed(s, sequence(1), [0])
    disconnected = []
    real = b.data_plane.disconnect
    b.data_plane.intercept("disconnect", lambda peer: disconnected.append(peer) or real(peer))
    b.client.lease(a.endpoint, [("kv", sequence(1))])
    b.client.lease(a.endpoint, [("kv", sequence(1))])  # used twice
    cluster.clock.advance(30.0)  # exactly idle for link_idle_s
    b.client.lease(c.endpoint, [("kv", sequence(1))])  # a new link looks for idle ones first
    assert disconnected == ["A"] and b.client.links == 1


def test_close_drops_every_link(cluster):
    a = cluster.make("A")
    b = cluster.make("B")
    seed(a, sequence(1), [0])
    b.client.lease(a.endpoint, [("kv", sequence(1))])
    forgotten = []
    b.control.intercept("forget", forgotten.append)
    b.client.close()
    assert forgotten == [a.endpoint] and b.client.links == 0


def test_the_quarantine_gauge_counts_peers_still_in_their_window(cluster):
    b = cluster.make("B")
    first = Rogue(cluster, lambda r: b"\x00", port=1981)
    second = Rogue(cluster, lambda r: b"\x00", port=1982)
    b.client.lease(first.endpoint, [("kv", sequence(1))])
    assert counter(b, "kvcr_peers_quarantined") == 1
    cluster.clock.advance(TIMING.retry_after_s)  # the first window ends exactly now
    b.client.lease(second.endpoint, [("kv", sequence(1))])
    assert counter(b, "kvcr_peers_quarantined") == 1


# ---------------------------------------------------------------------------------------------- estimates


def learn(cluster, name, latency, **settings):
    """A target that read 4 pages once from a source with ``latency`` (its rate estimate is set)."""
    source = cluster.make(f"S{name}", faults=Faults(latency_s=latency))
    target = cluster.make(name, peer=PeerSettings(**settings))
    seed(source, sequence(4), range(4))
    assert reasons(target.client.restore(source.endpoint, [PoolRead("kv", sequence(4), range(10, 14))])) == [None] * 4
    return source, target


# 4 pages of 512 bytes in 0.1 s: ~20 kB/s. Recomputing 4 tokens per page at R tokens/s is slower than the read
# when R < 20480 * 4 / 512 = 160.
@pytest.mark.parametrize(("rate", "skipped_after"), [(200.0, True), (120.0, False)])
def test_a_read_estimated_slower_than_recomputing_is_skipped(cluster, rate, skipped_after):
    source, target = learn(cluster, "B", 0.1, recompute_tokens_per_s=rate, tokens_per_page=4)
    again = target.client.lease(source.endpoint, [("kv", sequence(4))])
    assert (again is None) is skipped_after
    assert failures(target, "slower_than_recompute") == int(skipped_after)


def test_one_token_pages_still_get_the_estimate(cluster):
    source, target = learn(cluster, "B", 0.1, recompute_tokens_per_s=50.0, tokens_per_page=1)  # threshold 40 tokens/s
    assert target.client.lease(source.endpoint, [("kv", sequence(4))]) is None


@pytest.mark.parametrize(("rate", "per_page"), [(0.0, 4), (100.0, 0)])
def test_without_a_recompute_rate_or_page_size_nothing_is_skipped(cluster, rate, per_page):
    source, target = learn(cluster, "B", 0.1, recompute_tokens_per_s=rate, tokens_per_page=per_page)
    assert target.client.lease(source.endpoint, [("kv", sequence(4))]) is not None


@pytest.mark.parametrize(("rate", "third_skipped"), [(150.0, True), (114.0, False)])
def test_the_estimate_weighs_the_newest_read_by_0_3(cluster, rate, third_skipped):
    # Reads at ~20.4 kB/s then ~2.0 kB/s: the estimate is 0.7 * 20.4 + 0.3 * 2.0 = ~14.9 kB/s, a recompute
    # threshold of ~116.6 tokens/s. Both reads themselves proceed (after the first the threshold is ~160).
    source, target = learn(cluster, "B", 0.1, recompute_tokens_per_s=rate, tokens_per_page=4)
    source.data_plane.set_faults(Faults(latency_s=1.0))
    second = target.client.restore(source.endpoint, [PoolRead("kv", sequence(4), range(20, 24))])
    assert reasons(second) == [None] * 4
    assert (target.client.lease(source.endpoint, [("kv", sequence(4))]) is None) is third_skipped


# ---------------------------------------------------------------------------------------------- more edges


def test_a_request_after_the_deadline_is_never_sent(cluster):
    b = cluster.make("B", timing=Timing(operation_s=0.3, abandon_s=4.0, control_s=0.25))
    a = cluster.make("A")
    answer = proxy(a)

    def slow_hello(request):
        cluster.clock.advance(0.3)  # the HELLO answer takes the whole operation deadline
        return answer(request)

    rogue = Rogue(cluster, slow_hello)
    assert b.client.lease(rogue.endpoint, [("kv", sequence(1))]) is None
    assert [type(c).__name__ for c in rogue.calls] == ["Hello"]
    assert failures(b, "peer_unavailable") == 0  # no time left is no fault of the peer


def test_a_control_call_gets_what_is_left_of_the_deadline(cluster, caplog):
    b = cluster.make("B", timing=Timing(operation_s=0.3, abandon_s=4.0, control_s=0.25))
    a = cluster.make("A")
    answer = proxy(a)

    def then_stall(request):
        cluster.clock.advance(0.2)
        rogue.channel.set_faults(ControlFaults(stall=True))  # the LEASE after this HELLO never answers
        return answer(request)

    rogue = Rogue(cluster, then_stall)
    with caplog.at_level(logging.INFO, logger="kvcr.runner"):
        assert b.client.lease(rogue.endpoint, [("kv", sequence(1))]) is None
    (why,) = skipped(caplog, rogue.endpoint)
    assert why.startswith(f"{rogue.endpoint} did not answer within 0.1")


def test_a_grant_whose_every_slot_is_unusable_is_released(cluster):
    a, b = cluster.make("A", slots=4), cluster.make("B")
    seed(a, sequence(2), [0, 1])
    bad = lambda r: LeaseReply(r.nonce, r.lease_id, r.ttl_ms, [[4, -1]], r.digests)  # noqa: E731
    assert b.client.lease(Rogue(cluster, proxy(a, change_lease=bad)).endpoint, [("kv", sequence(2))]) is None
    assert a.runner.active_leases == 0


def test_a_read_is_posted_under_its_lease(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(1), [0])
    lease = b.client.lease(a.endpoint, [("kv", sequence(1))])
    seen = []
    real = b.data_plane.read
    b.data_plane.intercept("read", lambda peer, runs, **kw: seen.append(kw) or real(peer, runs, **kw))
    b.client.read(lease, [PoolRead("kv", sequence(1), [5])])
    assert seen == [{"lease": lease.lease_id}]


def test_pages_and_host_slots_of_different_lengths_are_a_caller_bug(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(2), [0, 1])
    lease = b.client.lease(a.endpoint, [("kv", sequence(2))])
    with pytest.raises(ValueError):
        b.client.read(lease, [PoolRead("kv", sequence(2), [5])])


def test_a_read_completing_only_at_the_lease_end_is_refused(cluster):
    timing = Timing(operation_s=6.0, abandon_s=8.0, lease_s=5.0, lease_margin_s=0.5)
    a = cluster.make("A", timing=timing, faults=Faults(latency_s=4.5))  # done exactly at sent + lease - margin
    b = cluster.make("B", timing=timing)
    seed(a, sequence(1), [0])
    result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])
    assert reasons(result) == ["read finished after the lease"]
    assert b.hosts["kv"].read_page(5) == content(sequence(1)[0], KV.page_bytes)  # landed, but not handed over


def test_a_failed_read_skips_the_peer_and_drops_its_link(cluster, caplog):
    a = cluster.make("A", faults=Faults(error=True))
    b = cluster.make("B")
    seed(a, sequence(1), [0])
    dropped, forgotten = [], []
    real = b.data_plane.disconnect
    b.data_plane.intercept("disconnect", lambda peer: dropped.append(peer) or real(peer))
    b.control.intercept("forget", forgotten.append)
    with caplog.at_level(logging.INFO, logger="kvcr.runner"):
        b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])
    assert skipped(caplog, a.endpoint) == ["read failed"]
    assert dropped == ["A"] and b.client.links == 0
    assert forgotten == [a.endpoint]  # its control connection goes too


def test_a_stalled_read_that_will_not_cancel_tears_the_link_down_and_skips_the_peer(cluster, caplog):
    a = cluster.make("A", faults=Faults(stall=True, uncertain_cancel=True))
    b = cluster.make("B", peer=PeerSettings(landing="direct"))
    seed(a, sequence(1), [0])
    dropped = []
    real = b.data_plane.disconnect
    b.data_plane.intercept("disconnect", lambda peer: dropped.append(peer) or real(peer))
    with caplog.at_level(logging.INFO, logger="kvcr.runner"):
        result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])
    assert reasons(result) == ["read timed out"]  # the disconnect fenced it: a failure, not uncertain
    assert skipped(caplog, a.endpoint) == ["a read stalled"]
    assert dropped == ["A"]


def test_a_transport_that_reports_uncertain_while_reading_is_waited_out(cluster):
    from kvcr.ports.dataplane import TransferState

    a = cluster.make("A")
    b = cluster.make("B")
    seed(a, sequence(1), [0])
    b.data_plane.intercept("poll", lambda handle: TransferState.UNCERTAIN)
    result = b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])
    assert reasons(result) == ["read timed out"]


def test_a_disconnect_that_fails_does_not_stop_closing(cluster):
    from kvcr.ports.errors import TransportError

    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(1), [0])
    b.client.lease(a.endpoint, [("kv", sequence(1))])

    def broken(peer):
        raise TransportError("gone")

    b.data_plane.intercept("disconnect", broken)
    b.client.close()
    assert b.client.links == 0


def test_idle_links_are_dropped_and_fresh_ones_kept(cluster):
    a, c, d = cluster.make("A"), cluster.make("C"), cluster.make("D")
    b = cluster.make("B", peer=PeerSettings(link_idle_s=30.0))
    for s in (a, c, d):
        seed(s, sequence(1), [0])
    forgotten = []
    b.control.intercept("forget", forgotten.append)
    b.client.lease(a.endpoint, [("kv", sequence(1))])
    cluster.clock.advance(20.0)
    b.client.lease(d.endpoint, [("kv", sequence(1))])
    cluster.clock.advance(10.0)  # A idle for 30 s, D for 10 s
    b.client.lease(c.endpoint, [("kv", sequence(1))])
    assert forgotten == [a.endpoint] and b.client.links == 2


def test_buffers_of_a_failed_staged_read_are_reused(cluster):
    a = cluster.make("A", faults=Faults(error=True))
    b = cluster.make("B", peer=PeerSettings(landing="staged", staging_buffers=1))
    seed(a, sequence(1), [0])
    assert reasons(b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])) == ["read failed"]
    a.data_plane.set_faults(Faults())
    cluster.clock.advance(TIMING.retry_after_s)
    assert reasons(b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [6])])) == [None]


# ---------------------------------------------------------------------------------------------- boundaries


@pytest.mark.parametrize(("slots", "linked"), [(0, False), (1, True)])
def test_a_pool_is_linked_only_when_the_source_describes_at_least_one_slot(cluster, slots, linked):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(1)
    seed(a, pages, [0])  # slot 0: inside even a one-slot arena

    def resize(reply):
        pools = [protocol.PoolWire(p.pool_id, p.name, p.namespace, p.regions, p.pieces, slots) for p in reply.pools]
        return HelloReply(reply.nonce, reply.session, reply.incarnation, reply.data_plane, pools, reply.max_lease_ms)

    rogue = Rogue(cluster, proxy(a, change_hello=resize))
    result = b.client.restore(rogue.endpoint, [PoolRead("kv", pages, [5])])
    assert reasons(result) == ([None] if linked else ["peer unavailable"])
    assert [type(c).__name__ for c in rogue.calls] == (["Hello", "Lease", "Release"] if linked else ["Hello"])


def test_a_peer_never_skipped_is_dialled_at_any_clock_reading():
    c = Cluster(clock=FakeClock(0.0))  # a monotonic clock may read 0
    try:
        a, b = c.node("A", timing=TIMING), c.node("B", timing=TIMING)
        seed(a, sequence(1), [0])
        assert reasons(b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])) == [None]
    finally:
        c.close()


def test_a_read_under_a_lease_whose_link_was_evicted_is_a_miss_at_once(cluster):
    a = cluster.make("A")
    c = cluster.make("C")
    b = cluster.make("B", peer=PeerSettings(max_links=1))
    pages = sequence(1)
    for source in (a, c):
        seed(source, pages, [0])
    lease = b.client.lease(a.endpoint, [("kv", pages)])
    assert b.client.lease(c.endpoint, [("kv", pages)]) is not None  # evicts the link to A; the lease lives on
    a.data_plane.set_faults(Faults(stall=True, uncertain_cancel=True))
    start = cluster.clock.now()
    result = b.client.read(lease, [PoolRead("kv", pages, [5])])  # never an exception to the caller
    # The eviction disconnected A's data-plane peer: nothing is posted, so nothing can stall.
    assert reasons(result) == ["peer unavailable"] and cluster.clock.now() == start


def test_two_reads_stalled_on_one_link_both_give_up_with_an_outcome(cluster):
    a = cluster.make("A", faults=Faults(stall=True, late_writes=True))
    b = cluster.make("B")  # auto: late writes mean staged
    pages = sequence(2)
    seed(a, pages, [0, 1])
    leases = [b.client.lease(a.endpoint, [("kv", [page])]) for page in pages]
    both_posted = threading.Barrier(2)
    real = b.data_plane.read

    def read_then_wait(*args, **kwargs):
        handle = real(*args, **kwargs)
        both_posted.wait(timeout=5)  # neither gives up before the other's read is live
        return handle

    b.data_plane.intercept("read", read_then_wait)
    results: dict[int, object] = {}

    def read(i):
        try:
            results[i] = reasons(b.client.read(leases[i], [PoolRead("kv", [pages[i]], [5 + i])]))
        except Exception as exc:  # the second to give up finds the link already forgotten
            results[i] = exc

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {0: ["read stalled (staged, quarantined)"], 1: ["read stalled (staged, quarantined)"]}


def test_a_quarantined_read_whose_poll_fails_does_not_keep_the_others_from_being_reaped(cluster):
    a = cluster.make("A", faults=Faults(stall=True, late_writes=True))
    b = cluster.make("B", peer=PeerSettings(landing="direct"))
    pages = sequence(2)
    seed(a, pages, [0, 1])
    for page, slot in zip(pages, [5, 6], strict=True):
        assert reasons(b.client.restore(a.endpoint, [PoolRead("kv", [page], [slot])])) == [
            "transfer could not be confirmed stopped"
        ]
        cluster.clock.advance(TIMING.retry_after_s)
    assert b.client.quarantined == 2
    a.data_plane.set_faults(Faults(late_writes=True))  # the source resumes: both reads end
    real, polled = b.data_plane.poll, []

    def poll(handle):
        polled.append(handle)
        if len(polled) == 1:
            raise TransportError("injected")
        return real(handle)

    b.data_plane.intercept("poll", poll)
    assert b.client.reap() == 1  # the one whose poll failed is kept for the next reap; the other is released
    assert b.client.reap() == 0


def test_a_one_byte_read_still_teaches_the_links_rate(cluster):
    tiny = PoolSpec("kv", (ComponentSpec("k", 1),), anchor=True)  # pages of one byte
    source = cluster.make("S", pools=(tiny,), faults=Faults(latency_s=1.0))
    target = cluster.make("B", pools=(tiny,), peer=PeerSettings(recompute_tokens_per_s=2.0, tokens_per_page=1))
    pages = sequence(1)
    seed(source, pages, [0])
    assert reasons(target.client.restore(source.endpoint, [PoolRead("kv", pages, [5])])) == [None]
    # ~1 B/s: one more page takes ~1 s to read, 0.5 s to recompute
    assert target.client.lease(source.endpoint, [("kv", pages)]) is None
    assert failures(target, "slower_than_recompute") == 1


def test_a_recompute_rate_of_one_token_per_second_is_still_a_rate(cluster):
    source = cluster.make("S", faults=Faults(latency_s=1.5))
    target = cluster.make("B", peer=PeerSettings(recompute_tokens_per_s=1.0, tokens_per_page=1))
    pages = sequence(1)
    seed(source, pages, [0])
    assert reasons(target.client.restore(source.endpoint, [PoolRead("kv", pages, [5])])) == [None]
    # one page read in ~1.5 s; recomputing its one token takes 1 s
    assert target.client.lease(source.endpoint, [("kv", pages)]) is None
    assert failures(target, "slower_than_recompute") == 1


# 4 pages of 512 bytes read in exactly 0.5 s: 4096 B/s, so 4 more take 0.5 s; recomputing 4 x 4 tokens at
# 32 tokens/s takes exactly 0.5 s too: a read no slower than recomputing is tried.
@pytest.mark.parametrize(("rate", "skipped_after"), [(32.0, False), (33.0, True)])
def test_a_read_estimated_exactly_as_long_as_recomputing_is_tried(coarse, rate, skipped_after):
    source = coarse.make("S", faults=Faults(latency_s=0.5))
    target = coarse.make("B", peer=PeerSettings(recompute_tokens_per_s=rate, tokens_per_page=4))
    seed(source, sequence(4), range(4))
    start = coarse.clock.now()
    assert reasons(target.client.restore(source.endpoint, [PoolRead("kv", sequence(4), range(10, 14))])) == [None] * 4
    assert coarse.clock.now() - start == 0.5
    assert (target.client.lease(source.endpoint, [("kv", sequence(4))]) is None) is skipped_after


def test_a_read_still_pending_at_its_deadline_is_given_up_then(coarse):
    a = coarse.make("A", faults=Faults(latency_s=2.1))  # would complete just after the 2 s operation deadline
    b = coarse.make("B")
    seed(a, sequence(1), [0])
    start = coarse.clock.now()
    assert reasons(b.client.restore(a.endpoint, [PoolRead("kv", sequence(1), [5])])) == ["read timed out"]
    assert coarse.clock.now() - start == TIMING.operation_s


def test_a_peer_connected_ahead_is_linked_before_any_hint_and_kept_however_idle(cluster):
    a, c = cluster.make("A"), cluster.make("C")
    b = cluster.make("B", peer=PeerSettings(link_idle_s=30.0))
    for s in (a, c):
        seed(s, sequence(1), [0])
    b.client.connect_ahead([a.endpoint, a.endpoint]).join(10)
    assert b.client.links == 1 and a.control.requests_served == 1  # one HELLO, before any hint
    lease = b.client.lease(a.endpoint, [("kv", sequence(1))])
    assert lease is not None and a.control.requests_served == 2  # the LEASE only: the link was ready
    b.client.release(lease)
    cluster.clock.advance(60.0)  # idle for twice link_idle_s
    b.client.lease(c.endpoint, [("kv", sequence(1))])  # a new link looks for idle ones first
    assert b.client.links == 2  # A's, made ahead of need, stays


def test_a_peer_that_does_not_answer_ahead_of_need_is_skipped_and_linked_on_its_hint(cluster):
    b = cluster.make("B")
    b.client.connect_ahead(["tcp://127.0.0.1:1"]).join(10)
    assert b.client.links == 0
    assert b.client.connect_ahead([]) is None


def test_callers_asking_for_a_new_link_at_once_make_one(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(1), [0])
    answer = proxy(a)

    def slow_hello(request):
        if isinstance(request, protocol.Hello):
            time.sleep(0.3)  # a first contact on a loaded host: the other callers arrive meanwhile
        return answer(request)

    rogue = Rogue(cluster, slow_hello)
    leases = []
    threads = [
        threading.Thread(target=lambda: leases.append(b.client.lease(rogue.endpoint, [("kv", sequence(1))])))
        for _ in range(4)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert [type(c).__name__ for c in rogue.calls].count("Hello") == 1
    assert b.client.links == 1 and len(leases) == 4 and all(lease is not None for lease in leases)
