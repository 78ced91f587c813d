"""Transfers on its own: one posted read per chunk, where it lands, and what a failed read leaves behind.

A real runner reads from a source endpoint on the mock fabric (bytes really move, faults are the
source's) through a link that HELLO made over a scripted control channel, so each rule is seen
without a peer server or a PeerClient in front: the runs a chunk posts, the bytes that land, and
which handles and staging buffers stay quarantined until their read is really over.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import pytest

from kvcr.adapters.local import InMemoryMetrics, RecordingInventory
from kvcr.adapters.mock import FakeClock, Faults, MockDataPlane, MockFabric, MockHostMemory
from kvcr.domain.deadlines import Timing
from kvcr.domain.layout import PieceRun, page_extents
from kvcr.domain.outcomes import RESTORED, Outcome, failed, miss, uncertain
from kvcr.domain.pools import PoolSpec
from kvcr.ports.errors import TransportError
from kvcr.runner import protocol
from kvcr.runner.peer_links import RemoteLease, SourceLinks
from kvcr.runner.protocol import Hello, HelloReply, PoolWire
from kvcr.runner.staging import StagingPool
from kvcr.runner.transfers import Transfers, Wanted, chunks
from tests.support import HostPool, content, indexer_pool, kv_pool, make_runner, sequence

TIMING = Timing(operation_s=2.0, abandon_s=4.0, control_s=0.25, lease_s=5.0, lease_margin_s=0.5, retry_after_s=1.0)
KV = kv_pool()
INDEXER = indexer_pool()
FAR = 1e12  # a deadline that never bites
SOURCE_SLOTS = 16
HOST_PAGES = 32
LEASE_ID = 7
PAGES = sequence(4)

STALLED = Faults(stall=True, late_writes=True)  # a read that never ends, and that nothing can stop


class HelloControl:
    """Answers HELLO with the source's data plane and pools; nothing else is ever asked of it."""

    def __init__(self, description: bytes, pools: list[PoolWire]) -> None:
        self.description = description
        self.pools = pools
        self.forgotten: list[str] = []

    def request(self, endpoint: str, payload: bytes, timeout_s: float) -> bytes:
        hello = protocol.decode(payload)
        assert isinstance(hello, Hello)
        return protocol.encode(HelloReply(hello.nonce, 3, f"{endpoint}-1", self.description, self.pools, 10_000))

    def send(self, endpoint: str, payload: bytes) -> None:
        pass

    def forget(self, endpoint: str) -> None:
        self.forgotten.append(endpoint)


