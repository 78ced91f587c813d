"""The mock adapters' injected faults behave like the failures they stand for."""

import ctypes

import pytest

from kvcr.adapters.mock import ControlFaults, FakeClock, Faults, MockControlChannel, MockDataPlane, MockFabric
from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import CopyRun, RegionDescriptor
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import ControlTimeout, PeerUnavailable

PIECE = 64


def setup(faults=None):
    fabric, clock = MockFabric(), FakeClock()
    source = MockDataPlane(fabric, "source", clock, faults)
    target = MockDataPlane(fabric, "target", clock)
    src = ctypes.create_string_buffer(b"\x5a" * (PIECE * 4), PIECE * 4)
    dst = ctypes.create_string_buffer(PIECE * 4)
    source.register([RegionDescriptor("src", ctypes.addressof(src), PIECE, 4, PIECE)])
    target.register([RegionDescriptor("dst", ctypes.addressof(dst), PIECE, 4, PIECE)])
    peer = target.connect(source.describe())
    runs = [CopyRun("src", 0, "dst", 0, PIECE), CopyRun("src", 2 * PIECE, "dst", 2 * PIECE, PIECE)]
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
    *_, target, peer, runs, _ = setup(Faults(peer_down=True))
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
    reborn.register([RegionDescriptor("src", ctypes.addressof(keep[0]), PIECE, 4, PIECE)])
    assert target.connect(reborn.describe()) == "source"
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
