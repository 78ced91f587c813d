"""Local-then-remote hit queries and reads (Restorer) and the lease book between them (PrefetchBook).

Two nodes on the mock fabric: A is the source, B the target whose engine asks. Leases are watched on
A's side (``active_leases``): a page pinned for nothing is the failure these rules prevent.
"""

import pytest

from kvcr.adapters.local import InMemoryMetrics
from kvcr.domain.deadlines import Timing
from kvcr.domain.keys import router_id
from kvcr.runner.peer_client import PoolRead
from kvcr.runner.prefetch import PrefetchBook
from kvcr.runner.restore import ReadResult, Restorer, Source
from tests.support import Cluster, content, indexer_pool, kv_pool, seed, sequence

TIMING = Timing(operation_s=2.0, abandon_s=4.0, control_s=0.25, lease_s=5.0, lease_margin_s=0.5)
POOLS = (kv_pool(), indexer_pool())


@pytest.fixture
def nodes():
    cluster = Cluster()
    a = cluster.node("A", pools=POOLS, timing=TIMING)
    b = cluster.node("B", pools=POOLS, timing=TIMING)
    book = PrefetchBook(b.client)
    yield cluster, a, b, book, Restorer(b.runner, b.client, book)
    cluster.close()


def host_bytes(node, pool, slot):
    return node.hosts[pool].read_page(slot)


def expected(page, pool):
    return content(page, (kv_pool() if pool == "kv" else indexer_pool()).page_bytes)


# ---------------------------------------------------------------------------------------------- sources


def test_a_source_covers_what_its_hint_names_or_everything_without_one():
    pages = sequence(2)
    assert Source("tcp://h:1").covers(pages[0])
    named = Source("tcp://h:1", frozenset({router_id(pages[0])}))
    assert named.covers(pages[0]) and not named.covers(pages[1])


# ---------------------------------------------------------------------------------------------- presence


def test_without_a_peer_client_only_local_pages_count(nodes):
    _, a, b, _, _ = nodes
    pages = sequence(3)
    seed(b, pages[:1], [0])
    seed(a, pages, [0, 1, 2])
    local_only = Restorer(b.runner, None, None)
    found = local_only.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, evidence=["kv"])
    assert found == {"kv": [True, False, False]}
    assert a.runner.active_leases == 0 and local_only.booked == 0
    local_only.finish("r")  # no book: nothing to do, nothing raised
    local_only.trim("r", [])
    local_only.close()


def test_local_pages_count_and_the_source_leases_the_rest_once(nodes):
    _, a, b, book, restorer = nodes
    pages = sequence(4)
    seed(a, pages, range(4))
    seed(b, pages[:1], [0])
    found = restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, request="r1", evidence=["kv"])
    assert found == {"kv": [True] * 4}
    assert a.runner.active_leases == 1 and restorer.booked == 3 and len(book) == 3
    again = restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, request="r2", evidence=["kv"])
    assert again == {"kv": [True] * 4}
    assert a.runner.active_leases == 1 and restorer.booked == 3  # booked pages are not leased twice
    assert [book.held("kv", p) is not None for p in pages] == [False, True, True, True]


def test_a_hit_query_without_a_request_id_holds_nothing_once_it_returns(nodes):
    # No request id: nobody will say the engine cut the hit or dropped the prefetch, so a lease kept
    # past the call could pin up to half the source's pool for nothing until it expires.
    _, a, b, book, restorer = nodes
    pages = sequence(4)
    seed(a, pages, range(4))
    seed(b, pages[:1], [0])
    found = restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, evidence=["kv"])
    assert found == {"kv": [True] * 4}  # the count is still exact: the source granted the pages
    assert a.runner.active_leases == 0 and restorer.booked == 0 and len(book) == 0
    result = restorer.read({"kv": (pages, [10, 11, 12, 13])}, {"kv": Source(a.endpoint)})
    assert result.restored == {"kv": [True] * 4}  # the read leases what it reads, then releases it
    assert [host_bytes(b, "kv", 10 + i) for i in range(4)] == [expected(p, "kv") for p in pages]
    assert a.runner.active_leases == 0


