"""DataPlane: one-sided reads from a peer's registered memory into ours.

Call order::

    register(regions)                    once per region, at start-up
    describe() -> bytes                  handed to peers over the control channel
    connect(peer_description) -> peer    on first use of a peer; cached by the adapter
    read(peer, runs) -> handle           one batched transfer
    poll(handle) -> state                until terminal (DONE / FAILED / CANCELLED)
    cancel(handle) -> state              when a deadline passes; UNCERTAIN if not confirmed
    release(handle)                      after a terminal state
    deregister(labels)                   only when no transfer touches them
    close()

``CopyRun.src_label`` names a region of the *peer* (from its description); ``dst_label`` names
one of ours. A handle that ended UNCERTAIN must never be released with its destination reused:
the destination may still be written.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

from kvcr.domain.layout import CopyRun, RegionDescriptor


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


class DataPlane(Protocol):
    @property
    def name(self) -> str:
        """This endpoint's name on the fabric (unique per runner)."""

    def register(self, regions: Sequence[RegionDescriptor]) -> None:
        """Make regions readable by peers (ours as sources) and writable by reads (destinations).

        Raises:
            RegistrationError: a region is already registered or cannot be registered.
        """

    def deregister(self, labels: Sequence[str]) -> None:
        """Forget regions; the caller guarantees no transfer touches them."""

    def describe(self) -> bytes:
        """What a peer needs to read from us (agent metadata and region table)."""

    def connect(self, description: bytes) -> str:
        """Load a peer's description; returns the peer's name. Idempotent.

        Raises:
            PeerUnavailable: the description is unusable.
        """

    def disconnect(self, peer: str) -> None:
        """Forget a peer (it restarted or went away)."""

    def read(self, peer: str, runs: Sequence[CopyRun]) -> int:
        """Start reading every run from ``peer`` into our regions; returns a handle.

        Raises:
            PeerUnavailable: the peer is not connected or not reachable.
            TransportError: the transfer could not be posted.
        """

    def poll(self, handle: int) -> TransferState:
        """Current state; also drives progress for adapters that need it."""

    def cancel(self, handle: int) -> TransferState:
        """Try to stop a transfer; CANCELLED only when confirmed, else UNCERTAIN (or its terminal state)."""

    def release(self, handle: int) -> None:
        """Forget a handle in a terminal state."""

    def close(self) -> None:
        """Release everything this data plane registered or connected."""
