"""``transport: auto``: the shm plane for peers on this host, another plane (NIXL) for the rest.

Both planes register every region; the ids this plane hands out are its own, mapped to each
plane's. Its description carries both planes' descriptions and the id maps, so a peer connects
over shm when its checks pass (same host, namespace and uid, a sealed memfd, the beacon read back)
and over the other plane when any of them fails: one peer, one plane, chosen at connect.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec

from kvcr.domain.board import BoardHits, BoardLayout
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.control import ConnectionHandler
from kvcr.ports.dataplane import (
    BoundSideLinks,
    DataPlane,
    GuardedReads,
    PeerInfo,
    ReadGuard,
    SharedBoards,
    SideChannel,
    TransferState,
)
from kvcr.ports.errors import PeerUnavailable, TransportError

log = logging.getLogger(__name__)

VERSION = 1


class _Wire(msgspec.Struct, frozen=True):
    version: int
    shm: bytes
    fallback: bytes
    ids: list[tuple[int, int, int]]  # (our id, the shm plane's, the fallback's) per exposed region


@dataclass(slots=True)
class _Route:
    plane: DataPlane
    ids: dict[int, int]  # the peer's ids -> that plane's ids on the peer


def fallback_description(description: bytes) -> tuple[bytes, dict[int, int]]:
    """The other plane's part of an ``auto`` description, and our region ids -> its ids (for a bare reader).

    Raises:
        PeerUnavailable: not an ``auto`` description.
    """
    try:
        desc = msgspec.msgpack.decode(description, type=_Wire)
    except (msgspec.MsgspecError, TypeError) as exc:
        raise PeerUnavailable(f"not an auto peer description: {exc}") from exc
    return desc.fallback, {mine: fallback for mine, _, fallback in desc.ids}


class SameHostFirst:
    """A DataPlane that reads from same-host peers through ``shm`` and from the others through ``fallback``."""

    def __init__(self, shm: DataPlane, fallback: DataPlane) -> None:
        if shm.name != fallback.name:
            raise TransportError(f"the two planes have different names ({shm.name!r}, {fallback.name!r})")
        self._shm, self._fallback = shm, fallback
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._regions: dict[int, tuple[int, int, bool]] = {}  # our id -> (shm id, fallback id, exposed)
        self._routes: dict[str, _Route] = {}
        self._handles = itertools.count(1)
        self._transfers: dict[int, tuple[DataPlane, int]] = {}

    @property
    def name(self) -> str:
        return self._fallback.name

    @property
    def shm(self) -> DataPlane:
        """The same-host plane (diagnostics: its counters)."""
        return self._shm

    def plane_of(self, peer: str) -> str | None:
        """Which plane reads from ``peer`` (``"shm"`` or ``"fallback"``), None if not connected."""
        with self._lock:
            route = self._routes.get(peer)
        if route is None:
            return None
        return "shm" if route.plane is self._shm else "fallback"

    def register(self, regions: Sequence[RegionDescriptor], *, exposed: bool) -> tuple[int, ...]:
        fallback = self._fallback.register(regions, exposed=exposed)
        try:
            shm = self._shm.register(regions, exposed=exposed)
        except TransportError:
            self._fallback.deregister(fallback)
            raise
        with self._lock:
            ours = tuple(next(self._ids) for _ in regions)
            for mine, s, f in zip(ours, shm, fallback, strict=True):
                self._regions[mine] = (s, f, exposed)
        return ours

    def deregister(self, ids: Sequence[int]) -> None:
        with self._lock:
            known = [self._regions.pop(i) for i in ids if i in self._regions]
        self._shm.deregister([s for s, _, _ in known])
        self._fallback.deregister([f for _, f, _ in known if f >= 0])

    # ------------------------------------------------------------------ slot boards

    def share_board(self, region: RegionDescriptor) -> int:
        """A board goes to the shm plane only: a peer on another host has no use for it (-1: no fallback id)."""
        if not isinstance(self._shm, SharedBoards):
            raise TransportError("the same-host plane shares no slot boards")
        inner = self._shm.share_board(region)
        with self._lock:
            mine = next(self._ids)
            self._regions[mine] = (inner, -1, True)
        return mine

    def _boards(self, peer: str, region: int) -> tuple[SharedBoards, int] | None:
        with self._lock:
            route = self._routes.get(peer)
        if route is None or route.plane is not self._shm or not isinstance(self._shm, SharedBoards):
            return None
        inner = route.ids.get(region)
        return (self._shm, inner) if inner is not None else None

    def board_lookup(self, peer: str, region: int, layout: BoardLayout, keys: list[str]) -> BoardHits | None:
        found = self._boards(peer, region)
        return found[0].board_lookup(peer, found[1], layout, keys) if found is not None else None

    def board_still(
        self, peer: str, region: int, layout: BoardLayout, slots: list[int], gens: list[int]
    ) -> list[bool] | None:
        found = self._boards(peer, region)
        return found[0].board_still(peer, found[1], layout, slots, gens) if found is not None else None

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
        found = self._boards(peer, region)
        if found is None:
            return None
        with self._lock:
            route = self._routes.get(peer)
            inner = []
            for src, dst in components:
                theirs = route.ids.get(src) if route is not None else None
                ours = self._regions.get(dst)
                if theirs is None or ours is None:
                    raise TransportError(f"no region {src} at peer {peer!r} or {dst} here to copy between")
                inner.append((theirs, ours[0]))
        return found[0].board_read(peer, found[1], layout, inner, src_slots, dst_slots, gens)

    def describe(self) -> bytes:
        return self.describe_to(b"")

    def describe_to(self, node: bytes) -> bytes:
        """Both planes' descriptions; the same-host part is made for ``node`` (see ``BoundSideLinks``)."""
        shm = self._shm.describe_to(node) if isinstance(self._shm, BoundSideLinks) else self._shm.describe()
        fallback = self._fallback.describe()
        with self._lock:
            ids = [(mine, s, f) for mine, (s, f, exposed) in self._regions.items() if exposed]
        return msgspec.msgpack.encode(_Wire(VERSION, shm, fallback, ids))

    def peer_name(self, description: bytes) -> str:
        return self._decode(description)[1]

    def _decode(self, description: bytes) -> tuple[_Wire, str]:
        """The description and the one name both its planes' parts claim.

        Raises:
            PeerUnavailable: unreadable, another version, or two parts naming two peers (a peer
                must not be read over one plane under a name it holds on the other).
        """
        try:
            desc = msgspec.msgpack.decode(description, type=_Wire)
        except (msgspec.MsgspecError, TypeError) as exc:
            raise PeerUnavailable(f"unreadable peer description (is the peer's transport auto?): {exc}") from exc
        if desc.version != VERSION:
            raise PeerUnavailable(f"auto peer description version {desc.version}, expected {VERSION}")
        name = self._fallback.peer_name(desc.fallback)
        if self._shm.peer_name(desc.shm) != name:
            raise PeerUnavailable(f"auto peer {name!r}: its shared-memory part names another peer")
        return desc, name

    def connect(self, description: bytes, timeout_s: float) -> PeerInfo:
        desc, _ = self._decode(description)
        try:
            info = self._shm.connect(desc.shm, timeout_s)
            plane, column = self._shm, 1
        except PeerUnavailable as exc:
            info = self._fallback.connect(desc.fallback, timeout_s)
            plane, column = self._fallback, 2
            # Once per peer connect: which plane a peer is read over is an operator's first question.
            fallback = type(self._fallback).__name__
            log.info("kvcr: peer %s is read over %s, not shared memory (%s)", info.name, fallback, exc)
        else:
            log.info("kvcr: peer %s is read over shared memory (same host)", info.name)
        route = _Route(plane, {row[0]: row[column] for row in desc.ids})
        with self._lock:
            previous = self._routes.get(info.name)
            self._routes[info.name] = route
        if previous is not None and previous.plane is not plane:
            previous.plane.disconnect(info.name)
        return info

    def disconnect(self, peer: str) -> None:
        with self._lock:
            self._routes.pop(peer, None)
        self._shm.disconnect(peer)
        self._fallback.disconnect(peer)

    def read(self, peer: str, runs: Sequence[PieceRun], *, lease: int = 0) -> int:
        with self._lock:
            route = self._routes.get(peer)
            if route is None:
                raise PeerUnavailable(f"peer {peer!r} is not connected")
            column = 0 if route.plane is self._shm else 1
            inner = []
            for run in runs:
                src = route.ids.get(run.src)
                dst = self._regions.get(run.dst)
                if src is None:
                    raise TransportError(f"peer {peer!r} exposes no region {run.src}")
                if dst is None:
                    raise TransportError(f"no registered region {run.dst} to read into")
                inner.append(PieceRun(src, run.src_first, dst[column], run.dst_first, run.count))
        handle = route.plane.read(peer, inner, lease=lease)
        with self._lock:
            mine = next(self._handles)
            self._transfers[mine] = (route.plane, handle)
        return mine

    def _transfer(self, handle: int) -> tuple[DataPlane, int]:
        with self._lock:
            found = self._transfers.get(handle)
        if found is None:
            raise TransportError(f"unknown transfer handle {handle}")
        return found

    def poll(self, handle: int) -> TransferState:
        plane, inner = self._transfer(handle)
        return plane.poll(inner)

    def cancel(self, handle: int) -> TransferState:
        plane, inner = self._transfer(handle)
        return plane.cancel(inner)

    def release(self, handle: int) -> None:
        plane, inner = self._transfer(handle)
        plane.release(inner)
        with self._lock:
            self._transfers.pop(handle, None)

    def guard_reads(self, allowed: ReadGuard) -> None:
        """A two-sided fallback checks reads against leases in our ids (shm reads are one-sided)."""
        if not isinstance(self._fallback, GuardedReads):
            return

        def in_our_ids(lease: int, runs: Sequence[PieceRun]) -> bool:
            with self._lock:
                ours = {f: mine for mine, (_, f, _) in self._regions.items() if f >= 0}
            if any(run.src not in ours for run in runs):
                return False
            return allowed(lease, [PieceRun(ours[r.src], r.src_first, r.dst, r.dst_first, r.count) for r in runs])

        self._fallback.guard_reads(in_our_ids)

    def admit_side(self, admitted: Callable[[bytes], bool]) -> None:
        if isinstance(self._shm, BoundSideLinks):
            self._shm.admit_side(admitted)

    def serve_side(self, handler: ConnectionHandler) -> None:
        """Side links are the shm plane's (a NIXL peer has none)."""
        if isinstance(self._shm, SideChannel):
            self._shm.serve_side(handler)

    def _side(self, peer: str) -> SideChannel | None:
        with self._lock:
            route = self._routes.get(peer)
        if route is None or route.plane is not self._shm or not isinstance(self._shm, SideChannel):
            return None
        return self._shm

    def side_request(self, peer: str, payload: bytes, timeout_s: float) -> bytes | None:
        side = self._side(peer)
        return side.side_request(peer, payload, timeout_s) if side is not None else None

    def side_send(self, peer: str, payload: bytes) -> bool:
        side = self._side(peer)
        return side.side_send(peer, payload) if side is not None else False

    def close(self) -> None:
        self._fallback.close()  # refuses (KvcrError) while one of its reads is live
        self._shm.close()