def test_pages_the_source_does_not_hold_stay_missing(nodes):
    _, a, _, _, restorer = nodes
    pages = sequence(3)
    seed(a, pages[:2], [0, 1])
    found = restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, request="r", evidence=["kv"])
    assert found == {"kv": [True, True, False]}
    assert restorer.booked == 2


def test_nothing_is_leased_past_the_first_page_no_evidence_pool_can_cover(nodes):
    _, a, _b, _, restorer = nodes
    pages = sequence(4)
    seed(a, pages, range(4), pool="indexer")
    seed(a, pages[:2], [0, 1])  # A's KV stops at page 2
    hinted = Source(a.endpoint, frozenset(router_id(p) for p in pages[:2]))
    sources = {"kv": hinted, "indexer": Source(a.endpoint)}
    found = restorer.presence(pages, ["kv", "indexer"], sources, request="r", evidence=["kv", "indexer"])
    assert found == {"kv": [True, True, False, False], "indexer": [True, True, False, False]}
    assert restorer.booked == 4  # two pages of each pool; indexer pages 3 and 4 were not pinned


def test_pages_booked_earlier_do_not_count_past_the_first_page_the_evidence_lacks(nodes):
    _, a, _b, book, restorer = nodes
    pages = sequence(4)
    seed(a, pages, range(4), pool="indexer")
    seed(a, pages[:2], [0, 1])  # A's KV stops at page 2
    assert restorer.presence(
        pages, ["indexer"], {"indexer": Source(a.endpoint)}, request="r", evidence=["indexer"]
    ) == {"indexer": [True] * 4}
    assert [book.held("indexer", p) is not None for p in pages] == [True] * 4
    hinted = Source(a.endpoint, frozenset(router_id(p) for p in pages[:2]))
    found = restorer.presence(pages, ["kv", "indexer"], {"kv": hinted, "indexer": Source(a.endpoint)}, evidence=["kv"])
    # the engine can use no page past the KV run, so the indexer's booked pages 3 and 4 are no hit
    assert found == {"kv": [True, True, False, False], "indexer": [True, True, False, False]}


def test_a_pool_without_a_source_answers_from_its_own_tier(nodes):
    _, a, b, _, restorer = nodes
    pages = sequence(2)
    seed(a, pages, [0, 1])
    seed(b, pages[:1], [0], pool="indexer")
    found = restorer.presence(pages, ["kv", "indexer"], {"kv": Source(a.endpoint), "indexer": None}, evidence=["kv"])
    assert found == {"kv": [True, True], "indexer": [True, False]}


def test_an_unreachable_source_leaves_only_local_pages(nodes):
    _cluster, _, b, _, restorer = nodes
    pages = sequence(2)
    seed(b, pages[:1], [0])
    found = restorer.presence(pages, ["kv"], {"kv": Source("tcp://127.0.0.1:1")}, evidence=["kv"])
    assert found == {"kv": [True, False]} and restorer.booked == 0


# ---------------------------------------------------------------------------------------------- reads


def test_a_read_takes_local_pages_first_then_booked_ones_and_releases_the_lease(nodes):
    _, a, b, _, restorer = nodes
    pages = sequence(3)
    seed(a, pages, range(3))
    seed(b, pages[:1], [0])
    restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, request="r", evidence=["kv"])
    served_before = a.metrics.snapshot().get("kvcr_pages_total{outcome=ok,path=served}", 0)
    result = restorer.read({"kv": (pages, [40, 41, 42])}, {"kv": Source(a.endpoint)})
    assert result == ReadResult({"kv": [True, True, True]})
    assert [host_bytes(b, "kv", s) for s in (40, 41, 42)] == [expected(p, "kv") for p in pages]
    assert a.runner.active_leases == 0 and restorer.booked == 0
    assert a.metrics.snapshot().get("kvcr_pages_total{outcome=ok,path=served}", 0) == served_before  # no new lease


def test_a_read_without_a_hit_query_leases_then_and_releases_at_once(nodes):
    _, a, b, _, restorer = nodes
    pages = sequence(2)
    seed(a, pages, [0, 1], pool="indexer")
    result = restorer.read({"indexer": (pages, [7, 8])}, {"indexer": Source(a.endpoint)})
    assert result.restored == {"indexer": [True, True]} and result.uncertain is None
    assert host_bytes(b, "indexer", 8) == expected(pages[1], "indexer")
    assert a.runner.active_leases == 0