class Rig:
    """A target runner with host pools, a source endpoint holding known pages, and Transfers between them."""

    def __init__(self, *, pools=(KV,), faults=None, landing="auto", verify_bytes=True, staging_buffers=4):
        self.clock = FakeClock()
        self.fabric = MockFabric()
        self.metrics = InMemoryMetrics(strict=True)
        self.memory = MockHostMemory()
        self.source = MockDataPlane(self.fabric, "src", self.clock, faults)
        self.plane = MockDataPlane(self.fabric, "dst", self.clock)
        inventory = RecordingInventory()
        changes = {"timing": TIMING, "verify_bytes": verify_bytes}
        self.runner = make_runner(pools, 16, self.memory, self.clock, self.metrics, inventory, **changes)
        self.specs: dict[str, PoolSpec] = {p.name: p for p in pools}
        self.held = {p.name: HostPool(p, SOURCE_SLOTS) for p in pools}  # the source's exposed memory
        self.src_ids: dict[str, tuple[int, ...]] = {}
        self.hosts: dict[str, HostPool] = {}
        self.host_ids: dict[str, tuple[int, ...]] = {}
        wires = []
        for pool_id, p in enumerate(pools):
            self.src_ids[p.name] = self.source.register(self.held[p.name].regions, exposed=True)
            pieces = [c.piece_bytes for c in p.components]
            namespace = self.runner.namespaces[p.name]
            wires.append(PoolWire(pool_id, p.name, namespace, list(self.src_ids[p.name]), pieces, SOURCE_SLOTS))
            self.hosts[p.name] = HostPool(p, HOST_PAGES)
            canonical = self.runner.register_host_pool(p.name, self.hosts[p.name].regions)
            self.host_ids[p.name] = self.plane.register(canonical, exposed=False)
        self.links = SourceLinks(
            HelloControl(self.source.describe(), wires),
            self.plane,
            self.clock,
            self.metrics,
            timing=TIMING,
            namespaces=self.runner.namespaces,
            specs=self.specs,
            landing=landing,
            max_links=4,
            link_idle_s=300.0,
        )
        self.staging = StagingPool(self.memory, self.plane, 8, staging_buffers)
        self.transfers = Transfers(
            self.runner, self.links, self.plane, self.memory, self.clock, self.metrics, self.staging, self.host_ids.get
        )
        link = self.links.get("src", FAR)
        assert link is not None
        self.link = link
        self.posted: list[tuple[list[PieceRun], int]] = []  # (runs, lease id) of every read posted
        self.handles: list[int] = []
        real_read = self.plane.read

        def recording_read(peer, runs, *, lease=0):
            self.posted.append((list(runs), lease))
            self.handles.append(real_read(peer, runs, lease=lease))
            return self.handles[-1]

        self.plane.intercept("read", recording_read)

    def put(self, pool: str, src_slot: int, page: str) -> bytes:
        """Write a known page into the source's slot; returns the digest the source would send for it."""
        held = self.held[pool]
        held.write_page(src_slot, content(page, held.pool.page_bytes))
        return self.runner.digest_extents(pool, page_extents(held.regions, src_slot), page)

    def lease(self, items: list[Item], *, ttl_s: float = TIMING.lease_s, unsigned=(), wrong=()) -> RemoteLease:
        """A lease over ``items`` (each written at the source first), with a digest per page unless told."""
        order: dict[str, tuple[list[str], list[int], list[bytes]]] = {}
        for item in items:
            pages, slots, digests = order.setdefault(item.pool, ([], [], []))
            digest = self.put(item.pool, item.src_slot, item.page)
            if item.page in wrong:
                digest = bytes(16)
            pages.append(item.page)
            slots.append(item.src_slot)
            digests.append(b"" if item.page in unsigned else digest)
        return RemoteLease("src", LEASE_ID, self.clock.now(), ttl_s, dict(order), self.link)

    def read(self, lease: RemoteLease, chunk: list[Item], give_up: float | None = None):
        deadline = self.clock.now() + TIMING.operation_s if give_up is None else give_up
        return self.transfers.read_chunk(lease, self.link, parts(lease, chunk), deadline)

    def landed(self, item: Item) -> bool:
        """Whether the item's host slot holds exactly the source's bytes of its page."""
        host = self.hosts[item.pool]
        return host.read_page(item.host_slot) == content(item.page, host.pool.page_bytes)

    def untouched(self, item: Item) -> bool:
        host = self.hosts[item.pool]
        return host.read_page(item.host_slot) == bytes(host.pool.page_bytes)

    def failures(self, reason: str) -> float:
        return self.metrics.snapshot().get(f"kvcr_failures_total{{path=remote_restore,reason={reason}}}", 0)

    def close(self) -> None:
        self.runner.close()


@pytest.fixture
def rig():
    made: list[Rig] = []

    def _make(**kw):
        made.append(Rig(**kw))
        return made[-1]

    yield _make
    for r in made:
        r.close()


@dataclass(frozen=True)
class Item:
    """One page of a chunk as the tests write it: the transfers read them as per-pool arrays (``Wanted``)."""

    pool: str
    index: int
    page: str
    host_slot: int
    src_slot: int


def wanted(pages, src_slots, host_slots, pool="kv") -> list[Item]:
    return [
        Item(pool, i, page, host, src)
        for i, (page, src, host) in enumerate(zip(pages, src_slots, host_slots, strict=True))
    ]


