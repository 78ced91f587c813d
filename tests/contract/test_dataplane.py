"""The DataPlane contract: every adapter must pass every test here."""

import ctypes
import os

import pytest

from kvcr.domain.layout import CopyRun, RegionDescriptor
from kvcr.ports.dataplane import TransferState
from kvcr.ports.errors import PeerUnavailable, TransportError

PIECE = 4096
COUNT = 16


class Buffer:
    def __init__(self, label, fill=None):
        self.raw = ctypes.create_string_buffer(PIECE * COUNT)
        if fill is not None:
            ctypes.memmove(self.raw, fill, PIECE * COUNT)
        self.region = RegionDescriptor(label, ctypes.addressof(self.raw), PIECE, COUNT, PIECE)

    def piece(self, index):
        return ctypes.string_at(self.region.address(index), PIECE)


def wait(plane, handle, limit=10_000):
    for _ in range(limit):
        state = plane.poll(handle)
        if state is not TransferState.PENDING:
            return state
    raise AssertionError("transfer never reached a terminal state")


@pytest.fixture
def pair(data_planes):
    source, target = data_planes("source"), data_planes("target")
    src = Buffer("src", os.urandom(PIECE * COUNT))
    dst = Buffer("dst")
    source.register([src.region])
    target.register([dst.region])
    peer = target.connect(source.describe())
    return source, target, peer, src, dst


def test_read_copies_the_bytes_of_every_run(pair):
    _, target, peer, src, dst = pair
    runs = [CopyRun("src", 3 * PIECE, "dst", 0, 2 * PIECE), CopyRun("src", 9 * PIECE, "dst", 5 * PIECE, PIECE)]
    handle = target.read(peer, runs)
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    assert dst.piece(0) == src.piece(3) and dst.piece(1) == src.piece(4) and dst.piece(5) == src.piece(9)
    assert dst.piece(2) == bytes(PIECE)


def test_connect_is_idempotent_and_names_the_peer(pair):
    source, target, peer, *_ = pair
    assert target.connect(source.describe()) == peer


def test_unknown_regions_and_out_of_bounds_runs_are_refused(pair):
    _, target, peer, *_ = pair
    for run in (
        CopyRun("nope", 0, "dst", 0, PIECE),
        CopyRun("src", 0, "nope", 0, PIECE),
        CopyRun("src", (COUNT - 1) * PIECE, "dst", 0, 2 * PIECE),
        CopyRun("src", 0, "dst", (COUNT - 1) * PIECE, 2 * PIECE),
    ):
        with pytest.raises(TransportError):
            target.read(peer, [run])


def test_reading_from_a_peer_never_connected_is_refused(pair):
    _, target, _, *_ = pair
    with pytest.raises(PeerUnavailable):
        target.read("stranger", [CopyRun("src", 0, "dst", 0, PIECE)])


def test_unreadable_description_is_refused(pair):
    _, target, *_ = pair
    with pytest.raises(PeerUnavailable):
        target.connect(b"\x00not a description")


def test_duplicate_registration_is_refused(pair):
    source, _, _, src, _ = pair
    with pytest.raises(TransportError):
        source.register([src.region])


def test_a_closed_peer_cannot_be_read(pair):
    source, target, peer, *_ = pair
    source.close()
    try:
        handle = target.read(peer, [CopyRun("src", 0, "dst", 0, PIECE)])
    except TransportError:
        return
    assert wait(target, handle) is TransferState.FAILED
    target.release(handle)


def test_cancel_of_a_finished_transfer_reports_its_terminal_state(pair):
    _, target, peer, *_ = pair
    handle = target.read(peer, [CopyRun("src", 0, "dst", 0, PIECE)])
    assert wait(target, handle) is TransferState.DONE
    assert target.cancel(handle) is TransferState.DONE
    target.release(handle)


def test_a_closed_data_plane_refuses_work(pair):
    _, target, peer, *_ = pair
    target.close()
    with pytest.raises(TransportError):
        target.read(peer, [CopyRun("src", 0, "dst", 0, PIECE)])
