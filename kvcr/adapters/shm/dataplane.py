"""DataPlane for peers on this host: the source's arena memfds mapped read-only, reads are memcpy.

How the port maps onto shared memory:

- ``register`` records regions; an *exposed* one must lie in one shared allocation of the memory
  adapter (``SharesMemory.backing``: a sealed memfd), or registration fails. Private regions (the
  engine's host pages, staging) are only destinations and are never shared.
- ``describe`` (``describe_to`` a named node) names this plane, its host identity (``host.py``),
  its broker's abstract socket, a ticket for that node (``wire.make_ticket``) and the exposed
  region table. The broker (``broker.py``, started at the first description) hands a peer that
  presents a ticket of ours, for a node still admitted (``admit_side``), a *read-only* descriptor
  of each exposed region's memfd and keeps that connection open as the liveness signal.
- ``connect`` refuses a peer on another host, namespace or uid (``PeerUnavailable``: the caller
  falls back to another plane), takes the grant, checks each descriptor is sealed against
  shrinking (so a mapping can never SIGBUS) and covers its regions, maps it ``PROT_READ``, and
  reads the peer's beacon through the mapping against the digest in the description.
- ``read`` checks every run, then copies outside the lock (the GIL is released) and returns a
  handle that is already terminal: a frozen source cannot stall a copy from a mapping, and nothing
  can land after it returns, so peers have no late writes and ``cancel`` has nothing to stop. A
  peer whose socket has closed (closed or dead) fails its reads. A read of at least
  ``STREAM_MIN_BYTES`` copies with streaming stores (``_stream``, a small C extension) when that
  was built and measured faster than memmove on this host (``copies.py``), else with memmove.
- ``disconnect`` unmaps a peer once no read of it is copying.
- Slot boards (``SharedBoards``): a source shares each pool's board as one more exposed region;
  a target looks keys up in a peer's mapped board, and ``board_read`` copies what it found and
  re-checks the generations in one call, with no handle (``_board``, a small C extension that
  bounds-checks every slot before copying; without it there are no board reads and every page is
  leased).
- Side links (``SideChannel``): the grant's connection also carries control frames. The source's
  broker answers them with the peer server's handler (``serve_side``); the target's
  ``side_request`` is a send and a wait on that socket, a UNIX-socket round trip instead of a
  CURVE one over ZMQ.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import itertools
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType

from kvcr.adapters.shm import copies, wire
from kvcr.adapters.shm.broker import Broker
from kvcr.adapters.shm.host import HostIdentity, this_host
from kvcr.adapters.shm.wire import Description, Grant, RegionWire
from kvcr.domain.board import BoardHits, BoardLayout
from kvcr.domain.layout import PieceRun, RegionDescriptor, slot_runs
from kvcr.ports.control import ConnectionHandler
from kvcr.ports.dataplane import SIDE_FRAME_BYTES, PeerInfo, TransferState
from kvcr.ports.errors import ControlTimeout, PeerUnavailable, RegistrationError, TransportError
from kvcr.ports.memory import SharesMemory

BEACON_BYTES = 64
SIDE_SPIN_S = 0.0005  # how long a side request busy-polls its reply before it blocks (see _await_reply)
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value
_HANGUP = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL
_PROT_READ, _MAP_SHARED = 0x1, 0x01


def _load_board() -> ModuleType | None:
    """The board reader, built from ``_board.c`` at install when a C compiler was there; else None."""
    try:
        from kvcr.adapters.shm import _board
    except ImportError:  # not built: same-host peers lease every page with a round trip
        return None
    return _board


_board_reader = _load_board()


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True, slots=True)
class _Local:
    region: RegionDescriptor
    exposed: bool


@dataclass(slots=True)
class _Peer:
    name: str
    description: bytes
    sock: socket.socket
    maps: list[tuple[int, int]]  # (address, size) of each mapping, unmapped at the end
    regions: dict[int, tuple[int, RegionWire]]  # region id -> (address of its piece 0, shape)
    info: PeerInfo
    hangup: select.poll = field(default_factory=select.poll)  # watches sock for the peer closing (see _alive)
    users: int = 0  # reads copying from its mappings, side requests waiting on its socket
    closing: bool = False
    side: threading.Lock = field(default_factory=threading.Lock)  # one side request at a time


@dataclass(slots=True)
class _Beacon:
    fd: int
    readonly: int
    digest: bytes
    address: int = field(default=0)


class ShmDataPlane:
    """A DataPlane between processes on one host, over memfds passed on an abstract socket. Thread-safe.

    Args:
        name: our name on the fabric (unique per incarnation).
        memory: the memory adapter our exposed regions were allocated from (shared allocations).
        host: this process's identity (tests pass another to play a peer elsewhere).
    """

    def __init__(self, name: str, memory: SharesMemory, *, host: HostIdentity | None = None) -> None:
        if not name:
            raise TransportError("a shm data plane needs a non-empty name")
        self._name = name
        self._memory = memory
        self._host = host or this_host()
        copies.calibrate()  # once per process, in the background: which copy pays for large reads here
        self._incarnation = os.urandom(16)
        self._secret = os.urandom(wire.SECRET_BYTES)
        self._lock = threading.Lock()
        self._closed = False
        self._ids = itertools.count(1)
        self._regions: dict[int, _Local] = {}
        self._peers: dict[str, _Peer] = {}
        self._handles = itertools.count(1)
        self._transfers: dict[int, TransferState] = {}
        self._broker: Broker | None = None
        self._beacon: _Beacon | None = None
        self._side_handler: ConnectionHandler | None = None
        self._admitted: Callable[[bytes], bool] | None = None
        self.side_requests = 0  # side round trips this plane made as a target

    @property
    def name(self) -> str:
        return self._name

    # ------------------------------------------------------------------ regions

    def register(self, regions: Sequence[RegionDescriptor], *, exposed: bool) -> tuple[int, ...]:
        with self._lock:
            self._check_open()
            taken = [r.region for r in self._regions.values()]
            for region in regions:
                if any(region.overlaps(other) for other in taken):
                    raise RegistrationError(f"region {region.label!r} overlaps a registered region")
                taken.append(region)
                if exposed and self._memory.backing(region.base, region.span) is None:
                    raise RegistrationError(
                        f"region {region.label!r} is not in shared memory, so a same-host peer cannot map it "
                        "(the shm plane needs the memory adapter's shared allocations)"
                    )
            ids = tuple(next(self._ids) for _ in regions)
            for region_id, region in zip(ids, regions, strict=True):
                self._regions[region_id] = _Local(region, exposed)
            return ids

    def deregister(self, ids: Sequence[int]) -> None:
        with self._lock:
            for region_id in ids:
                self._regions.pop(region_id, None)

    # ------------------------------------------------------------------ source side

    def describe(self) -> bytes:
        return self.describe_to(b"")

    def describe_to(self, node: bytes) -> bytes:
        with self._lock:
            self._check_open()
            if self._broker is None:
                self._beacon = _new_beacon()
                self._broker = Broker(self._secret, self._grant)
                if self._side_handler is not None:
                    self._broker.serve(self._side_handler)
                if self._admitted is not None:
                    self._broker.admit(self._admitted)
            exposed = [
                RegionWire(rid, r.region.count, r.region.piece_bytes, r.region.stride)
                for rid, r in self._regions.items()
                if r.exposed
            ]
            host = self._host
            return wire.encode(
                Description(
                    wire.VERSION,
                    self._name,
                    self._incarnation,
                    host.boot_id,
                    host.net_namespace,
                    host.uid,
                    self._broker.address,
                    wire.make_ticket(self._secret, node),
                    self._beacon.digest if self._beacon else b"",
                    exposed,
                )
            )

    def _grant(self) -> tuple[bytes, list[int]]:
        """The broker's answer: every exposed region's placement, and the descriptors (beacon first)."""
        with self._lock:
            assert self._beacon is not None
            fds = [self._beacon.readonly]
            placements = []
            for rid, local in self._regions.items():
                if not local.exposed:
                    continue
                backing = self._memory.backing(local.region.base, local.region.span)
                if backing is None:  # freed behind our back: not offered
                    continue
                if backing.fd not in fds:
                    fds.append(backing.fd)
                placements.append(wire.Placement(rid, fds.index(backing.fd), backing.offset))
            if len(fds) > wire.MAX_FILES:
                raise OSError(f"{len(fds)} shared files exceed one message's {wire.MAX_FILES}")
            return wire.encode(Grant(wire.VERSION, self._incarnation, 0, placements)), fds

    # ------------------------------------------------------------------ target side

    def peer_name(self, description: bytes) -> str:
        return wire.decode_description(description).name

    def connect(self, description: bytes, timeout_s: float) -> PeerInfo:
        desc = wire.decode_description(description)
        with self._lock:
            self._check_open()
            known = self._peers.get(desc.name)
            if known is not None and known.description == description and self._alive(known):
                return known.info
        why = self._host.differs(desc.host)
        if why:
            raise PeerUnavailable(f"shm peer {desc.name!r} cannot share memory with us: {why}")
        peer = _attach(desc, description, timeout_s)
        with self._lock:
            if self._closed:
                _unmap(peer)
                raise TransportError("the shm data plane is closed")
            previous = self._peers.pop(desc.name, None)
            self._peers[desc.name] = peer
            if previous is not None:
                self._retire(previous)
        return peer.info

    def disconnect(self, peer: str) -> None:
        with self._lock:
            known = self._peers.pop(peer, None)
            if known is not None:
                self._retire(known)

    def read(self, peer: str, runs: Sequence[PieceRun], *, lease: int = 0) -> int:
        with self._lock:
            self._check_open()
            known = self._peers.get(peer)
            if known is None:
                raise PeerUnavailable(f"shm peer {peer!r} is not connected")
            moves = [move for run in runs for move in self._moves(known, run)]
            copy = copies.copier(sum(move[2] for move in moves))
            alive = self._alive(known)
            if alive:
                known.users += 1
            handle = next(self._handles)
        if not alive:
            with self._lock:
                self._transfers[handle] = TransferState.FAILED
            return handle
        try:
            for dst, src, nbytes in moves:
                copy(dst, src, nbytes)
        finally:
            with self._lock:  # one acquisition: let go of the peer, record the transfer
                self._let_go(known)
                self._transfers[handle] = TransferState.DONE
        return handle

    def _moves(self, peer: _Peer, run: PieceRun) -> list[tuple[int, int, int]]:
        """(dst, src, nbytes) copies for one run, after every check (TransportError names the problem)."""
        source = peer.regions.get(run.src)
        local = self._regions.get(run.dst)
        if source is None:
            raise TransportError(f"shm peer {peer.name!r} exposes no region {run.src}")
        if local is None:
            raise TransportError(f"no registered region {run.dst} to read into")
        src_base, shape = source
        dst = local.region
        problem = run.misfit(shape, dst)
        if problem:
            raise TransportError(problem)
        size = shape.piece_bytes
        src_at, dst_at = src_base + run.src_first * shape.stride, dst.base + run.dst_first * dst.stride
        if run.count == 1 or (shape.stride == size and dst.dense):
            return [(dst_at, src_at, size * run.count)]
        return [(dst_at + k * dst.stride, src_at + k * shape.stride, size) for k in range(run.count)]

    @staticmethod
    def _alive(peer: _Peer) -> bool:
        """Whether the peer's end of the socket is still open (it closes when the peer closes or dies).

        One ``poll`` for hang-up only (data the peer sent out of turn does not count): measured on the
        2-core VM it costs a 64 KiB x 32 restore a third of a MSG_PEEK ``recv`` and its exception,
        and every restore asks it twice (the board lookup and the read).
        """
        try:
            events = peer.hangup.poll(0)
        except OSError:
            return False
        return not events or not events[0][1] & _HANGUP

    def _done_with(self, peer: _Peer) -> None:
        with self._lock:
            self._let_go(peer)

    @staticmethod
    def _let_go(peer: _Peer) -> None:
        """One user fewer (the caller holds the lock); the last one out of a closing peer unmaps it."""
        peer.users -= 1
        if peer.closing and not peer.users:
            _unmap(peer)

    # ------------------------------------------------------------------ slot boards

    def share_board(self, region: RegionDescriptor) -> int:
        return self.register([region], exposed=True)[0]

    def board_lookup(self, peer: str, region: int, layout: BoardLayout, keys: list[str]) -> BoardHits | None:
        found = self._board_of(peer, region, layout)
        if found is None:
            return None
        known, address = found
        try:
            slots, gens, digests = _board_reader.lookup(address, layout.as_tuple(), keys)  # type: ignore[union-attr]
        finally:
            self._done_with(known)
        return BoardHits(slots, gens, digests)

    def board_still(
        self, peer: str, region: int, layout: BoardLayout, slots: list[int], gens: list[int]
    ) -> list[bool] | None:
        found = self._board_of(peer, region, layout, alive=False)  # a read just asked; a dead board is frozen anyway
        if found is None:
            return None
        known, address = found
        try:
            return _board_reader.still(address, layout.as_tuple(), slots, gens)  # type: ignore[union-attr,no-any-return]
        finally:
            self._done_with(known)

    def board_read(
        self,
        peer: str,
        region: int,
        layout: BoardLayout,
        components: Sequence[tuple[int, int]],
        src_slots: list[int],
        dst_slots: list[int],
        gens: list[int],
    ) -> list[bool] | None:
        found = self._board_of(peer, region, layout)  # held from here: released in the finally
        if found is None:
            return None
        known, board = found
        try:
            with self._lock:
                pieces = [self._piece(known, src_id, dst_id) for src_id, dst_id in components]
                copy = copies.copier(sum(p[6] for p in pieces) * len(src_slots))
                # A large read streams past the cache (see copies.py): the same runs and checks as a
                # posted read, then the generation check.
                runs = slot_runs(zip(src_slots, dst_slots, strict=True)) if copy is not copies.memmove else []
                moves = [
                    move
                    for src_id, dst_id in components
                    for src_first, dst_first, count in runs
                    for move in self._moves(known, PieceRun(src_id, src_first, dst_id, dst_first, count))
                ]
            if copy is copies.memmove:
                return _board_reader.copy(board, layout.as_tuple(), pieces, src_slots, dst_slots, gens)  # type: ignore[union-attr,no-any-return]
            for dst, src, nbytes in moves:
                copy(dst, src, nbytes)
            return _board_reader.still(board, layout.as_tuple(), src_slots, gens)  # type: ignore[union-attr,no-any-return]
        except ValueError as exc:  # a slot outside its region: the C reader copied nothing
            raise TransportError(str(exc)) from exc
        finally:
            self._done_with(known)

    def _piece(self, peer: _Peer, src_id: int, dst_id: int) -> tuple[int, int, int, int, int, int, int]:
        """One component of a board copy, for the C reader (the caller holds the lock)."""
        source = peer.regions.get(src_id)
        local = self._regions.get(dst_id)
        if source is None or local is None:
            raise TransportError(f"no region {src_id} at shm peer {peer.name!r} or {dst_id} here to copy between")
        src_base, shape = source
        dst = local.region
        if shape.piece_bytes != dst.piece_bytes:
            raise TransportError(f"pieces of {shape.piece_bytes} bytes there, {dst.piece_bytes} here")
        return (src_base, shape.stride, shape.count, dst.base, dst.stride, dst.count, dst.piece_bytes)

    def _board_of(self, peer: str, region: int, layout: BoardLayout, *, alive: bool = True) -> tuple[_Peer, int] | None:
        """The peer (held: release with ``_done_with``) and its board's address: if alive, mapped and large enough."""
        if _board_reader is None:
            return None
        with self._lock:
            known = self._peers.get(peer)
            if self._closed or known is None or known.closing:
                return None
            found = known.regions.get(region)
            if found is None or found[1].count != 1 or found[1].span < layout.nbytes:
                return None
            # A dead source's board still reads back (we hold the mapping) but it serves nothing more:
            # no board answer, so the caller's LEASE fails and drops the link, as for any dead peer.
            if alive and not self._alive(known):
                return None
            known.users += 1
            return known, found[0]

    # ------------------------------------------------------------------ side links

    def serve_side(self, handler: ConnectionHandler) -> None:
        with self._lock:
            self._side_handler = handler
            if self._broker is not None:
                self._broker.serve(handler)

    def admit_side(self, admitted: Callable[[bytes], bool]) -> None:
        with self._lock:
            self._admitted = admitted
            if self._broker is not None:
                self._broker.admit(admitted)

    def side_request(self, peer: str, payload: bytes, timeout_s: float) -> bytes | None:
        if len(payload) > SIDE_FRAME_BYTES:
            return None
        with self._lock:
            known = self._peers.get(peer)
            if self._closed or known is None or known.closing:
                return None
            known.users += 1
            self.side_requests += 1
        try:
            with known.side:
                try:
                    known.sock.send(payload, socket.MSG_DONTWAIT)
                except OSError as exc:
                    raise PeerUnavailable(f"shm peer {peer!r}: its side link is closed: {exc}") from exc
                try:
                    reply, flags = _await_reply(known.sock, timeout_s)
                except OSError as exc:
                    raise PeerUnavailable(f"shm peer {peer!r}: its side link broke: {exc}") from exc
                if reply is None:
                    raise ControlTimeout(f"shm peer {peer!r} did not answer within {timeout_s:.3f}s")
                if not reply:
                    raise PeerUnavailable(f"shm peer {peer!r} closed its side link")
                if flags & socket.MSG_TRUNC:
                    raise PeerUnavailable(f"shm peer {peer!r} sent a reply larger than a side frame")
                return reply
        finally:
            self._done_with(known)

    def side_send(self, peer: str, payload: bytes) -> bool:
        if len(payload) > SIDE_FRAME_BYTES:
            return False
        with self._lock:
            known = self._peers.get(peer)
            if self._closed or known is None or known.closing:
                return False
            try:
                known.sock.send(payload, socket.MSG_DONTWAIT)
            except OSError:
                return False
            return True

    def poll(self, handle: int) -> TransferState:
        with self._lock:
            state = self._transfers.get(handle)
        if state is None:
            raise TransportError(f"unknown transfer handle {handle}")
        return state

    def cancel(self, handle: int) -> TransferState:
        return self.poll(handle)  # every read is terminal when read() returns

    def release(self, handle: int) -> None:
        with self._lock:
            if self._transfers.pop(handle, None) is None:
                raise TransportError(f"unknown transfer handle {handle}")

    # ------------------------------------------------------------------ ends

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
            for peer in peers:
                self._retire(peer)
            broker, self._broker = self._broker, None
            beacon, self._beacon = self._beacon, None
            self._regions.clear()
        if broker is not None:
            broker.close()
        if beacon is not None:
            for fd in (beacon.readonly, beacon.fd):
                with contextlib.suppress(OSError):
                    os.close(fd)

    def _retire(self, peer: _Peer) -> None:
        """Close a peer's socket; unmap now, or when its last copy ends. Called under the lock."""
        peer.closing = True
        if not peer.users:
            _unmap(peer)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("the shm data plane is closed")

    @property
    def broker(self) -> Broker | None:
        """The broker serving our memory (None until the first ``describe``), for diagnostics."""
        return self._broker


