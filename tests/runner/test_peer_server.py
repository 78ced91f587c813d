"""The source side, frame by frame: what each request gets back, what is refused and how, what is bounded.

Frames are built with the protocol module and handed to ``PeerServer.handle`` the way the control
channel does; nothing here goes through a client, so every answer is the server's own.
"""

import logging
import secrets

import pytest

from kvcr.adapters.local import InMemoryMetrics, MonotonicClock, RecordingInventory
from kvcr.adapters.mock import MockDataPlane, MockFabric, MockHostMemory
from kvcr.domain.layout import PieceRun
from kvcr.runner import protocol
from kvcr.runner.peer_server import PeerServer, ServerLimits
from kvcr.runner.protocol import (
    MAX_LEASE_PAGES,
    MAX_POOLS,
    Hello,
    HelloReply,
    Lease,
    LeaseReply,
    RefusalCode,
    Refused,
    Release,
)
from kvcr.runner.runner import KvcrRunner
from tests.support import HostPool, content, indexer_pool, kv_pool, runner_config, sequence

POOLS = (kv_pool(), indexer_pool())
FILLER = {f"p{i}": "x" for i in range(MAX_POOLS)}  # with "kv": one pool too many for a HELLO


class Recording(MockDataPlane):
    """A mock data plane that is also a two-sided transport and wants to know when peers will read."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.expected: list[float] = []
        self.guard = None

    def expect_reads(self, within_s):
        self.expected.append(within_s)

    def guard_reads(self, allowed):
        self.guard = allowed


@pytest.fixture
def sources():
    """sources(limits=...) -> a peer server over its own runner, host pools and recording data plane."""
    made = []

    def build(limits=None, runner_type=KvcrRunner):
        memory = MockHostMemory()
        metrics = InMemoryMetrics(strict=True)
        runner = runner_type(
            runner_config(POOLS, 16),
            memory=memory,
            clock=MonotonicClock(),
            metrics=metrics,
            inventory=RecordingInventory(),
        )
        made.append(runner)
        hosts = {p.name: HostPool(p, 32) for p in POOLS}
        for name, host in hosts.items():
            runner.register_host_pool(name, host.regions)
        plane = Recording(MockFabric(), "A", MonotonicClock())
        ids = {pool: plane.register(regions, exposed=True) for pool, regions in runner.pool_arenas().items()}
        server = PeerServer(runner, plane, ids, metrics, limits=limits or ServerLimits())
        server.runner, server.plane, server.ids, server.metrics, server.hosts = runner, plane, ids, metrics, hosts
        return server

    yield build
    for runner in made:
        runner.close()


@pytest.fixture
def source(sources):
    return sources()


def nonce():
    return secrets.token_bytes(16)


def ask(server, message):
    reply = server.handle(protocol.encode(message))
    return None if reply is None else protocol.decode(reply)


def hello(server, namespaces=None, sent=None):
    return ask(server, Hello(sent or nonce(), "target", "inc", namespaces or dict(server.runner.namespaces)))


def store(server, pages, pool="kv"):
    host = server.hosts[pool]
    for slot, page in enumerate(pages):
        host.write_page(slot, content(page, host.pool.page_bytes))
    assert all(server.runner.backup(pool, pages, list(range(len(pages)))))


def refused(server, reason):
    return server.metrics.snapshot().get(f"kvcr_peer_requests_refused_total{{reason={reason}}}", 0)


# ---------------------------------------------------------------------------------------------- HELLO


def test_hello_opens_a_session_with_the_matching_pools_and_the_lease_length(source):
    reply = hello(source, {"kv": source.runner.namespaces["kv"], "indexer": "0" * 16})
    assert isinstance(reply, HelloReply)
    assert [p.name for p in reply.pools] == ["kv"]
    assert reply.max_lease_ms == 10_000  # Timing().lease_s, in ms
    assert reply.incarnation == source.incarnation and reply.data_plane == source.plane.describe()
    wire = reply.pools[0]
    assert wire.regions == list(source.ids["kv"]) and wire.pieces == [256, 256] and wire.slots == 16
    assert source.plane.expected == [10.0]  # a peer may read from now on


def test_session_ids_are_random_non_zero_and_fit_a_signed_64_bit_int(source):
    sessions = [hello(source).session for _ in range(64)]
    assert len(set(sessions)) == 64
    assert all(0 < s < 1 << 63 for s in sessions)


@pytest.mark.parametrize(
    ("make", "code"),
    [
        (lambda s: {"kv": "0" * 16}, RefusalCode.NAMESPACE),
        (lambda s: {**FILLER, "kv": s.runner.namespaces["kv"]}, RefusalCode.TOO_LARGE),
    ],
)
def test_hello_refusals_answer_the_requests_nonce_with_a_code(source, make, code):
    sent = nonce()
    reply = hello(source, make(source), sent)
    assert reply == Refused(sent, int(code))
    assert refused(source, code.name.lower()) == 1


def test_hello_may_name_exactly_max_pools(source):
    names = {**{f"p{i}": "x" for i in range(MAX_POOLS - 1)}, "kv": source.runner.namespaces["kv"]}
    assert isinstance(hello(source, names), HelloReply)


def test_a_hello_nonce_is_accepted_once_and_must_be_16_bytes(source):
    sent = nonce()
    assert isinstance(hello(source, sent=sent), HelloReply)
    assert hello(source, sent=sent) == Refused(sent, int(RefusalCode.REPLAYED))
    short = secrets.token_bytes(8)
    # a nonce of the wrong length is malformed, and it is not echoed back
    assert hello(source, sent=short) == Refused(b"", int(RefusalCode.MALFORMED))
    assert refused(source, "replayed") == 1
    assert refused(source, "malformed") == 1


def test_remembered_hello_nonces_are_bounded_oldest_first(sources):
    source = sources(ServerLimits(max_nonces=3))
    sent = [nonce() for _ in range(4)]
    for n in sent:
        assert isinstance(hello(source, sent=n), HelloReply)
    assert isinstance(hello(source, sent=sent[0]), HelloReply)  # the oldest was forgotten
    for n in sent[2:]:
        assert isinstance(hello(source, sent=n), Refused)  # the newest are still remembered
    assert isinstance(hello(source, sent=sent[1]), HelloReply)


def test_open_sessions_are_bounded_least_recently_used_first(sources):
    source = sources(ServerLimits(max_sessions=2))
    store(source, sequence(1))
    first, second = hello(source).session, hello(source).session
    lease = ask(source, Lease(nonce(), first, 1000, [(1, sequence(1))]))  # touching `first` makes it the newest
    assert isinstance(lease, LeaseReply)
    hello(source)  # a third session pushes out the least recently used: `second`
    assert ask(source, Lease(nonce(), second, 1000, [(1, sequence(1))])).code == RefusalCode.UNKNOWN_SESSION
    assert isinstance(ask(source, Lease(nonce(), first, 1000, [(1, sequence(1))])), LeaseReply)


def test_a_closing_server_refuses_hello_and_lease_but_takes_releases(source):
    store(source, sequence(1))
    session = hello(source).session
    granted = ask(source, Lease(nonce(), session, 1000, [(1, sequence(1))]))
    source.close_to_new_work()
    sent = nonce()
    assert hello(source, sent=sent) == Refused(sent, int(RefusalCode.CLOSING))
    assert ask(source, Lease(sent, session, 1000, [(1, sequence(1))])) == Refused(sent, int(RefusalCode.CLOSING))
    assert refused(source, "closing") == 2
    assert ask(source, Release(session, [granted.lease_id])) is None
    assert source.runner.active_leases == 0


# ---------------------------------------------------------------------------------------------- LEASE


def test_a_lease_grants_for_the_time_asked_at_most_the_configured_length(source):
    store(source, sequence(2))
    session = hello(source).session
    short = ask(source, Lease(nonce(), session, 2500, [(1, sequence(2))]))
    assert short.ttl_ms == 2500 and short.lease_id and short.slots == [[0, 1]]
    assert short.digests[0] == list(source.runner.lease([("kv", sequence(2))], 1).digests[0])
    long = ask(source, Lease(nonce(), session, 60_000, [(1, sequence(2))]))  # a peer configured for longer
    assert long.ttl_ms == 10_000
    hour = ask(source, Lease(nonce(), session, protocol.MAX_LEASE_MS, [(1, sequence(2))]))
    assert hour.ttl_ms == 10_000
    assert source.plane.expected == [10.0, 10.0, 10.0, 10.0]  # HELLO and every granted lease


@pytest.mark.parametrize("lease_ms", [-1, 0, protocol.MAX_LEASE_MS + 1, 10**9, 2**63 - 1, 2**64 - 1])
def test_a_lease_length_no_node_could_ask_for_is_refused_not_clamped(source, lease_ms):
    store(source, sequence(2))
    session = hello(source).session
    sent = nonce()
    assert ask(source, Lease(sent, session, lease_ms, [(1, sequence(2))])) == Refused(
        sent, int(RefusalCode.OUT_OF_RANGE)
    )
    assert refused(source, "out_of_range") == 1
    assert source.runner.active_leases == 0  # nothing pinned


def test_a_lease_nonce_is_accepted_once_per_session(source):
    store(source, sequence(1))
    session = hello(source).session
    sent = nonce()
    assert isinstance(ask(source, Lease(sent, session, 1000, [(1, sequence(1))])), LeaseReply)
    assert ask(source, Lease(sent, session, 1000, [(1, sequence(1))])) == Refused(sent, int(RefusalCode.REPLAYED))
    short = b"\x01" * 15
    assert ask(source, Lease(short, session, 1000, [(1, sequence(1))])) == Refused(b"", int(RefusalCode.MALFORMED))


def test_a_session_is_dropped_once_it_has_used_too_many_nonces(sources):
    source = sources(ServerLimits(max_nonces=2))
    store(source, sequence(1))
    session = hello(source).session
    for _ in range(2):
        assert isinstance(ask(source, Lease(nonce(), session, 1000, [(1, sequence(1))])), LeaseReply)
    third = ask(source, Lease(nonce(), session, 1000, [(1, sequence(1))]))
    assert isinstance(third, LeaseReply)  # the third is served, then the session is gone
    assert ask(source, Lease(nonce(), session, 1000, [(1, sequence(1))])).code == RefusalCode.UNKNOWN_SESSION


def budgeted(source, max_tracked):
    server = PeerServer(
        source.runner, source.plane, source.ids, InMemoryMetrics(), limits=ServerLimits(max_tracked_nonces=max_tracked)
    )
    server.runner = source.runner
    return server


def lease_once(server, session):
    return ask(server, Lease(nonce(), session, 1000, [(1, sequence(1))]))


def test_the_nonce_budget_drops_the_least_recently_used_session_first(source):
    store(source, sequence(1))
    server = budgeted(source, 4)
    s1, s2, s3 = (hello(server).session for _ in range(3))
    for session in (s1, s1, s2, s2):
        assert isinstance(lease_once(server, session), LeaseReply)
    assert server.tracked_nonces == 4  # at the budget: nothing dropped yet
    assert isinstance(lease_once(server, s3), LeaseReply)
    assert server.tracked_nonces == 3  # s1, used least recently, was dropped with its two nonces
    assert lease_once(server, s1).code == RefusalCode.UNKNOWN_SESSION
    assert isinstance(lease_once(server, s2), LeaseReply)  # 4 again
    assert isinstance(lease_once(server, s3), LeaseReply)  # 5: s2 is now the least recently used
    assert server.tracked_nonces == 2
    assert lease_once(server, s2).code == RefusalCode.UNKNOWN_SESSION
    assert isinstance(lease_once(server, s3), LeaseReply)


def test_the_nonce_budget_never_drops_the_last_session(source):
    store(source, sequence(1))
    server = budgeted(source, 2)
    only = hello(server).session
    for _ in range(4):
        assert isinstance(lease_once(server, only), LeaseReply)
    assert server.tracked_nonces == 4  # over the budget, but the one session left is kept


def test_lease_sizes_are_bounded_per_request(source):
    session = hello(source).session
    page = sequence(1)[0]
    at_limit = ask(source, Lease(nonce(), session, 1000, [(1, [page] * MAX_LEASE_PAGES)]))
    assert isinstance(at_limit, LeaseReply)
    sent = nonce()
    over = ask(source, Lease(sent, session, 1000, [(1, [page] * (MAX_LEASE_PAGES + 1))]))
    assert over == Refused(sent, int(RefusalCode.TOO_LARGE))
    many = ask(source, Lease(nonce(), session, 1000, [(1, [page])] * MAX_POOLS))
    assert isinstance(many, LeaseReply)
    sent = nonce()
    assert ask(source, Lease(sent, session, 1000, [(1, [page])] * (MAX_POOLS + 1))) == Refused(
        sent, int(RefusalCode.TOO_LARGE)
    )
    assert refused(source, "too_large") == 2


def test_a_lease_under_an_unknown_session_is_refused(source):
    sent = nonce()
    assert ask(source, Lease(sent, 12345, 1000, [(1, sequence(1))])) == Refused(sent, int(RefusalCode.UNKNOWN_SESSION))


def test_pool_ids_outside_the_session_are_misses_not_errors(source):
    store(source, sequence(1))
    session = hello(source, {"kv": source.runner.namespaces["kv"]}).session
    reply = ask(source, Lease(nonce(), session, 1000, [(7, sequence(1)), (0, sequence(1)), (1, sequence(1))]))
    assert reply.slots == [[-1], [-1], [0]]  # id 7 does not exist, id 0 (indexer) is not this session's


def test_release_ends_only_the_sessions_own_leases(source):
    store(source, sequence(1))
    mine, other = hello(source).session, hello(source).session
    granted = ask(source, Lease(nonce(), mine, 1000, [(1, sequence(1))]))
    assert ask(source, Release(other, [granted.lease_id])) is None
    assert source.runner.active_leases == 1  # another session cannot release it
    assert ask(source, Release(424242, [granted.lease_id])) is None  # nor an unknown one
    assert source.runner.active_leases == 1
    assert ask(source, Release(mine, [granted.lease_id])) is None
    assert source.runner.active_leases == 0
    assert ask(source, Release(mine, [granted.lease_id])) is None  # twice is harmless


def test_a_release_names_at_most_max_release_ids_leases(sources):
    source = sources(ServerLimits(max_release_ids=1))
    store(source, sequence(2))
    session = hello(source).session
    ids = [ask(source, Lease(nonce(), session, 1000, [(1, [p])])).lease_id for p in sequence(2)]
    ask(source, Release(session, ids))
    assert source.runner.active_leases == 1


# ---------------------------------------------------------------------------------------------- frames


def test_unreadable_frames_and_non_requests_are_malformed_without_a_nonce(source):
    assert protocol.decode(source.handle(b"\x00garbage")) == Refused(b"", int(RefusalCode.MALFORMED))
    reply = LeaseReply(nonce(), 1, 1, [], [])
    assert protocol.decode(source.handle(protocol.encode(reply))) == Refused(b"", int(RefusalCode.MALFORMED))
    assert refused(source, "malformed") == 2


def test_a_failure_inside_the_server_is_an_internal_refusal_with_the_nonce(source, caplog):
    session = hello(source).session
    source.runner.close()  # a shutdown race: the runner is gone while the server still answers
    sent = nonce()
    with caplog.at_level(logging.ERROR, logger="kvcr.runner.peer_server"):
        assert ask(source, Lease(sent, session, 1000, [(1, sequence(1))])) == Refused(sent, int(RefusalCode.INTERNAL))
    assert "Lease failed" in caplog.text
    assert refused(source, "internal") == 1


def test_refusals_are_logged_at_most_once_per_interval(source, caplog):
    with caplog.at_level(logging.INFO, logger="kvcr.runner.peer_server"):
        for _ in range(5):
            source.handle(b"garbage")
    assert caplog.text.count("refused a request: malformed") == 1


# ---------------------------------------------------------------------------------------------- the read guard


def test_a_two_sided_source_sends_only_pieces_a_live_lease_covers(source):
    store(source, sequence(3))
    store(source, sequence(3), pool="indexer")
    session = hello(source).session
    granted = ask(source, Lease(nonce(), session, 5000, [(1, sequence(2))]))  # kv slots 0 and 1
    guard = source.plane.guard
    k, v = source.ids["kv"]
    (ix,) = source.ids["indexer"]
    assert guard(granted.lease_id, [PieceRun(k, 0, 99, 0, 2), PieceRun(v, 1, 99, 5, 1)])
    assert not guard(granted.lease_id, [PieceRun(k, 1, 99, 0, 2)])  # slot 2 is not leased
    assert not guard(granted.lease_id, [PieceRun(k, 0, 99, 0, 1), PieceRun(ix, 0, 99, 0, 1)])  # nor the indexer
    assert not guard(granted.lease_id, [PieceRun(999, 0, 99, 0, 1)])  # a region that is not an arena
    assert not guard(granted.lease_id + 1, [PieceRun(k, 0, 99, 0, 1)])  # another lease
    assert guard(granted.lease_id, [])
    second = ask(source, Lease(nonce(), session, 5000, [(1, sequence(3)[2:])]))  # kv slot 2 only
    assert guard(second.lease_id, [PieceRun(k, 2, 99, 0, 1)]) and not guard(second.lease_id, [PieceRun(k, 1, 99, 0, 2)])
    ask(source, Release(session, [granted.lease_id]))
    assert not guard(granted.lease_id, [PieceRun(k, 0, 99, 0, 1)])  # released: nothing is covered


class ReleaseBug(KvcrRunner):
    """A runner with a bug in release_lease (a test double: what the server does about bugs)."""

    def release_lease(self, lease_id: int) -> bool:
        raise RuntimeError("bug")


def test_a_failure_while_releasing_is_an_internal_refusal_without_a_nonce(sources, caplog):
    source = sources(runner_type=ReleaseBug)
    store(source, sequence(1))
    session = hello(source).session
    granted = ask(source, Lease(nonce(), session, 1000, [(1, sequence(1))]))
    with caplog.at_level(logging.ERROR, logger="kvcr.runner.peer_server"):
        assert ask(source, Release(session, [granted.lease_id])) == Refused(b"", int(RefusalCode.INTERNAL))


def test_a_session_answers_only_the_connection_that_opened_it(source):
    store(source, sequence(2))

    def on(connection, message):
        reply = source.handle(protocol.encode(message), connection)
        return None if reply is None else protocol.decode(reply)

    session = on(b"victim", Hello(nonce(), "target", "inc", dict(source.runner.namespaces))).session
    granted = on(b"victim", Lease(nonce(), session, 1000, [(1, sequence(2))]))
    assert granted.lease_id and source.runner.active_leases == 1
    sent = nonce()
    assert on(b"insider", Lease(sent, session, 1000, [(1, sequence(2))])) == Refused(
        sent, int(RefusalCode.UNKNOWN_SESSION)
    )
    assert on(b"insider", Release(session, [granted.lease_id])) is None
    assert source.runner.active_leases == 1  # the lease holds
    assert refused(source, "foreign_session") == 2 and refused(source, "unknown_session") == 0
    # The insider's LEASE did not spend the victim's nonce: the victim may still use it.
    assert isinstance(on(b"victim", Lease(sent, session, 1000, [(1, sequence(2))])), LeaseReply)
    assert on(b"victim", Release(session, [granted.lease_id])) is None
    assert source.runner.active_leases == 1  # the second lease is still held