def test_a_read_with_no_source_or_no_client_is_local_only(nodes):
    _, a, b, _, restorer = nodes
    pages = sequence(2)
    seed(a, pages, [0, 1])
    seed(b, pages[:1], [0])
    assert restorer.read({"kv": (pages, [3, 4])}, {"kv": None}).restored == {"kv": [True, False]}
    local_only = Restorer(b.runner, None, None)
    assert local_only.read({"kv": (pages, [3, 4])}, {"kv": Source(a.endpoint)}).restored == {"kv": [True, False]}
    assert a.runner.active_leases == 0


def test_an_unconfirmed_remote_read_is_reported_uncertain():
    from kvcr.adapters.mock import Faults
    from kvcr.runner.peer_client import PeerSettings

    cluster = Cluster()
    try:
        a = cluster.node("A", pools=POOLS, timing=TIMING, faults=Faults(stall=True, late_writes=True))
        b = cluster.node("B", pools=POOLS, timing=TIMING, peer=PeerSettings(landing="direct"))
        pages = sequence(2)
        seed(a, pages, [0, 1], pool="indexer")
        restorer = Restorer(b.runner, b.client, PrefetchBook(b.client))
        result = restorer.read({"indexer": (pages, [9, 10])}, {"indexer": Source(a.endpoint)})
        assert result.restored == {"indexer": [False, False]}
        assert result.uncertain == (
            "a read into host pages of pool 'indexer' could not be confirmed stopped "
            "(transfer could not be confirmed stopped)"
        )
    finally:
        cluster.close()


# ---------------------------------------------------------------------------------------------- the book


def booked(nodes, n, request="r", pool="kv"):
    _, a, _, _book, restorer = nodes
    pages = sequence(n)
    seed(a, pages, range(n), pool=pool)
    restorer.presence(pages, [pool], {pool: Source(a.endpoint)}, request=request, evidence=[pool])
    return pages


def test_trim_releases_what_the_engine_cut_and_keeps_the_rest(nodes):
    _, a, _, book, restorer = nodes
    pages = booked(nodes, 4)
    restorer.trim("r", pages[:2])
    assert len(book) == 2 and a.runner.active_leases == 1
    restorer.trim("r", [])
    assert len(book) == 0 and a.runner.active_leases == 0
    restorer.trim("unknown", [])  # nothing booked for it: nothing happens


def test_finish_releases_everything_a_request_still_books_and_only_that(nodes):
    _cluster, a, _b, book, restorer = nodes
    first = booked(nodes, 2, request="r1")
    other = sequence(2, start=500)
    seed(a, other, [10, 11])
    restorer.presence(other, ["kv"], {"kv": Source(a.endpoint)}, request="r2", evidence=["kv"])
    assert a.runner.active_leases == 2 and len(book) == 4
    restorer.finish("r1")
    assert a.runner.active_leases == 1 and len(book) == 2
    assert book.held("kv", first[0]) is None and book.held("kv", other[0]) is not None
    restorer.finish("r1")  # twice is harmless
    restorer.close()
    assert a.runner.active_leases == 0 and len(book) == 0


def test_done_releases_a_lease_only_once_all_its_pages_are_read(nodes):
    _, a, _, book, _ = nodes
    pages = booked(nodes, 3)
    book.done([("kv", pages[0])])
    assert a.runner.active_leases == 1 and len(book) == 2
    book.done([("kv", "0" * 64), ("kv", pages[1])])  # a page the book never had is ignored
    assert a.runner.active_leases == 1
    book.done([("kv", pages[2])])
    assert a.runner.active_leases == 0 and len(book) == 0


def test_take_groups_booked_pages_by_their_lease(nodes):
    _, a, _b, book, restorer = nodes
    first = booked(nodes, 2)
    other = sequence(2, start=900)
    seed(a, other, [20, 21])
    restorer.presence(other, ["kv"], {"kv": Source(a.endpoint)}, request="r", evidence=["kv"])
    groups = book.take([("kv", first[0]), ("kv", other[1]), ("kv", first[1]), ("kv", "f" * 64)])
    assert sorted(sorted(p for _, p in items) for _, items in groups) == sorted([sorted(first), [other[1]]])
    assert len({id(lease) for lease, _ in groups}) == 2
    assert len(book) == 4  # take does not drop: done does