def parts(lease: RemoteLease, chunk: list[Item]) -> list[Wanted]:
    """``chunk`` as the client hands it over: runs of one pool's pages, with the lease's digests."""
    out: list[Wanted] = []
    for item in chunk:
        digest = lease.digests.get((item.pool, item.page), b"")
        if out and out[-1].pool == item.pool:
            last = out[-1]
            out[-1] = Wanted(
                item.pool,
                [*last.indices, item.index],
                [*last.pages, item.page],
                [*last.host_slots, item.host_slot],
                [*last.src_slots, item.src_slot],
                [*last.digests, digest],
            )
        else:
            out.append(Wanted(item.pool, [item.index], [item.page], [item.host_slot], [item.src_slot], [digest]))
    return out


# ------------------------------------------------------------------ one read per chunk


def test_a_chunk_is_one_posted_read_with_consecutive_slots_merged_into_one_run_per_component(rig):
    """The whole chunk costs one transfer; the lease it was granted under travels with it."""
    r = rig()
    chunk = wanted(PAGES[:3], [4, 5, 6], [10, 11, 12])
    r.read(r.lease(chunk), chunk)
    (k, v), (hk, hv) = r.src_ids["kv"], r.host_ids["kv"]
    assert r.posted == [([PieceRun(k, 4, hk, 10, 3), PieceRun(v, 4, hv, 10, 3)], LEASE_ID)]


def test_slots_that_do_not_continue_each_other_start_a_new_run(rig):
    """A gap on either side breaks the run; both components follow the same slot runs."""
    r = rig()
    chunk = wanted(PAGES[:3], [4, 5, 9], [10, 11, 12])
    outcomes, moved = r.read(r.lease(chunk), chunk)
    (k, v), (hk, hv) = r.src_ids["kv"], r.host_ids["kv"]
    runs, _ = r.posted[0]
    assert runs == [
        PieceRun(k, 4, hk, 10, 2),
        PieceRun(v, 4, hv, 10, 2),
        PieceRun(k, 9, hk, 12),
        PieceRun(v, 9, hv, 12),
    ]
    assert outcomes == [RESTORED] * 3 and moved and all(r.landed(item) for item in chunk)


@pytest.mark.parametrize(
    ("src", "host", "expected"),
    [
        ([4, 4, 6], [10, 11, 12], [(4, 10, 1), (4, 11, 1), (6, 12, 1)]),  # ends as if consecutive, is not
        ([4, 5, 6], [10, 12, 11], [(4, 10, 1), (6, 11, 1), (5, 12, 1)]),  # the source counts up, the host not
    ],
    ids=["source repeats", "host out of order"],
)
def test_one_run_only_when_both_sides_count_up_by_one(rig, src, host, expected):
    r = rig()
    chunk = wanted(PAGES[:3], src, host)
    _, moved = r.read(r.lease(chunk), chunk)
    (k, v), (hk, hv) = r.src_ids["kv"], r.host_ids["kv"]
    runs, _ = r.posted[0]
    assert runs == [PieceRun(c, s, h, d, n) for s, d, n in expected for c, h in ((k, hk), (v, hv))]
    assert moved


def test_two_parts_of_one_pool_in_one_chunk_share_the_runs_of_that_pool(rig):
    r = rig()
    first, second = wanted(PAGES[:2], [4, 5], [10, 11]), wanted(PAGES[2:4], [6, 7], [12, 13])
    lease = r.lease(first + second)
    together = [*parts(lease, first), *parts(lease, second)]
    assert len(together) == 2
    outcomes, moved = r.transfers.read_chunk(lease, r.link, together, r.clock.now() + TIMING.operation_s)
    (k, v), (hk, hv) = r.src_ids["kv"], r.host_ids["kv"]
    assert r.posted[0][0] == [PieceRun(k, 4, hk, 10, 4), PieceRun(v, 4, hv, 10, 4)]
    assert outcomes == [RESTORED] * 4 and moved and all(r.landed(item) for item in first + second)


