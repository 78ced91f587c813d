"""The kvcr runner: a DRAM tier per pool, its key index, and local backup / restore.

The runner is the service layer over two pieces of bookkeeping: one slot index per physical pool
(``index.py``: slot states, claims, eviction, prefix alignment) and the lease table of what peers
hold (``leases.py``). It owns the lock around them, the arenas (``pool_state.py`` checks their
geometry against the engine's) and the copies, outside the lock and protected by slot state: a
slot being filled is FILLING, a slot being read is claimed. ``accounting.py`` turns what each
operation did into metrics and inventory events. Memory and peers are reached only through ports.

Per page, a backup is all-or-nothing: a page becomes READY only after every component's piece
was copied; a failed copy frees the page's slot and reports it unstored. With ``verify_bytes`` a
page also gets a digest, bound to its key and namespace, computed from the bytes kvcr just copied
into its own memory and kept in the index (never in memory a peer can reach). Every delivery is
checked against it: a local restore hashes what it wrote into the host page, a peer hashes what
it read. Bytes that changed in the arena behind kvcr's back are therefore never served.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvcr.domain.errors import ClosedError, ConfigError, DeadlineExceeded, KvcrError, LayoutError
from kvcr.domain.eviction import POLICIES
from kvcr.domain.keys import check_page_hash
from kvcr.domain.layout import RegionDescriptor, check_disjoint, page_extents
from kvcr.domain.outcomes import RESTORED, PageOutcome, failed, miss
from kvcr.domain.pools import PoolSpec
from kvcr.domain.residency import SlotState
from kvcr.ports.clock import Clock
from kvcr.ports.errors import MemoryCopyError, RegistrationError
from kvcr.ports.inventory import InventorySink
from kvcr.ports.memory import HostMemory, Move
from kvcr.ports.metrics import Metrics
from kvcr.runner.accounting import TierAccounting
from kvcr.runner.arena import Arena
from kvcr.runner.config import RunnerConfig
from kvcr.runner.index import Entry, Fill, SlotIndex
from kvcr.runner.leases import HeldLease, LeaseGrant, LeaseTable
from kvcr.runner.pool_state import PoolState, merged_moves, page_moves

log = logging.getLogger(__name__)

_READY = SlotState.READY
_NOT_HELD = miss("not held")
_CORRUPT = failed("bytes differ from their backup digest")


@dataclass(frozen=True, slots=True)
class PoolStats:
    pool: str
    slots: int
    free: int
    ready: int
    filling: int
    discarding: int
    claimed: int
    page_bytes: int

    def as_dict(self) -> dict[str, int | str]:
        """Plain values for stats pages and JSON."""
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class RunnerStats:
    name: str
    namespace: str
    pools: tuple[PoolStats, ...]
    counters: dict[str, float]


@dataclass(frozen=True, slots=True)
class QueryResult:
    """Per-key presence and the leading run of present keys."""

    present: tuple[bool, ...]
    prefix: int


# One page's moves (its position in the batch, its entry) and a whole batch's coalesced moves.
PageMoves = Callable[[int, Entry], list[Move]]
BatchMoves = Callable[[list[tuple[int, Entry]]], list[Move]]


class KvcrRunner:
    """The DRAM tier of one engine rank. Thread-safe."""

    def __init__(
        self,
        config: RunnerConfig,
        *,
        memory: HostMemory,
        clock: Clock,
        metrics: Metrics,
        inventory: InventorySink,
    ) -> None:
        self.config = config
        self.namespaces = config.namespaces()
        # One digest naming the whole replica's key space, for logs and stats pages.
        self.namespace = hashlib.sha256(repr(sorted(self.namespaces.items())).encode()).hexdigest()[:16]
        self._verify = config.verify_bytes
        self._memory = memory
        self._clock = clock
        self._metrics = metrics
        self._account = TierAccounting(metrics, inventory)
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        self._leases = LeaseTable(config.max_peer_leases)
        slots = config.slots_per_pool()
        self._pools: dict[str, PoolState] = {}
        try:
            for spec in config.pools:
                arena = self._arena(spec, slots[spec.name]) if spec.physical else None
                self._pools[spec.name] = PoolState(spec, arena, self._index(arena), self.namespaces.get(spec.name, ""))
        except BaseException:
            self._release_arenas()
            raise
        check_disjoint([r for p in self._pools.values() if p.arena for r in p.arena.regions])
        # What a peer may lease from: the physical pools' indexes (fixed for the runner's life).
        self._leasable = {name: p.index for name, p in self._pools.items() if p.arena is not None}
        self._gauges()

    def _index(self, arena: Arena | None) -> SlotIndex:
        config = self.config
        slots = arena.slots if arena is not None else 0
        lease_cap = max(1, int(slots * config.max_leased_fraction)) if slots else 0
        return SlotIndex(
            slots,
            POLICIES[config.policy],
            max_alignment_depth=config.max_alignment_depth,
            lease_cap=lease_cap,
            peer_cap=max(1, int(lease_cap * config.max_peer_leased_fraction)) if slots else 0,
        )

    def _arena(self, spec: PoolSpec, slots: int) -> Arena:
        try:
            return Arena(spec, slots, self._memory)
        except RegistrationError as exc:
            raise ConfigError(
                f"dram_bytes: cannot allocate {slots * spec.page_bytes} bytes for pool {spec.name!r} "
                f"({exc}); lower dram_bytes"
            ) from exc

    # ------------------------------------------------------------------ registration

    @property
    def pools(self) -> tuple[PoolSpec, ...]:
        return self.config.pools

    def arena_regions(self) -> tuple[RegionDescriptor, ...]:
        """Every arena region (what peers may read)."""
        return tuple(r for p in self._pools.values() if p.arena for r in p.arena.regions)

    def pool_arenas(self) -> dict[str, tuple[RegionDescriptor, ...]]:
        """Arena regions per physical pool, components in order."""
        return {name: p.arena.regions for name, p in self._pools.items() if p.arena}

    def pool_host_regions(self, pool: str) -> tuple[RegionDescriptor, ...]:
        """The registered host regions of ``pool`` (LayoutError when none)."""
        return self._physical(pool).host_regions()

    def host_digest(self, pool: str, host_slot: int, page_hash: str) -> bytes:
        """Digest of one host page across its components, bound to the page's key (what a peer's digest vouches for)."""
        state = self._physical(pool)
        regions = state.host_regions()
        return self._memory.digest(page_extents(regions, host_slot), state.seed(page_hash))

    def digest_extents(self, pool: str, extents: Sequence[tuple[int, int]], page_hash: str) -> bytes:
        """Digest of a page whose components sit at ``extents`` (staging memory), bound to its key."""
        return self._memory.digest(extents, self._physical(pool).seed(page_hash))

    def host_regions(self) -> tuple[RegionDescriptor, ...]:
        """Every registered host region (where restores land)."""
        return tuple(r for p in self._pools.values() if p.host for r in p.host)

    def register_host_pool(self, pool: str, regions: Sequence[RegionDescriptor]) -> tuple[RegionDescriptor, ...]:
        """Describe where the engine keeps ``pool``'s pages: one region per component, in order.

        Returns the regions under kvcr's canonical labels. Re-registering identical geometry is a
        no-op; a different geometry is accepted only while nothing is in flight.
        """
        state = self._physical(pool)
        new = state.canonical_host(regions)
        with self._lock:
            self._check_open()
            if state.host == new:
                return new
            if state.host is not None and self._inflight:
                raise LayoutError(f"pool {pool!r}: host regions cannot change while operations are in flight")
            others = [r for p in self._pools.values() if p is not state and p.host for r in p.host]
            check_disjoint([*others, *new, *self.arena_regions()])
            state.host = new
        return new

    # ------------------------------------------------------------------ operations

    def backup(
        self,
        pool: str,
        page_hashes: Sequence[str],
        host_slots: Sequence[int],
        *,
        parent: str | None = None,
    ) -> list[bool]:
        """Copy pages from host slots into kvcr DRAM; per page, True when it is stored.

        ``page_hashes`` are in prefix order; ``parent`` is the page before the first one (for
        prefix-recency alignment and inventory events). Pages already held count as stored.
        """
        state = self._physical(pool)
        host = state.check_batch(page_hashes, host_slots)
        arena = state.arena_regions()
        return self._backup(
            state,
            page_hashes,
            lambda i, e: page_moves(arena, e.slot, host, host_slots[i]),
            lambda fills: merged_moves(arena, host, [(e.slot, host_slots[i]) for i, e in fills]),
            parent,
        )

    def store_page(self, pool: str, page_hash: str, sources: Sequence[int]) -> bool:
        """Back up one page from arbitrary addresses, one per component (SGLang's copy path)."""
        state = self._physical(pool)
        arena = state.arena_regions()
        if len(sources) != len(arena):
            raise LayoutError(f"pool {pool!r} has {len(arena)} components, {len(sources)} sources given")
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
        deadline = self._clock.now() + self.config.timing.operation_s
        with self._locked(deadline):
            self._check_open()
            results, fills, evicted = state.index.begin_fills(page_hashes, parent, self._expire_now)
            self._account.evicted(state, evicted)
            self._inflight += 1
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
            with self._lock:
                self._finish_backup(state, fills, copied, results, page_hashes, parent)
                self._inflight -= 1
                self._quiet.notify_all()
        return results

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

    def exists(self, pool: str, page_hashes: Sequence[str]) -> list[bool]:
        """Per page, whether it is READY in kvcr DRAM now."""
        state = self._physical(pool)
        with self._lock:
            self._check_open()
            return state.index.present(page_hashes)

    def query(self, pool: str, page_hashes: Sequence[str]) -> QueryResult:
        """Per-key presence plus the leading prefix of present pages."""
        present = self.exists(pool, page_hashes)
        prefix = next((i for i, hit in enumerate(present) if not hit), len(present))
        return QueryResult(tuple(present), prefix)

    def restore(
        self,
        pool: str,
        page_hashes: Sequence[str],
        host_slots: Sequence[int],
        *,
        prefix_only: bool = False,
    ) -> list[PageOutcome]:
        """Copy held pages from kvcr DRAM into host slots; one outcome per page.

        With ``prefix_only`` the restore stops at the first page not held (an engine consumes
        only the leading run, so copying past a hole is wasted bandwidth).
        """
        state = self._physical(pool)
        host = state.check_batch(page_hashes, host_slots)
        arena = state.arena_regions()
        return self._restore(
            state,
            page_hashes,
            lambda i, e: page_moves(host, host_slots[i], arena, e.slot),
            lambda claimed: merged_moves(host, arena, [(host_slots[i], e.slot) for i, e in claimed]),
            prefix_only,
        )

    def load_page(self, pool: str, page_hash: str, destinations: Sequence[int]) -> bool:
        """Restore one page to arbitrary addresses, one per component (SGLang's copy path)."""
        state = self._physical(pool)
        arena = state.arena_regions()
        if len(destinations) != len(arena):
            raise LayoutError(f"pool {pool!r} has {len(arena)} components, {len(destinations)} destinations given")
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
        deadline = started + self.config.timing.operation_s
        outcomes: list[PageOutcome] = [_NOT_HELD] * len(page_hashes)
        with self._locked(deadline):
            self._check_open()
            claimed = state.index.claim_ready(page_hashes, prefix_only=prefix_only)
            self._inflight += 1
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
            with self._lock:
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
                self._inflight -= 1
                self._quiet.notify_all()
        self._account.local_restore(
            state, len(page_hashes), len(claimed), len(corrupt), copied, self._clock.now() - started
        )
        return outcomes

    def lease(self, requests: Sequence[tuple[str, Sequence[str]]], duration_s: float, *, holder: int = 0) -> LeaseGrant:
        """Hold READY pages for a peer until the lease expires on our clock or is released.

        ``requests`` are (pool, page hashes); pages that are malformed, of an unknown or logical
        pool, not READY, past the pool's lease cap (``max_leased_fraction`` of its slots) or past
        ``holder``'s own cap (``max_peer_leased_fraction`` of that, ``max_peer_leases``) are
        granted as -1: from a peer they are misses, not errors. ``duration_s`` is capped at the
        configured lease length. Lease ids are random 63-bit numbers, never reused.
        """
        duration = min(max(duration_s, 0.0), self.config.timing.lease_s)
        pools = self._pools
        with self._lock:
            self._check_open()
            now = self._clock.now()
            self._expire_leases(now)
            grant, leased = self._leases.lease(requests, self._leasable, holder, now, duration)
        pages = sum(leased.values())
        served = sum(n * pools[pool].spec.page_bytes for pool, n in leased.items())
        self._account.served(pages, served)
        self._account.leases(len(self._leases))
        return grant

    def leased_slots(self, lease_id: int) -> dict[str, set[int]] | None:
        """The slots a live lease holds, per pool; None when the lease is unknown or expired."""
        with self._lock:
            self._expire_leases(self._clock.now())
            held = self._leases.get(lease_id)
            if held is None:
                return None
            slots: dict[str, set[int]] = {}
            for pool, entry in held.claims:
                slots.setdefault(pool, set()).add(entry.slot)
            return slots

    def stop_leasing(self) -> None:
        """Grant nothing from now on (shutdown); releases and expiry keep working."""
        with self._lock:
            self._leases.leasing = False

    def wait_for_leases(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` (real time) for peers to release or let expire every lease; returns those left."""
        give_up = time.monotonic() + max(0.0, timeout_s)
        with self._lock:
            while self._leases and time.monotonic() < give_up:
                self._expire_leases(self._clock.now())
                if self._leases:
                    self._quiet.wait(timeout=min(0.05, max(0.0, give_up - time.monotonic())))
            return len(self._leases)

    def release_lease(self, lease_id: int) -> bool:
        """End a lease early; False when it is unknown (released, expired or never granted)."""
        with self._lock:
            held = self._leases.release(lease_id)
            if held is None:
                return False
            self._drop_claims(held)
            self._quiet.notify_all()
            self._account.leases(len(self._leases))
        return True

    def expire_leases(self) -> int:
        """End every lease past its deadline on our clock; returns how many ended."""
        with self._lock:
            return self._expire_leases(self._clock.now())

    @property
    def active_leases(self) -> int:
        """Leases live now (one past its deadline is ended here, not counted)."""
        with self._lock:
            self._expire_leases(self._clock.now())
            return len(self._leases)

    def clear(self) -> None:
        """Drop every page; slots still being read or filled are freed when that ends."""
        with self._lock:
            self._check_open()
            for state in self._pools.values():
                state.index.clear()
            self._account.cleared()
        self._gauges()

    def stats(self) -> RunnerStats:
        """A snapshot of occupancy per pool plus the counters."""
        pools = []
        with self._lock:
            for state in self._pools.values():
                index = state.index
                ready, filling, discarding, claimed = index.counts()
                pools.append(
                    PoolStats(
                        pool=state.spec.name,
                        slots=index.slots,
                        free=index.free_count,
                        ready=ready,
                        filling=filling,
                        discarding=discarding,
                        claimed=claimed,
                        page_bytes=state.spec.page_bytes,
                    )
                )
        return RunnerStats(self.config.name, self.namespace, tuple(pools), dict(self._metrics.snapshot()))

    def close(self, on_quiescent: Callable[[], None] | None = None, *, lease_wait_s: float = 0.0) -> None:
        """Stop, wait for in-flight operations, call ``on_quiescent``, then free the arenas.

        New leases are refused at once; peers' leases get ``lease_wait_s`` to be released (the
        caller keeps the control channel open meanwhile). Pools whose pages a peer may still be
        reading are deregistered (``on_quiescent``) but never freed: this process will not reuse
        that memory. ``on_quiescent`` is where a data plane deregisters the arenas: after nothing
        of ours touches them, before their memory goes back.

        Raises:
            KvcrError: our own operations still touch kvcr memory after the abandonment budget;
                nothing was deregistered or freed.
        """
        self.stop_leasing()
        self.wait_for_leases(lease_wait_s)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # Bounded in real time too, so an injected clock that never moves cannot hang close().
            give_up = time.monotonic() + self.config.timing.abandon_s
            while self._inflight and time.monotonic() < give_up:
                self._quiet.wait(timeout=0.05)
            if self._inflight:
                raise KvcrError(f"close: {self._inflight} operations still touch kvcr memory; memory kept")
            self._expire_leases(self._clock.now())
            pinned = self._leases.pinned_pools()
            for state in self._pools.values():
                state.index.forget()
        if on_quiescent is not None:
            on_quiescent()
        if pinned:
            log.warning(
                "kvcr closed with peers' leases still live on pools %s; their memory stays mapped until exit",
                sorted(pinned),
            )
        self._release_arenas(keep=pinned)

    # ------------------------------------------------------------------ internals

    def _gauges(self) -> None:
        for state in self._pools.values():
            self._account.pool_gauges(state)
        self._account.leases(len(self._leases))

    def _expire_leases(self, now: float) -> int:
        expired = self._leases.expire(now)
        for held in expired:
            self._drop_claims(held)
        if expired:
            self._account.leases(len(self._leases), expired=len(expired))
            self._quiet.notify_all()
        return len(expired)

    def _expire_now(self) -> None:
        self._expire_leases(self._clock.now())

    def _drop_claims(self, held: HeldLease) -> None:
        pools = self._pools
        for pool, entry in held.claims:
            pools[pool].index.unpin(entry)

    def _release_arenas(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        for state in self._pools.values():
            if state.arena is not None and state.spec.name not in keep:
                state.arena.release()

    @contextlib.contextmanager
    def _locked(self, deadline: float) -> Iterator[None]:
        if not self._lock.acquire(timeout=max(0.0, deadline - self._clock.now())):
            raise DeadlineExceeded("runner lock not acquired before the operation deadline")
        try:
            yield
        finally:
            self._lock.release()

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"runner {self.config.name!r} is closed")

    def _physical(self, pool: str) -> PoolState:
        state = self._pools.get(pool)
        if state is None:
            raise LayoutError(f"unknown pool {pool!r}; this runner has {sorted(self._pools)}")
        if state.arena is None:
            raise LayoutError(f"pool {pool!r} is logical: it holds no bytes to back up or restore")
        return state

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
