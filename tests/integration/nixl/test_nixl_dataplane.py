"""NIXL specifics of the data plane, two agents in this process (CMA between them)."""

import logging
import os
import struct
import time

import msgspec
import numpy as np
import pytest

from kvcr.domain.layout import PieceRun, slot_runs
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable, TransportError
from tests.integration.buffers import Pool, wait

pytestmark = pytest.mark.nixl

KIB = 1024
MIB = 1024 * KIB


def connected(planes, src_pools, dst_pools):
    source, target = planes("source"), planes("target")
    src_ids = source.register([p.region for p in src_pools], exposed=True)
    dst_ids = target.register([p.region for p in dst_pools], exposed=False)
    return source, target, target.connect(source.describe(), 5.0), src_ids, dst_ids


def read_all(target, peer, runs):
    handle = target.read(peer, runs)
    state = wait(target, handle)
    target.release(handle)
    return state


def runs_for(pairs, src_id, dst_id):
    return [PieceRun(src_id, s, dst_id, d, n) for s, d, n in slot_runs(pairs)]


def test_coalesced_runs_and_scattered_pieces_land_the_same_bytes(planes):
    src, dst = Pool("src", 64, 4 * KIB, seed=1), Pool("dst", 64, 4 * KIB)
    _, target, peer, (s,), (d,) = connected(planes, [src], [dst])
    adjacent = runs_for([(10 + i, i) for i in range(32)], s, d)
    assert len(adjacent) == 1 and adjacent[0].count == 32
    assert read_all(target, peer.name, adjacent) is TransferState.DONE
    assert all(dst.piece(i) == src.piece(10 + i) for i in range(32))
    rng = np.random.default_rng(7)
    pairs = list(zip(rng.permutation(64)[:32].tolist(), rng.permutation(64)[:32].tolist(), strict=True))
    scattered = runs_for(pairs, s, d)
    assert len(scattered) > 16
    assert read_all(target, peer.name, scattered) is TransferState.DONE
    assert all(dst.piece(b) == src.piece(a) for a, b in pairs)


def test_strided_regions_are_read_piece_by_piece(planes):
    src = Pool("src", 16, 4 * KIB, stride=8 * KIB, seed=2)  # gaps between pieces
    dst = Pool("dst", 16, 4 * KIB, stride=12 * KIB)
    _, target, peer, (s,), (d,) = connected(planes, [src], [dst])
    assert read_all(target, peer.name, [PieceRun(s, 3, d, 0, 4), PieceRun(s, 15, d, 15)]) is TransferState.DONE
    assert [dst.piece(k) for k in range(4)] == [src.piece(3 + k) for k in range(4)] and dst.piece(15) == src.piece(15)
    gap = dst.array[4 * KIB : 12 * KIB]
    assert not gap.any()  # nothing written between destination pieces


def test_two_agents_read_32_pages_of_2_mib_byte_equal(planes):
    src, dst = Pool("src", 48, 2 * MIB, seed=4), Pool("dst", 40, 2 * MIB)
    _, target, peer, (s,), (d,) = connected(planes, [src], [dst])
    rng = np.random.default_rng(5)
    pairs = list(zip(rng.permutation(48)[:32].tolist(), rng.permutation(40)[:32].tolist(), strict=True))
    assert read_all(target, peer.name, runs_for(pairs, s, d)) is TransferState.DONE
    for a, b in pairs:
        assert dst.piece(b) == src.piece(a), f"slot {a} -> page {b} differs"


def test_the_description_names_only_exposed_memory(planes):
    arena, host, dst = Pool("arena", 8, 4 * KIB, seed=6), Pool("host", 8, 4 * KIB, seed=7), Pool("dst", 8, 4 * KIB)
    source, target = planes("source"), planes("target")
    (a,) = source.register([arena.region], exposed=True)
    (h,) = source.register([host.region], exposed=False)
    target.register([dst.region], exposed=False)
    fields = msgspec.msgpack.decode(source.describe())
    assert [r[0] for r in fields["regions"]] == [a]
    base = struct.pack("<Q", host.region.base)
    assert base not in fields["metadata"] and base not in source.describe()
    assert struct.pack("<Q", arena.region.base) in fields["metadata"]
    # A private region registered later does not change what peers are told.
    before = source.describe()
    source.register([Pool("staging", 2, 4 * KIB).region], exposed=False)
    assert source.describe() == before
    peer = target.connect(before, 5.0)
    with pytest.raises(TransportError, match="exposes no region"):
        target.read(peer.name, [PieceRun(h, 0, 1, 0)])


def test_late_writes_are_false_between_agents_of_this_host(planes):
    src, dst = Pool("src", 4, 4 * KIB, seed=8), Pool("dst", 4, 4 * KIB)
    _, target, peer, _, _ = connected(planes, [src], [dst])
    assert peer.late_writes is False  # CMA: a READ's bytes are copied inside its post
    own = target.connect(target.describe(), 5.0)
    assert own.name == "target" and own.late_writes is False


def test_connect_loads_metadata_once_and_a_new_region_on_top(planes):
    a, b, dst = Pool("a", 4, 4 * KIB, seed=9), Pool("b", 4, 4 * KIB, seed=10), Pool("dst", 4, 4 * KIB)
    source, target, peer, (a_id,), (d,) = connected(planes, [a], [dst])
    for _ in range(3):
        assert target.connect(source.describe(), 5.0) == peer
    assert target.metadata_loads == 1
    (b_id,) = source.register([b.region], exposed=True)
    assert target.connect(source.describe(), 5.0) == peer  # same incarnation: no new warm-up
    assert target.metadata_loads == 2
    assert read_all(target, peer.name, [PieceRun(b_id, 1, d, 0), PieceRun(a_id, 2, d, 1)]) is TransferState.DONE
    assert dst.piece(0) == b.piece(1) and dst.piece(1) == a.piece(2)


