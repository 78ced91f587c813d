"""The shm data plane's own guarantees, beyond the DataPlane contract.

Memory: what is handed out cannot be written, shrunk or grown by anyone holding it. The broker:
a wrong secret or a silent connection gets nothing and is dropped, and connections are capped.
Peers: one on another host (or namespace, or uid) is refused, and ``auto`` then reads it over NIXL;
a frozen source stalls no read; a killed one fails its reads at once. Idle: a served pair costs no
CPU.
"""

import contextlib
import ctypes
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvcr.adapters.local import MmapHostMemory
from kvcr.adapters.shm import SameHostFirst, ShmDataPlane, copies, dataplane
from kvcr.adapters.shm.broker import Broker
from kvcr.adapters.shm.dataplane import SIDE_SPIN_S
from kvcr.adapters.shm.host import HostIdentity, this_host
from kvcr.adapters.shm.wire import REQUEST_MAGIC, SECRET_BYTES, make_ticket
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.dataplane import SIDE_FRAME_BYTES, TransferState
from kvcr.ports.errors import ControlTimeout, PeerUnavailable, RegistrationError
from kvcr.ports.memory import SharedBacking
from kvcr.testing.processes import stop_process, wait_until_stopped

REPO = Path(__file__).resolve().parents[3]
PIECE, COUNT = 4096, 16


@pytest.fixture
def memory():
    made = MmapHostMemory(shared=True)
    yield made
    made.close()


@pytest.fixture
def planes():
    made = []

    def make(plane):
        made.append(plane)
        return plane

    yield make
    for plane in made:
        with contextlib.suppress(Exception):
            plane.close()


def _region(memory, label, fill=None):
    allocation = memory.allocate(PIECE * COUNT, label)
    if fill is not None:
        ctypes.memmove(allocation.address, fill, len(fill))
    return RegionDescriptor(label, allocation.address, PIECE, COUNT, PIECE)


def _pair(memory, planes, target_host=None):
    source = planes(ShmDataPlane("source", memory))
    target = planes(ShmDataPlane("target", memory, host=target_host))
    data = os.urandom(PIECE * COUNT)
    (src,) = source.register([_region(memory, "src", data)], exposed=True)
    dst_region = RegionDescriptor("dst", memory.allocate(PIECE * COUNT, "dst").address, PIECE, COUNT, PIECE)
    (dst,) = target.register([dst_region], exposed=False)
    return source, target, src, dst, dst_region, data


# ---------------------------------------------------------------------- memory