def test_a_chunk_spanning_pools_is_still_one_read_and_each_pool_lands_in_its_own_host_pages(rig):
    r = rig(pools=(KV, INDEXER))
    chunk = [Item("kv", 0, PAGES[0], 3, 1), Item("indexer", 0, PAGES[0], 5, 2)]
    outcomes, moved = r.read(r.lease(chunk), chunk)
    assert outcomes == [RESTORED, RESTORED] and moved
    assert len(r.posted) == 1
    runs, _ = r.posted[0]
    (k, v), (i,) = r.src_ids["kv"], r.src_ids["indexer"]
    (hk, hv), (hi,) = r.host_ids["kv"], r.host_ids["indexer"]
    assert runs == [PieceRun(k, 1, hk, 3), PieceRun(v, 1, hv, 3), PieceRun(i, 2, hi, 5)]
    assert r.landed(chunk[0]) and r.landed(chunk[1])


# ------------------------------------------------------------------ where it lands


def test_a_direct_read_lands_byte_for_byte_in_the_host_slots_and_releases_its_handle(rig):
    r = rig()
    chunk = wanted(PAGES, [0, 1, 2, 3], [20, 21, 22, 23])
    outcomes, moved = r.read(r.lease(chunk), chunk)
    assert outcomes == [RESTORED] * 4 and moved
    assert all(r.landed(item) for item in chunk)
    assert r.untouched(Item("kv", 0, "", 24, 0))  # not a byte beyond the chunk
    assert r.plane.live_transfers == 0 and r.transfers.quarantined == 0
    assert r.memory.live_allocations == 1  # the runner's arena only: a direct read takes no staging memory


def test_a_staged_read_lands_in_staging_first_then_is_copied_into_the_host_slots(rig):
    """Staging slots are dense from 0 in chunk order, whatever the host slots; the buffer is reused after."""
    r = rig(landing="staged")
    chunk = wanted(PAGES[:3], [4, 5, 9], [30, 12, 20])
    outcomes, moved = r.read(r.lease(chunk), chunk)
    assert outcomes == [RESTORED] * 3 and moved
    assert all(r.landed(item) for item in chunk)
    runs, _ = r.posted[0]
    staged_ids = tuple(dict.fromkeys(run.dst for run in runs))
    assert not set(staged_ids) & set(r.host_ids["kv"])
    (k, v), (sk, sv) = r.src_ids["kv"], staged_ids
    # staged slots 0, 1, 2 in chunk order: scattered host slots still make one run of source slots 4-5
    assert runs == [PieceRun(k, 4, sk, 0, 2), PieceRun(v, 4, sv, 0, 2), PieceRun(k, 9, sk, 2), PieceRun(v, 9, sv, 2)]
    assert r.plane.live_transfers == 0 and r.staging.quarantined == 0
    buffer = r.staging.take(KV)
    assert buffer is not None and buffer.ids == staged_ids  # given back, not leaked


def test_a_corrupt_staged_read_never_touches_the_host_pages_a_corrupt_direct_one_does(rig):
    """Staging exists so that bytes reach the engine's pages only after their check."""
    staged, direct = rig(landing="staged", faults=Faults(corrupt=True)), rig(faults=Faults(corrupt=True))
    chunk = wanted(PAGES[:2], [0, 2], [5, 6])  # one run per page: the fault flips each run's first byte
    for r in (staged, direct):
        outcomes, moved = r.read(r.lease(chunk), chunk)
        assert outcomes == [failed("bytes differ from the source's digest")] * 2
        assert moved  # the transfer itself completed; its bytes are what failed
    assert all(staged.untouched(item) for item in chunk)
    assert not any(direct.untouched(item) or direct.landed(item) for item in chunk)


def test_a_staged_page_that_fails_its_check_stays_out_of_its_host_slot_while_its_neighbours_land(rig):
    r = rig(landing="staged")
    chunk = wanted(PAGES[:3], [0, 1, 2], [5, 6, 7])
    outcomes, _ = r.read(r.lease(chunk, wrong={PAGES[1]}), chunk)
    assert outcomes == [RESTORED, failed("bytes differ from the source's digest"), RESTORED]
    assert r.landed(chunk[0]) and r.untouched(chunk[1]) and r.landed(chunk[2])


