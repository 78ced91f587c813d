"""A lease grants a page only under the namespace it was asked for: the same page hash elsewhere is a miss."""

import secrets

from kvcr.runner import protocol
from kvcr.runner.protocol import Hello, HelloReply, Lease, LeaseReply
from tests.support import Cluster, content, indexer_pool, kv_pool, seed, sequence


def fill(host, pages, slots):
    for page, slot in zip(pages, slots, strict=True):
        host.write_page(slot, content(page, host.pool.page_bytes))


def test_a_page_held_in_one_pool_is_missing_in_another(build):
    runner, hosts = build(pools=(kv_pool(), indexer_pool()))
    pages = sequence(2)
    fill(hosts["kv"], pages, [0, 1])
    runner.backup("kv", pages, [0, 1])  # the indexer pool holds neither page
    grant = runner.lease([("indexer", pages), ("kv", pages)], 5.0)
    assert grant.slots[0] == (-1, -1) and grant.digests[0] == (b"", b"")
    assert all(s >= 0 for s in grant.slots[1])
    assert runner.leased_slots(grant.lease_id) == {"kv": set(grant.slots[1])}
    nothing = runner.lease([("indexer", pages)], 5.0)
    assert nothing.lease_id == 0 and runner.active_leases == 1


def test_a_session_cannot_lease_from_a_pool_whose_namespace_it_does_not_share():
    cluster = Cluster()
    try:
        a = cluster.node("A", pools=(kv_pool(), indexer_pool()))
        pages = sequence(2)
        seed(a, pages, [0, 1], pool="kv")
        seed(a, pages, [0, 1], pool="indexer")  # the same page hashes, in both pools
        ask = Hello(secrets.token_bytes(16), "b", "i", {"kv": a.runner.namespaces["kv"]})
        hello = protocol.decode(a.server.handle(protocol.encode(ask)))
        assert isinstance(hello, HelloReply) and [p.name for p in hello.pools] == ["kv"]
        ids = {"indexer": 0, "kv": 1}  # pool ids follow pool names; "indexer" is not this session's
        lease = Lease(secrets.token_bytes(16), hello.session, 5000, [(ids["indexer"], pages), (ids["kv"], pages)])
        reply = protocol.decode(a.server.handle(protocol.encode(lease)))
        assert isinstance(reply, LeaseReply)
        assert reply.slots[0] == [-1, -1]
        assert all(s >= 0 for s in reply.slots[1])
        assert a.runner.leased_slots(reply.lease_id) == {"kv": set(reply.slots[1])}
    finally:
        cluster.close()
