"""The DataPlane contract: every adapter must pass every test here.

Most tests use two planes from the kind's ``make_data_plane``. The ones about a read that is
still in flight use the kind's *live reads*: a target, a connected source region and a way to
stall the source and resume it. Each kind produces the flavours it can: the mock both a fenced
source (a given-up read writes nothing more) and a late-writing one; NIXL a late-writing one only
(a tcp READ from a frozen process: on CMA a READ's bytes are all copied inside its post).
"""

import contextlib
import ctypes
import importlib
import os
import time

import numpy as np
import pytest

from kvcr.adapters.local import MmapHostMemory
from kvcr.adapters.mock import Faults
from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.dataplane import PeerInfo, TransferState
from kvcr.ports.errors import PeerUnavailable, RegistrationError, TransportError
from tests.contract.memory import CURRENT

PIECE = 4096
COUNT = 16
POISON = 0xAB


@pytest.fixture(autouse=True)
def shared_memory():
    """Every buffer lives in a sealed memfd, as kvcr's arenas do, so the shm kinds can expose it.

    Autouse fixtures are set up first and torn down last: the planes are closed before it frees.
    """
    memory = MmapHostMemory(shared=True)
    CURRENT.append(memory)
    yield memory
    CURRENT.remove(memory)
    memory.close()


class Buffer:
    def __init__(self, label, fill=None, piece=PIECE, count=COUNT):
        self.piece_bytes = piece
        allocation = CURRENT[-1].allocate(piece * count, label)
        self.raw = (ctypes.c_char * (piece * count)).from_address(allocation.address)
        if fill is not None:
            ctypes.memmove(self.raw, fill, piece * count)
        self.region = RegionDescriptor(label, ctypes.addressof(self.raw), piece, count, piece)

    def piece(self, index):
        return ctypes.string_at(self.region.address(index), self.piece_bytes)

    def all(self):
        return self.raw.raw


def wait(plane, handle, timeout_s=10.0):
    """Poll until terminal (or give up after ``timeout_s``, returning the last state)."""
    deadline = time.monotonic() + timeout_s
    spins = 0
    while True:
        state = plane.poll(handle)
        if state.terminal or time.monotonic() >= deadline:
            return state
        spins += 1
        if spins > 200:
            time.sleep(0.0005)


@pytest.fixture
def pair(data_planes):
    source, target = data_planes("source"), data_planes("target")
    src = Buffer("src", os.urandom(PIECE * COUNT))
    dst = Buffer("dst")
    (src_id,) = source.register([src.region], exposed=True)
    (dst_id,) = target.register([dst.region], exposed=False)
    peer = target.connect(source.describe(), 5.0)
    return source, target, peer, src, dst, src_id, dst_id


# ---------------------------------------------------------------------- reads


def test_read_copies_the_pieces_of_every_run(pair):
    _, target, peer, src, dst, s, d = pair
    assert isinstance(peer, PeerInfo) and peer.name == "source"
    runs = [PieceRun(s, 3, d, 0, 2), PieceRun(s, 9, d, 5), PieceRun(s, 12, d, 13, 3)]
    handle = target.read(peer.name, runs)
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    assert dst.piece(0) == src.piece(3) and dst.piece(1) == src.piece(4) and dst.piece(5) == src.piece(9)
    assert [dst.piece(13 + k) for k in range(3)] == [src.piece(12 + k) for k in range(3)]
    assert dst.piece(2) == bytes(PIECE) and dst.piece(12) == bytes(PIECE)


def test_an_empty_read_is_done_at_once(pair):
    _, target, peer, *_ = pair
    handle = target.read(peer.name, [])
    assert target.poll(handle) is TransferState.DONE
    target.release(handle)


def test_connect_is_idempotent_and_names_the_peer(pair):
    source, target, peer, *_ = pair
    description = source.describe()
    assert target.connect(description, 5.0) == peer
    assert target.connect(description, 5.0).name == "source"
    assert target.peer_name(description) == "source"  # what a caller binds before it connects