def test_a_lease_with_no_page_left_to_book_is_released_at_once(nodes):
    _, a, b, book, _ = nodes
    pages = sequence(2)
    seed(a, pages, [0, 1])
    lease = b.client.lease(a.endpoint, [("kv", pages)])
    assert a.runner.active_leases == 1
    book.add(lease, [("kv", "0" * 64)], "r")  # nothing it holds is asked for
    assert a.runner.active_leases == 0 and len(book) == 0
    first = b.client.lease(a.endpoint, [("kv", pages)])
    book.add(first, [("kv", pages[0]), ("kv", pages[1])], None)
    second = b.client.lease(a.endpoint, [("kv", pages)])
    book.add(second, [("kv", pages[0])], None)  # already booked under the first lease
    assert book.held("kv", pages[0]) is first and a.runner.active_leases == 1


def test_a_lease_that_can_no_longer_be_read_in_time_is_forgotten(nodes):
    cluster, a, _, book, restorer = nodes
    pages = booked(nodes, 2)
    lease = book.held("kv", pages[0])
    cluster.clock.advance(TIMING.lease_s - TIMING.lease_margin_s - 0.01)
    assert book.held("kv", pages[0]) is lease  # still readable
    cluster.clock.advance(0.02)
    assert book.held("kv", pages[0]) is None and len(book) == 0
    assert lease.released  # expired at the source too: no RELEASE is sent for it
    found = restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, request="r", evidence=["kv"])
    assert found == {"kv": [True, True]} and len(book) == 2  # a fresh lease


def test_reads_use_the_book_and_leave_other_requests_bookings_alone(nodes):
    _, a, _b, book, restorer = nodes
    pages = booked(nodes, 4, request="r1")
    result = restorer.read({"kv": (pages[:2], [50, 51])}, {"kv": Source(a.endpoint)})
    assert result.restored == {"kv": [True, True]}
    assert len(book) == 2 and a.runner.active_leases == 1  # the lease still holds pages 3 and 4
    restorer.finish("r1")
    assert a.runner.active_leases == 0


def test_close_of_the_client_side_releases_every_booked_lease(nodes):
    _, a, _, book, _ = nodes
    booked(nodes, 2)
    book.close()
    assert len(book) == 0 and a.runner.active_leases == 0


def test_a_read_from_a_lease_that_was_released_is_all_misses(nodes):
    _, a, b, _, _ = nodes
    pages = sequence(1)
    seed(a, pages, [0])
    lease = b.client.lease(a.endpoint, [("kv", pages)])
    b.client.release(lease)
    outcomes = b.client.read(lease, [PoolRead("kv", pages, [5])])
    assert [o.reason for o in outcomes["kv"]] == ["lease released"]


def test_a_request_whose_leases_all_ended_can_still_be_trimmed_and_finished(nodes):
    _, a, _, book, restorer = nodes
    pages = booked(nodes, 2, request="r")
    book.done([("kv", p) for p in pages])
    assert a.runner.active_leases == 0
    restorer.trim("r", [])
    restorer.finish("r")
    assert len(book) == 0


def test_finish_releases_a_requests_later_lease_after_its_first_one_ended(nodes):
    _, a, _, book, restorer = nodes
    first = booked(nodes, 1, request="r")
    later = sequence(1, start=700)
    seed(a, later, [9])
    restorer.presence(later, ["kv"], {"kv": Source(a.endpoint)}, request="r", evidence=["kv"])
    assert a.runner.active_leases == 2
    book.done([("kv", first[0])])
    assert a.runner.active_leases == 1
    restorer.finish("r")
    assert a.runner.active_leases == 0


def test_a_lease_is_dead_exactly_at_its_usable_end(nodes):
    cluster, _, b, book, _ = nodes
    pages = booked(nodes, 1)
    lease = book.held("kv", pages[0])
    cluster.clock.advance(lease.usable_until(TIMING.lease_margin_s) - cluster.clock.now())
    assert not b.client.alive(lease) and book.held("kv", pages[0]) is None


