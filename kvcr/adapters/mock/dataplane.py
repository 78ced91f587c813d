"""A DataPlane over the in-process fabric that really copies bytes between registered regions.

It enforces what NIXL enforces (runs name registered regions in bounds, equal piece sizes, peers
connected and of the incarnation they were connected at, endpoints open) and what kvcr asks of
every data plane: a peer reads only *exposed* regions, never private ones. Transfers complete
through the injected clock: a read posted at ``t`` completes on the first poll at or after
``t + latency_s``, and only then are bytes copied, from the source's memory as it is at that
moment. Faults model the source side and are constructor arguments (see :class:`Faults`).
"""

from __future__ import annotations

import ctypes
import itertools
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcr.adapters.mock.fabric import Faults, MockFabric, _Node
from kvcr.adapters.mock.intercept import Interceptable
from kvcr.domain.errors import KvcrError
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.clock import Clock
from kvcr.ports.dataplane import PeerInfo, TransferState
from kvcr.ports.errors import PeerUnavailable, RegistrationError, TransportError


@dataclass
class _Transfer:
    source: str
    incarnation: int
    moves: tuple[tuple[int, int, int], ...]  # (dst address, src address, nbytes)
    complete_at: float
    state: TransferState = TransferState.PENDING


class MockDataPlane(Interceptable):
    INTERCEPTABLE = frozenset({"register", "deregister", "connect", "disconnect", "read", "poll", "cancel", "close"})

    def __init__(self, fabric: MockFabric, name: str, clock: Clock, faults: Faults | None = None) -> None:
        self._fabric = fabric
        self._name = name
        self._clock = clock
        self._handles = itertools.count(1)
        self._transfers: dict[int, _Transfer] = {}
        self._peers: dict[str, int] = {}  # name -> incarnation we connected to
        self._lock = threading.Lock()
        self._closed = False
        node = fabric.node(name)
        with fabric.lock:
            node.data_up = True
            node.incarnation += 1
            node.exposed.clear()
            node.private.clear()
            node.faults = faults or Faults()

    @property
    def name(self) -> str:
        return self._name

    @property
    def faults(self) -> Faults:
        """Faults of reads served by this endpoint."""
        return self._fabric.node(self._name).faults

    def set_faults(self, faults: Faults) -> None:
        """Change this endpoint's faults (they apply to reads already posted, too)."""
        with self._fabric.lock:
            self._fabric.node(self._name).faults = faults

    @property
    def live_transfers(self) -> int:
        """Handles not yet released (tests check nothing leaks)."""
        with self._lock:
            return len(self._transfers)

    def register(self, regions: Sequence[RegionDescriptor], *, exposed: bool) -> tuple[int, ...]:
        self._check_open()
        node = self._fabric.node(self._name)
        with self._fabric.lock:
            known = [*node.exposed.values(), *node.private.values()]
            for i, region in enumerate(regions):
                for other in [*known, *regions[:i]]:
                    if region.overlaps(other):
                        raise RegistrationError(f"{self._name}: region {region.label!r} overlaps {other.label!r}")
            ids = []
            table = node.exposed if exposed else node.private
            for region in regions:
                region_id = node.next_region
                node.next_region += 1
                table[region_id] = region
                ids.append(region_id)
        return tuple(ids)

    def deregister(self, ids: Sequence[int]) -> None:
        node = self._fabric.node(self._name)
        with self._fabric.lock:
            for region_id in ids:
                node.exposed.pop(region_id, None)
                node.private.pop(region_id, None)

    def describe(self) -> bytes:
        self._check_open()
        node = self._fabric.node(self._name)
        with self._fabric.lock:
            exposed = {str(i): [r.count, r.piece_bytes] for i, r in node.exposed.items()}
            incarnation = node.incarnation
        return json.dumps(
            {"fabric": "mock", "name": self._name, "incarnation": incarnation, "exposed": exposed}
        ).encode()

    def peer_name(self, description: bytes) -> str:
        return _decoded(description)[0]

    def connect(self, description: bytes, timeout_s: float) -> PeerInfo:
        del timeout_s  # the fake answers at once or not at all
        self._check_open()
        peer, incarnation = _decoded(description)
        node = self._fabric.find(peer)
        if node is None or not node.data_up or node.faults.peer_down or node.incarnation != incarnation:
            raise PeerUnavailable(f"peer {peer!r} is not on the fabric (or not at that incarnation)")
        with self._lock:
            self._peers[peer] = incarnation
        return PeerInfo(peer, late_writes=node.faults.late_writes)

    def disconnect(self, peer: str) -> None:
        with self._lock:
            self._peers.pop(peer, None)
            source = self._fabric.find(peer)
            late = source is not None and source.faults.late_writes
            for transfer in self._transfers.values():
                if transfer.source == peer and not transfer.state.terminal and not late:
                    transfer.state = TransferState.FAILED  # torn down: it will never write again

    def read(self, peer: str, runs: Sequence[PieceRun], *, lease: int = 0) -> int:
        del lease  # one-sided, like NIXL: the source takes no part in a read
        self._check_open()
        with self._lock:
            incarnation = self._peers.get(peer)
        if incarnation is None:
            raise PeerUnavailable(f"{self._name}: peer {peer!r} is not connected")
        source = self._fabric.find(peer)
        if source is None or not source.data_up or source.faults.peer_down or source.incarnation != incarnation:
            raise PeerUnavailable(f"peer {peer!r} is down (or restarted)")
        mine = self._fabric.node(self._name)
        with self._fabric.lock:
            moves = _resolve(runs, source, mine, peer, self._name)
        handle = next(self._handles)
        with self._lock:
            self._transfers[handle] = _Transfer(peer, incarnation, moves, self._clock.now() + source.faults.latency_s)
        return handle

    def poll(self, handle: int) -> TransferState:
        with self._lock:
            transfer = self._transfer(handle)
            if transfer.state is TransferState.PENDING or transfer.state is TransferState.UNCERTAIN:
                self._progress(transfer)
            return transfer.state

    def cancel(self, handle: int) -> TransferState:
        with self._lock:
            transfer = self._transfer(handle)
            if transfer.state is not TransferState.PENDING:
                return transfer.state  # a cancelled (or ended) read never writes again
            self._progress(transfer)
            if transfer.state is not TransferState.PENDING:
                return transfer.state
            source = self._fabric.find(transfer.source)
            if source is not None and (source.faults.uncertain_cancel or source.faults.late_writes):
                transfer.state = TransferState.UNCERTAIN  # still live: a later poll may land it
                return transfer.state
            transfer.state = TransferState.CANCELLED
            return transfer.state

    def release(self, handle: int) -> None:
        with self._lock:
            transfer = self._transfer(handle)
            if not transfer.state.terminal:
                raise KvcrError(f"transfer {handle} is {transfer.state.value}; releasing it could reuse live memory")
            del self._transfers[handle]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            live = [h for h, t in self._transfers.items() if not t.state.terminal]
            if live:
                raise KvcrError(f"{self._name}: {len(live)} transfers are not terminal; cannot close")
            self._transfers.clear()
            self._closed = True
        node = self._fabric.node(self._name)
        with self._fabric.lock:
            node.exposed.clear()
            node.private.clear()
            node.data_up = False

    # -------------------------------------------------------------- internals

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"data plane {self._name!r} is closed")

    def _transfer(self, handle: int) -> _Transfer:
        transfer = self._transfers.get(handle)
        if transfer is None:
            raise TransportError(f"unknown transfer handle {handle}")
        return transfer

    def _progress(self, transfer: _Transfer) -> None:
        source = self._fabric.find(transfer.source)
        faults = source.faults if source is not None else Faults(peer_down=True)
        if faults.stall or self._clock.now() < transfer.complete_at:
            return
        if source is None or not source.data_up or faults.peer_down or faults.error:
            transfer.state = TransferState.FAILED
            return
        if source.incarnation != transfer.incarnation:
            transfer.state = TransferState.FAILED  # the source restarted: its memory is someone else's
            return
        moves = transfer.moves
        if faults.partial_runs is not None:
            moves = moves[: faults.partial_runs]
        for dst, src, nbytes in moves:
            ctypes.memmove(dst, src, nbytes)
            if faults.corrupt:
                flipped = ctypes.string_at(dst, 1)[0] ^ 0xFF
                ctypes.memset(dst, flipped, 1)
        partial = faults.partial_runs is not None and faults.partial_runs < len(transfer.moves)
        transfer.state = TransferState.FAILED if partial else TransferState.DONE


