"""Same-host restores off the source's slot board: no LEASE, still counted, never wrong bytes.

Two nodes in one process over the real shm plane (real memfds, the real broker, the C board
reader): the target finds the pages on the source's board and copies them with no control round
trip; the source hears how many it served from the SERVED report; a page whose slot the source
reused between the lookup and the copy is a miss, not a verification failure; a source that
offers no board is leased as before.
"""

import time

import pytest

from kvcr.adapters.local import MmapHostMemory
from kvcr.adapters.shm import ShmDataPlane, copies
from kvcr.container import build_container
from kvcr.domain.deadlines import Timing
from kvcr.domain.outcomes import Outcome
from kvcr.runner import peer_server, protocol
from kvcr.runner.node import NodeSettings
from kvcr.runner.peer_client import PoolRead
from kvcr.testing.replica import HostPool, bench_keys, bench_pool, page_pattern
from tests.support import free_port, runner_config

PAGE = 64 * 1024
TIMING = Timing(operation_s=3.0, abandon_s=6.0, control_s=1.0, lease_s=8.0, lease_margin_s=0.5, retry_after_s=0.2)
SERVED = "kvcr_pages_total{outcome=ok,path=served}"  # leased
REPORTED = "kvcr_pages_total{outcome=reported,path=served}"  # taken off the board, as SERVED says
RESTORED = "kvcr_pages_total{outcome=ok,path=remote_restore}"


class Node:
    """A node over the shm plane, its metrics, and an engine host pool of 64 pages."""

    def __init__(self, name: str, slots: int) -> None:
        pool = bench_pool(PAGE)
        config = runner_config((pool,), slots, name=name, timing=TIMING, verify_bytes=True)
        container = build_container(
            config, node=NodeSettings("127.0.0.1", free_port()), transport="shm", control="zmq", metrics="strict"
        )
        self.node = container.node()
        self.metrics = container.metrics()
        self.memory = MmapHostMemory()
        self.host = HostPool.allocate(self.memory, pool, 64)
        self.node.register_host_pool("kv", self.host.regions)

    def seed(self, keys: list[str], first_slot: int = 0) -> None:
        slots = list(range(first_slot, first_slot + len(keys)))
        for slot, key in zip(slots, keys, strict=True):
            self.host.write(slot, page_pattern(key, PAGE))
        assert all(self.node.runner.backup("kv", keys, slots))

    def count(self, series: str) -> float:
        return self.metrics.snapshot().get(series, 0)

    @property
    def side_requests(self) -> int:
        plane = self.node.data_plane
        assert isinstance(plane, ShmDataPlane)
        return plane.side_requests

    def close(self) -> None:
        self.node.close()
        self.host.free()
        self.memory.close()


@pytest.fixture
def nodes():
    made: list[Node] = []

    def make(name: str, slots: int = 16) -> Node:
        made.append(Node(name, slots))
        return made[-1]

    yield make
    for node in reversed(made):
        node.close()


def outcomes(result):
    return [o.outcome for o in result["kv"]]


def wait_for(check, seconds=2.0):
    deadline = time.monotonic() + seconds
    while not check() and time.monotonic() < deadline:
        time.sleep(0.01)
    return check()


def test_a_same_host_restore_reads_the_board_with_no_lease_and_the_source_counts_what_it_served(nodes):
    a, b = nodes("A"), nodes("B")
    keys = bench_keys(8)
    a.seed(keys)
    result = b.node.client.restore(a.node.endpoint, [PoolRead("kv", keys, list(range(20, 28)))])
    assert outcomes(result) == [Outcome.RESTORED] * 8
    for i, key in enumerate(keys):
        assert b.host.read(20 + i) == page_pattern(key, PAGE)
    assert b.side_requests == 1  # HELLO only: no LEASE, no RELEASE
    assert a.node.runner.active_leases == 0
    assert b.count(RESTORED) == 8
    assert wait_for(lambda: a.count(REPORTED) == 8)  # the SERVED report, batched off the restore path
    assert a.count(SERVED) == 0  # apart from what was leased: nothing was
    again = b.node.client.restore(a.node.endpoint, [PoolRead("kv", keys[:3], [40, 41, 42])])
    assert outcomes(again) == [Outcome.RESTORED] * 3
    assert b.side_requests == 1
    assert wait_for(lambda: a.count(REPORTED) == 11)


def test_a_served_report_larger_than_the_pool_is_counted_whole(nodes):
    # One report gathers every board restore of its interval: 70 restores of a full 8-slot pool make
    # one report of 560 pages, more than the source believes in one entry (at most the pool's slots)
    # or reads from one frame (64 entries).
    a, b = nodes("A", slots=8), nodes("B")
    keys = bench_keys(8)
    a.seed(keys)
    for _ in range(70):
        result = b.node.client.restore(a.node.endpoint, [PoolRead("kv", keys, list(range(8)))])
        assert outcomes(result) == [Outcome.RESTORED] * 8
    assert b.side_requests == 1
    assert wait_for(lambda: a.count(REPORTED) == 560)


