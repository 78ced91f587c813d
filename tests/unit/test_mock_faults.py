"""The mock adapters' injected faults behave like the failures they stand for."""

import ctypes

import pytest

from kvcr.adapters.mock import ControlFaults, FakeClock, Faults, MockControlChannel, MockDataPlane, MockFabric
from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import ControlTimeout, PeerUnavailable, TransportError

PIECE = 64


def setup(faults=None):
    fabric, clock = MockFabric(), FakeClock()
    source = MockDataPlane(fabric, "source", clock, faults)
    target = MockDataPlane(fabric, "target", clock)
    src = ctypes.create_string_buffer(b"\x5a" * (PIECE * 4), PIECE * 4)
    dst = ctypes.create_string_buffer(PIECE * 4)
    (src_id,) = source.register([RegionDescriptor("src", ctypes.addressof(src), PIECE, 4, PIECE)], exposed=True)
    (dst_id,) = target.register([RegionDescriptor("dst", ctypes.addressof(dst), PIECE, 4, PIECE)], exposed=False)
    peer = target.connect(source.describe(), 1.0).name
    runs = [PieceRun(src_id, 0, dst_id, 0), PieceRun(src_id, 2, dst_id, 2)]
    return fabric, clock, source, target, peer, runs, (src, dst)


def test_completion_follows_the_injected_clock():
    _, clock, _, target, peer, runs, (_, dst) = setup(Faults(latency_s=0.5))
    handle = target.read(peer, runs)
    assert target.poll(handle) is TransferState.PENDING
    assert dst.raw[:PIECE] == bytes(PIECE)  # nothing moves before completion
    clock.advance(0.5)
    assert target.poll(handle) is TransferState.DONE
    assert dst.raw[:PIECE] == b"\x5a" * PIECE


def test_stall_then_cancel_is_confirmed():
    _, clock, _, target, peer, runs, (_, dst) = setup(Faults(stall=True))
    handle = target.read(peer, runs)
    clock.advance(100)
    assert target.poll(handle) is TransferState.PENDING
    assert target.cancel(handle) is TransferState.CANCELLED
    target.release(handle)
    assert dst.raw == bytes(PIECE * 4)


def test_uncertain_cancel_may_still_land_and_cannot_be_released():
    _, _, source, target, peer, runs, (_, dst) = setup(Faults(stall=True, uncertain_cancel=True))
    handle = target.read(peer, runs)
    assert target.cancel(handle) is TransferState.UNCERTAIN
    with pytest.raises(KvcrError, match="reuse live memory"):
        target.release(handle)
    source.set_faults(Faults())  # the stuck transfer finally lands
    assert target.poll(handle) is TransferState.DONE
    assert dst.raw[:PIECE] == b"\x5a" * PIECE


def test_disconnect_fences_an_uncertain_read_unless_the_transport_writes_late():
    _, _, source, target, peer, runs, (_, dst) = setup(Faults(stall=True, uncertain_cancel=True))
    handle = target.read(peer, runs)
    assert target.cancel(handle) is TransferState.UNCERTAIN
    target.disconnect(peer)
    assert target.poll(handle) is TransferState.FAILED  # torn down: it will never write
    source.set_faults(Faults())
    assert target.poll(handle) is TransferState.FAILED and dst.raw == bytes(PIECE * 4)

    _, _, source, target, peer, runs, (_, dst) = setup(Faults(stall=True, late_writes=True))
    handle = target.read(peer, runs)
    assert target.cancel(handle) is TransferState.UNCERTAIN
    target.disconnect(peer)
    assert target.poll(handle) is TransferState.UNCERTAIN
    source.set_faults(Faults(late_writes=True))
    assert target.poll(handle) is TransferState.DONE and dst.raw[:PIECE] == b"\x5a" * PIECE  # it landed late


