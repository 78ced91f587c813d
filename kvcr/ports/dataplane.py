"""DataPlane: one-sided reads of a peer's exposed pieces into our own regions, by piece index.

Call order::

    register(regions, exposed=...) -> ids   once per region at start-up
    describe() -> bytes                     handed to authenticated peers over the control channel
    connect(description, timeout_s) -> peer on first use of a peer (proves it reachable)
    read(peer.name, runs) -> handle         one batched transfer of piece runs
    poll(handle) -> state                   until terminal (DONE / FAILED / CANCELLED)
    cancel(handle) -> state                 when a deadline passes; UNCERTAIN if not confirmed stopped
    disconnect(peer.name)                   tear a peer down (also after an UNCERTAIN read, see below)
    release(handle)                         after a terminal state
    deregister(ids) / close()

Regions are addressed by the ids ``register`` returns, pieces by their index inside a region
(``RegionDescriptor``: ``count`` pieces of ``piece_bytes``, ``stride`` apart). A ``PieceRun``
names ``count`` consecutive pieces on both sides; the source region is the peer's (its id comes
from the peer's description, relayed by the peer protocol), the destination is ours.

*Exposed* regions (kvcr's DRAM arena) are what peers may read: ``describe`` names them and
nothing else. *Private* regions (the engine's host pages, staging memory) are only destinations
of our own reads; no description ever names them, so a peer holding our description has no
handle on them.

A handle that ended UNCERTAIN must never be released with its destination reused: the
destination may still be written. ``disconnect`` is the adapter's strongest stop: afterwards a
live read either reaches a terminal state (the transport guarantees it writes no more) or stays
UNCERTAIN. ``PeerInfo.late_writes`` says up front whether that can happen with this peer; the
runner then lands such reads in kvcr-owned staging memory it can quarantine, never in engine
memory.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvcr.domain.board import BoardHits, BoardLayout
from kvcr.domain.layout import PieceRun, RegionDescriptor
from kvcr.ports.control import ConnectionHandler

__all__ = [
    "DataPlane",
    "GuardedReads",
    "PeerActivity",
    "PeerInfo",
    "PieceRun",
    "ReadGuard",
    "SharedBoards",
    "SideChannel",
    "TransferState",
]


class TransferState(str, enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNCERTAIN = "uncertain"

    @property
    def terminal(self) -> bool:
        """Whether the transfer will not touch memory any more (UNCERTAIN is not)."""
        return self in (TransferState.DONE, TransferState.FAILED, TransferState.CANCELLED)


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """A connected peer: its name on the fabric, and whether a given-up read may still land later."""

    name: str
    late_writes: bool


class DataPlane(Protocol):
    @property
    def name(self) -> str:
        """This endpoint's name on the fabric (unique per runner incarnation)."""

    def register(self, regions: Sequence[RegionDescriptor], *, exposed: bool) -> tuple[int, ...]:
        """Register regions (all or none); returns their ids, in order.

        ``exposed`` regions are described to peers and readable by them; private ones are only
        destinations of our reads.

        Raises:
            RegistrationError: a region overlaps a registered one or cannot be registered.
        """

    def deregister(self, ids: Sequence[int]) -> None:
        """Forget regions; the caller guarantees no transfer touches them."""

    def describe(self) -> bytes:
        """What a peer needs to read our exposed regions (and nothing about private ones)."""

    def peer_name(self, description: bytes) -> str:
        """The name a peer's description claims on the fabric, read without connecting.

        ``connect`` replaces a peer already connected under the same name, and reads name their
        peer by it: a caller binds each name to the peer it authenticated first, and checks a
        new description's name here before it connects (see ``SourceLinks``).

        Raises:
            PeerUnavailable: the description is unreadable.
        """

    def connect(self, description: bytes, timeout_s: float) -> PeerInfo:
        """Load a peer's description and make sure it is reachable. Idempotent for one description.

        Raises:
            PeerUnavailable: the description is unusable or the peer did not answer in time.
        """

    def disconnect(self, peer: str) -> None:
        """Tear a peer down: its live reads end (terminal) or stay UNCERTAIN (see module doc)."""

    def read(self, peer: str, runs: Sequence[PieceRun], *, lease: int = 0) -> int:
        """Start reading every run from ``peer`` into our regions; returns a handle.

        ``lease`` is the source's lease id the runs were granted under; one-sided transports
        ignore it, two-sided ones let the source check it (see :class:`GuardedReads`).

        Raises:
            PeerUnavailable: the peer is not connected or not reachable.
            TransportError: a run names an unknown region, runs out of bounds, or pairs pieces of
                different sizes; or the transfer could not be posted. Nothing was posted.
        """

    def poll(self, handle: int) -> TransferState:
        """Current state; also drives progress for adapters that need it."""

    def cancel(self, handle: int) -> TransferState:
        """Try to stop a transfer; CANCELLED only when confirmed, else UNCERTAIN (or its terminal state)."""

    def release(self, handle: int) -> None:
        """Forget a handle in a terminal state.

        Raises:
            KvcrError: the transfer is not terminal (its destination may still be written).
        """

    def close(self) -> None:
        """Release everything this data plane registered or connected.

        Raises:
            KvcrError: a transfer is still live; nothing was released.
        """


