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

import sys
from collections.abc import Hashable, Iterable


class _Holder:
    """One holder's pins: claims per page, distinct pages per pool, live leases."""

    __slots__ = ("leases", "pages", "pinned")

    def __init__(self) -> None:
        self.pages: dict[Hashable, int] = {}  # page -> this holder's leases claiming it
        self.pinned: dict[str, int] = {}  # pool -> distinct pages pinned
        self.leases = 0


class PeerQuota:
    """Pages pinned per (holder, pool) and live leases per holder.

    Plain dicts, one lookup per holder and one per page: a LEASE of a few hundred pages pays this
    on the source's side-link thread for every grant and every release, so it stays off Counter
    (whose missing-key path runs Python code per page).
    """

    __slots__ = ("_holders", "max_leases")

    def __init__(self, max_leases: int) -> None:
        self.max_leases = max_leases
        self._holders: dict[int, _Holder] = {}

    def may_lease(self, holder: int) -> bool:
        """Whether ``holder`` may take one more lease."""
        if not holder:
            return True
        held = self._holders.get(holder)
        return held is None or held.leases < self.max_leases

    def may_pin(self, holder: int, pool: str, page: Hashable, cap: int) -> bool:
        """Whether ``holder`` may pin ``page`` of ``pool``: it pins it already, or fewer than ``cap`` pages."""
        if not holder:
            return True
        held = self._holders.get(holder)
        if held is None:
            return cap > 0
        return page in held.pages or held.pinned.get(pool, 0) < cap

    def pin(self, holder: int, pool: str, page: Hashable) -> None:
        """Count one more claim of ``holder`` on ``page`` of ``pool``, whatever its share."""
        if holder:
            pins = self.pins(holder, pool, cap=sys.maxsize)
            pins.admit(page)
            pins.commit()

    def try_pin(self, holder: int, pool: str, page: Hashable, cap: int) -> bool:
        """``pin`` if ``may_pin``, in one step; whether it pinned."""
        if not holder:
            return True
        pins = self.pins(holder, pool, cap)
        pinned = pins.admit(page)
        pins.commit()
        return pinned

    def pins(self, holder: int, pool: str, cap: int) -> HolderPins:
        """``holder``'s pins in ``pool`` for one grant: ``admit`` each page, then ``commit`` once."""
        return HolderPins(self._holders, holder, pool, cap)

    def add_lease(self, holder: int) -> None:
        """Count a granted lease of ``holder`` (after its pages were pinned)."""
        if holder:
            self._holder(holder).leases += 1

    def end(self, holder: int, pages: Iterable[tuple[str, Hashable]]) -> None:
        """Forget a lease of ``holder`` (released or expired) that pinned ``pages`` ((pool, page), repeats allowed)."""
        if not holder:
            return
        held = self._holders.get(holder)
        if held is None:
            return
        held.leases -= 1
        claims, pinned = held.pages, held.pinned
        for pool, page in pages:
            n = claims.get(page, 0) - 1
            if n > 0:
                claims[page] = n
                continue
            if claims.pop(page, None) is not None:
                left = pinned.get(pool, 0) - 1
                if left > 0:
                    pinned[pool] = left
                else:
                    pinned.pop(pool, None)
        if held.leases <= 0 and not claims:
            del self._holders[holder]

    def holders(self) -> int:
        """How many holders have live leases (bounded by the live leases themselves)."""
        return sum(1 for held in self._holders.values() if held.leases > 0)

    def _holder(self, holder: int) -> _Holder:
        held = self._holders.get(holder)
        if held is None:
            held = self._holders[holder] = _Holder()
        return held


class HolderPins:
    """One holder's pins in one pool while a grant is made: ``admit`` per page, ``commit`` at the end.

    The grant's pass over its pages asks this once per page (a dict lookup, no holder lookup);
    a holder with no record gets one only at ``commit``, and only if something was pinned.
    """

    __slots__ = ("_holder", "_holders", "_pool", "_record", "cap", "count", "pages")

    def __init__(self, holders: dict[int, _Holder], holder: int, pool: str, cap: int) -> None:
        self._holders, self._holder, self._pool, self.cap = holders, holder, pool, cap
        self._record = holders.get(holder)
        self.pages: dict[Hashable, int] = self._record.pages if self._record is not None else {}
        self.count = self._record.pinned.get(pool, 0) if self._record is not None else 0

    def admit(self, page: Hashable) -> bool:
        """Claim ``page``: free when already pinned, else one of the pool's ``cap`` distinct pages."""
        pages = self.pages
        claims = pages.get(page, 0)
        if not claims:
            if self.count >= self.cap:
                return False
            self.count += 1
        pages[page] = claims + 1
        return True

    def commit(self) -> None:
        """Record what ``admit`` pinned."""
        record = self._record
        if record is None:
            if not self.pages:
                return
            record = self._record = self._holders[self._holder] = _Holder()
            record.pages = self.pages
        if self.count:
            record.pinned[self._pool] = self.count