def test_a_slot_reused_between_the_lookup_and_the_copy_is_a_miss_not_wrong_bytes(nodes):
    a, b = nodes("A", slots=8), nodes("B")
    keys = bench_keys(8)
    a.seed(keys)
    lease = b.node.client.lease(a.node.endpoint, [("kv", keys)])
    assert lease is not None and lease.board is not None and lease.lease_id == 0  # found, not leased
    # Nothing pins what a board lookup found: the source evicts four of them for new pages, whose
    # bytes now sit in those slots.
    newer = bench_keys(12)[8:]
    a.seed(newer, first_slot=10)
    evicted = [not held for held in a.node.runner.exists("kv", keys)]
    assert sum(evicted) == 4
    # Read in another order than found (each page's generation is then looked up by its slot).
    order = [7, 0, 6, 1, 5, 2, 4, 3]
    read = b.node.client.read(lease, [PoolRead("kv", [keys[k] for k in order], order)])
    b.node.client.release(lease)
    for k, outcome in zip(order, read["kv"], strict=True):
        i, key, gone = k, keys[k], evicted[k]
        if gone:
            assert outcome.outcome is Outcome.MISS and "reused the slot" in outcome.reason
        else:
            assert outcome.outcome is Outcome.RESTORED and b.host.read(i) == page_pattern(key, PAGE)
    assert not any(k.startswith("kvcr_verification_failures_total") for k in b.metrics.snapshot())
    # The board already says where the new pages are; the evicted ones are not on it.
    fresh = b.node.client.restore(a.node.endpoint, [PoolRead("kv", newer, [20, 21, 22, 23])])
    assert outcomes(fresh) == [Outcome.RESTORED] * 4
    for i, key in enumerate(newer):
        assert b.host.read(20 + i) == page_pattern(key, PAGE)
    assert b.side_requests == 1
    gone = keys[evicted.index(True)]
    assert outcomes(b.node.client.restore(a.node.endpoint, [PoolRead("kv", [gone], [30])])) == [Outcome.MISS]
    assert b.side_requests == 2  # not on the board: LEASE asked, and the source has it no more


def test_a_large_board_read_streams_its_copies_and_still_checks_the_slots(nodes, monkeypatch):
    monkeypatch.setattr(copies, "STREAM_MIN_BYTES", 0)  # every read is "large" (64 MiB+ in service)
    monkeypatch.setattr(copies._choice, "result", copies.Measurement(1 << 20, 1.0, 2.0))  # and streaming pays
    a, b = nodes("A", slots=8), nodes("B")
    keys = bench_keys(6)
    a.seed(keys)
    lease = b.node.client.lease(a.node.endpoint, [("kv", keys)])
    assert lease is not None and lease.board is not None
    a.seed(bench_keys(10)[6:], first_slot=8)  # the source needs two slots: it evicts two of ours
    evicted = [not held for held in a.node.runner.exists("kv", keys)]
    assert sum(evicted) == 2
    # Host slots 30, 31, 33, ... : two runs, so both the one-copy and the next-run paths are taken.
    hosts = [30, 31, 33, 34, 35, 36]
    result = b.node.client.read(lease, [PoolRead("kv", keys, hosts)])
    b.node.client.release(lease)
    for key, host, gone, outcome in zip(keys, hosts, evicted, result["kv"], strict=True):
        if gone:
            assert outcome.outcome is Outcome.MISS and "reused the slot" in outcome.reason
        else:
            assert outcome.outcome is Outcome.RESTORED and b.host.read(host) == page_pattern(key, PAGE)


def test_a_source_gone_between_the_lookup_and_the_copy_serves_nothing_more(nodes):
    a, b = nodes("A"), nodes("B")
    keys = bench_keys(4)
    a.seed(keys)
    lease = b.node.client.lease(a.node.endpoint, [("kv", keys)])
    assert lease is not None and lease.board is not None
    b.host.write(5, b"\x07" * PAGE)
    a.node.close()  # its mapping stays ours, but a peer that went away is not read
    result = b.node.client.read(lease, [PoolRead("kv", keys, [5, 6, 7, 8])])
    b.node.client.release(lease)
    assert outcomes(result) == [Outcome.FAILED] * 4
    assert b.host.read(5) == b"\x07" * PAGE  # nothing landed
    assert b.node.client.links == 0  # and the link is dropped, as after any failed read


def test_a_source_that_offers_no_board_is_leased_over_the_side_link(nodes, monkeypatch):
    monkeypatch.setattr(peer_server, "shares_boards", lambda: False)  # e.g. a source on a host that is not x86-64
    a = nodes("A")
    monkeypatch.undo()
    b = nodes("B")
    keys = bench_keys(4)
    a.seed(keys)
    result = b.node.client.restore(a.node.endpoint, [PoolRead("kv", keys, [0, 1, 2, 3])])
    assert outcomes(result) == [Outcome.RESTORED] * 4
    assert b.side_requests == 2  # HELLO and LEASE
    assert wait_for(lambda: a.node.runner.active_leases == 0)  # and its RELEASE
    assert a.count(SERVED) == 4


def test_served_reports_count_only_for_their_own_session_and_pools(nodes):
    a = nodes("A")
    server = a.node.server
    nonce = bytes(protocol.NONCE_BYTES)
    hello = protocol.Hello(nonce, "peer", "incarnation", dict(a.node.runner.namespaces))
    reply = protocol.decode(server.handle(protocol.encode(hello), b"conn-1"))
    assert isinstance(reply, protocol.HelloReply)
    (pool,) = reply.pools
    assert pool.board >= 0  # the HELLO offers the pool's board

    def report(session, pages, connection):
        assert server.handle(protocol.encode(protocol.Served(session, pages)), connection) is None

    report(reply.session, [(pool.pool_id, 5), (pool.pool_id + 7, 9)], b"conn-1")  # an unknown pool id is ignored
    report(reply.session, [(pool.pool_id, 5)], b"conn-2")  # another connection's report: ignored
    report(reply.session + 2, [(pool.pool_id, 5)], b"conn-1")  # no such session
    report(reply.session, [(pool.pool_id, 10**9)], b"conn-1")  # more pages than the pool has slots
    assert a.count(REPORTED) == 5
    assert a.count(SERVED) == 0  # a report never moves what the source itself granted (issue 43)