def test_a_staged_copy_that_fails_fails_every_page_of_the_chunk_and_gives_the_buffer_back(rig):
    r = rig(landing="staged", staging_buffers=1)
    chunk = wanted(PAGES[:2], [0, 1], [5, 6])
    lease = r.lease(chunk)
    r.memory.fail_after_moves = 0  # the fake's copy fault: nothing reaches the host pages
    outcomes, moved = r.read(lease, chunk)
    assert outcomes == [failed("staged copy failed")] * 2 and moved
    assert all(r.untouched(item) for item in chunk)
    assert r.staging.quarantined == 0 and r.staging.take(KV) is not None  # the only buffer is free again


# ------------------------------------------------------------------ digests


def test_a_page_whose_bytes_differ_from_its_digest_fails_alone_and_is_counted(rig):
    r = rig()
    chunk = wanted(PAGES[:3], [0, 1, 2], [5, 6, 7])
    outcomes, moved = r.read(r.lease(chunk, wrong={PAGES[2]}), chunk)
    assert outcomes == [RESTORED, RESTORED, failed("bytes differ from the source's digest")] and moved
    counted = r.metrics.snapshot()
    assert counted["kvcr_verification_failures_total{path=remote_restore}"] == 1
    assert r.failures("verification") == 1


def test_a_page_without_a_digest_is_not_served_even_when_its_bytes_are_right(rig):
    """Fail closed: a page nobody vouches for is as good as a corrupt one."""
    r = rig()
    chunk = wanted(PAGES[:2], [0, 1], [5, 6])
    outcomes, _ = r.read(r.lease(chunk, unsigned={PAGES[0]}), chunk)
    assert outcomes == [failed("the source sent no digest for the page (verify_bytes off there?)"), RESTORED]
    assert r.landed(chunk[0])  # the bytes arrived; they are just not vouched for
    assert r.metrics.snapshot()["kvcr_verification_failures_total{path=remote_restore}"] == 1


def test_with_verify_bytes_off_a_completed_read_is_restored_whatever_the_digests_say(rig):
    r = rig(verify_bytes=False)
    chunk = wanted(PAGES[:2], [0, 1], [5, 6])
    outcomes, _ = r.read(r.lease(chunk, unsigned={PAGES[0]}, wrong={PAGES[1]}), chunk)
    assert outcomes == [RESTORED, RESTORED] and all(r.landed(item) for item in chunk)


# ------------------------------------------------------------------ reads that never start


def test_a_chunk_whose_deadline_has_passed_posts_nothing(rig):
    r = rig(landing="staged")
    chunk = wanted(PAGES[:2], [0, 1], [5, 6])
    lease = r.lease(chunk)
    outcomes, moved = r.read(lease, chunk, give_up=r.clock.now())
    assert outcomes == [miss("lease expired before the read")] * 2 and not moved
    assert r.posted == [] and r.memory.live_allocations == 1  # no read, no staging buffer


def test_with_no_staging_memory_free_the_chunk_is_a_miss_and_buffers_already_taken_go_back(rig):
    """A chunk needs one buffer per pool: the kv one it got returns when the indexer one is missing."""
    r = rig(pools=(KV, INDEXER), landing="staged", staging_buffers=1)
    held = r.staging.take(INDEXER)
    assert held is not None
    chunk = [Item("kv", 0, PAGES[0], 3, 1), Item("indexer", 0, PAGES[0], 5, 2)]
    outcomes, moved = r.read(r.lease(chunk), chunk)
    assert outcomes == [miss("no staging memory free")] * 2 and not moved
    assert r.posted == []
    assert r.failures("no_staging") == 1
    assert r.metrics.snapshot()["kvcr_pages_total{outcome=miss,path=remote_restore}"] == 2
    assert r.staging.take(KV) is not None  # with one buffer per pool, only a given-back one can be taken


