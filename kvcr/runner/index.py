"""One pool's slot index: which page sits in which slot, in what state, who holds it, who goes first.

Bookkeeping only: no lock, no I/O, no metrics. The runner holds its lock around every call, moves
the bytes outside it, and publishes events and counts from what these calls return. The rules the
design leans on live here and nowhere else:

- a new page is FILLING: invisible to readers, never evicted; only its filler makes it READY
  (``finish_fills``), or gives its slot back when the copy failed;
- a claimed page (a local restore reading it, or a peer's lease) is never evicted and its slot is
  never reused; a page dropped while claimed turns DISCARDING and its slot returns with the last
  claim;
- eviction takes unclaimed READY pages in the policy's order and never a protected one (the
  prefix a backup extends);
- pages are admitted and touched together with their resident ancestors, root first, so a prefix
  ages as a unit and a deep page never outlives the pages that make it restorable.

Free slots are handed out lowest first, which keeps a batch's slots consecutive when it can (and
its copies merged into runs).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Sequence

from kvcr.domain.eviction import EvictionPolicy
from kvcr.domain.keys import check_page_hash, check_page_hashes
from kvcr.domain.residency import SlotState, check_transition
from kvcr.runner.board import SlotBoard

_READY = SlotState.READY
_FILLING = SlotState.FILLING
_DISCARDING = SlotState.DISCARDING
_FREE = SlotState.FREE


class Entry:
    """One resident (or arriving) page."""

    __slots__ = ("claims", "digest", "leased", "parent", "slot", "state")

    def __init__(self, slot: int, parent: str | None) -> None:
        self.slot = slot
        self.state = _FILLING  # a new entry is being filled: invisible to readers, never evicted
        self.claims = 0  # local readers plus peers' leases
        self.leased = 0  # the claims that are peers' leases
        self.parent = parent
        self.digest = b""


Fill = tuple[int, str, Entry]
"""A page being filled: its position in the batch, its key and its entry."""


class SlotIndex:
    """The pages of one pool over ``slots`` slots. Not thread-safe: the caller's lock guards it.

    ``lease_cap``: pages peers' leases may pin at once (the rest stays for the owner's backups);
    ``peer_cap``: the pages one peer may pin, read by the lease table's quota.
    """

    __slots__ = (
        "_depth",
        "_free",
        "_policy_type",
        "board",
        "detached",
        "entries",
        "lease_cap",
        "leased",
        "peer_cap",
        "policy",
        "slots",
    )

    def __init__(
        self,
        slots: int,
        policy_type: Callable[[], EvictionPolicy],
        *,
        max_alignment_depth: int,
        lease_cap: int,
        peer_cap: int,
    ) -> None:
        self.slots = slots
        self.entries: dict[str, Entry] = {}
        self._policy_type = policy_type
        self.policy = policy_type()
        self._free: list[int] = list(range(slots))
        self._depth = max_alignment_depth
        self.detached = 0  # DISCARDING pages already dropped from the index, still owning a slot
        self.leased = 0  # pages held by at least one peer lease
        self.lease_cap = lease_cap
        self.peer_cap = peer_cap
        self.board: SlotBoard | None = None  # same-host peers' view of READY pages (see ``share``)

    # ------------------------------------------------------------------ reading

    @property
    def free_count(self) -> int:
        return len(self._free)

    def present(self, page_hashes: Sequence[str]) -> list[bool]:
        """Per page, whether it is READY; a malformed key not in the index is an error, not a miss."""
        entries = self.entries
        present = []
        for page in page_hashes:
            entry = entries.get(page)
            if entry is None:
                check_page_hash(page)
                present.append(False)
            else:
                present.append(entry.state is _READY)
        return present

    def is_ready(self, page: str) -> bool:
        entry = self.entries.get(page)
        return entry is not None and entry.state is _READY

    def counts(self) -> tuple[int, int, int, int]:
        """(ready, filling, discarding, claimed) pages; discarding includes those already out of the index."""
        counts = {_READY: 0, _FILLING: 0, _DISCARDING: 0}
        claimed = 0
        for entry in self.entries.values():
            counts[entry.state] += 1
            claimed += entry.claims > 0
        return counts[_READY], counts[_FILLING], counts[_DISCARDING] + self.detached, claimed

    # ------------------------------------------------------------------ backup

    def begin_fills(
        self,
        page_hashes: Sequence[str],
        parent: str | None,
        reclaim: Callable[[], None],
    ) -> tuple[list[bool], list[Fill], list[str]]:
        """Give every page of a backup batch not yet held a FILLING entry, as far as slots allow.

        Returns (held, fills, evicted): per page whether it counts as stored already (READY, or
        FILLING by a caller storing the same bytes), the entries the caller must now fill, and the
        pages evicted for them. ``reclaim`` is called once when free slots run short, before any
        page is evicted: the caller ends what pins slots for nothing (expired leases).
        """
        held = [False] * len(page_hashes)
        entries = self.entries
        needed: list[int] = []
        resident: list[str] = []
        known = [entries.get(page) for page in page_hashes]
        if not any(known) and len(set(page_hashes)) == len(page_hashes):
            check_page_hashes(page_hashes)  # the common batch: all new, no repeats
            needed = list(range(len(page_hashes)))
        else:
            pending: set[str] = set()
            for i, page in enumerate(page_hashes):
                entry = known[i]
                if entry is not None:
                    held[i] = True
                    if entry.state is _READY:
                        resident.append(page)
                elif page not in pending:
                    check_page_hash(page)  # keys already in the index were checked on the way in
                    pending.add(page)
                    needed.append(i)
        # Refresh the prefix this batch extends before choosing victims, so a deeper batch never
        # evicts the ancestors that make it restorable.
        lineage = self.ancestors(parent)
        if lineage or resident:
            self.policy.touch([*lineage, *resident])
        fills: list[Fill] = []
        evicted: list[str] = []
        if needed:
            slots, evicted = self._reserve(len(needed), [*lineage, *page_hashes], reclaim)
            for k, slot in enumerate(slots):  # fewer slots than pages: the rest stays unstored
                i = needed[k]
                page = page_hashes[i]
                entry = Entry(slot, page_hashes[i - 1] if i else parent)
                entries[page] = entry
                fills.append((i, page, entry))
        return held, fills, evicted

    def finish_fills(self, fills: Sequence[Fill], copied: bool) -> list[tuple[int, str]]:
        """End the fills of one backup: READY when ``copied``, else their slots go back.

        A page cleared while it was being filled gives its slot back either way. Returns the
        (position, page) pairs that became READY.
        """
        entries = self.entries
        board = self.board
        stored: list[tuple[int, str]] = []
        for i, page, entry in fills:
            if entry.state is _DISCARDING:  # cleared while we copied
                self._free_slot(entry)
                continue
            if copied:
                entry.state = _READY  # FILLING -> READY: only this call fills it
                stored.append((i, page))
                if board is not None:
                    board.publish(entry.slot, page, entry.digest)
            else:
                if entries.get(page) is entry:
                    del entries[page]
                self._free_slot(entry)
        return stored

    def admit(self, pages: list[str]) -> None:
        """Tell the policy about newly READY ``pages``, preceded by their resident ancestors.

        Admit, not touch: FIFO ignores touches, so pages it was never told about would never
        become victims and a full arena would refuse every later backup.
        """
        self.policy.admit(self.aligned(pages))

    # ------------------------------------------------------------------ restore

    def claim_ready(self, page_hashes: Sequence[str], *, prefix_only: bool) -> list[tuple[int, Entry]]:
        """Claim every READY page of ``page_hashes`` (with ``prefix_only``, up to the first one that is
        not) and touch them with their ancestors. Returns (position, entry) per claimed page; each
        claim ends with ``unclaim`` or ``discard``."""
        known = [self.entries.get(page) for page in page_hashes]
        claimed: list[tuple[int, Entry]]
        hits: Sequence[str]
        if all(entry is not None and entry.state is _READY for entry in known):
            claimed = list(enumerate(known))  # type: ignore[arg-type]  # the common batch: all held
            hits = page_hashes
        else:
            claimed, hits = [], []
            for i, entry in enumerate(known):
                if entry is None or entry.state is not _READY:
                    if entry is None:
                        check_page_hash(page_hashes[i])
                    if prefix_only:
                        break
                    continue
                claimed.append((i, entry))
                hits.append(page_hashes[i])
        for _, entry in claimed:
            entry.claims += 1
        if hits:
            self.policy.touch(self.aligned(list(hits)))
        return claimed

    def unclaim(self, entry: Entry) -> None:
        """End one claim; the last claim on a DISCARDING page gives its slot back."""
        entry.claims -= 1
        if entry.claims == 0 and entry.state is _DISCARDING:
            self._free_slot(entry)

    def discard(self, page: str, entry: Entry) -> bool:
        """End the caller's claim on a page whose bytes can no longer be trusted, and drop the page.

        Returns whether it left the index now (the caller reports it removed). Its slot goes back
        at once when nobody else claims it, else with the last claim.
        """
        entry.claims -= 1
        removed = self.entries.get(page) is entry
        if removed:
            del self.entries[page]
            self.policy.remove(page)
            if self.board is not None:
                self.board.withdraw(entry.slot)
        if entry.claims == 0:  # the last reader: free the slot, also when an earlier reader marked it DISCARDING
            self._free_slot(entry)
        elif entry.state is not _DISCARDING:
            entry.state = check_transition(entry.state, _DISCARDING)
            self.detached += 1
        return removed

    # ------------------------------------------------------------------ leases

    def pin_for_lease(
        self, pages: Sequence[str], admit: Callable[[Entry], bool] | None = None
    ) -> tuple[tuple[int, ...], tuple[bytes, ...], list[Entry], int]:
        """Pin the READY pages of one lease in one pass: per page its slot (or -1) and digest, the
        entries pinned (a page named twice is pinned twice), and how many ``admit`` refused.

        A page is left out (-1, no digest) when it is not READY (or not a key), when pinning it
        would take the pool past ``lease_cap`` distinct leased pages, or when ``admit`` (the
        holder's quota, asked only about pages the pool could lease) says no. No call per page
        beyond ``admit``: a LEASE of a few hundred pages runs this in front of its reply.
        """
        entries = self.entries
        room = self.lease_cap - self.leased  # distinct pages peers may still pin
        slots: list[int] = []
        digests: list[bytes] = []
        pinned: list[Entry] = []
        refused = 0
        for page in pages:
            entry = entries.get(page) if isinstance(page, str) else None
            if entry is None or entry.state is not _READY or (not entry.leased and room <= 0):
                slots.append(-1)
                digests.append(b"")
                continue
            if admit is not None and not admit(entry):
                refused += 1
                slots.append(-1)
                digests.append(b"")
                continue
            if not entry.leased:
                room -= 1
            entry.leased += 1
            entry.claims += 1
            pinned.append(entry)
            slots.append(entry.slot)
            digests.append(entry.digest)
        self.leased = self.lease_cap - room
        return tuple(slots), tuple(digests), pinned, refused

    def unpin_all(self, entries: Iterable[Entry]) -> None:
        """A peer lease on each of ``entries`` ended (repeats allowed), in one pass."""
        ended = 0
        for entry in entries:
            entry.leased -= 1
            if not entry.leased:
                ended += 1
            entry.claims -= 1  # unclaim's step, inlined: this runs per page of every RELEASE
            if entry.claims == 0 and entry.state is _DISCARDING:
                self._free_slot(entry)
        self.leased -= ended

    def share(self, board: SlotBoard) -> None:
        """Keep ``board`` in step with the index from now on, starting with every READY page."""
        self.board = board
        for page, entry in self.entries.items():
            if entry.state is _READY:
                board.publish(entry.slot, page, entry.digest)

    # ------------------------------------------------------------------ whole pool

    def clear(self) -> None:
        """Drop every page; slots still being read or filled come back when that ends."""
        if self.board is not None:
            self.board.withdraw_all()
        for entry in self.entries.values():
            if entry.state is _READY and entry.claims == 0:
                self._free_slot(entry)
            else:
                entry.state = check_transition(entry.state, _DISCARDING)
                self.detached += 1
        self.entries = {}
        self.policy = self._policy_type()

    def forget(self) -> None:
        """Drop the index without touching slots (the runner is closing: nothing reads it again)."""
        self.entries = {}
        if self.board is not None:
            self.board.withdraw_all()
            self.board = None  # its memory is freed next

    # ------------------------------------------------------------------ prefix alignment

    def aligned(self, pages: list[str]) -> list[str]:
        """``pages`` (all in the index) preceded by their resident ancestors, root first (prefix-recency
        alignment)."""
        lineage = self.ancestors(self.entries[pages[0]].parent, exclude=pages)
        return [*lineage, *pages]

    def ancestors(self, parent: str | None, exclude: Sequence[str] = ()) -> list[str]:
        """READY ancestors reached through parent links from ``parent``, root first, at most the
        configured depth."""
        entries = self.entries
        lineage: list[str] = []
        seen = set(exclude)
        while parent is not None and len(lineage) < self._depth and parent not in seen:
            entry = entries.get(parent)
            if entry is None or entry.state is not _READY:
                break
            lineage.append(parent)
            seen.add(parent)
            parent = entry.parent
        lineage.reverse()
        return lineage

    # ------------------------------------------------------------------ slots

    def _take(self, count: int) -> list[int]:
        taken = self._free[:count]
        del self._free[:count]
        return taken

    def _reserve(self, count: int, protect: Sequence[str], reclaim: Callable[[], None]) -> tuple[list[int], list[str]]:
        """Up to ``count`` free slots, evicting unclaimed READY pages the policy picks first."""
        slots = self._take(count)
        if len(slots) == count:
            return slots, []
        # Slots pinned for nothing (expired leases, pages dropped while leased) come back first,
        # and such slots are used before any resident page is evicted.
        reclaim()
        slots.extend(self._take(count - len(slots)))
        short = count - len(slots)
        if short <= 0:
            return slots, []
        protected = set(protect)
        entries = self.entries
        victims: list[str] = []
        for page in self.policy.victims():
            entry = entries[page]
            if entry.state is _READY and entry.claims == 0 and page not in protected:
                victims.append(page)
                if len(victims) == short:
                    break
        freed = []
        board = self.board
        for page in victims:
            self.policy.remove(page)
            entry = entries.pop(page)
            entry.state = _FREE  # READY -> FREE, checked by the loop above
            freed.append(entry.slot)
            if board is not None:
                board.withdraw(entry.slot)  # before the caller overwrites the slot
        slots.extend(sorted(freed))  # no slot was free: the victims' slots are all there is, lowest first
        return slots, victims

    def _free_slot(self, entry: Entry) -> None:
        if entry.state is _DISCARDING:
            self.detached -= 1
        entry.state = check_transition(entry.state, _FREE)
        bisect.insort(self._free, entry.slot)