@runtime_checkable
class PeerActivity(Protocol):
    """Optional: a data plane whose idle cost depends on knowing when peers will read from it.

    The peer server calls ``expect_reads`` whenever it answers a HELLO or grants a lease, so an
    adapter that must progress for remote readers (wire-up, keep-alive) can stay responsive
    while leases live and back off to near-zero cost when nobody reads.
    """

    def expect_reads(self, within_s: float) -> None:
        """Peers may read our exposed regions during the next ``within_s`` seconds."""


ReadGuard = Callable[[int, Sequence[PieceRun]], bool]
"""``allowed(lease, runs)``: whether a peer's read of ``runs`` (source region ids) is covered by ``lease``."""


@runtime_checkable
class GuardedReads(Protocol):
    """Optional: a two-sided transport, where the source itself sends the bytes a peer reads.

    The peer server installs its lease table as the guard, so such a source sends nothing but
    pieces a live lease covers; a read outside it fails at the target without a byte moved.
    """

    def guard_reads(self, allowed: ReadGuard) -> None:
        """Check every incoming read with ``allowed`` before sending anything."""


SIDE_FRAME_BYTES = 128 << 10
"""The largest control frame a side link carries either way; a larger request uses the control channel."""


@runtime_checkable
class SideChannel(Protocol):
    """Optional: a data plane whose peer link also carries control frames, cheaper than the control channel.

    The same-host plane's link is a UNIX socket opened with a secret that only the authenticated
    HELLO reply carries, so it is as authenticated as the control connection. The source answers
    its frames with the peer server's handler, the side link being their connection (a session
    opened over it is bound to it); the target says HELLO over it, then LEASE and RELEASE.
    """

    def serve_side(self, handler: ConnectionHandler) -> None:
        """Answer frames that arrive over side links with ``handler`` (on the plane's own thread)."""

    def side_request(self, peer: str, payload: bytes, timeout_s: float) -> bytes | None:
        """The reply to ``payload`` over ``peer``'s side link; None when it has none.

        Raises:
            PeerUnavailable: the link broke (the peer closed or died).
            ControlTimeout: no reply within ``timeout_s``.
        """

    def side_send(self, peer: str, payload: bytes) -> bool:
        """A one-way frame over ``peer``'s side link (never blocks); False when it has none or it failed."""


@runtime_checkable
class BoundSideLinks(Protocol):
    """Optional: a ``SideChannel`` whose links are bound to the node whose HELLO got the description.

    The description a node receives carries a credential only for it; a link opened with it
    carries that node's name to the handler (``with_node``), so per-node quotas count it with the
    node's control connections, and a node the channel no longer admits loses its links.
    """

    def describe_to(self, node: bytes) -> bytes:
        """``describe()`` for the peer ``node`` (b"": a peer the channel cannot name): its links are bound to it."""

    def admit_side(self, admitted: Callable[[bytes], bool]) -> None:
        """Close the links (and drop the frames) of a node ``admitted`` says no to, within ``SIDE_RECHECK_S``."""


SIDE_RECHECK_S = 0.1
"""How stale a revocation may be on a side link (the control channel's directory is read as often)."""


@runtime_checkable
class SharedBoards(Protocol):
    """Optional: a data plane that lets same-host peers map a source's slot boards (``kvcr.domain.board``).

    The source shares each pool's board as a region only same-host peers can map; a target that
    maps it finds where pages sit without a LEASE, and checks after its copy that they did not move.
    Board reads are lock-free reads of the peer's memory; a peer this plane does not map (another
    host, or no board support built) answers None, and the caller leases the usual way.
    """

    def share_board(self, region: RegionDescriptor) -> int:
        """Expose ``region`` (a board) to same-host peers only; its id goes into the peer protocol's HELLO."""

    def board_lookup(self, peer: str, region: int, layout: BoardLayout, keys: list[str]) -> BoardHits | None:
        """Per page key of ``keys``, where ``peer``'s board ``region`` has it; None: no board to read.

        Raises:
            ValueError: a key that is not 64 lowercase hex characters (a board holds no other).
        """

    def board_still(
        self, peer: str, region: int, layout: BoardLayout, slots: list[int], gens: list[int]
    ) -> list[bool] | None:
        """Per slot, whether its generation is still the one a lookup read; None: no board to read."""

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
        """Copy pages found on ``peer``'s board ``region`` into ours, then say per page whether its slot
        still has the generation found (False: the peer reused it meanwhile; what landed is not that page).

        ``components``: per component, (the peer's region id, our region id); page ``i`` is source
        slot ``src_slots[i]`` into our slot ``dst_slots[i]`` of each. A synchronous read and check in
        one call (a same-host copy cannot stall). None: the peer is gone or shares no such board,
        and nothing was copied.

        Raises:
            TransportError: a region unknown or shaped unlike its counterpart, a slot outside it
                (nothing copied).
        """