def test_a_refused_read_is_a_miss_marks_the_source_down_and_gives_the_staging_buffer_back(rig):
    r = rig(landing="staged", staging_buffers=1)
    chunk = wanted(PAGES[:1], [0], [5])
    lease = r.lease(chunk)
    r.source.set_faults(Faults(peer_down=True))  # the plane refuses to post
    outcomes, moved = r.read(lease, chunk)
    assert outcomes == [miss("peer unavailable")] and not moved
    assert len(r.links) == 0 and r.links.get("src", FAR) is None  # skipped for retry_after_s
    assert r.staging.quarantined == 0 and r.staging.take(KV) is not None


# ------------------------------------------------------------------ reads that end badly


def test_a_read_that_fails_is_released_marks_the_source_down_and_frees_its_staging_buffer(rig):
    """A FAILED read is terminal: nothing can land any more, so nothing needs quarantine."""
    r = rig(landing="staged", staging_buffers=1, faults=Faults(error=True))
    chunk = wanted(PAGES[:2], [0, 1], [5, 6])
    outcomes, moved = r.read(r.lease(chunk), chunk)
    assert outcomes == [failed("read failed")] * 2 and not moved
    assert r.plane.live_transfers == 0 and r.transfers.quarantined == 0
    assert len(r.links) == 0
    assert r.staging.quarantined == 0 and r.staging.take(KV) is not None
    assert all(r.untouched(item) for item in chunk)


def test_a_read_that_ends_after_the_lease_is_a_failure_even_though_its_bytes_arrived(rig):
    """The source may have reused the slots once its lease ran out: late bytes are not trusted."""
    r = rig(faults=Faults(latency_s=0.6))
    chunk = wanted(PAGES[:1], [0], [5])
    lease = r.lease(chunk, ttl_s=1.0)  # usable until sent + 0.5 s
    outcomes, moved = r.read(lease, chunk, give_up=r.clock.now() + 2.0)
    assert outcomes == [failed("read finished after the lease")] and not moved
    assert r.plane.live_transfers == 0 and len(r.links) == 1  # the source did nothing wrong
    assert r.link.bytes_per_s == 0.0  # nor is the read's time learned


def test_a_read_past_its_deadline_that_cancels_cleanly_is_timed_out_and_released(rig):
    r = rig(faults=Faults(stall=True))
    chunk = wanted(PAGES[:1], [0], [5])
    outcomes, moved = r.read(r.lease(chunk), chunk, give_up=r.clock.now() + 1.0)
    assert outcomes == [failed("read timed out")] and not moved
    assert r.plane.live_transfers == 0 and r.transfers.quarantined == 0
    assert r.failures("timeout") == 1 and r.failures("uncertain") == 0
    assert len(r.links) == 1  # a confirmed cancel needs no tear-down


def test_a_read_cut_off_by_the_lease_end_says_so_and_is_counted_as_an_expired_lease(rig):
    r = rig(faults=Faults(stall=True))
    chunk = wanted(PAGES[:1], [0], [5])
    lease = r.lease(chunk)
    outcomes, _ = r.read(lease, chunk, give_up=lease.usable_until(TIMING.lease_margin_s))
    assert outcomes == [failed("read would outlive the lease")]
    assert r.failures("lease_expired") == 1 and r.failures("timeout") == 0


def test_a_read_that_completes_only_while_being_cancelled_stays_a_failure(rig):
    """A late DONE is released like any terminal read, but never turns the timeout into a success."""
    r = rig(faults=Faults(latency_s=1.0))
    chunk = wanted(PAGES[:1], [0], [5])
    real_cancel = r.plane.cancel

    def cancel_after_it_landed(handle):
        r.clock.advance(1.0)
        return real_cancel(handle)

    r.plane.intercept("cancel", cancel_after_it_landed)
    outcomes, moved = r.read(r.lease(chunk), chunk, give_up=r.clock.now() + 0.5)
    assert outcomes == [failed("read timed out")] and not moved
    assert r.landed(chunk[0])  # it did land, too late to count
    assert r.plane.live_transfers == 0 and r.transfers.quarantined == 0