def _await_reply(sock: socket.socket, timeout_s: float) -> tuple[bytes | None, int]:
    """The reply frame and its flags, or None after ``timeout_s``: busy-polled for ``SIDE_SPIN_S``, then blocked.

    A same-host answer usually comes within the spin; blocking first costs more than the whole
    answer on a VM (measured on the 2-core VM: a UNIX-socket round trip 100-130 us blocked, 36-42
    us polled). The spin is bounded and only runs while a request waits, so an idle link costs nothing.

    Raises:
        OSError: the socket broke.
    """
    spin_until = time.perf_counter() + min(SIDE_SPIN_S, timeout_s)
    while True:
        try:
            reply, _, flags, _ = sock.recvmsg(SIDE_FRAME_BYTES + 1, 0, socket.MSG_DONTWAIT)
            return reply, flags
        except (BlockingIOError, InterruptedError):
            if time.perf_counter() >= spin_until:
                break
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(max(0, int((timeout_s - SIDE_SPIN_S) * 1000))):
        return None, 0
    reply, _, flags, _ = sock.recvmsg(SIDE_FRAME_BYTES + 1)
    return reply, flags


def _new_beacon() -> _Beacon:
    data = os.urandom(BEACON_BYTES)
    fd = os.memfd_create("kvcr-shm-beacon", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, data)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL)
    readonly = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    return _Beacon(fd, readonly, _digest(data))


