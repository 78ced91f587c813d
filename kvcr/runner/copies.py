"""Backup and local restore: the runner's copies between engine host pages and kvcr DRAM.

Each operation reserves or claims entries in the pool's ``SlotIndex`` under the runner's lock,
copies outside it (the slots are FILLING or claimed, so nobody else touches them), then settles
the entries under the lock again. Per page a backup is all-or-nothing; with ``verify_bytes`` every
copy is hashed while it runs (``HostMemory.copy_digested``): a backup keeps the digest, a restore
compares against it, and a page whose bytes changed behind kvcr's back is discarded, never served.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvcr.domain.errors import LayoutError
from kvcr.domain.keys import check_page_hash
from kvcr.domain.outcomes import RESTORED, PageOutcome, failed, miss
from kvcr.ports.clock import Clock
from kvcr.ports.errors import MemoryCopyError
from kvcr.ports.memory import HostMemory, Move
from kvcr.runner.accounting import TierAccounting
from kvcr.runner.guard import RunnerGuard
from kvcr.runner.index import Entry, Fill
from kvcr.runner.pool_state import PoolState, merged_moves, page_moves

log = logging.getLogger(__name__)

_NOT_HELD = miss("not held")
_CORRUPT = failed("bytes differ from their backup digest")

# One page's moves (its position in the batch, its entry) and a whole batch's coalesced moves.
PageMoves = Callable[[int, Entry], list[Move]]
BatchMoves = Callable[[list[tuple[int, Entry]]], list[Move]]


class TierCopies:
    """Copies pages in and out of one runner's pools. Thread-safe (under the guard's lock).

    Args:
        operation_s: each operation's deadline for the lock (the copy itself is not interrupted).
        verify: digest every copy (``verify_bytes``).
        expire_leases: ends expired leases (with the lock held) before the index evicts.
    """

    def __init__(
        self,
        guard: RunnerGuard,
        memory: HostMemory,
        clock: Clock,
        account: TierAccounting,
        *,
        operation_s: float,
        verify: bool,
        expire_leases: Callable[[], None],
    ) -> None:
        self._guard = guard
        self._memory = memory
        self._clock = clock
        self._account = account
        self._operation_s = operation_s
        self._verify = verify
        self._expire_leases = expire_leases

    # ------------------------------------------------------------------ backup

    def backup(
        self, state: PoolState, page_hashes: Sequence[str], host_slots: Sequence[int], parent: str | None
    ) -> list[bool]:
        """See ``KvcrRunner.backup``."""
        host = state.check_batch(page_hashes, host_slots)
        arena = state.arena_regions()
        return self._backup(
            state,
            page_hashes,
            lambda i, e: page_moves(arena, e.slot, host, host_slots[i]),
            lambda fills: merged_moves(arena, host, [(e.slot, host_slots[i]) for i, e in fills]),
            parent,
        )

    def store_page(self, state: PoolState, page_hash: str, sources: Sequence[int]) -> bool:
        """See ``KvcrRunner.store_page``."""
        arena = state.arena_regions()
        if len(sources) != len(arena):
            raise LayoutError(f"pool {state.spec.name!r} has {len(arena)} components, {len(sources)} sources given")
        return self._backup(
            state,
            [page_hash],
            lambda _, e: [Move(r.address(e.slot), src, r.piece_bytes) for r, src in zip(arena, sources, strict=True)],
            None,
            None,
        )[0]

    def _backup(
        self,
        state: PoolState,
        page_hashes: Sequence[str],
        moves_of: PageMoves,
        merged: BatchMoves | None,
        parent: str | None,
    ) -> list[bool]:
        if parent is not None:
            check_page_hash(parent)
        guard = self._guard
        with guard.locked(self._clock.now() + self._operation_s):
            guard.check_open()
            results, fills, evicted = state.index.begin_fills(page_hashes, parent, self._expire_leases)
            self._account.evicted(state, evicted)
            guard.inflight += 1
        copied = False
        try:
            if fills:
                digests = self._copy(state, page_hashes, [(i, e) for i, _, e in fills], moves_of, merged)
                if digests is not None:  # of kvcr's own copy; FILLING, so nobody else reads these entries yet
                    for (_, _, entry), digest in zip(fills, digests, strict=True):
                        entry.digest = digest
            copied = True
        except MemoryCopyError as exc:
            log.warning("backup of %d pages of pool %s failed: %s", len(fills), state.spec.name, exc)
        finally:
            with guard.lock:
                self._finish_backup(state, fills, copied, results, page_hashes, parent)
                guard.finished()
        return results

    def _finish_backup(
        self,
        state: PoolState,
        fills: list[Fill],
        copied: bool,
        results: list[bool],
        page_hashes: Sequence[str],
        parent: str | None,
    ) -> None:
        index = state.index
        stored = index.finish_fills(fills, copied)
        for i, _ in stored:
            results[i] = True
        if len(stored) == len(page_hashes):
            ready = list(page_hashes)  # the common batch: every page is new and now READY
        else:
            ready = []
            for i, page in enumerate(page_hashes):
                if index.is_ready(page):
                    ready.append(page)
                    results[i] = True  # also a page listed twice in one batch
        if ready:
            index.admit(ready)
        self._account.backup(state, page_hashes, parent, stored, len(ready), 0 if copied else len(fills))

    # ------------------------------------------------------------------ restore

    def restore(
        self, state: PoolState, page_hashes: Sequence[str], host_slots: Sequence[int], prefix_only: bool
    ) -> list[PageOutcome]:
        """See ``KvcrRunner.restore``."""
        host = state.check_batch(page_hashes, host_slots)
        arena = state.arena_regions()
        return self._restore(
            state,
            page_hashes,
            lambda i, e: page_moves(host, host_slots[i], arena, e.slot),
            lambda claimed: merged_moves(host, arena, [(host_slots[i], e.slot) for i, e in claimed]),
            prefix_only,
        )

    def load_page(self, state: PoolState, page_hash: str, destinations: Sequence[int]) -> bool:
        """See ``KvcrRunner.load_page``."""
        arena = state.arena_regions()
        if len(destinations) != len(arena):
            raise LayoutError(
                f"pool {state.spec.name!r} has {len(arena)} components, {len(destinations)} destinations given"
            )
        return self._restore(
            state,
            [page_hash],
            lambda _, e: [
                Move(dst, r.address(e.slot), r.piece_bytes) for r, dst in zip(arena, destinations, strict=True)
            ],
            None,
            False,
        )[0].restored

    def _restore(
        self,
        state: PoolState,
        page_hashes: Sequence[str],
        moves_of: PageMoves,
        merged: BatchMoves | None,
        prefix_only: bool,
    ) -> list[PageOutcome]:
        started = self._clock.now()
        outcomes: list[PageOutcome] = [_NOT_HELD] * len(page_hashes)
        guard = self._guard
        with guard.locked(started + self._operation_s):
            guard.check_open()
            claimed = state.index.claim_ready(page_hashes, prefix_only=prefix_only)
            guard.inflight += 1
        copied = False
        corrupt: list[int] = []
        try:
            if claimed:
                digests = self._copy(state, page_hashes, claimed, moves_of, merged)
                if digests is not None:  # what landed in the host page must match the backup digest
                    corrupt = [i for (i, entry), d in zip(claimed, digests, strict=True) if d != entry.digest]
            copied = True
        except MemoryCopyError as exc:
            log.warning("restore of %d pages of pool %s failed: %s", len(claimed), state.spec.name, exc)
        finally:
            with guard.lock:
                outcome = RESTORED if copied else failed("local copy failed")
                bad = set(corrupt)
                index = state.index
                for i, entry in claimed:
                    outcomes[i] = _CORRUPT if i in bad else outcome
                    if i in bad:
                        if index.discard(page_hashes[i], entry):
                            self._account.removed(state, page_hashes[i])
                    else:
                        index.unclaim(entry)
                guard.finished()
        self._account.local_restore(
            state, len(page_hashes), len(claimed), len(corrupt), copied, self._clock.now() - started
        )
        return outcomes

    # ------------------------------------------------------------------ the copy itself

    def _copy(
        self,
        state: PoolState,
        page_hashes: Sequence[str],
        items: list[tuple[int, Entry]],
        moves_of: PageMoves,
        merged: BatchMoves | None,
    ) -> list[bytes] | None:
        """Copy the items' pages; with ``verify_bytes`` return, per item, the digest of what landed.

        Verified copies go page by page, hashed while they copy (``HostMemory.copy_digested``);
        the others go as one coalesced batch where the caller can plan one.
        """
        if self._verify:
            seeds = [state.seed(page_hashes[i]) for i, _ in items]
            return self._memory.copy_digested([moves_of(i, e) for i, e in items], seeds)
        self._memory.copy(merged(items) if merged is not None else [m for i, e in items for m in moves_of(i, e)])
        return None
