"""Serving peers' leases: grant, look up, release, expire, wait; the runner's lease half.

A lease pins READY pages in the pools' indexes (``SlotIndex``) so that eviction passes them by
until the lease is released or expires on our clock; ``LeaseTable`` keeps who holds what. The
desk holds the runner's lock (``RunnerGuard``) around both, reports grants and expiries to
``TierAccounting``, and wakes whoever waits on the guard when a lease ends.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

from kvcr.ports.clock import Clock
from kvcr.runner.accounting import TierAccounting
from kvcr.runner.guard import RunnerGuard
from kvcr.runner.index import SlotIndex
from kvcr.runner.leases import HeldLease, LeaseGrant, LeaseTable


class LeaseDesk:
    """Peers' leases over the physical pools' indexes. Thread-safe (under the guard's lock).

    Args:
        indexes: what a peer may lease from, by pool (the physical pools, fixed for the runner's life).
        page_bytes: each pool's page size (the bytes a grant serves).
        lease_s: the longest lease granted.
    """

    def __init__(
        self,
        guard: RunnerGuard,
        table: LeaseTable,
        indexes: Mapping[str, SlotIndex],
        page_bytes: Mapping[str, int],
        account: TierAccounting,
        clock: Clock,
        lease_s: float,
    ) -> None:
        self._guard = guard
        self._table = table
        self._indexes = dict(indexes)
        self._page_bytes = dict(page_bytes)
        self._account = account
        self._clock = clock
        self._lease_s = lease_s

    def __len__(self) -> int:
        """Leases held now, expired ones included until the next expiry pass (call with the lock held)."""
        return len(self._table)

    def lease(self, requests: Sequence[tuple[str, Sequence[str]]], duration_s: float, holder: int) -> LeaseGrant:
        """See ``KvcrRunner.lease``."""
        duration = min(max(duration_s, 0.0), self._lease_s)
        guard = self._guard
        with guard.lock:
            guard.check_open()
            now = self._clock.now()
            self.expire_locked(now)
            grant, leased = self._table.lease(requests, self._indexes, holder, now, duration)
        pages = sum(leased.values())
        served = sum(n * self._page_bytes[pool] for pool, n in leased.items())
        self._account.served(pages, served)
        self._account.leases(len(self._table))
        return grant

    def leased_slots(self, lease_id: int) -> dict[str, set[int]] | None:
        """The slots a live lease holds, per pool; None when the lease is unknown or expired."""
        with self._guard.lock:
            self.expire_locked(self._clock.now())
            held = self._table.get(lease_id)
            if held is None:
                return None
            slots: dict[str, set[int]] = {}
            for pool, entry in held.claims:
                slots.setdefault(pool, set()).add(entry.slot)
            return slots

    def stop(self) -> None:
        """Grant nothing from now on (shutdown); releases and expiry keep working."""
        with self._guard.lock:
            self._table.leasing = False

    def wait(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` (real time) for every lease to be released or expire; returns those left."""
        give_up = time.monotonic() + max(0.0, timeout_s)
        guard = self._guard
        with guard.lock:
            while self._table and time.monotonic() < give_up:
                self.expire_locked(self._clock.now())
                if self._table:
                    guard.quiet.wait(timeout=min(0.05, max(0.0, give_up - time.monotonic())))
            return len(self._table)

    def release(self, lease_id: int) -> bool:
        """End a lease early; False when it is unknown (released, expired or never granted)."""
        guard = self._guard
        with guard.lock:
            held = self._table.release(lease_id)
            if held is None:
                return False
            self._unpin(held)
            guard.quiet.notify_all()
            self._account.leases(len(self._table))
        return True

    def expire(self) -> int:
        """End every lease past its deadline on our clock; returns how many ended."""
        with self._guard.lock:
            return self.expire_locked(self._clock.now())

    def active(self) -> int:
        """Leases live now (one past its deadline is ended here, not counted)."""
        with self._guard.lock:
            self.expire_locked(self._clock.now())
            return len(self._table)

    def expire_locked(self, now: float) -> int:
        """``expire`` with the lock already held."""
        expired = self._table.expire(now)
        for held in expired:
            self._unpin(held)
        if expired:
            self._account.leases(len(self._table), expired=len(expired))
            self._guard.quiet.notify_all()
        return len(expired)

    def expire_now(self) -> None:
        """``expire_locked`` at the clock's now (the index calls it before it evicts)."""
        self.expire_locked(self._clock.now())

    def pinned_pools(self) -> set[str]:
        """Pools some live lease still holds pages of (call with the lock held)."""
        return self._table.pinned_pools()

    def _unpin(self, held: HeldLease) -> None:
        claims = held.claims
        for pool in {pool for pool, _ in claims}:
            self._indexes[pool].unpin_all([entry for of, entry in claims if of == pool])
