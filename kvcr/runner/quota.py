"""Per-peer lease quotas: what each peer's live leases pin, so one peer cannot starve another.

A pool's lease cap (``max_leased_fraction`` of its slots) protects the owner's own backups from
peers; it is shared by every peer, so one peer that keeps re-leasing pages would hold the pool at
its cap and every other peer's restore of pages nobody leases would get nothing. A *holder* (the
peer server names one per control connection, and a session is bound to its connection) may pin
at most ``cap`` distinct pages of a pool and hold at most ``max_leases`` live leases; a page it
already pins costs nothing more when it leases it again.

Not thread-safe: the runner drives it under its lock, on every grant and every lease's end
(release, expiry, clear). Holder 0 is no holder (the runner's own callers): never counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable


class PeerQuota:
    """Pages pinned per (holder, pool) and live leases per holder."""

    def __init__(self, max_leases: int) -> None:
        self.max_leases = max_leases
        self._pins: dict[int, Counter[Hashable]] = {}  # holder -> page -> its leases holding that page
        self._pinned: Counter[tuple[int, str]] = Counter()  # (holder, pool) -> distinct pages pinned
        self._leases: Counter[int] = Counter()

    def may_lease(self, holder: int) -> bool:
        """Whether ``holder`` may take one more lease."""
        return not holder or self._leases[holder] < self.max_leases

    def may_pin(self, holder: int, pool: str, page: Hashable, cap: int) -> bool:
        """Whether ``holder`` may pin ``page`` of ``pool``: it pins it already, or fewer than ``cap`` pages."""
        if not holder:
            return True
        pins = self._pins.get(holder)
        return (pins is not None and page in pins) or self._pinned[(holder, pool)] < cap

    def pin(self, holder: int, pool: str, page: Hashable) -> None:
        """Count one more claim of ``holder`` on ``page`` of ``pool`` (for the lease being granted)."""
        if not holder:
            return
        pins = self._pins.setdefault(holder, Counter())
        if not pins[page]:
            self._pinned[(holder, pool)] += 1
        pins[page] += 1

    def add_lease(self, holder: int) -> None:
        """Count a granted lease of ``holder`` (after its pages were pinned)."""
        if holder:
            self._leases[holder] += 1

    def end(self, holder: int, pages: Iterable[tuple[str, Hashable]]) -> None:
        """Forget a lease of ``holder`` (released or expired) that pinned ``pages`` ((pool, page), repeats allowed)."""
        if not holder:
            return
        self._leases[holder] -= 1
        if self._leases[holder] <= 0:
            del self._leases[holder]
        pins = self._pins.get(holder)
        if pins is None:
            return
        for pool, page in pages:
            pins[page] -= 1
            if pins[page] <= 0:
                del pins[page]
                self._pinned[(holder, pool)] -= 1
                if self._pinned[(holder, pool)] <= 0:
                    del self._pinned[(holder, pool)]
        if not pins:
            del self._pins[holder]

    def holders(self) -> int:
        """How many holders have live leases (bounded by the live leases themselves)."""
        return len(self._leases)