def test_bad_runs_are_refused_before_anything_moves(data_planes):
    source, target = data_planes("source"), data_planes("target")
    src, dst, small = Buffer("src", os.urandom(PIECE * COUNT)), Buffer("dst"), Buffer("small", piece=PIECE // 2)
    (s,) = source.register([src.region], exposed=True)
    d, h = target.register([dst.region, small.region], exposed=False)
    peer = target.connect(source.describe(), 5.0).name
    for run in (
        PieceRun(999, 0, d, 0),  # the peer has no such region
        PieceRun(s, 0, 999, 0),  # neither do we
        PieceRun(s, COUNT - 1, d, 0, 2),  # past the source region's end
        PieceRun(s, 0, d, COUNT - 1, 2),  # past ours
        PieceRun(s, -1, d, 0),
        PieceRun(s, 0, d, -1),
        PieceRun(s, 0, d, 0, 0),
        PieceRun(s, 0, h, 0),  # pieces of different sizes
    ):
        with pytest.raises(TransportError):
            target.read(peer, [PieceRun(s, 1, d, 1), run])  # one bad run refuses the whole read
    assert dst.all() == bytes(PIECE * COUNT)


def test_a_peer_reads_only_exposed_regions(data_planes):
    source, target = data_planes("source"), data_planes("target")
    arena, secret, dst = Buffer("arena", os.urandom(PIECE * COUNT)), Buffer("secret", b"s" * PIECE * COUNT), Buffer("d")
    (a,) = source.register([arena.region], exposed=True)
    (p,) = source.register([secret.region], exposed=False)
    (d,) = target.register([dst.region], exposed=False)
    peer = target.connect(source.describe(), 5.0).name
    with pytest.raises(TransportError):
        target.read(peer, [PieceRun(p, 0, d, 0)])
    handle = target.read(peer, [PieceRun(a, 0, d, 0)])
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    assert dst.piece(0) == arena.piece(0) and b"s" * 8 not in dst.all()


def test_reading_from_a_peer_never_connected_is_refused(pair):
    _, target, _, _, _, s, d = pair
    with pytest.raises(PeerUnavailable):
        target.read("stranger", [PieceRun(s, 0, d, 0)])


def test_unreadable_description_is_refused(pair):
    _, target, *_ = pair
    for junk in (b"", b"\x00not a description", os.urandom(64)):
        with pytest.raises(PeerUnavailable):
            target.connect(junk, 1.0)
        with pytest.raises(PeerUnavailable):
            target.peer_name(junk)


# ---------------------------------------------------------------------- registration


def test_registration_gives_ids_and_refuses_overlaps(data_planes):
    plane = data_planes("solo")
    a, b = Buffer("a"), Buffer("b")
    ids = plane.register([a.region], exposed=True) + plane.register([b.region], exposed=False)
    assert len(set(ids)) == 2
    with pytest.raises(RegistrationError):
        plane.register([a.region], exposed=True)  # the same memory again
    half = RegionDescriptor("half", a.region.base + PIECE, PIECE, 2, PIECE)
    c = Buffer("c")
    with pytest.raises(RegistrationError):
        plane.register([c.region, half], exposed=False)  # all or none: c is not registered either
    (c_id,) = plane.register([c.region], exposed=False)
    assert c_id not in ids
    plane.deregister([ids[0]])
    (again,) = plane.register([a.region], exposed=True)
    assert again not in (*ids, c_id)


def test_a_deregistered_region_cannot_be_read_into(pair):
    _, target, peer, _, _, s, d = pair
    target.deregister([d])
    with pytest.raises(TransportError):
        target.read(peer.name, [PieceRun(s, 0, d, 0)])


# ---------------------------------------------------------------------- ends


def test_a_closed_peer_cannot_be_read(pair):
    source, target, peer, _, _, s, d = pair
    source.close()
    try:
        handle = target.read(peer.name, [PieceRun(s, 0, d, 0)])
    except TransportError:
        return
    assert wait(target, handle) is TransferState.FAILED
    target.release(handle)


def test_cancel_of_a_finished_transfer_reports_its_terminal_state(pair):
    _, target, peer, _, _, s, d = pair
    handle = target.read(peer.name, [PieceRun(s, 0, d, 0)])
    assert wait(target, handle) is TransferState.DONE
    assert target.cancel(handle) is TransferState.DONE
    target.release(handle)


def test_unknown_handles_are_refused(pair):
    _, target, peer, _, _, s, d = pair
    handle = target.read(peer.name, [PieceRun(s, 0, d, 0)])
    wait(target, handle)
    target.release(handle)
    for call in (target.poll, target.release, target.cancel):
        with pytest.raises(TransportError):
            call(handle)


def test_a_disconnected_peer_is_refused_until_it_connects_again(pair):
    source, target, peer, src, dst, s, d = pair
    target.disconnect(peer.name)
    target.disconnect(peer.name)  # idempotent
    with pytest.raises(PeerUnavailable):
        target.read(peer.name, [PieceRun(s, 0, d, 0)])
    assert target.connect(source.describe(), 5.0).name == peer.name
    handle = target.read(peer.name, [PieceRun(s, 2, d, 2)])
    assert wait(target, handle) is TransferState.DONE
    target.release(handle)
    assert dst.piece(2) == src.piece(2)


def test_a_closed_data_plane_refuses_work(pair):
    source, target, peer, _, _, s, d = pair
    target.close()
    target.close()  # idempotent
    with pytest.raises(TransportError):
        target.read(peer.name, [PieceRun(s, 0, d, 0)])
    with pytest.raises(TransportError):
        target.describe()
    with pytest.raises(TransportError):
        target.connect(source.describe(), 1.0)


# ---------------------------------------------------------------------- reads in flight


class _MockLiveRead:
    """A mock source whose reads stall until ``resume``; ``late`` makes a given-up read still land."""

    def __init__(self, data_planes, late):
        self.flavour = "late" if late else "fenced"
        self.late = late
        self.source = data_planes(f"live-{self.flavour}")
        self.target = data_planes(f"reader-{self.flavour}")
        self.expected = np.frombuffer(os.urandom(PIECE * COUNT), dtype=np.uint8).copy()
        self.src_buf = Buffer("src", self.expected.tobytes())
        self.dst = np.zeros(PIECE * COUNT, dtype=np.uint8)
        (self.src_id,) = self.source.register([self.src_buf.region], exposed=True)
        region = RegionDescriptor("dst", self.dst.ctypes.data, PIECE, COUNT, PIECE)
        (self.dst_id,) = self.target.register([region], exposed=False)
        self.source.set_faults(Faults(late_writes=late))
        self.peer = self.target.connect(self.source.describe(), 5.0)

    def stall(self):
        self.source.set_faults(Faults(stall=True, late_writes=self.late))

    def resume(self):
        self.source.set_faults(Faults(late_writes=self.late))


@pytest.fixture
def live(request, data_planes):
    """Every live-read flavour the kind under test can produce."""
    kind = request.node.callspec.params["data_planes"]
    with contextlib.ExitStack() as stack:
        if kind == "mock":
            yield [_MockLiveRead(data_planes, late=False), _MockLiveRead(data_planes, late=True)]
        else:
            cases = importlib.import_module(f"tests.contract.{kind}_kind").live_reads(stack, PIECE, COUNT)
            if not cases:
                pytest.skip(f"{kind}: a read is terminal when read() returns, so none is ever in flight")
            yield cases


def _stalled_read(case):
    case.stall()
    handle = case.target.read(case.peer.name, [PieceRun(case.src_id, 0, case.dst_id, 0, COUNT)])
    assert case.target.poll(handle) is TransferState.PENDING, case.flavour
    return handle


def _nothing_lands_after(case, handle, settle_s=0.3):
    """Poison the destination, resume the source, progress a while: no byte may change."""
    case.dst[:] = POISON
    case.resume()
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        case.target.poll(handle)
        time.sleep(0.01)
    assert int(np.count_nonzero(case.dst != POISON)) == 0, f"{case.flavour}: bytes landed after the read ended"


def _ends_after_resume(case, handle):
    case.resume()
    state = wait(case.target, handle, timeout_s=20.0)
    assert state.terminal, f"{case.flavour}: still {state.value} after the source resumed"
    if state is TransferState.DONE:
        assert np.array_equal(case.dst, case.expected), case.flavour
    return state


def test_cancel_of_a_live_read_is_confirmed_or_uncertain(live):
    for case in live:
        handle = _stalled_read(case)
        state = case.target.cancel(handle)
        assert state in (TransferState.CANCELLED, TransferState.UNCERTAIN), case.flavour
        if state is TransferState.CANCELLED:
            _nothing_lands_after(case, handle)
        else:
            assert case.peer.late_writes, f"{case.flavour}: uncertain cancel from a peer without late writes"
            _ends_after_resume(case, handle)
        case.target.release(handle)


def test_release_of_a_live_handle_is_refused(live):
    for case in live:
        handle = _stalled_read(case)
        with pytest.raises(KvcrError):
            case.target.release(handle)
        if case.target.cancel(handle) is TransferState.UNCERTAIN:
            with pytest.raises(KvcrError):
                case.target.release(handle)  # UNCERTAIN is not terminal either
            _ends_after_resume(case, handle)
        case.target.release(handle)


def test_disconnect_during_a_read_fences_it_or_keeps_it_observable(live):
    for case in live:
        handle = _stalled_read(case)
        case.target.disconnect(case.peer.name)
        with pytest.raises(PeerUnavailable):
            case.target.read(case.peer.name, [PieceRun(case.src_id, 0, case.dst_id, 0)])
        state = case.target.poll(handle)
        if state.terminal:
            assert state is not TransferState.DONE, case.flavour
            _nothing_lands_after(case, handle)
        else:
            assert case.peer.late_writes, f"{case.flavour}: a disconnect did not fence a peer without late writes"
            with pytest.raises(KvcrError):
                case.target.release(handle)
            _ends_after_resume(case, handle)  # still observable after the disconnect
        case.target.release(handle)


def test_close_with_a_live_transfer_is_refused_and_releases_nothing(live):
    for case in live:
        handle = _stalled_read(case)
        with pytest.raises(KvcrError):
            case.target.close()
        assert not case.target.poll(handle).terminal  # still watched
        _ends_after_resume(case, handle)
        case.target.release(handle)
        case.target.close()
        with pytest.raises(TransportError):
            case.target.describe()