def test_a_peer_reads_only_exposed_regions_in_bounds():
    fabric, clock = MockFabric(), FakeClock()
    source, target = MockDataPlane(fabric, "source", clock), MockDataPlane(fabric, "target", clock)
    buffers = [ctypes.create_string_buffer(PIECE * 4) for _ in range(3)]
    (exposed,) = source.register([RegionDescriptor("a", ctypes.addressof(buffers[0]), PIECE, 4, PIECE)], exposed=True)
    (private,) = source.register([RegionDescriptor("b", ctypes.addressof(buffers[1]), PIECE, 4, PIECE)], exposed=False)
    (dst,) = target.register([RegionDescriptor("d", ctypes.addressof(buffers[2]), PIECE, 4, PIECE)], exposed=False)
    assert str(private) not in source.describe().decode().split('"exposed"')[1]
    peer = target.connect(source.describe(), 1.0).name
    with pytest.raises(TransportError, match="exposes no region"):
        target.read(peer, [PieceRun(private, 0, dst, 0)])
    with pytest.raises(TransportError, match="out of the registered bounds"):
        target.read(peer, [PieceRun(exposed, 3, dst, 0, 2)])


def test_error_partial_and_corrupt():
    *_, target, peer, runs, (_, dst) = setup(Faults(error=True))
    assert target.poll(target.read(peer, runs)) is TransferState.FAILED
    assert dst.raw == bytes(PIECE * 4)

    *_, target, peer, runs, (_, dst) = setup(Faults(partial_runs=1))
    assert target.poll(target.read(peer, runs)) is TransferState.FAILED
    assert dst.raw[:PIECE] == b"\x5a" * PIECE and dst.raw[2 * PIECE : 3 * PIECE] == bytes(PIECE)

    *_, target, peer, runs, (_, dst) = setup(Faults(corrupt=True))
    assert target.poll(target.read(peer, runs)) is TransferState.DONE
    assert dst.raw[:PIECE] != b"\x5a" * PIECE


def test_peer_down_and_kill():
    with pytest.raises(PeerUnavailable):
        setup(Faults(peer_down=True))  # connect() proves the peer reachable
    *_, source, target, peer, runs, _ = setup()
    source.set_faults(Faults(peer_down=True))
    with pytest.raises(PeerUnavailable):
        target.read(peer, runs)

    fabric, clock, _, target, peer, runs, _ = setup(Faults(latency_s=1.0))
    handle = target.read(peer, runs)
    fabric.kill("source")
    clock.advance(1.0)
    assert target.poll(handle) is TransferState.FAILED


def test_a_killed_endpoint_can_restart_under_the_same_name():
    fabric, clock, _, target, peer, runs, keep = setup()
    fabric.kill("source")
    with pytest.raises(PeerUnavailable):
        target.read(peer, runs)
    reborn = MockDataPlane(fabric, "source", clock)
    (src,) = reborn.register([RegionDescriptor("src", ctypes.addressof(keep[0]), PIECE, 4, PIECE)], exposed=True)
    runs = [PieceRun(src, r.src_first, r.dst, r.dst_first) for r in runs]  # the new incarnation's region ids
    with pytest.raises(PeerUnavailable):
        target.read(peer, runs)  # still connected to the old incarnation: its memory is gone
    assert target.connect(reborn.describe(), 1.0).name == "source"
    assert target.poll(target.read(peer, runs)) is TransferState.DONE


def test_control_faults():
    fabric, clock = MockFabric(), FakeClock()
    server = MockControlChannel(fabric, "tcp://a:1", clock, ControlFaults(stall=True))
    client = MockControlChannel(fabric, "tcp://b:1", clock)
    server.serve(lambda p: p)
    before = clock.now()
    with pytest.raises(ControlTimeout):
        client.request("tcp://a:1", b"x", timeout_s=2.0)
    assert clock.now() - before == pytest.approx(2.0)
    server.set_faults(ControlFaults(garble=True))
    assert client.request("tcp://a:1", b"x", timeout_s=2.0) != b"x"
    server.set_faults(ControlFaults(down=True))
    with pytest.raises(PeerUnavailable):
        client.request("tcp://a:1", b"x", timeout_s=2.0)
    server.set_faults(ControlFaults())
    assert client.request("tcp://a:1", b"x", timeout_s=2.0) == b"x"
    assert server.requests_served == 1
    fabric.kill("tcp://a:1")
    with pytest.raises(PeerUnavailable):
        client.request("tcp://a:1", b"x", timeout_s=2.0)
