"""The source side at its edges: quotas per connection, refusal counts, side links, pool scope, lease bounds.

Frames are handed to ``PeerServer.handle`` the way the control channel does, each naming the
connection it came over.
"""

import secrets

import pytest

from kvcr.adapters.local import InMemoryMetrics, MonotonicClock, RecordingInventory
from kvcr.adapters.mock import MockDataPlane, MockFabric, MockHostMemory
from kvcr.domain.layout import ComponentSpec
from kvcr.domain.pools import PoolSpec
from kvcr.runner import protocol
from kvcr.runner.peer_server import PeerServer
from kvcr.runner.protocol import Hello, HelloReply, Lease, LeaseReply, RefusalCode, Refused, Release
from kvcr.runner.runner import KvcrRunner
from tests.support import HostPool, content, kv_pool, runner_config, sequence


class SideLinks(MockDataPlane):
    """A mock data plane whose peer links also carry control frames: it keeps the handler it is given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handler = None

    def serve_side(self, handler):
        self.handler = handler

    def side_request(self, peer, payload, timeout_s):
        return None

    def side_send(self, peer, payload):
        return False


class Source:
    """A peer server over its own runner, host pools and mock data plane."""

    def __init__(self, pools, plane_type=MockDataPlane, strict=True, **changes):
        self.metrics = InMemoryMetrics(strict=strict)
        self.runner = KvcrRunner(
            runner_config(pools, 16, **changes),
            memory=MockHostMemory(),
            clock=MonotonicClock(),
            metrics=self.metrics,
            inventory=RecordingInventory(),
        )
        self.hosts = {p.name: HostPool(p, 32) for p in pools}
        for name, host in self.hosts.items():
            self.runner.register_host_pool(name, host.regions)
        self.plane = plane_type(MockFabric(), "A", MonotonicClock())
        ids = {pool: self.plane.register(regions, exposed=True) for pool, regions in self.runner.pool_arenas().items()}
        self.server = PeerServer(self.runner, self.plane, ids, self.metrics)

    def store(self, pages, pool="kv"):
        host = self.hosts[pool]
        for slot, page in enumerate(pages):
            host.write_page(slot, content(page, host.pool.page_bytes))
        assert all(self.runner.backup(pool, pages, list(range(len(pages)))))

    def on(self, connection, message):
        reply = self.server.handle(protocol.encode(message), connection)
        return None if reply is None else protocol.decode(reply)

    def hello(self, connection, namespaces=None):
        reply = self.on(connection, Hello(nonce(), "target", "inc", namespaces or dict(self.runner.namespaces)))
        assert isinstance(reply, HelloReply)
        return reply

    def refused(self, reason):
        return self.metrics.snapshot().get(f"kvcr_peer_requests_refused_total{{reason={reason}}}", 0)


@pytest.fixture
def sources():
    made = []

    def build(pools=None, **kwargs):
        source = Source(pools or (kv_pool(),), **kwargs)
        made.append(source)
        return source

    yield build
    for source in made:
        source.runner.close()


def nonce():
    return secrets.token_bytes(16)


KV = 0  # the only pool: id 0 on the link


def test_each_connection_has_its_own_lease_quota_shared_by_all_its_sessions(sources):
    source = sources(max_peer_leases=1)
    pages = sequence(4)
    source.store(pages)
    for connection, page in ((b"first", pages[0]), (b"second", pages[1])):
        session = source.hello(connection).session
        granted = source.on(connection, Lease(nonce(), session, 1000, [(KV, [page])]))
        assert granted.lease_id and granted.slots[0][0] >= 0
        over = source.on(connection, Lease(nonce(), session, 1000, [(KV, [pages[2]])]))
        assert isinstance(over, LeaseReply) and over.lease_id == 0 and over.slots == [[-1]]
        another = source.hello(connection).session  # a fresh session does not bring a fresh quota
        assert source.on(connection, Lease(nonce(), another, 1000, [(KV, [pages[3]])])).lease_id == 0
    assert source.runner.active_leases == 2
    assert source.refused("peer_quota") == 4


def test_a_lease_under_a_session_that_never_existed_counts_as_unknown_not_foreign(sources):
    source = sources()
    sent = nonce()
    reply = source.on(b"peer", Lease(sent, 12345, 1000, [(KV, sequence(1))]))
    assert reply == Refused(sent, int(RefusalCode.UNKNOWN_SESSION))
    assert source.refused("unknown_session") == 1 and source.refused("foreign_session") == 0


def test_the_shortest_lease_one_millisecond_is_granted(sources):
    source = sources()
    source.store(sequence(1))
    session = source.hello(b"peer").session
    reply = source.on(b"peer", Lease(nonce(), session, 1, [(KV, sequence(1))]))
    assert isinstance(reply, LeaseReply) and reply.lease_id and reply.ttl_ms == 1 and reply.slots == [[0]]


def test_a_frame_given_without_a_connection_comes_over_the_empty_connection(sources):
    source = sources()
    source.store(sequence(1))
    hello = Hello(nonce(), "target", "inc", dict(source.runner.namespaces))
    session = protocol.decode(source.server.handle(protocol.encode(hello))).session
    reply = source.on(b"", Lease(nonce(), session, 1000, [(KV, sequence(1))]))
    assert isinstance(reply, LeaseReply) and reply.lease_id


def test_frames_over_side_links_are_answered_by_the_peer_server(sources):
    source = sources(plane_type=SideLinks)
    source.store(sequence(1))
    handler = source.plane.handler
    hello = Hello(nonce(), "target", "inc", dict(source.runner.namespaces))
    session = protocol.decode(handler(protocol.encode(hello), b"side-link")).session
    lease = protocol.decode(handler(protocol.encode(Lease(nonce(), session, 1000, [(KV, sequence(1))])), b"side-link"))
    assert isinstance(lease, LeaseReply) and lease.slots == [[0]]
    assert handler(protocol.encode(Release(session, [lease.lease_id])), b"side-link") is None
    assert source.runner.active_leases == 0


def test_a_pool_outside_the_session_is_a_miss_whatever_its_name(sources):
    # Any legal pool name, not only SGLang's (whose metric labels a strict catalogue checks).
    # Pool ids follow sorted pool names: "XXXX" (upper case sorts first) is 0, "kv" is 1.
    source = sources(pools=(kv_pool(), PoolSpec("XXXX", (ComponentSpec("x", 64),))), strict=False)
    pages = sequence(1)
    source.store(pages)
    source.store(pages, pool="XXXX")
    session = source.hello(b"peer", {"kv": source.runner.namespaces["kv"]})
    assert [(p.pool_id, p.name) for p in session.pools] == [(1, "kv")]
    reply = source.on(b"peer", Lease(nonce(), session.session, 1000, [(0, pages), (1, pages)]))
    assert reply.slots == [[-1], [0]]
    assert source.runner.leased_slots(reply.lease_id) == {"kv": {0}}
