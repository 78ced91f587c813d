"""NIXL specifics of the data plane: descriptor paths, big pages, peers coming and going, cancel."""

import numpy as np
import pytest

from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import CopyRun, coalesce
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable, RegistrationError, TransportError
from tests.integration.nixl.support import Pool, wait

pytestmark = pytest.mark.nixl

KIB = 1024
MIB = 1024 * KIB


def connected(planes, src_pools, dst_pools):
    source, target = planes("source"), planes("target")
    source.register([p.region for p in src_pools])
    target.register([p.region for p in dst_pools])
    return source, target, target.connect(source.describe())


def read_all(target, peer, runs):
    handle = target.read(peer, runs)
    state = wait(target, handle)
    target.release(handle)
    return state


def test_coalesced_runs_and_scattered_pieces_land_the_same_bytes(planes):
    src, dst = Pool("src", 64, 4 * KIB, seed=1), Pool("dst", 64, 4 * KIB)
    _, target, peer = connected(planes, [src], [dst])
    # 32 adjacent pieces: coalesce() merges them into one run, read as 32 consecutive indices.
    pairs = [(src.region, 10 + i, dst.region, i) for i in range(32)]
    merged = coalesce(pairs)
    assert len(merged) == 1
    assert read_all(target, peer, merged) is TransferState.DONE
    assert all(dst.piece(i) == src.piece(10 + i) for i in range(32))
    # The same pieces scattered: 32 one-piece runs, in random order on both sides.
    rng = np.random.default_rng(7)
    src_slots, dst_slots = rng.permutation(64)[:32], rng.permutation(64)[:32]
    scattered = coalesce([(src.region, int(s), dst.region, int(d)) for s, d in zip(src_slots, dst_slots, strict=True)])
    assert len(scattered) > 16
    assert read_all(target, peer, scattered) is TransferState.DONE
    assert all(dst.piece(int(d)) == src.piece(int(s)) for s, d in zip(src_slots, dst_slots, strict=True))


def test_runs_off_piece_boundaries_and_strided_regions(planes):
    src = Pool("src", 16, 4 * KIB, stride=8 * KIB, seed=2)  # gaps between pieces
    dense = Pool("dense", 16, 2 * KIB, seed=3)
    dst = Pool("dst", 16, 4 * KIB)
    _, target, peer = connected(planes, [src, dense], [dst])
    # Whole pieces of a strided region: prepared indices.
    assert read_all(target, peer, [CopyRun("src", 3 * 8 * KIB, "dst", 0, 4 * KIB)]) is TransferState.DONE
    assert dst.piece(0) == src.piece(3)
    # Bytes that straddle a piece and its gap, and pieces of another size: raw descriptors.
    odd = [CopyRun("src", 4 * KIB - 100, "dst", 5 * 4 * KIB + 7, 300), CopyRun("dense", 0, "dst", 8 * 4 * KIB, 2 * KIB)]
    assert read_all(target, peer, odd) is TransferState.DONE
    assert dst.bytes_at(5 * 4 * KIB + 7, 300) == src.bytes_at(4 * KIB - 100, 300)
    assert dst.bytes_at(8 * 4 * KIB, 2 * KIB) == dense.piece(0)
    # A run over several strided pieces is plain bytes, gaps included: raw descriptors too.
    span = CopyRun("src", 0, "dst", 0, 8 * KIB + 4 * KIB)
    assert read_all(target, peer, [span]) is TransferState.DONE
    assert dst.bytes_at(0, 12 * KIB) == src.bytes_at(0, 12 * KIB)


def test_two_agents_read_32_pages_of_2_mib_byte_equal(planes):
    src, dst = Pool("src", 48, 2 * MIB, seed=4), Pool("dst", 40, 2 * MIB)
    _, target, peer = connected(planes, [src], [dst])
    rng = np.random.default_rng(5)
    slots, places = rng.permutation(48)[:32], rng.permutation(40)[:32]
    runs = coalesce([(src.region, int(s), dst.region, int(d)) for s, d in zip(slots, places, strict=True)])
    assert read_all(target, peer, runs) is TransferState.DONE
    for s, d in zip(slots, places, strict=True):
        assert dst.piece(int(d)) == src.piece(int(s)), f"slot {s} -> page {d} differs"


def test_connect_is_idempotent_and_loads_metadata_once(planes):
    src, dst = Pool("src", 8, 4 * KIB, seed=6), Pool("dst", 8, 4 * KIB)
    source, target, peer = connected(planes, [src], [dst])
    for _ in range(3):
        assert target.connect(source.describe()) == peer == "source"
    assert target.metadata_loads == 1
    assert read_all(target, peer, [CopyRun("src", 0, "dst", 0, 8 * 4 * KIB)]) is TransferState.DONE
    assert dst.array.tobytes() == src.array.tobytes()