def test_a_direct_read_whose_cancel_is_unsure_is_stopped_by_tearing_the_peer_down(rig):
    """Disconnect is the strongest stop: when it ends the read, the read is an ordinary timeout."""
    r = rig(faults=Faults(stall=True, uncertain_cancel=True))
    chunk = wanted(PAGES[:1], [0], [5])
    outcomes, _ = r.read(r.lease(chunk), chunk, give_up=r.clock.now() + 1.0)
    assert outcomes == [failed("read timed out")]
    assert len(r.links) == 0  # marked down: its link dropped, its data-plane peer disconnected
    assert r.plane.live_transfers == 0 and r.transfers.quarantined == 0 and r.failures("uncertain") == 0


# ------------------------------------------------------------------ reads that never stop


def test_a_direct_read_that_cannot_be_stopped_is_uncertain_and_its_handle_quarantined(rig):
    """The host pages may still change: UNCERTAIN, and the handle is never released while live."""
    r = rig(faults=STALLED, landing="direct")
    chunk = wanted(PAGES[:2], [0, 1], [5, 6])
    give_up = r.clock.now() + 1.0
    outcomes, moved = r.read(r.lease(chunk), chunk, give_up=give_up)
    assert outcomes == [uncertain("transfer could not be confirmed stopped")] * 2 and not moved
    assert r.clock.now() >= give_up + 0.5  # it was given half a second to stop after the tear-down
    assert r.transfers.quarantined == 1 and r.plane.live_transfers == 1
    assert r.failures("uncertain") == 1 and r.failures("timeout") == 1
    assert len(r.links) == 0 and r.staging.quarantined == 0


def test_a_staged_read_that_cannot_be_stopped_is_a_miss_and_quarantines_its_buffer_at_once(rig):
    """No half-second wait: a staged read's late bytes can only land in memory nobody reads."""
    r = rig(faults=STALLED, staging_buffers=1)
    assert r.link.staged  # auto landing: the source says its given-up reads may still write
    chunk = wanted(PAGES[:2], [0, 1], [5, 6])
    give_up = r.clock.now() + 1.0
    outcomes, moved = r.read(r.lease(chunk), chunk, give_up=give_up)
    assert outcomes == [miss("read stalled (staged, quarantined)")] * 2 and not moved
    assert r.clock.now() < give_up + 0.01
    assert r.transfers.quarantined == 1 and r.staging.quarantined == 1 and r.plane.live_transfers == 1
    assert r.failures("uncertain") == 1


def test_a_quarantined_staging_buffer_is_not_reused_until_its_read_ends_and_is_reaped(rig):
    """Late bytes land in the quarantined buffer, never in host pages; only reap frees the buffer."""
    r = rig(faults=STALLED, staging_buffers=1)
    chunk = wanted(PAGES[:2], [0, 1], [5, 6])
    lease = r.lease(chunk)
    r.read(lease, chunk, give_up=r.clock.now() + 1.0)
    staged_ids = {run.dst for run in r.posted[0][0]}
    again = wanted(PAGES[2:3], [2], [7])
    assert r.read(r.lease(again), again) == ([miss("no staging memory free")], False)
    assert r.transfers.reap() == 1  # still live: kept
    assert r.staging.quarantined == 1 and r.staging.take(KV) is None
    r.source.set_faults(Faults(late_writes=True))  # the source thaws: the given-up read lands now
    assert r.transfers.reap() == 0
    assert r.transfers.quarantined == 0 and r.staging.quarantined == 0 and r.plane.live_transfers == 0
    assert all(r.untouched(item) for item in chunk)  # the late bytes went to staging only
    buffer = r.staging.take(KV)
    assert buffer is not None and set(buffer.ids) == staged_ids  # the same buffer, free again
    extents = buffer.extents(0)
    assert b"".join(ctypes.string_at(a, n) for a, n in extents) == content(PAGES[0], KV.page_bytes)


def test_a_stalled_chunk_spanning_pools_quarantines_one_handle_with_every_pools_buffer(rig):
    r = rig(pools=(KV, INDEXER), faults=STALLED)
    chunk = [Item("kv", 0, PAGES[0], 3, 1), Item("indexer", 0, PAGES[0], 5, 2)]
    r.read(r.lease(chunk), chunk, give_up=r.clock.now() + 1.0)
    assert r.transfers.quarantined == 1 and r.staging.quarantined == 2
    r.source.set_faults(Faults(late_writes=True))
    assert r.transfers.reap() == 0 and r.staging.quarantined == 0