def test_booked_pages_count_on_a_later_query_without_a_source(nodes):
    _, a, b, _, restorer = nodes
    pages = sequence(3)
    seed(a, pages, range(3))
    seed(b, pages[:1], [0])
    restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, request="r", evidence=["kv"])
    assert restorer.booked == 2
    again = restorer.presence(pages, ["kv"], {}, evidence=["kv"])  # no hint this time: the book still counts
    assert again == {"kv": [True, True, True]} and a.runner.active_leases == 1


def test_without_evidence_pools_every_page_may_be_leased(nodes):
    _, a, _, _, restorer = nodes
    pages = sequence(2)
    seed(a, pages, [0, 1])
    assert restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}) == {"kv": [True, True]}


def test_a_pool_without_a_source_does_not_stop_the_next_pool_from_leasing(nodes):
    _, a, _, _, restorer = nodes
    pages = sequence(2)
    seed(a, pages, [0, 1], pool="indexer")
    found = restorer.presence(pages, ["kv", "indexer"], {"kv": None, "indexer": Source(a.endpoint)}, evidence=[])
    assert found == {"kv": [False, False], "indexer": [True, True]}
    read = restorer.read(
        {"kv": (pages, [1, 2]), "indexer": (pages, [3, 4])}, {"kv": None, "indexer": Source(a.endpoint)}
    )
    assert read.restored == {"kv": [False, False], "indexer": [True, True]}


def test_a_pool_without_a_source_does_not_stop_the_next_pool_from_leasing_at_read(nodes):
    _, a, _, _, restorer = nodes
    pages = sequence(2)
    seed(a, pages, [0, 1])
    seed(a, pages, [0, 1], pool="indexer")
    restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, request="r", evidence=["kv"])  # kv is booked
    # kv, read first, has no source now (its pages come from the book); indexer was not booked: it is leased now
    sources = {"kv": None, "indexer": Source(a.endpoint)}
    read = restorer.read({"kv": (pages, [1, 2]), "indexer": (pages, [3, 4])}, sources)
    assert read.restored == {"kv": [True, True], "indexer": [True, True]}
    assert a.runner.active_leases == 0


def test_the_book_keeps_no_record_of_a_lease_once_it_ended(nodes):
    _, a, _, book, restorer = nodes
    pages = booked(nodes, 2, request="r")
    restorer.read({"kv": (pages, [40, 41])}, {"kv": Source(a.endpoint)})
    assert len(book) == 0 and a.runner.active_leases == 0
    # a bound on the book's size: nothing of a lease read in full is kept, so the book does not grow per lease
    assert book._by_id == {} and book._requests == {}


def test_a_dead_source_does_not_stop_the_next_source_from_leasing(nodes):
    _, a, _, _, restorer = nodes
    pages = sequence(1)
    seed(a, pages, [0], pool="indexer")
    sources = {"kv": Source("tcp://127.0.0.1:1"), "indexer": Source(a.endpoint)}
    found = restorer.presence(pages, ["kv", "indexer"], sources, evidence=[])
    assert found == {"kv": [False], "indexer": [True]}


def test_a_restorer_with_a_client_but_no_book_answers_locally(nodes):
    _, a, b, _, _ = nodes
    seed(a, sequence(1), [0])
    half = Restorer(b.runner, b.client, None)
    assert half.presence(sequence(1), ["kv"], {"kv": Source(a.endpoint)}, evidence=["kv"]) == {"kv": [False]}
    assert half.booked == 0


@pytest.mark.parametrize("missing", ["book", "client"])
def test_a_restorer_without_a_book_or_without_a_client_reads_only_local_pages(nodes, missing):
    _, a, b, book, _ = nodes
    pages = sequence(2)
    seed(a, pages, [0, 1])
    seed(b, pages[:1], [0])
    half = Restorer(b.runner, b.client, None) if missing == "book" else Restorer(b.runner, None, book)
    served = a.control.requests_served
    result = half.read({"kv": (pages, [40, 41])}, {"kv": Source(a.endpoint)})
    assert result == ReadResult({"kv": [True, False]})
    assert host_bytes(b, "kv", 40) == expected(pages[0], "kv")
    assert a.control.requests_served == served  # the source was not asked


