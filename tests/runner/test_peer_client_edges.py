"""The target side at its edges: side-link sessions, an old incarnation's failed read, wiring mistakes.

Two nodes on the mock fabric with a fake clock. A side link (a data plane whose peer links also
carry control frames) is a small wrapper around the target's mock data plane that hands its frames
to the source's peer server over their own connection, the way the same-host plane does.
"""

import dataclasses
import logging

import pytest

from kvcr.domain.deadlines import Timing
from kvcr.domain.outcomes import Outcome
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable
from kvcr.runner import protocol
from kvcr.runner.peer_client import PeerClient, PeerSettings, PoolRead
from kvcr.runner.protocol import LeaseReply
from tests.runner.test_peer_client_paths import restarted
from tests.support import Cluster, content, indexer_pool, kv_pool, seed, sequence

TIMING = Timing(operation_s=2.0, abandon_s=4.0, control_s=0.25, lease_s=5.0, lease_margin_s=0.5, retry_after_s=1.0)
KV = kv_pool()
SIDE = b"side-link"  # the connection side frames arrive over at the source


@pytest.fixture
def cluster():
    c = Cluster()
    c.make = lambda name, **kw: c.node(name, timing=kw.pop("timing", TIMING), **kw)
    yield c
    c.close()


def counter(node, key):
    return node.metrics.snapshot().get(key, 0)


def failures(node, reason):
    return counter(node, f"kvcr_failures_total{{path=remote_restore,reason={reason}}}")


def reasons(result, pool="kv"):
    return [o.reason for o in result[pool]]


def skipped(caplog, endpoint):
    prefix = f"kvcr: peer {endpoint} skipped for 1.0s: "
    return [m[len(prefix) :] for m in caplog.messages if m.startswith(prefix)]


class SideLinks:
    """A target's data plane whose peer links also carry control frames, to the peer servers it is given.

    ``change_lease`` may rewrite a LEASE reply that comes back over a side link.
    """

    def __init__(self, plane, servers, change_lease=None):
        self._plane = plane
        self._servers = servers  # data-plane peer name -> its PeerServer
        self._change_lease = change_lease
        self.requests: list[str] = []  # kinds of the round trips made over side links
        self.sent: list[str] = []  # kinds of the one-way frames sent over side links

    def __getattr__(self, name):
        return getattr(self._plane, name)

    def serve_side(self, handler):
        pass

    def side_request(self, peer, payload, timeout_s):
        server = self._servers.get(peer)
        if server is None:
            return None
        self.requests.append(type(protocol.decode(payload)).__name__)
        frame = server.handle(payload, SIDE)
        reply = protocol.decode(frame)
        if isinstance(reply, LeaseReply) and self._change_lease is not None:
            frame = protocol.encode(self._change_lease(reply))
        return frame

    def side_send(self, peer, payload):
        server = self._servers.get(peer)
        if server is None:
            return False
        self.sent.append(type(protocol.decode(payload)).__name__)
        server.handle(payload, SIDE)
        return True


def client_of(node, data_plane, host_ids=None):
    """Another PeerClient of ``node`` (its runner, control channel, host regions), over ``data_plane``."""
    return PeerClient(
        node.runner,
        node.control,
        data_plane,
        node.container.memory(),
        node.container.clock(),
        node.metrics,
        PeerSettings(),
        host_ids or node.host_regions.ids,
        node.staging,
    )


# ---------------------------------------------------------------------------------------------- side links


def test_a_lease_over_the_side_link_is_read_and_released_under_the_side_session(cluster):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    side = SideLinks(b.data_plane, {"A": a.server})
    client = client_of(b, side)
    lease = client.lease(a.endpoint, [("kv", pages)])
    assert lease is not None and set(lease.slots) == {("kv", pages[0]), ("kv", pages[1])}
    assert side.requests == ["Hello", "Lease"]  # the LEASE went where its session was opened
    assert a.runner.active_leases == 1
    result = client.read(lease, [PoolRead("kv", pages, [5, 6])])
    assert [o.outcome for o in result["kv"]] == [Outcome.RESTORED] * 2
    assert b.hosts["kv"].read_page(6) == content(pages[1], KV.page_bytes)
    client.release(lease)
    assert side.sent == ["Release"]
    assert a.runner.active_leases == 0  # the source let go: the RELEASE named the session that holds it
    client.close()


@pytest.mark.parametrize(
    "mangle",
    [
        lambda r: LeaseReply(r.nonce, r.lease_id, r.ttl_ms, [*r.slots, [1]], r.digests),
        lambda r: LeaseReply(r.nonce, r.lease_id, r.ttl_ms, [[-1] * len(s) for s in r.slots], r.digests),
    ],
    ids=["wrong shape", "no slot usable"],
)
def test_an_unusable_lease_granted_over_the_side_link_is_released_under_the_side_session(cluster, mangle):
    a, b = cluster.make("A"), cluster.make("B")
    seed(a, sequence(2), [0, 1])
    side = SideLinks(b.data_plane, {"A": a.server}, change_lease=mangle)
    client = client_of(b, side)
    assert client.lease(a.endpoint, [("kv", sequence(2))]) is None
    assert side.sent == ["Release"]
    assert a.runner.active_leases == 0
    client.close()


# ---------------------------------------------------------------------------------------------- restarts