def test_shared_memory_cannot_be_written_shrunk_or_grown_through_what_is_handed_out(memory):
    allocation = memory.allocate(1 << 20, "arena")
    backing = memory.backing(allocation.address + 4096, 8192)
    assert isinstance(backing, SharedBacking) and backing.offset == 4096 and backing.size == 1 << 20
    for change in (lambda: os.ftruncate(backing.fd, 0), lambda: os.ftruncate(backing.fd, 2 << 20)):
        with pytest.raises(OSError):
            change()
    with pytest.raises(PermissionError):
        mmap.mmap(backing.fd, 1 << 20, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    with pytest.raises(OSError):
        os.write(backing.fd, b"x")
    ctypes.memmove(allocation.address, b"ours", 4)  # our own first mapping still writes
    assert os.pread(backing.fd, 4, 0) == b"ours"
    assert memory.backing(allocation.address, (1 << 20) + 1) is None  # past its end: not one allocation


def test_a_region_outside_shared_memory_cannot_be_exposed(planes):
    plane = planes(ShmDataPlane("solo", MmapHostMemory()))
    buffer = ctypes.create_string_buffer(PIECE * COUNT)
    region = RegionDescriptor("private", ctypes.addressof(buffer), PIECE, COUNT, PIECE)
    with pytest.raises(RegistrationError, match="not in shared memory"):
        plane.register([region], exposed=True)
    assert plane.register([region], exposed=False)  # as a destination it is fine


# ---------------------------------------------------------------------- the broker


def _ask(address, payload):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(5.0)
        sock.connect(address)
        sock.sendall(payload)
        blob, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
        for fd in fds:
            os.close(fd)
        return blob, len(fds)


def _request(secret, owner=b""):
    return REQUEST_MAGIC + make_ticket(secret, owner)


def test_the_broker_gives_nothing_for_a_wrong_ticket_and_a_descriptor_for_the_right_one():
    secret = os.urandom(SECRET_BYTES)
    memfd = os.memfd_create("grant")
    broker = Broker(secret, lambda: (b"grant", [memfd]))
    try:
        ticket = make_ticket(secret, b"node-a")
        for wrong in (
            _request(os.urandom(SECRET_BYTES)),  # a ticket another source made
            _request(secret)[:-1],
            REQUEST_MAGIC + ticket[:1] + b"node-b" + ticket[7:],  # node-a's MAC under another owner's name
            b"",
            make_ticket(secret, b""),  # no magic
        ):
            assert _ask(broker.address, wrong or b"\0") == (b"", 0)
        assert broker.refused == 5
        assert _ask(broker.address, _request(secret)) == (b"grant", 1)
        assert _ask(broker.address, REQUEST_MAGIC + ticket) == (b"grant", 1)
    finally:
        broker.close()
        os.close(memfd)


def test_silent_connections_are_dropped_after_the_handshake_window_and_capped():
    broker = Broker(os.urandom(SECRET_BYTES), lambda: (b"", []), max_pending=8, handshake_s=0.3)
    socks = []
    try:
        for _ in range(20):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            sock.connect(broker.address)
            socks.append(sock)
        deadline = time.monotonic() + 2.0
        while broker.refused < 12 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert broker.connections <= 8 and broker.refused >= 12  # over the cap: closed at once
        deadline = time.monotonic() + 3.0
        while broker.connections and time.monotonic() < deadline:
            time.sleep(0.02)
        assert broker.connections == 0 and broker.refused == 20  # silent ones: gone after 0.3 s
    finally:
        for sock in socks:
            sock.close()
        broker.close()


def _granted_link(broker, secret, owner=b""):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(5.0)
    try:
        dataplane._connect(sock, broker.address, time.monotonic() + 5.0)  # as a target does: a full backlog waits
    except OSError:
        sock.close()
        raise
    sock.sendall(_request(secret, owner))
    blob, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
    for fd in fds:
        os.close(fd)
    assert blob == b"grant"
    return sock


def _broker(**limits):
    secret = os.urandom(SECRET_BYTES)
    memfd = os.memfd_create("grant")
    broker = Broker(secret, lambda: (b"grant", [memfd]), **limits)
    return broker, secret, memfd


@pytest.mark.skipif(os.geteuid() != 0, reason="playing another uid needs root (CI runs as root)")
def test_another_uids_connections_are_closed_as_they_are_accepted_and_never_held():
    """Issue 43: any local uid held the 256-connection cap without the secret (8,081 connects in 12 s)."""
    broker, secret, memfd = _broker(max_connections=8, handshake_s=30.0)  # a held one would stay
    flooder = subprocess.Popen(
        [sys.executable, "-c", _FLOOD, broker.address[1:], "200", "65534"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert flooder.stdout.readline().strip() == "held"  # 200 connects made and kept open
        deadline = time.monotonic() + 2.0
        while broker.refused < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert broker.connections == 0 and broker.refused == 200
        _granted_link(broker, secret).close()
    finally:
        flooder.kill()
        flooder.communicate()
        broker.close()
        os.close(memfd)


def test_connections_without_the_secret_never_keep_a_target_from_its_grant():
    """Silent connections of our own uid fill only the handshake slots; a target with the secret is granted."""
    broker, secret, memfd = _broker(max_connections=4, max_pending=8, handshake_s=5.0)
    flooder = subprocess.Popen(
        [sys.executable, "-c", _FLOOD, broker.address[1:], "300"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert flooder.stdout.readline().strip() == "held"
        links = [_granted_link(broker, secret) for _ in range(4)]  # every granted slot, while 300 sit silent
        deadline = time.monotonic() + 2.0
        while broker.granted < 4 and time.monotonic() < deadline:  # the grant reaches us before it is counted
            time.sleep(0.01)
        assert broker.granted == 4 and broker.connections <= 4 + 8
        assert _ask(broker.address, _request(secret)) == (b"", 0)  # past max_connections: refused
        for link in links:
            link.close()
    finally:
        flooder.kill()
        flooder.communicate()
        broker.close()
        os.close(memfd)


def test_a_peer_that_does_not_read_its_replies_loses_its_link_and_stalls_nobody():
    """40 links that never read replies stalled the broker thread about 30 s."""
    broker, secret, memfd = _broker(max_per_process=64)  # all 41 links are this process's
    broker.serve(lambda frame, connection: bytes(SIDE_FRAME_BYTES))  # every reply as large as a frame may be
    deaf = [_granted_link(broker, secret) for _ in range(40)]
    honest = _granted_link(broker, secret)
    try:
        for sock in deaf:  # fill each one's receive queue; none of them ever reads
            sock.setblocking(False)
            for _ in range(64):
                with contextlib.suppress(OSError):
                    sock.send(b"lease?")
        started = time.monotonic()
        honest.sendall(b"lease?")
        assert len(honest.recv(SIDE_FRAME_BYTES + 1)) == SIDE_FRAME_BYTES
        assert time.monotonic() - started < 1.0
        deadline = time.monotonic() + 5.0
        while broker.granted > 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert broker.granted == 1  # every deaf link dropped; the honest one kept
    finally:
        for sock in [*deaf, honest]:
            sock.close()
        broker.close()
        os.close(memfd)


_FLOOD = """
import os, socket, sys, time
address, count = "\\0" + sys.argv[1], int(sys.argv[2])  # an abstract socket: no NUL in argv
if len(sys.argv) > 3:
    os.setuid(int(sys.argv[3]))
held = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(address)
    held.append(s)
print("held", flush=True)
time.sleep(60)
"""


def test_a_link_speaks_as_its_tickets_owner_and_closes_within_the_recheck_once_the_owner_is_revoked():
    """Issue 43: a revoked node kept leasing over its old side link and opened a new one with the kept secret."""
    from kvcr.ports.control import node_of
    from kvcr.ports.dataplane import SIDE_RECHECK_S

    broker, secret, memfd = _broker()
    admitted = {b"node-a", b"node-b"}
    broker.admit(lambda node: node in admitted)
    broker.serve(lambda frame, connection: node_of(connection))
    a, b = _granted_link(broker, secret, b"node-a"), _granted_link(broker, secret, b"node-b")
    try:
        for link, node in ((a, b"node-a"), (b, b"node-b")):
            link.sendall(b"who?")
            assert link.recv(64) == node
        admitted.discard(b"node-a")
        revoked_at = time.monotonic()
        assert a.recv(64) == b""  # closed by the broker though a sent nothing
        assert time.monotonic() - revoked_at < SIDE_RECHECK_S + 0.4
        assert _ask(broker.address, _request(secret, b"node-a")) == (b"", 0)  # its ticket opens nothing now
        b.sendall(b"who?")
        assert b.recv(64) == b"node-b"
    finally:
        a.close()
        b.close()
        broker.close()
        os.close(memfd)


def test_one_process_holds_at_most_max_per_node_links_whatever_tickets_it_holds():
    """A token holder kept 255 granted links: with a cluster token no node is named, so the process is."""
    broker, secret, memfd = _broker(max_per_process=3)
    held = [_granted_link(broker, secret) for _ in range(3)]
    try:
        assert _ask(broker.address, _request(secret)) == (b"", 0)
        assert _ask(broker.address, _request(secret, b"node-x")) == (b"", 0)  # another ticket: the same process
    finally:
        for sock in held:
            sock.close()
        broker.close()
        os.close(memfd)


def test_one_node_holds_at_most_max_per_node_links():
    """One listed node over 4 side links pinned the whole lease cap: its links are few, and count as it."""
    broker, secret, memfd = _broker(max_per_node=2, max_per_process=8)
    try:
        held = [_granted_link(broker, secret, b"node-a") for _ in range(2)]
        assert _ask(broker.address, _request(secret, b"node-a")) == (b"", 0)
        held.append(_granted_link(broker, secret, b"node-b"))
        for sock in held:
            sock.close()
    finally:
        broker.close()
        os.close(memfd)


def test_an_idle_served_pair_costs_no_cpu(memory, planes):
    source, target, *_ = _pair(memory, planes)
    target.connect(source.describe(), 5.0)
    broker_thread = source.broker._thread.native_id

    def cpu_s():
        with open(f"/proc/self/task/{broker_thread}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    before = cpu_s()
    time.sleep(1.0)
    assert cpu_s() - before <= 0.01  # under 1 % of a core


# ---------------------------------------------------------------------- peers


def test_a_peer_elsewhere_is_refused_naming_why(memory, planes):
    here = this_host()
    for other, why in (
        (HostIdentity("another-boot", here.net_namespace, here.uid), "another host"),
        (HostIdentity(here.boot_id, here.net_namespace + 1, here.uid), "network namespace"),
        (HostIdentity(here.boot_id, here.net_namespace, here.uid + 1), "uid"),
    ):
        source, target, *_ = _pair(memory, planes, target_host=other)
        with pytest.raises(PeerUnavailable, match=why):
            target.connect(source.describe(), 2.0)


@pytest.mark.nixl
def test_auto_reads_a_peer_elsewhere_over_nixl(memory, planes):
    from kvcr.adapters.nixl import NixlDataPlane

    elsewhere = HostIdentity("another-boot", 0, os.getuid())
    source = planes(
        SameHostFirst(ShmDataPlane("src", memory), NixlDataPlane("src", backend_params={"ucx_devices": "lo"}))
    )
    target = planes(
        SameHostFirst(
            ShmDataPlane("dst", memory, host=elsewhere), NixlDataPlane("dst", backend_params={"ucx_devices": "lo"})
        )
    )
    data = os.urandom(PIECE * COUNT)
    (src,) = source.register([_region(memory, "src", data)], exposed=True)
    dst_region = _region(memory, "dst")
    (dst,) = target.register([dst_region], exposed=False)
    peer = target.connect(source.describe(), 10.0)
    assert target.plane_of(peer.name) == "fallback"
    handle = target.read(peer.name, [PieceRun(src, 2, dst, 0, 3)])
    deadline = time.monotonic() + 10
    while not target.poll(handle).terminal and time.monotonic() < deadline:
        time.sleep(0.001)
    assert target.poll(handle) is TransferState.DONE
    target.release(handle)
    assert ctypes.string_at(dst_region.base, 3 * PIECE) == data[2 * PIECE : 5 * PIECE]


@pytest.mark.nixl
def test_an_auto_description_whose_two_parts_name_two_peers_is_refused(memory, planes):
    """Else a peer could be bound under one name and read over the other plane under another (issue 43)."""
    import msgspec

    from kvcr.adapters.nixl import NixlDataPlane
    from kvcr.adapters.shm.routed import _Wire

    def auto(name):
        return planes(
            SameHostFirst(ShmDataPlane(name, memory), NixlDataPlane(name, backend_params={"ucx_devices": "lo"}))
        )

    honest, other, target = auto("honest"), auto("other"), auto("target")
    for plane in (honest, other):
        plane.register([_region(memory, "src")], exposed=True)
    good = msgspec.msgpack.decode(honest.describe(), type=_Wire)
    stitched = msgspec.msgpack.encode(
        _Wire(good.version, msgspec.msgpack.decode(other.describe(), type=_Wire).shm, good.fallback, good.ids)
    )
    assert target.peer_name(honest.describe()) == "honest"
    for ask in (target.peer_name, lambda d: target.connect(d, 5.0)):
        with pytest.raises(PeerUnavailable, match="names another peer"):
            ask(stitched)
    assert target.plane_of("honest") is None and target.plane_of("other") is None


class _Unsealed:
    """A memory whose one allocation is an ordinary memfd (what a hostile or broken source could send)."""

    def __init__(self, nbytes):
        self.fd = os.memfd_create("unsealed")
        os.ftruncate(self.fd, nbytes)
        self.map = mmap.mmap(self.fd, nbytes)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.nbytes = nbytes

    def backing(self, address, nbytes):
        return SharedBacking(self.fd, address - self.address, self.nbytes)


def test_a_memfd_that_could_shrink_is_never_mapped(memory, planes):
    unsealed = _Unsealed(PIECE * COUNT)
    source = planes(ShmDataPlane("source", unsealed))
    source.register([RegionDescriptor("arena", unsealed.address, PIECE, COUNT, PIECE)], exposed=True)
    target = planes(ShmDataPlane("target", memory))
    with pytest.raises(PeerUnavailable, match="not sealed against shrinking"):
        target.connect(source.describe(), 2.0)


class _SourceProcess:
    def __init__(self, seed):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.shm.source_process", str(PIECE), str(COUNT), str(seed)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        hello = json.loads(self.proc.stdout.readline())
        self.description = bytes.fromhex(hello["description"])
        self.region = hello["region"]
        self.data = np.random.default_rng(seed).integers(0, 256, PIECE * COUNT, dtype=np.uint8).tobytes()

    def close(self):
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGCONT)
        stop_process(self.proc, grace_s=10)


@pytest.mark.multiprocess
def test_a_frozen_source_stalls_no_read_and_a_killed_one_fails_them_at_once(memory, planes):
    source = _SourceProcess(seed=7)
    try:
        target = planes(ShmDataPlane("target", memory))
        dst_region = _region(memory, "dst")
        (dst,) = target.register([dst_region], exposed=False)
        peer = target.connect(source.description, 5.0)
        assert peer.late_writes is False
        os.kill(source.proc.pid, signal.SIGSTOP)
        assert wait_until_stopped(source.proc.pid)
        started = time.monotonic()
        handle = target.read(peer.name, [PieceRun(source.region, 0, dst, 0, COUNT)])
        assert target.poll(handle) is TransferState.DONE and time.monotonic() - started < 1.0
        target.release(handle)
        assert ctypes.string_at(dst_region.base, PIECE * COUNT) == source.data
        os.kill(source.proc.pid, signal.SIGKILL)
        source.proc.wait(10)
        handle = target.read(peer.name, [PieceRun(source.region, 0, dst, 0)])
        assert target.poll(handle) is TransferState.FAILED  # its socket closed with it
        target.release(handle)
        target.disconnect(peer.name)
        with pytest.raises(PeerUnavailable):
            target.connect(source.description, 1.0)  # nobody serves its socket any more
    finally:
        source.close()


def test_where_streaming_pays_a_read_of_stream_min_bytes_streams_and_a_smaller_one_does_not(
    memory, planes, monkeypatch
):
    """A large read goes through the streaming copy (one call per run), a small one through memmove;
    both land the source's exact bytes. (Pinned: this host's own measurement may say memmove.)"""
    piece, count = 1 << 20, copies.STREAM_MIN_BYTES >> 20
    streamed = []
    real = copies.stream_copy
    assert real is not None, "the _stream extension was not built (a C compiler is needed at install)"

    def counting(dst, src, nbytes):
        streamed.append(nbytes)
        return real(dst, src, nbytes)

    monkeypatch.setattr(copies, "stream_copy", counting)
    monkeypatch.setattr(copies._choice, "result", copies.Measurement(1 << 20, 1.0, 2.0))
    source = planes(ShmDataPlane("source", memory))
    target = planes(ShmDataPlane("target", memory))
    src_alloc = memory.allocate(piece * count, "big-src")
    data = np.random.default_rng(5).integers(0, 256, piece * count, dtype=np.uint8).tobytes()
    ctypes.memmove(src_alloc.address, data, len(data))
    (src,) = source.register([RegionDescriptor("big-src", src_alloc.address, piece, count, piece)], exposed=True)
    dst_region = RegionDescriptor("big-dst", memory.allocate(piece * count, "big-dst").address, piece, count, piece)
    (dst,) = target.register([dst_region], exposed=False)
    peer = target.connect(source.describe(), 5.0)
    handle = target.read(peer.name, [PieceRun(src, 0, dst, count - 1, 1), PieceRun(src, 1, dst, 0, count - 1)])
    assert target.poll(handle) is TransferState.DONE
    target.release(handle)
    assert streamed == [piece, piece * (count - 1)]
    got = ctypes.string_at(dst_region.base, piece * count)
    assert got[: piece * (count - 1)] == data[piece:] and got[piece * (count - 1) :] == data[:piece]
    handle = target.read(peer.name, [PieceRun(src, 3, dst, 3, 2)])  # 2 MiB: below STREAM_MIN_BYTES
    target.release(handle)
    assert streamed == [piece, piece * (count - 1)]


# ---------------------------------------------------------------------- side links


def test_side_links_carry_frames_bound_to_their_own_connection(memory, planes):
    source, target, *_ = _pair(memory, planes)
    other = planes(ShmDataPlane("other", memory))
    seen = []

    def handler(frame, connection):
        seen.append((frame, connection))
        return None if frame == b"one-way" else b"re:" + frame

    source.serve_side(handler)
    description = source.describe()
    for plane in (target, other):
        plane.connect(description, 5.0)
    assert target.side_request("source", b"ping", 2.0) == b"re:ping"
    assert target.side_request("source", b"again", 2.0) == b"re:again"
    assert other.side_request("source", b"ping", 2.0) == b"re:ping"
    assert target.side_send("source", b"one-way")
    deadline = time.monotonic() + 2.0
    while len(seen) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    connections = [c for _, c in seen]
    assert connections[0] == connections[1] == connections[3] != connections[2]  # one id per link
    assert all(c.startswith(b"\x00shm-side:") for c in connections)  # no node named: the link is what is known
    assert target.side_request("nobody", b"ping", 1.0) is None  # no link: the caller uses the control channel
    assert target.side_request("source", b"x" * (SIDE_FRAME_BYTES + 1), 1.0) is None
    assert not target.side_send("source", b"x" * (SIDE_FRAME_BYTES + 1))


def test_a_side_reply_slower_than_the_spin_is_still_taken_and_a_quick_one_within_it(memory, planes):
    """A side request busy-polls its reply for SIDE_SPIN_S, then blocks: both ways end in the reply."""
    source, target, *_ = _pair(memory, planes)
    delays = {b"quick": 0.0, b"slow": SIDE_SPIN_S * 20}
    source.serve_side(lambda frame, connection: time.sleep(delays[frame]) or b"re:" + frame)
    target.connect(source.describe(), 5.0)
    for frame in (b"quick", b"slow", b"quick"):
        started = time.monotonic()
        assert target.side_request("source", frame, 2.0) == b"re:" + frame
        assert time.monotonic() - started >= delays[frame]
    with pytest.raises(ControlTimeout):  # a timeout shorter than the spin is kept, not stretched to it
        source.serve_side(lambda frame, connection: time.sleep(0.05) or b"late")
        target.side_request("source", b"quick", SIDE_SPIN_S / 2)


def test_a_side_request_to_a_stalled_source_times_out_and_to_a_closed_one_fails(memory, planes):
    source, target, *_ = _pair(memory, planes)
    release = threading.Event()
    source.serve_side(lambda frame, connection: release.wait(5.0) and b"late")
    target.connect(source.describe(), 5.0)
    started = time.monotonic()
    with pytest.raises(ControlTimeout):
        target.side_request("source", b"ping", 0.2)
    assert time.monotonic() - started < 1.0
    release.set()
    source.close()
    with pytest.raises(PeerUnavailable):
        for _ in range(3):  # a late reply may still be queued; then the closed link
            target.side_request("source", b"ping", 1.0)


def test_large_reads_use_the_copy_measured_faster_on_this_host(monkeypatch):
    """Issue 44: streaming stores tuned on one CPU ran at a third of memmove on another; the host decides."""
    found = copies.measured(wait_s=30.0)
    assert found is not None and found.memmove_gbps > 0 and found.stream_gbps > 0
    big = copies.STREAM_MIN_BYTES
    assert copies.copier(big) is (
        copies.stream_copy if found.stream_gbps >= 1.1 * found.memmove_gbps else copies.memmove
    )
    for memmove_gbps, stream_gbps, chosen in ((10.0, 3.0, copies.memmove), (6.0, 9.5, copies.stream_copy)):
        monkeypatch.setattr(copies._choice, "result", copies.Measurement(1 << 20, memmove_gbps, stream_gbps))
        assert copies.copier(big) is chosen
        assert copies.copier(big - 1) is copies.memmove  # below the threshold: memmove, whatever was measured
    monkeypatch.setattr(copies._choice, "result", None)  # not measured yet: memmove
    assert copies.copier(big) is copies.memmove
