"""The kvcr runner: a DRAM tier per pool, its key index, and local backup / restore.

The runner is the service layer over two pieces of bookkeeping: one slot index per physical pool
(``index.py``: slot states, claims, eviction, prefix alignment) and the lease table of what peers
hold (``leases.py``). It owns the lock around them (``guard.py``) and the arenas (``pool_state.py``
checks their geometry against the engine's), and hands the work to two halves: ``copies.py``
(backup and local restore, copying outside the lock, protected by slot state: a slot being filled
is FILLING, a slot being read is claimed) and ``lease_desk.py`` (peers' leases). ``accounting.py``
turns what each operation did into metrics and inventory events. Memory and peers are reached only
through ports.

Per page, a backup is all-or-nothing: a page becomes READY only after every component's piece
was copied; a failed copy frees the page's slot and reports it unstored. With ``verify_bytes`` a
page also gets a digest, bound to its key and namespace, computed from the bytes kvcr just copied
into its own memory and kept in the index (never in memory a peer can reach). Every delivery is
checked against it: a local restore hashes what it wrote into the host page, a peer hashes what
it read. Bytes that changed in the arena behind kvcr's back are therefore never served.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcr.domain.errors import ConfigError, KvcrError, LayoutError
from kvcr.domain.eviction import POLICIES
from kvcr.domain.layout import RegionDescriptor, check_disjoint, page_extents
from kvcr.domain.outcomes import PageOutcome
from kvcr.domain.pools import PoolSpec
from kvcr.ports.clock import Clock
from kvcr.ports.errors import RegistrationError
from kvcr.ports.inventory import InventorySink
from kvcr.ports.memory import HostMemory
from kvcr.ports.metrics import Metrics
from kvcr.runner.accounting import TierAccounting
from kvcr.runner.arena import Arena
from kvcr.runner.config import RunnerConfig
from kvcr.runner.copies import TierCopies
from kvcr.runner.guard import RunnerGuard
from kvcr.runner.index import SlotIndex
from kvcr.runner.lease_desk import LeaseDesk
from kvcr.runner.leases import LeaseGrant, LeaseTable
from kvcr.runner.pool_state import PoolState

log = logging.getLogger(__name__)


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
        if config.verify_bytes and memory.page_digest != config.page_digest:
            raise ConfigError(
                f"page_digest is {config.page_digest!r} but the runner's memory adapter digests with "
                f"{memory.page_digest!r}: build the adapter with the runner's page_digest"
            )
        self.config = config
        self.namespaces = config.namespaces()
        # One digest naming the whole replica's key space, for logs and stats pages.
        self.namespace = hashlib.sha256(repr(sorted(self.namespaces.items())).encode()).hexdigest()[:16]
        self._memory = memory
        self._clock = clock
        self._metrics = metrics
        self._account = TierAccounting(metrics, inventory)
        self._guard = RunnerGuard(config.name, clock)
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
        physical = {name: p for name, p in self._pools.items() if p.arena is not None}
        self._desk = LeaseDesk(
            self._guard,
            LeaseTable(config.max_peer_leases),
            {name: p.index for name, p in physical.items()},  # what a peer may lease from
            {name: p.spec.page_bytes for name, p in physical.items()},
            self._account,
            clock,
            config.timing.lease_s,
        )
        self._copies = TierCopies(
            self._guard,
            memory,
            clock,
            self._account,
            operation_s=config.timing.operation_s,
            verify=config.verify_bytes,
            expire_leases=self._desk.expire_now,
        )
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

    def share_boards(self) -> dict[str, RegionDescriptor]:
        """Give every physical pool a slot board kept in step with its index; returns each board's region.

        Called once, by a source whose data plane lets same-host peers map the boards (they find
        pages there without a LEASE). Idempotent per pool.
        """
        regions: dict[str, RegionDescriptor] = {}
        with self._guard.lock:
            self._guard.check_open()
            for name, state in self._pools.items():
                if state.arena is None:
                    continue
                board, region = state.arena.share_board()
                if state.index.board is None:
                    state.index.share(board)
                regions[name] = region
        return regions

    def count_board_reads(self, pool: str, pages: int) -> None:
        """A same-host peer says it took ``pages`` of ``pool`` from its slot board: counted as reported,
        apart from what was leased (nothing pinned them, so nothing here can check the report)."""
        state = self._pools.get(pool)
        if state is not None and 0 < pages <= state.index.slots:
            self._account.reported(pages, pages * state.spec.page_bytes)

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
        with self._guard.lock:
            self._guard.check_open()
            if state.host == new:
                return new
            if state.host is not None and self._guard.inflight:
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
        return self._copies.backup(self._physical(pool), page_hashes, host_slots, parent)

    def store_page(self, pool: str, page_hash: str, sources: Sequence[int]) -> bool:
        """Back up one page from arbitrary addresses, one per component (SGLang's copy path)."""
        return self._copies.store_page(self._physical(pool), page_hash, sources)

    def exists(self, pool: str, page_hashes: Sequence[str]) -> list[bool]:
        """Per page, whether it is READY in kvcr DRAM now."""
        state = self._physical(pool)
        with self._guard.lock:
            self._guard.check_open()
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
        return self._copies.restore(self._physical(pool), page_hashes, host_slots, prefix_only)

    def load_page(self, pool: str, page_hash: str, destinations: Sequence[int]) -> bool:
        """Restore one page to arbitrary addresses, one per component (SGLang's copy path)."""
        return self._copies.load_page(self._physical(pool), page_hash, destinations)

    def lease(self, requests: Sequence[tuple[str, Sequence[str]]], duration_s: float, *, holder: int = 0) -> LeaseGrant:
        """Hold READY pages for a peer until the lease expires on our clock or is released.

        ``requests`` are (pool, page hashes); pages that are malformed, of an unknown or logical
        pool, not READY, past the pool's lease cap (``max_leased_fraction`` of its slots) or past
        ``holder``'s own cap (``max_peer_leased_fraction`` of that, ``max_peer_leases``) are
        granted as -1: from a peer they are misses, not errors. ``duration_s`` is capped at the
        configured lease length. Lease ids are random 63-bit numbers, never reused.
        """
        return self._desk.lease(requests, duration_s, holder)

    def leased_slots(self, lease_id: int) -> dict[str, set[int]] | None:
        """The slots a live lease holds, per pool; None when the lease is unknown or expired."""
        return self._desk.leased_slots(lease_id)

    def stop_leasing(self) -> None:
        """Grant nothing from now on (shutdown); releases and expiry keep working."""
        self._desk.stop()

    def wait_for_leases(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` (real time) for peers to release or let expire every lease; returns those left."""
        return self._desk.wait(timeout_s)

    def release_lease(self, lease_id: int) -> bool:
        """End a lease early; False when it is unknown (released, expired or never granted)."""
        return self._desk.release(lease_id)

    def expire_leases(self) -> int:
        """End every lease past its deadline on our clock; returns how many ended."""
        return self._desk.expire()

    @property
    def active_leases(self) -> int:
        """Leases live now (one past its deadline is ended here, not counted)."""
        return self._desk.active()

    def clear(self) -> None:
        """Drop every page; slots still being read or filled are freed when that ends."""
        with self._guard.lock:
            self._guard.check_open()
            for state in self._pools.values():
                state.index.clear()
            self._account.cleared()
        self._gauges()

    def stats(self) -> RunnerStats:
        """A snapshot of occupancy per pool plus the counters."""
        pools = []
        with self._guard.lock:
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
        self._desk.stop()
        self._desk.wait(lease_wait_s)
        guard = self._guard
        with guard.lock:
            if guard.closed:
                return
            guard.closed = True
            # Bounded in real time too, so an injected clock that never moves cannot hang close().
            give_up = time.monotonic() + self.config.timing.abandon_s
            while guard.inflight and time.monotonic() < give_up:
                guard.quiet.wait(timeout=0.05)
            if guard.inflight:
                raise KvcrError(f"close: {guard.inflight} operations still touch kvcr memory; memory kept")
            self._desk.expire_now()
            pinned = self._desk.pinned_pools()
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
        self._account.leases(len(self._desk))

    def _release_arenas(self, keep: set[str] | frozenset[str] = frozenset()) -> None:
        for state in self._pools.values():
            if state.arena is not None and state.spec.name not in keep:
                state.arena.release()

    def _physical(self, pool: str) -> PoolState:
        state = self._pools.get(pool)
        if state is None:
            raise LayoutError(f"unknown pool {pool!r}; this runner has {sorted(self._pools)}")
        if state.arena is None:
            raise LayoutError(f"pool {pool!r} is logical: it holds no bytes to back up or restore")
        return state