def _resolve(
    runs: Sequence[PieceRun], source: _Node, mine: _Node, peer: str, name: str
) -> tuple[tuple[int, int, int], ...]:
    """Byte moves for ``runs`` (one per run when both regions are dense), after every check."""
    moves: list[tuple[int, int, int]] = []
    for run in runs:
        src = source.exposed.get(run.src)
        if src is None:
            raise TransportError(f"peer {peer!r} exposes no region {run.src}")
        dst = mine.exposed.get(run.dst) or mine.private.get(run.dst)
        if dst is None:
            raise TransportError(f"{name} has no registered region {run.dst}")
        misfit = run.misfit(src, dst)
        if misfit is not None:
            raise TransportError(misfit)
        if src.dense and dst.dense:
            moves.append((dst.address(run.dst_first), src.address(run.src_first), run.count * src.piece_bytes))
        else:
            for k in range(run.count):
                moves.append((dst.address(run.dst_first + k), src.address(run.src_first + k), src.piece_bytes))
    return tuple(moves)


if TYPE_CHECKING:
    from kvcr.adapters.mock.clock import FakeClock
    from kvcr.ports.dataplane import DataPlane

    _: DataPlane = MockDataPlane(MockFabric(), "a", FakeClock())


def _decoded(description: bytes) -> tuple[str, int]:
    """A mock description's name and incarnation.

    Raises:
        PeerUnavailable: unreadable.
    """
    try:
        info = json.loads(description)
        return str(info["name"]), int(info["incarnation"])
    except (ValueError, KeyError, TypeError) as exc:
        raise PeerUnavailable(f"unreadable peer description: {exc}") from exc