def _attach(desc: Description, description: bytes, timeout_s: float) -> _Peer:
    """Take the peer's grant over its socket, map what it sent, check the beacon.

    Raises:
        PeerUnavailable: the socket is unreachable or silent, or what came back is unusable.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    fds: list[int] = []
    maps: list[tuple[int, int]] = []
    try:
        sock.settimeout(max(timeout_s, 0.001))
        _connect(sock, desc.socket, time.monotonic() + timeout_s)
        sock.sendall(wire.Request(desc.ticket).encode())
        blob, fds, flags, _ = socket.recv_fds(sock, 1 << 20, wire.MAX_FILES + 1)
        if not blob:
            raise PeerUnavailable(f"shm peer {desc.name!r} closed its socket without a grant")
        if flags & socket.MSG_CTRUNC:
            raise PeerUnavailable(f"shm peer {desc.name!r} sent more descriptors than one grant may carry")
        grant = wire.decode_grant(blob, len(fds), desc.incarnation)
        sizes = [_checked_size(desc.name, fd) for fd in fds]
        addresses = []
        for fd, size in zip(fds, sizes, strict=True):
            addresses.append(_map(desc.name, fd, size))
            maps.append((addresses[-1], size))
        if _digest(ctypes.string_at(addresses[grant.beacon], BEACON_BYTES)) != desc.beacon_digest:
            raise PeerUnavailable(f"shm peer {desc.name!r}: its beacon reads back wrong through the mapping")
        placed = {p.id: p for p in grant.regions}
        regions: dict[int, tuple[int, RegionWire]] = {}
        for shape in desc.regions:
            where = placed.get(shape.id)
            if where is None or where.offset + shape.span > sizes[where.file]:
                raise PeerUnavailable(f"shm peer {desc.name!r}: region {shape.id} is not inside what it sent")
            regions[shape.id] = (addresses[where.file] + where.offset, shape)
        sock.setblocking(True)  # from here on only MSG_DONTWAIT sends and receives
        peer = _Peer(desc.name, description, sock, maps, regions, PeerInfo(desc.name, late_writes=False))
        peer.hangup.register(sock, select.POLLRDHUP)  # POLLHUP, POLLERR and POLLNVAL come unasked
        return peer
    except (OSError, PeerUnavailable) as exc:
        for address, size in maps:
            _libc.munmap(address, size)
        sock.close()
        if isinstance(exc, PeerUnavailable):
            raise
        raise PeerUnavailable(f"shm peer {desc.name!r} did not hand its memory over: {exc}") from exc
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def _connect(sock: socket.socket, address: str, deadline: float) -> None:
    """Connect, trying again while the broker's backlog is full (a UNIX socket says so at once,
    EAGAIN, instead of waiting): a flood of other connections must delay a target, not refuse it.

    Raises:
        OSError: refused, or still full at ``deadline``.
    """
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.001)


def _checked_size(name: str, fd: int) -> int:
    """The file's size, if it is sealed so that it can never shrink (else a mapping could SIGBUS)."""
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise PeerUnavailable(f"shm peer {name!r} sent a descriptor that is not a sealable memfd") from exc
    if not seals & fcntl.F_SEAL_SHRINK:
        raise PeerUnavailable(f"shm peer {name!r} sent a memfd that is not sealed against shrinking")
    size = os.fstat(fd).st_size
    if size <= 0:
        raise PeerUnavailable(f"shm peer {name!r} sent an empty memfd")
    return size


def _map(name: str, fd: int, size: int) -> int:
    address = _libc.mmap(None, size, _PROT_READ, _MAP_SHARED, fd, 0)
    if address is None or address == _MAP_FAILED:
        err = ctypes.get_errno()
        raise PeerUnavailable(f"shm peer {name!r}: cannot map {size} bytes: {os.strerror(err)}")
    return int(address)


def _unmap(peer: _Peer) -> None:
    peer.sock.close()
    maps, peer.maps = peer.maps, []
    for address, size in maps:
        _libc.munmap(address, size)


__all__ = ["ShmDataPlane"]