def test_a_read_leases_only_what_the_hint_covers_and_reports_no_uncertainty(nodes):
    _, a, _, _, restorer = nodes
    pages = sequence(2)
    seed(a, pages, [0, 1])
    covered = Source(a.endpoint, frozenset({router_id(pages[0])}))
    result = restorer.read({"kv": (pages, [5, 6])}, {"kv": covered})
    assert result.restored == {"kv": [True, False]} and result.uncertain is None
    dead = restorer.read({"kv": (pages, [5, 6])}, {"kv": Source("tcp://127.0.0.1:1")})
    assert dead.restored == {"kv": [False, False]} and dead.uncertain is None


# ---------------------------------------------------------------------------------------------- how far a read goes


def test_a_read_stops_at_the_first_page_available_nowhere(nodes):
    _, a, b, _, restorer = nodes
    pages = sequence(3)
    seed(a, pages, range(3))
    holed = Source(a.endpoint, frozenset({router_id(pages[0]), router_id(pages[2])}))
    served = a.metrics.snapshot().get("kvcr_pages_total{outcome=ok,path=served}", 0)
    result = restorer.read({"kv": (pages, [40, 41, 42])}, {"kv": holed})
    assert result.restored == {"kv": [True, False, False]}
    assert host_bytes(b, "kv", 42) != expected(pages[2], "kv")  # the page past the hole was not read
    assert a.metrics.snapshot().get("kvcr_pages_total{outcome=ok,path=served}", 0) == served + 1


def test_a_local_page_does_not_end_a_read(nodes):
    _, a, b, _, restorer = nodes
    pages = sequence(3)
    seed(a, [pages[0], pages[2]], [0, 2])
    seed(b, [pages[1]], [1])
    covered = Source(a.endpoint, frozenset({router_id(pages[0]), router_id(pages[2])}))
    result = restorer.read({"kv": (pages, [40, 41, 42])}, {"kv": covered})
    assert result.restored == {"kv": [True, True, True]}
    assert [host_bytes(b, "kv", s) for s in (40, 41, 42)] == [expected(p, "kv") for p in pages]


@pytest.mark.parametrize("later_source", ["narrower hint", "no source"])
def test_booked_pages_are_read_even_where_the_reads_hint_does_not_cover_them(nodes, later_source):
    _, a, b, _, restorer = nodes
    pages = sequence(3)
    seed(a, pages, range(3))
    restorer.presence(pages, ["kv"], {"kv": Source(a.endpoint)}, request="r", evidence=["kv"])
    narrower = Source(a.endpoint, frozenset({router_id(pages[0])})) if later_source == "narrower hint" else None
    result = restorer.read({"kv": (pages, [40, 41, 42])}, {"kv": narrower})
    assert result.restored == {"kv": [True, True, True]}
    assert [host_bytes(b, "kv", s) for s in (40, 41, 42)] == [expected(p, "kv") for p in pages]
    assert a.runner.active_leases == 0


def test_a_hole_after_a_local_page_still_ends_the_read(nodes):
    _, a, b, _, restorer = nodes
    pages = sequence(3)
    seed(a, [pages[2]], [2])
    seed(b, [pages[0]], [0])
    holed = Source(a.endpoint, frozenset({router_id(pages[2])}))
    assert restorer.read({"kv": (pages, [40, 41, 42])}, {"kv": holed}).restored == {"kv": [True, False, False]}
    assert a.runner.active_leases == 0


def test_a_hole_after_a_booked_page_still_ends_the_read(nodes):
    _, a, _, _, restorer = nodes
    pages = sequence(3)
    seed(a, [pages[0], pages[2]], [0, 2])
    first = Source(a.endpoint, frozenset({router_id(pages[0])}))
    restorer.presence(pages, ["kv"], {"kv": first}, request="r", evidence=["kv"])
    holed = Source(a.endpoint, frozenset({router_id(pages[0]), router_id(pages[2])}))
    assert restorer.read({"kv": (pages, [40, 41, 42])}, {"kv": holed}).restored == {"kv": [True, False, False]}
    assert a.runner.active_leases == 0


