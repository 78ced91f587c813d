"""Slot residency, claims and leases.

A DRAM slot moves FREE -> FILLING -> READY and back to FREE; DISCARDING marks a slot whose
contents are dead but which a reader (claim) or an unfinished transfer still touches. Readers
claim READY slots; a claimed slot is never evicted or reused. A peer *lease* is a claim with a
deadline on the source's own clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvcr.domain.errors import KvcrError


class SlotState(str, enum.Enum):
    """Where a DRAM slot is in its life."""

    FREE = "free"
    FILLING = "filling"
    READY = "ready"
    DISCARDING = "discarding"


_ALLOWED = frozenset(
    {
        (SlotState.FREE, SlotState.FILLING),
        (SlotState.FILLING, SlotState.READY),
        (SlotState.FILLING, SlotState.FREE),
        (SlotState.FILLING, SlotState.DISCARDING),
        (SlotState.READY, SlotState.FREE),
        (SlotState.READY, SlotState.DISCARDING),
        (SlotState.DISCARDING, SlotState.FREE),
    }
)


class IllegalTransition(KvcrError):
    """A slot was asked to move along an edge the state machine does not have."""


def check_transition(current: SlotState, target: SlotState) -> SlotState:
    """Return ``target`` if the move is legal, else raise IllegalTransition."""
    if (current, target) not in _ALLOWED:
        raise IllegalTransition(f"slot cannot go from {current.value} to {target.value}")
    return target


def evictable(state: SlotState, claims: int) -> bool:
    """Only READY, unclaimed slots may be evicted."""
    return state is SlotState.READY and claims == 0


@dataclass(frozen=True, slots=True)
class Lease:
    """Keys held for a peer until ``expires_at`` on the source's monotonic clock."""

    lease_id: int
    keys: tuple[str, ...]
    granted_at: float
    expires_at: float

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    def renewed(self, now: float, duration_s: float) -> Lease:
        """The same lease, running ``duration_s`` from ``now``."""
        return Lease(self.lease_id, self.keys, self.granted_at, now + duration_s)


def lease_accepts(sent_at: float, lease_s: float, margin_s: float, completed_at: float) -> bool:
    """The target's lease rule: data is usable only if the read ended before ``sent + lease - margin``.

    ``sent_at`` and ``completed_at`` are on the target's clock. The source started its lease
    clock after the request was sent, so everything before that bound was read under the lease.
    """
    return completed_at < sent_at + lease_s - margin_s
