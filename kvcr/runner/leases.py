"""A source's lease table: the leases it granted to peers, what each pins, and when each ends.

A lease is a set of claims with a deadline on the source's own clock. The table owns the ids
(random 63-bit numbers, never reused while live, so a peer cannot guess another's lease and a
restarted source honours none of its predecessor's), the deadlines, whether new leases are still
granted, and the per-peer quota. It holds no lock and touches no slot: the runner calls it under
its lock and ends each returned lease's claims in its pools' indexes.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvcr.domain.residency import Lease
from kvcr.runner.index import Entry, SlotIndex
from kvcr.runner.quota import PeerQuota

MISSING_SLOT = -1
"""The slot a grant gives a page it does not lease (from a peer: a miss, not an error)."""


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """What a source granted: a lease id, per requested pool and page its slot (or -1) and digest, the TTL.

    ``lease_id`` is 0 when nothing was granted (no lease is held then). ``over_quota``: pages
    refused only because the holder was at its own cap (pages or leases).
    """

    lease_id: int
    slots: tuple[tuple[int, ...], ...]
    digests: tuple[tuple[bytes, ...], ...]
    ttl_s: float
    over_quota: int = 0


@dataclass(slots=True)
class HeldLease:
    """One granted lease: its deadline, the (pool, entry) claims it holds, its holder (0: none)."""

    lease: Lease
    claims: list[tuple[str, Entry]]
    holder: int = 0


class LeaseTable:
    """Live leases by id. Not thread-safe: the runner's lock guards it."""

    __slots__ = ("_draw", "_leases", "leasing", "quota")

    def __init__(self, max_peer_leases: int, draw: Callable[[int], int] = secrets.randbits) -> None:
        """``draw(bits)``: where lease ids come from (a cryptographic source unless a test injects one)."""
        self._draw = draw
        self._leases: dict[int, HeldLease] = {}
        self.quota = PeerQuota(max_peer_leases)
        self.leasing = True  # False once the runner stops granting (shutdown)

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self) -> Iterator[HeldLease]:
        return iter(self._leases.values())

    def get(self, lease_id: int) -> HeldLease | None:
        return self._leases.get(lease_id)

    def lease(
        self,
        requests: Sequence[tuple[str, Sequence[str]]],
        indexes: Mapping[str, SlotIndex],
        holder: int,
        now: float,
        duration_s: float,
    ) -> tuple[LeaseGrant, dict[str, int]]:
        """Pin the READY pages of ``requests`` ((pool, page hashes)) in ``indexes`` for ``holder``.

        Pages that are malformed, of a pool not in ``indexes``, not READY, past the pool's lease cap
        or past the holder's own caps are granted as ``MISSING_SLOT``; nothing at all once leasing
        stopped. Returns the grant and the pages leased per pool.
        """
        slots: list[tuple[int, ...]] = []
        digests: list[tuple[bytes, ...]] = []
        claims: list[tuple[str, Entry]] = []
        leased: dict[str, int] = {}
        over_quota = 0
        quota = self.quota
        may_lease = quota.may_lease(holder)
        for pool, pages in requests:
            index = indexes.get(pool)
            if index is None or not self.leasing or not may_lease:
                over_quota += 0 if may_lease else len(pages)
                slots.append((MISSING_SLOT,) * len(pages))
                digests.append((b"",) * len(pages))
                continue
            pins = quota.pins(holder, pool, index.peer_cap) if holder else None
            pool_slots, pool_digests, pinned, refused = index.pin_for_lease(pages, pins.admit if pins else None)
            if pins is not None:
                pins.commit()
            over_quota += refused
            claims.extend((pool, entry) for entry in pinned)
            slots.append(pool_slots)
            digests.append(pool_digests)
            leased[pool] = leased.get(pool, 0) + len(pinned)
        lease_id = self._grant(claims, holder, now, duration_s) if claims else 0
        return LeaseGrant(lease_id, tuple(slots), tuple(digests), duration_s, over_quota), leased

    def _grant(self, claims: list[tuple[str, Entry]], holder: int, now: float, duration_s: float) -> int:
        """Record a lease of ``claims`` (already pinned) for ``holder`` until ``now + duration_s``; its id."""
        lease_id = self._new_id()
        self._leases[lease_id] = HeldLease(Lease(lease_id, (), now, now + duration_s), claims, holder)
        self.quota.add_lease(holder)
        return lease_id

    def release(self, lease_id: int) -> HeldLease | None:
        """Remove a lease now; None when it is unknown (released, expired or never granted)."""
        held = self._leases.pop(lease_id, None)
        if held is not None:
            self._forget(held)
        return held

    def expire(self, now: float) -> list[HeldLease]:
        """Remove and return every lease whose deadline has passed at ``now``."""
        expired = [held for held in self._leases.values() if held.lease.expired(now)]
        for held in expired:
            del self._leases[held.lease.lease_id]
            self._forget(held)
        return expired

    def pinned_pools(self) -> set[str]:
        """The pools some live lease still pins."""
        return {pool for held in self._leases.values() for pool, _ in held.claims}

    def _forget(self, held: HeldLease) -> None:
        self.quota.end(held.holder, held.claims)

    def _new_id(self) -> int:
        while True:
            lease_id = self._draw(63)
            if lease_id and lease_id not in self._leases:
                return lease_id