def test_reaping_a_direct_uncertain_read_releases_its_handle_once_it_ends(rig):
    r = rig(faults=STALLED, landing="direct")
    chunk = wanted(PAGES[:1], [0], [5])
    r.read(r.lease(chunk), chunk, give_up=r.clock.now() + 1.0)
    assert r.transfers.reap() == 1 and r.plane.live_transfers == 1
    r.source.set_faults(Faults(late_writes=True))
    assert r.transfers.reap() == 0 and r.transfers.quarantined == 0 and r.plane.live_transfers == 0


def test_a_quarantined_read_whose_poll_fails_is_kept_and_the_others_are_still_reaped(rig):
    r = rig(faults=STALLED)
    for page, slot in ((PAGES[0], 5), (PAGES[1], 6)):
        chunk = wanted([page], [slot], [slot])
        r.read(r.lease(chunk), chunk, give_up=r.clock.now() + 1.0)
        r.clock.advance(TIMING.retry_after_s)  # the stall marked the source down: dial it again
        link = r.links.get("src", FAR)
        assert link is not None
        r.link = link
    assert r.transfers.quarantined == 2 and r.staging.quarantined == 2
    r.source.set_faults(Faults(late_writes=True))
    real_poll = r.plane.poll
    first = r.handles[0]

    def poll(handle):
        if handle == first:
            raise TransportError("poll failed")
        return real_poll(handle)

    r.plane.intercept("poll", poll)
    assert r.transfers.reap() == 1 and r.staging.quarantined == 1
    r.plane.intercept("poll", real_poll)
    assert r.transfers.reap() == 0 and r.staging.quarantined == 0 and r.plane.live_transfers == 0


# ------------------------------------------------------------------ what a read teaches


def test_a_completed_read_teaches_the_link_its_rate_over_every_pools_bytes(rig):
    r = rig(pools=(KV, INDEXER), faults=Faults(latency_s=0.5))
    chunk = [Item("kv", 0, PAGES[0], 3, 1), Item("indexer", 0, PAGES[0], 5, 2)]
    outcomes, _ = r.read(r.lease(chunk), chunk)
    assert outcomes == [RESTORED, RESTORED]
    nbytes = KV.page_bytes + INDEXER.page_bytes
    assert r.link.bytes_per_s == pytest.approx(nbytes / 0.5, rel=1e-2)


def test_a_failed_read_teaches_the_link_nothing(rig):
    r = rig(faults=Faults(error=True, latency_s=0.5))
    chunk = wanted(PAGES[:1], [0], [5])
    outcomes, _ = r.read(r.lease(chunk), chunk)
    assert outcomes[0].outcome is Outcome.FAILED and r.link.bytes_per_s == 0.0


# ------------------------------------------------------------------ cutting reads into transfers


def _part(pool: str, n: int, first: int = 0) -> Wanted:
    pages = [f"{pool}{k}" for k in range(first, first + n)]
    return Wanted(pool, range(first, first + n), pages, list(range(n)), list(range(n)), [b""] * n)


def test_chunks_fill_each_transfer_up_to_the_step_across_pools_in_order():
    kv, idx = _part("kv", 5), _part("indexer", 3)
    cut = chunks([kv, idx], 4)
    assert [[(p.pool, list(p.indices)) for p in chunk] for chunk in cut] == [
        [("kv", [0, 1, 2, 3])],
        [("kv", [4]), ("indexer", [0, 1, 2])],
    ]
    assert cut[1][0].pages == ["kv4"] and cut[1][0].src_slots == [4] and isinstance(cut[1][0].indices, range)
    assert cut[1][1] is idx  # a part that fits whole is not copied


def test_chunks_of_nothing_are_none_and_a_step_of_one_is_one_page_each():
    assert chunks([], 4) == []
    assert [len(chunk[0]) for chunk in chunks([_part("kv", 3)], 1)] == [1, 1, 1]