def test_a_peer_that_restarts_under_the_same_name_is_reconnected(planes):
    first, dst = Pool("src", 8, 4 * KIB, seed=11), Pool("dst", 8, 4 * KIB)
    source, target, peer, (s,), (d,) = connected(planes, [first], [dst])
    assert read_all(target, peer.name, [PieceRun(s, 0, d, 0)]) is TransferState.DONE
    source.close()
    reborn, second = planes("source"), Pool("src", 8, 4 * KIB, seed=12)
    (s2,) = reborn.register([second.region], exposed=True)
    assert target.connect(reborn.describe(), 5.0).name == "source"
    assert read_all(target, "source", [PieceRun(s2, 1, d, 0)]) is TransferState.DONE
    assert dst.piece(0) == second.piece(1) != first.piece(1)


def test_bad_descriptions_are_refused_and_a_good_one_still_works(planes):
    src, dst = Pool("src", 4, 4 * KIB, seed=13), Pool("dst", 4, 4 * KIB)
    source, target, peer, _, _ = connected(planes, [src], [dst])
    target.disconnect(peer.name)
    fields = msgspec.msgpack.decode(source.describe())
    for bad in (
        {**fields, "version": 99},
        {**fields, "name": ""},
        {**fields, "metadata": b"garbage"},
        {**fields, "regions": [[1, fields["regions"][0][1], 4096, 4, 0]]},  # zero-byte pieces
        {**fields, "regions": fields["regions"] * 2},  # one id twice
        {**fields, "regions": [[7, 4096, 4096, 4, 4096]]},  # memory its metadata does not cover
    ):
        with pytest.raises(PeerUnavailable):
            target.connect(msgspec.msgpack.encode(bad), 2.0)
    assert target.connect(source.describe(), 5.0) == peer


def test_a_peer_that_went_away_is_unavailable_fast(planes):
    src, dst = Pool("src", 4, 4 * KIB, seed=14), Pool("dst", 4, 4 * KIB)
    source, target, peer, (s,), (d,) = connected(planes, [src], [dst])
    description = source.describe()
    source.close()
    start = time.monotonic()
    try:
        handle = target.read(peer.name, [PieceRun(s, 0, d, 0)])
        assert wait(target, handle, timeout_s=2.0) is TransferState.FAILED
        target.release(handle)
    except PeerUnavailable:
        pass
    target.disconnect(peer.name)
    with pytest.raises(PeerUnavailable):
        target.connect(description, 1.0)
    assert time.monotonic() - start < 2.5


def test_no_warning_at_construction_and_the_transport_report_on_request(planes, caplog):
    with caplog.at_level(logging.INFO, logger="kvcr.adapters.nixl"):
        plane = planes("reporter")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    report = plane.transport_report
    assert report.zero_copy and report.read_gbps > 0.5 and not report.causes, report.summary()


def test_close_stops_nixl_threads_and_refuses_work(planes):
    def threads():
        return len(os.listdir("/proc/self/task"))

    warm = planes("warm")  # the first agent of a process also starts threads that outlive it
    assert warm.transport_report  # and its zero-copy probe thread: counted only once it has ended
    before = threads()
    plane = planes("closing")
    assert threads() > before  # NIXL's progress thread (and UCX's)
    plane.close()
    deadline = time.monotonic() + 5
    while threads() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threads() == before
    with pytest.raises(TransportError):
        plane.describe()
    plane.close()  # idempotent


def test_an_idle_connected_pair_costs_under_one_percent_of_a_core(planes):
    src, dst = Pool("src", 8, 64 * KIB, seed=15), Pool("dst", 8, 64 * KIB)
    _, target, peer, (s,), (d,) = connected(planes, [src], [dst])
    assert read_all(target, peer.name, [PieceRun(s, 0, d, 0, 8)]) is TransferState.DONE
    cpu, start = time.process_time(), time.monotonic()
    time.sleep(4.0)
    used = (time.process_time() - cpu) / (time.monotonic() - start)
    assert used < 0.01, f"idle data planes used {100 * used:.2f} % of a core"


def test_progress_off_needs_the_source_to_progress_for_wire_up(planes):
    src, dst = Pool("src", 4, 4 * KIB, seed=16), Pool("dst", 4, 4 * KIB)
    idle = planes("idle-source", progress_wake_s=None)
    idle.register([src.region], exposed=True)
    target = planes("target")
    target.register([dst.region], exposed=False)
    start = time.monotonic()
    with pytest.raises(PeerUnavailable, match="did not answer"):
        target.connect(idle.describe(), 0.5)
    assert time.monotonic() - start < 1.5
    with pytest.raises(TransportError):
        planes("bad", progress_wake_s=0)


def test_described_peer_gives_a_bare_agent_the_metadata_and_the_exposed_regions(planes):
    from kvcr.adapters.nixl import described_peer

    arena, host = Pool("arena", 8, 4 * KIB, seed=6), Pool("host", 8, 4 * KIB, seed=7)
    source = planes("source")
    (a,) = source.register([arena.region], exposed=True)
    source.register([host.region], exposed=False)
    peer = described_peer(source.describe())
    assert peer.name == "source" and list(peer.regions) == [a]
    r = peer.regions[a]
    assert (r.base, r.stride, r.count, r.piece_bytes) == (arena.region.base, 4 * KIB, 8, 4 * KIB)
    assert peer.metadata == msgspec.msgpack.decode(source.describe())["metadata"]
    with pytest.raises(PeerUnavailable):
        described_peer(b"not a description")