# ---------------------------------------------------------------------------------------------- several holders


@pytest.fixture
def three():
    cluster = Cluster()
    a = cluster.node("A", pools=POOLS, timing=TIMING)
    b = cluster.node("B", pools=POOLS, timing=TIMING)
    c = cluster.node("C", pools=POOLS, timing=TIMING)
    book = PrefetchBook(c.client)
    metrics = InMemoryMetrics(strict=True)
    yield a, b, c, Restorer(c.runner, c.client, book, metrics), metrics
    cluster.close()


def hinted(endpoint, pages, then=None):
    return Source(endpoint, frozenset(router_id(p) for p in pages), then)


def hinted_counts(metrics):
    snap = metrics.snapshot()
    return {o: snap.get(f"kvcr_hinted_pages_total{{outcome={o}}}", 0) for o in ("leased", "missing", "unreachable")}


def test_a_dead_first_holder_costs_nothing_the_second_holds_in_the_same_hit_query(three):
    a, b, c, restorer, metrics = three
    pages = sequence(4)
    seed(b, pages, range(4))
    chain = hinted("tcp://127.0.0.1:1", pages, hinted(b.endpoint, pages))
    found = restorer.presence(pages, ["kv"], {"kv": chain}, request="r", evidence=["kv"])
    assert found == {"kv": [True] * 4}
    result = restorer.read({"kv": (pages, [20, 21, 22, 23])}, {"kv": chain})
    assert result.restored == {"kv": [True] * 4}
    assert [host_bytes(c, "kv", 20 + i) for i in range(4)] == [expected(p, "kv") for p in pages]
    assert hinted_counts(metrics) == {"leased": 4, "missing": 0, "unreachable": 4}
    by_source = restorer.hinted_by_source()
    assert by_source["tcp://127.0.0.1:1"] == {"leased": 0, "missing": 0, "unreachable": 4}
    assert by_source[b.endpoint] == {"leased": 4, "missing": 0, "unreachable": 0}
    assert a.runner.active_leases == 0


def test_pages_a_stale_first_holder_lacks_come_from_the_next_at_read_time(three):
    a, b, c, restorer, metrics = three
    pages = sequence(4)
    seed(a, pages[:2], [0, 1])  # A's hint is stale for the last two pages
    seed(b, pages, range(4))
    chain = hinted(a.endpoint, pages, hinted(b.endpoint, pages))
    result = restorer.read({"kv": (pages, [30, 31, 32, 33])}, {"kv": chain})  # no hit query before
    assert result.restored == {"kv": [True] * 4}
    assert [host_bytes(c, "kv", 30 + i) for i in range(4)] == [expected(p, "kv") for p in pages]
    assert restorer.hinted_by_source()[a.endpoint] == {"leased": 2, "missing": 2, "unreachable": 0}
    assert restorer.hinted_by_source()[b.endpoint] == {"leased": 2, "missing": 0, "unreachable": 0}
    assert hinted_counts(metrics) == {"leased": 4, "missing": 2, "unreachable": 0}
    assert a.runner.active_leases == 0 and b.runner.active_leases == 0


def test_a_second_holder_is_asked_only_for_pages_it_is_said_to_hold(three):
    a, b, _c, restorer, _ = three
    pages = sequence(3)
    seed(b, pages, range(3))
    chain = hinted(a.endpoint, pages, hinted(b.endpoint, pages[:1]))  # A holds nothing
    found = restorer.presence(pages, ["kv"], {"kv": chain}, request="r", evidence=["kv"])
    assert found == {"kv": [True, False, False]}
    assert restorer.hinted_by_source()[b.endpoint] == {"leased": 1, "missing": 0, "unreachable": 0}


def test_pages_without_a_hint_are_not_counted_as_hinted(three):
    _a, b, _c, restorer, metrics = three
    pages = sequence(2)
    seed(b, pages, [0, 1])
    restorer.presence(pages, ["kv"], {"kv": Source(b.endpoint)}, evidence=["kv"])  # our own writer rank
    assert hinted_counts(metrics) == {"leased": 0, "missing": 0, "unreachable": 0}
    assert restorer.hinted_by_source() == {}