def test_a_peer_that_restarts_under_the_same_name_is_reconnected(planes):
    first, dst = Pool("src", 8, 4 * KIB, seed=7), Pool("dst", 8, 4 * KIB)
    source, target, peer = connected(planes, [first], [dst])
    assert read_all(target, peer, [CopyRun("src", 0, "dst", 0, 4 * KIB)]) is TransferState.DONE
    source.close()
    reborn, second = planes("source"), Pool("src", 8, 4 * KIB, seed=8)
    reborn.register([second.region])
    assert target.connect(reborn.describe()) == "source"
    assert target.metadata_loads == 2
    assert read_all(target, "source", [CopyRun("src", 4 * KIB, "dst", 0, 4 * KIB)]) is TransferState.DONE
    assert dst.piece(0) == second.piece(1) != first.piece(1)


def test_a_peer_that_adds_a_region_is_reloaded_and_readable(planes):
    a, b, dst = Pool("a", 4, 4 * KIB, seed=9), Pool("b", 4, 4 * KIB, seed=10), Pool("dst", 4, 4 * KIB)
    source, target, peer = connected(planes, [a], [dst])
    source.register([b.region])
    target.connect(source.describe())
    assert read_all(target, peer, [CopyRun("b", 0, "dst", 0, 4 * KIB)]) is TransferState.DONE
    assert dst.piece(0) == b.piece(0)


def test_disconnected_peers_and_bad_descriptions_are_refused(planes):
    src, dst = Pool("src", 4, 4 * KIB, seed=11), Pool("dst", 4, 4 * KIB)
    source, target, peer = connected(planes, [src], [dst])
    target.disconnect(peer)
    with pytest.raises(PeerUnavailable):
        target.read(peer, [CopyRun("src", 0, "dst", 0, 4 * KIB)])
    import msgspec

    fields = msgspec.msgpack.decode(source.describe())
    for bad in ({**fields, "version": 99}, {**fields, "name": ""}, {**fields, "metadata": b"garbage"}):
        with pytest.raises(PeerUnavailable):
            target.connect(msgspec.msgpack.encode(bad))
    assert target.connect(source.describe()) == peer  # and a good one still works after them


def test_registration_rules(planes):
    plane = planes("solo")
    a, b = Pool("a", 4, 4 * KIB), Pool("b", 4, 4 * KIB)
    with pytest.raises(RegistrationError):
        plane.register([a.region, a.region])
    plane.register([a.region])
    with pytest.raises(RegistrationError):
        plane.register([b.region, a.region])
    plane.register([b.region])  # the failed call registered nothing
    plane.deregister(["a", "nope"])
    plane.register([a.region])


def test_empty_read_and_unknown_handles(planes):
    _, target, peer = connected(planes, [Pool("src", 2, 4 * KIB)], [Pool("dst", 2, 4 * KIB)])
    handle = target.read(peer, [])
    assert target.poll(handle) is TransferState.DONE
    target.release(handle)
    with pytest.raises(TransportError):
        target.poll(handle)


def test_the_transport_report_says_zero_copy_on_this_machine(planes):
    plane = planes("reporter")
    report = plane.transport_report
    assert report is not None and report.zero_copy, report.summary()
    assert report.read_gbps > 0.5 and not report.causes
    assert planes("quiet", check_transport=False).transport_report is None


def test_close_stops_the_pump_and_refuses_work(planes):
    plane = planes("closing")
    pump = plane._pump
    assert pump is not None and pump.is_alive()
    plane.close()
    assert not pump.is_alive()
    with pytest.raises(TransportError):
        plane.describe()
    plane.close()  # idempotent


def test_release_of_a_live_transfer_is_refused(planes):
    src, dst = Pool("src", 64, 2 * MIB, seed=12), Pool("dst", 64, 2 * MIB)
    _, target, peer = connected(planes, [src], [dst])
    handle = target.read(peer, [CopyRun("src", 0, "dst", 0, 64 * 2 * MIB)])
    state = target.poll(handle)
    if not state.terminal:  # a CMA read may already be done; then there is nothing to refuse
        with pytest.raises(KvcrError):
            target.release(handle)
        with pytest.raises(KvcrError):
            target.close()
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)


def test_a_plane_can_read_from_itself(planes):
    plane = planes("self")
    src, dst = Pool("src", 4, 4 * KIB, seed=13), Pool("dst", 4, 4 * KIB)
    plane.register([src.region, dst.region])
    assert plane.connect(plane.describe()) == "self"
    assert plane.metadata_loads == 0  # its own metadata is never loaded as a peer
    assert read_all(plane, "self", [CopyRun("src", 4 * KIB, "dst", 0, 4 * KIB)]) is TransferState.DONE
    assert dst.piece(0) == src.piece(1)