def test_an_old_incarnations_refused_read_after_the_new_one_answered_hello_skips_nothing(cluster, caplog):
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(2)
    seed(a, pages, [0, 1])
    old = b.client.lease(a.endpoint, [("kv", pages[:1])])
    later = {}
    real = b.data_plane.read

    def restart_then_refuse(*args, **kwargs):
        if later:
            return real(*args, **kwargs)
        later["a2"] = restarted(cluster, a, pages)  # the source dies; another request meets the new one
        later["lease"] = b.client.lease(a.endpoint, [("kv", pages[1:])])
        raise PeerUnavailable("the old process is gone")

    b.data_plane.intercept("read", restart_then_refuse)
    with caplog.at_level(logging.INFO):
        stale = b.client.read(old, [PoolRead("kv", pages[:1], [5])])
        assert reasons(stale) == ["peer unavailable"]
        fresh = b.client.read(later["lease"], [PoolRead("kv", pages[1:], [6])])
    assert [o.outcome for o in fresh["kv"]] == [Outcome.RESTORED]  # its link was not dropped for the old read
    assert b.hosts["kv"].read_page(6) == content(pages[1], KV.page_bytes, "restarted")
    assert skipped(caplog, a.endpoint) == [] and failures(b, "peer_unavailable") == 0
    b.client.release(later["lease"])


def test_an_old_incarnations_stalled_read_after_the_new_one_answered_hello_skips_nothing(cluster, caplog):
    a, b = cluster.make("A"), cluster.make("B", peer=PeerSettings(landing="direct"))
    pages = sequence(2)
    seed(a, pages, [0, 1])
    old = b.client.lease(a.endpoint, [("kv", pages[:1])])
    later: dict[str, object] = {}
    real_read, real_poll, real_cancel = b.data_plane.read, b.data_plane.poll, b.data_plane.cancel

    def restart_while_reading(*args, **kwargs):
        handle = real_read(*args, **kwargs)
        if not later:
            later["stalled"] = handle
            later["a2"] = restarted(cluster, a, pages)
            later["lease"] = b.client.lease(a.endpoint, [("kv", pages[1:])])
        return handle

    def poll(handle):
        # The old read looks live until it is given up on; after that its real (torn-down) state shows.
        if handle == later.get("stalled") and "cancelled" not in later:
            return TransferState.PENDING
        return real_poll(handle)

    def cancel(handle):
        if handle == later.get("stalled"):
            later["cancelled"] = True
            return TransferState.UNCERTAIN  # not confirmed stopped: the client must tear the peer down
        return real_cancel(handle)

    b.data_plane.intercept("read", restart_while_reading)
    b.data_plane.intercept("poll", poll)
    b.data_plane.intercept("cancel", cancel)
    with caplog.at_level(logging.INFO):
        stale = b.client.read(old, [PoolRead("kv", pages[:1], [5])])
        assert reasons(stale) == ["read timed out"]
        fresh = b.client.read(later["lease"], [PoolRead("kv", pages[1:], [6])])
    assert [o.outcome for o in fresh["kv"]] == [Outcome.RESTORED]
    assert b.hosts["kv"].read_page(6) == content(pages[1], KV.page_bytes, "restarted")
    assert skipped(caplog, a.endpoint) == [] and failures(b, "peer_unavailable") == 0
    b.client.release(later["lease"])


# ---------------------------------------------------------------------------------------------- wiring mistakes


def test_a_link_whose_pieces_differ_from_our_host_regions_reads_nothing_of_that_pool_only(cluster):
    """HELLO never links such a pool, so the lease's link is rewritten: read() must not trust it either."""
    pools = (KV, indexer_pool())
    a, b = cluster.make("A", pools=pools), cluster.make("B", pools=pools)
    pages = sequence(1)
    seed(a, pages, [0])
    seed(a, pages, [0], pool="indexer")
    lease = b.client.lease(a.endpoint, [("kv", pages), ("indexer", pages)])
    assert lease is not None and lease.link is not None
    wire = lease.link.pools["kv"]
    halved = dataclasses.replace(lease.link, pools={**lease.link.pools, "kv": _halved(wire)})
    odd = dataclasses.replace(lease, link=halved)  # the same source, describing kv in pieces of another size
    result = b.client.read(odd, [PoolRead("kv", pages, [5]), PoolRead("indexer", pages, [6])])
    assert reasons(result) == ["geometry differs from the source"]
    assert reasons(result, "indexer") == [None]  # the next pool is still read
    assert b.hosts["kv"].read_page(5) == bytes(KV.page_bytes)
    assert b.hosts["indexer"].read_page(6) == content(pages[0], indexer_pool().page_bytes)
    b.client.release(lease)


def _halved(wire):
    return protocol.PoolWire(
        wire.pool_id, wire.name, wire.namespace, wire.regions, [p // 2 for p in wire.pieces], wire.slots
    )


def test_host_region_ids_that_miss_a_component_fail_loudly_before_anything_is_posted(cluster):
    """A wiring bug must never land part of a page: one host region id for a two-component pool."""
    a, b = cluster.make("A"), cluster.make("B")
    pages = sequence(1)
    seed(a, pages, [0])
    posted = []
    real = b.data_plane.read
    b.data_plane.intercept("read", lambda *args, **kw: posted.append(args) or real(*args, **kw))
    client = client_of(b, b.data_plane, host_ids=lambda pool: b.host_regions.ids(pool)[:1])
    lease = client.lease(a.endpoint, [("kv", pages)])
    assert lease is not None
    with pytest.raises(ValueError):
        client.read(lease, [PoolRead("kv", pages, [5])])
    assert posted == [] and b.hosts["kv"].read_page(5) == bytes(KV.page_bytes)
    client.release(lease)
    client.close()