def test_a_closing_source_still_gives_what_it_leased_and_refuses_only_the_rest(nodes):
    # A prefetch booked part of the prefix (a per-peer quota, say), then the source began a graceful
    # close: its refusal of the rest must not cost the pages it already leased to us.
    _, a, b, _, restorer = nodes
    pages = sequence(4)
    seed(a, pages, range(4))
    source = {"kv": Source(a.endpoint)}
    assert restorer.presence(pages[:2], ["kv"], source, request="r", evidence=["kv"]) == {"kv": [True, True]}
    a.server.close_to_new_work()
    result = restorer.read({"kv": (pages, [40, 41, 42, 43])}, source)
    assert result.restored == {"kv": [True, True, False, False]}
    assert [host_bytes(b, "kv", 40 + i) for i in range(2)] == [expected(p, "kv") for p in pages[:2]]
    assert a.runner.active_leases == 0 and restorer.booked == 0  # released: the source's close need not wait


@pytest.fixture
def counted():
    cluster = Cluster()
    a = cluster.node("A", pools=POOLS, timing=TIMING)
    b = cluster.node("B", pools=POOLS, timing=TIMING)
    metrics = InMemoryMetrics(strict=True)
    book = PrefetchBook(b.client, metrics)
    yield cluster, a, b, book, Restorer(b.runner, b.client, book, metrics), metrics
    cluster.close()


def unread(metrics):
    snap = metrics.snapshot()
    return {r: snap.get(f"kvcr_unread_pages_total{{reason={r}}}", 0) for r in ("trimmed", "prefetch_ended", "expired")}


def test_pages_leased_and_never_read_are_counted_by_why(counted, caplog):
    cluster, a, _b, book, restorer, metrics = counted
    pages = sequence(6)
    seed(a, pages, range(6))
    source = {"kv": Source(a.endpoint)}
    restorer.presence(pages[:4], ["kv"], source, request="cut", evidence=["kv"])
    restorer.trim("cut", pages[:1])  # another rank held one page only
    assert unread(metrics) == {"trimmed": 3, "prefetch_ended": 0, "expired": 0}
    assert restorer.read({"kv": (pages[:1], [50])}, source).restored == {"kv": [True]}
    restorer.finish("cut")  # everything it booked was read or trimmed: nothing more is unread
    assert unread(metrics)["prefetch_ended"] == 0
    with caplog.at_level("INFO", logger="kvcr.runner.prefetch"):
        restorer.presence(pages[4:], ["kv"], source, request="dropped", evidence=["kv"])
        restorer.finish("dropped")  # SGLang ended the prefetch before any read
    assert unread(metrics) == {"trimmed": 3, "prefetch_ended": 2, "expired": 0}
    assert "prefetch_ended" in caplog.text and "hicache_storage_prefetch_policy" in caplog.text
    restorer.presence(pages[:2], ["kv"], source, request="late", evidence=["kv"])
    cluster.clock.advance(TIMING.lease_s)
    assert book.held("kv", pages[0]) is None and len(book) == 0  # swept: it can no longer be read in time
    assert unread(metrics) == {"trimmed": 3, "prefetch_ended": 2, "expired": 2}


def test_nothing_is_leased_when_the_reachable_span_is_below_what_the_engine_would_prefetch(nodes):
    # SGLang prefetches nothing below its prefetch_threshold: a lease for such a hit is a source's
    # work for nothing (it used to be leased, then trimmed to 0 by the engine).
    _, a, b, _, restorer = nodes
    pages = sequence(4)
    seed(a, pages, range(4))
    seed(b, pages[:1], [0])
    source = {"kv": Source(a.endpoint)}
    found = restorer.presence(pages, ["kv"], source, request="r", evidence=["kv"], min_pages=5)
    assert found == {"kv": [True, False, False, False]}  # local pages still count
    assert a.runner.active_leases == 0 and restorer.booked == 0
    found = restorer.presence(pages, ["kv"], source, request="r", evidence=["kv"], min_pages=4)
    assert found == {"kv": [True] * 4} and restorer.booked == 3
