"""The kvcr runner: a DRAM tier per pool, its key index, and local backup / restore.

The runner owns one arena per physical pool and an index from page hash to slot. Metadata
changes happen under one lock; bytes move outside it, protected by slot state: a slot being
filled is FILLING (invisible to readers, never evicted), a slot being read is claimed (never
evicted or reused). Memory and peers are reached only through ports.

Per page, a backup is all-or-nothing: a page becomes READY only after every component's piece
was copied; a failed copy frees the page's slot and reports it unstored.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvcr.domain.errors import ClosedError, DeadlineExceeded, InvalidKeyError, KvcrError, LayoutError
from kvcr.domain.eviction import POLICIES, EvictionPolicy
from kvcr.domain.keys import BlockKey, check_page_hash
from kvcr.domain.layout import RegionDescriptor, check_disjoint, merge_runs
from kvcr.domain.outcomes import RESTORED, PageOutcome, failed, miss
from kvcr.domain.pools import PoolSpec
from kvcr.domain.residency import Lease, SlotState, check_transition
from kvcr.ports.clock import Clock
from kvcr.ports.errors import MemoryCopyError
from kvcr.ports.inventory import InventoryEvent, InventoryKind, InventorySink
from kvcr.ports.memory import HostMemory, Move
from kvcr.ports.metrics import Metrics
from kvcr.runner.arena import Arena, host_label
from kvcr.runner.config import RunnerConfig

log = logging.getLogger(__name__)

_READY = SlotState.READY
_FILLING = SlotState.FILLING
_DISCARDING = SlotState.DISCARDING
_FREE = SlotState.FREE
_NOT_HELD = miss("not held")


class _Entry:
    """One resident (or arriving) page of one pool."""

    __slots__ = ("claims", "parent", "slot", "state")

    def __init__(self, slot: int, state: SlotState, parent: str | None) -> None:
        self.slot = slot
        self.state = state
        self.claims = 0
        self.parent = parent


class _Pool:
    """A pool's arena, host regions, index and eviction order."""

    __slots__ = ("arena", "detached", "entries", "host", "policy", "spec")

    def __init__(self, spec: PoolSpec, arena: Arena | None, policy: EvictionPolicy) -> None:
        self.spec = spec
        self.arena = arena
        self.host: tuple[RegionDescriptor, ...] | None = None
        self.entries: dict[str, _Entry] = {}
        self.policy = policy
        self.detached = 0  # DISCARDING pages already dropped from the index, still owning a slot


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


@dataclass(frozen=True, slots=True)
class RunnerStats:
    name: str
    namespace: str
    pools: tuple[PoolStats, ...]
    counters: dict[str, float]


@dataclass(frozen=True, slots=True)
class LeaseGrant:
    """What a source granted: a lease id, per requested key its slot (or -1), and the TTL."""

    lease_id: int
    slots: tuple[int, ...]
    ttl_s: float


@dataclass
class _HeldLease:
    lease: Lease
    claims: list[tuple[_Pool, _Entry]]


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
        self.config = config
        self.namespace = config.namespace.digest()
        self._memory = memory
        self._clock = clock
        self._metrics = metrics
        self._inventory = inventory
        self._lock = threading.Lock()
        self._quiet = threading.Condition(self._lock)
        self._inflight = 0
        self._closed = False
        self._leases: dict[int, _HeldLease] = {}
        # Lease ids start at a random point so a restarted source never honours an old id.
        self._next_lease = secrets.randbits(62) + 1
        policy_type = POLICIES[config.policy]
        slots = config.slots_per_pool()
        self._pools: dict[str, _Pool] = {}
        try:
            for spec in config.pools:
                arena = Arena(spec, slots[spec.name], memory) if spec.physical else None
                self._pools[spec.name] = _Pool(spec, arena, policy_type())
        except BaseException:
            self._release_arenas()
            raise
        check_disjoint([r for p in self._pools.values() if p.arena for r in p.arena.regions])

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
        return self._host(self._physical(pool))

    def checksums(self, block_keys: Sequence[str], slots: Sequence[int]) -> list[bytes]:
        """Digests of leased pages (``slots`` as granted; -1 gives an empty digest)."""
        digests = []
        for text, slot in zip(block_keys, slots, strict=True):
            if slot < 0:
                digests.append(b"")
                continue
            arena = self._pools[BlockKey.parse(text).pool].arena
            assert arena is not None  # a granted slot belongs to a physical pool
            regions = arena.regions
            digests.append(self._memory.checksum([(r.address(slot), r.piece_bytes) for r in regions]))
        return digests

    def host_checksum(self, pool: str, host_slot: int) -> bytes:
        """Digest of one host page across its components (to compare with a source checksum)."""
        regions = self.pool_host_regions(pool)
        return self._memory.checksum([(r.address(host_slot), r.piece_bytes) for r in regions])

    def host_regions(self) -> tuple[RegionDescriptor, ...]:
        """Every registered host region (where restores land)."""
        return tuple(r for p in self._pools.values() if p.host for r in p.host)

    def register_host_pool(self, pool: str, regions: Sequence[RegionDescriptor]) -> tuple[RegionDescriptor, ...]:
        """Describe where the engine keeps ``pool``'s pages: one region per component, in order.

        Returns the regions under kvcr's canonical labels. Re-registering identical geometry is a
        no-op; a different geometry is accepted only while nothing is in flight.
        """
        state = self._physical(pool)
        components = state.spec.components
        if len(regions) != len(components):
            raise LayoutError(f"pool {pool!r} has {len(components)} components, {len(regions)} host regions were given")
        canonical = []
        for region, component in zip(regions, components, strict=True):
            if region.piece_bytes != component.piece_bytes:
                raise LayoutError(
                    f"pool {pool!r} component {component.label!r}: host pieces are {region.piece_bytes} "
                    f"bytes, the pool expects {component.piece_bytes}"
                )
            canonical.append(
                RegionDescriptor(
                    host_label(pool, component.label), region.base, region.stride, region.count, region.piece_bytes
                )
            )
        new = tuple(canonical)
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

    def block_key(self, pool: str, page_hash: str) -> BlockKey:
        """The block key of one pool's bytes of a page in this runner's namespace."""
        return BlockKey(page_hash, self.namespace, pool)

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
        host = self._host(state)
        self._check_batch(page_hashes, host_slots, host)
        arena = state.arena
        assert arena is not None
        return self._backup(
            state,
            page_hashes,
            lambda fills: self._moves(arena.regions, host, [(e.slot, host_slots[i]) for i, e in fills]),
            parent,
        )

    def store_page(self, pool: str, page_hash: str, sources: Sequence[int]) -> bool:
        """Back up one page from arbitrary addresses, one per component (SGLang's copy path)."""
        state = self._physical(pool)
        arena = state.arena
        assert arena is not None
        if len(sources) != len(arena.regions):
            raise LayoutError(f"pool {pool!r} has {len(arena.regions)} components, {len(sources)} sources given")
        return self._backup(
            state,
            [page_hash],
            lambda fills: [
                Move(r.address(e.slot), src, r.piece_bytes)
                for _, e in fills
                for r, src in zip(arena.regions, sources, strict=True)
            ],
            None,
        )[0]

    def _backup(
        self,
        state: _Pool,
        page_hashes: Sequence[str],
        plan: Callable[[list[tuple[int, _Entry]]], list[Move]],
        parent: str | None,
    ) -> list[bool]:
        if parent is not None:
            check_page_hash(parent)
        deadline = self._clock.now() + self.config.budget.operation_s
        results = [False] * len(page_hashes)
        fills: list[tuple[int, str, _Entry]] = []
        with self._locked(deadline):
            self._check_open()
            entries = state.entries
            needed: list[int] = []
            held: list[str] = []
            pending: set[str] = set()
            for i, page in enumerate(page_hashes):
                entry = entries.get(page)
                if entry is not None:
                    results[i] = True  # READY, or FILLING by a caller storing the same bytes
                    if entry.state is _READY:
                        held.append(page)
                elif page not in pending:
                    check_page_hash(page)  # keys already in the index were checked on the way in
                    pending.add(page)
                    needed.append(i)
            # Refresh the prefix this batch extends before choosing victims, so a deeper batch
            # never evicts the ancestors that make it restorable.
            lineage = self._ancestors(state, parent)
            if lineage or held:
                state.policy.touch([*lineage, *held])
            slots = self._reserve(state, len(needed), protect=[*lineage, *page_hashes]) if needed else []
            for i, slot in zip(needed, slots, strict=False):
                page = page_hashes[i]
                entry = _Entry(slot, _FILLING, page_hashes[i - 1] if i else parent)
                entries[page] = entry
                fills.append((i, page, entry))
            self._inflight += 1
        copied = False
        try:
            if fills:
                self._memory.copy(plan([(i, e) for i, _, e in fills]))
            copied = True
        except MemoryCopyError as exc:
            log.warning("backup of %d pages of pool %s failed: %s", len(fills), state.spec.name, exc)
        finally:
            with self._lock:
                self._finish_backup(state, fills, copied, results, page_hashes, parent)
                self._inflight -= 1
                self._quiet.notify_all()
        return results

    def exists(self, pool: str, page_hashes: Sequence[str]) -> list[bool]:
        """Per page, whether it is READY in kvcr DRAM now."""
        state = self._physical(pool)
        with self._lock:
            self._check_open()
            entries = state.entries
            present = []
            for page in page_hashes:
                entry = entries.get(page)
                if entry is None:
                    check_page_hash(page)  # a malformed key is an error, not a miss
                    present.append(False)
                else:
                    present.append(entry.state is _READY)
        return present

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
        host = self._host(state)
        self._check_batch(page_hashes, host_slots, host)
        arena = state.arena
        assert arena is not None
        return self._restore(
            state,
            page_hashes,
            lambda claimed: self._moves(host, arena.regions, [(host_slots[i], e.slot) for i, e in claimed]),
            prefix_only,
        )

    def load_page(self, pool: str, page_hash: str, destinations: Sequence[int]) -> bool:
        """Restore one page to arbitrary addresses, one per component (SGLang's copy path)."""
        state = self._physical(pool)
        arena = state.arena
        assert arena is not None
        if len(destinations) != len(arena.regions):
            raise LayoutError(
                f"pool {pool!r} has {len(arena.regions)} components, {len(destinations)} destinations given"
            )
        return self._restore(
            state,
            [page_hash],
            lambda claimed: [
                Move(dst, r.address(e.slot), r.piece_bytes)
                for _, e in claimed
                for r, dst in zip(arena.regions, destinations, strict=True)
            ],
            False,
        )[0].restored

    def _restore(
        self,
        state: _Pool,
        page_hashes: Sequence[str],
        plan: Callable[[list[tuple[int, _Entry]]], list[Move]],
        prefix_only: bool,
    ) -> list[PageOutcome]:
        deadline = self._clock.now() + self.config.budget.operation_s
        outcomes: list[PageOutcome] = [_NOT_HELD] * len(page_hashes)
        claimed: list[tuple[int, _Entry]] = []
        with self._locked(deadline):
            self._check_open()
            entries = state.entries
            hits: list[str] = []
            for i, page in enumerate(page_hashes):
                entry = entries.get(page)
                if entry is None or entry.state is not _READY:
                    if entry is None:
                        check_page_hash(page)
                    if prefix_only:
                        break
                    continue
                entry.claims += 1
                claimed.append((i, entry))
                hits.append(page)
            if hits:
                state.policy.touch(self._aligned(state, hits))
            self._inflight += 1
        copied = False
        try:
            if claimed:
                self._memory.copy(plan(claimed))
            copied = True
        except MemoryCopyError as exc:
            log.warning("restore of %d pages of pool %s failed: %s", len(claimed), state.spec.name, exc)
        finally:
            with self._lock:
                outcome = RESTORED if copied else failed("local copy failed")
                for i, entry in claimed:
                    entry.claims -= 1
                    outcomes[i] = outcome
                    if entry.claims == 0 and entry.state is _DISCARDING:
                        self._free_slot(state, entry)
                self._inflight -= 1
                self._quiet.notify_all()
        labels = {"pool": state.spec.name, "source": "local"}
        self._metrics.increment("kvcr_restore_pages_total", len(claimed) if copied else 0, labels)
        self._metrics.increment("kvcr_restore_misses_total", len(page_hashes) - len(claimed), labels)
        return outcomes

    def lease(self, block_keys: Sequence[str], duration_s: float) -> LeaseGrant:
        """Hold READY pages for a peer until the lease expires on our clock or is released.

        Keys that are malformed, of another namespace, of an unknown or logical pool, or not
        READY are reported as -1: from a peer they are misses, not errors. ``duration_s`` is
        capped at the configured lease length.
        """
        duration = min(max(duration_s, 0.0), self.config.lease_s)
        slots: list[int] = []
        claims: list[tuple[_Pool, _Entry]] = []
        with self._lock:
            self._check_open()
            now = self._clock.now()
            self._expire_leases(now)
            for text in block_keys:
                entry = None
                state = None
                try:
                    key = BlockKey.parse(text)
                except InvalidKeyError:
                    key = None
                if key is not None and key.namespace == self.namespace:
                    state = self._pools.get(key.pool)
                    if state is not None and state.arena is not None:
                        entry = state.entries.get(key.page_hash)
                if state is None or entry is None or entry.state is not _READY:
                    slots.append(-1)
                    continue
                entry.claims += 1
                claims.append((state, entry))
                slots.append(entry.slot)
            lease_id = self._next_lease
            self._next_lease += 1
            if claims:
                lease = Lease(lease_id, tuple(block_keys), now, now + duration)
                self._leases[lease_id] = _HeldLease(lease, claims)
        self._metrics.increment("kvcr_leases_granted_total")
        self._metrics.increment("kvcr_lease_pages_total", len(claims))
        return LeaseGrant(lease_id, tuple(slots), duration)

    def renew_lease(self, lease_id: int, duration_s: float) -> float:
        """Extend a live lease; returns the new TTL, or 0 when the lease is unknown or expired."""
        duration = min(max(duration_s, 0.0), self.config.lease_s)
        with self._lock:
            now = self._clock.now()
            self._expire_leases(now)
            held = self._leases.get(lease_id)
            if held is None:
                return 0.0
            held.lease = held.lease.renewed(now, duration)
            return duration

    def release_lease(self, lease_id: int) -> bool:
        """End a lease early; False when it is unknown (released, expired or never granted)."""
        with self._lock:
            held = self._leases.pop(lease_id, None)
            if held is None:
                return False
            self._drop_claims(held)
            self._quiet.notify_all()
        return True

    def expire_leases(self) -> int:
        """End every lease past its deadline on our clock; returns how many ended."""
        with self._lock:
            return self._expire_leases(self._clock.now())

    @property
    def active_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    def clear(self) -> None:
        """Drop every page; slots still being read or filled are freed when that ends."""
        with self._lock:
            self._check_open()
            for state in self._pools.values():
                for entry in state.entries.values():
                    if entry.state is _READY and entry.claims == 0:
                        self._free_slot(state, entry)
                    else:
                        entry.state = check_transition(entry.state, _DISCARDING)
                        state.detached += 1
                state.entries = {}
                state.policy = POLICIES[self.config.policy]()
            self._inventory.publish(InventoryEvent(InventoryKind.CLEARED))
        self._metrics.increment("kvcr_clear_total")

    def stats(self) -> RunnerStats:
        """A snapshot of occupancy per pool plus the counters."""
        pools = []
        with self._lock:
            for state in self._pools.values():
                counts = {_READY: 0, _FILLING: 0, _DISCARDING: 0}
                claimed = 0
                for entry in state.entries.values():
                    counts[entry.state] += 1
                    claimed += entry.claims > 0
                arena = state.arena
                pools.append(
                    PoolStats(
                        pool=state.spec.name,
                        slots=arena.slots if arena else 0,
                        free=arena.free_count if arena else 0,
                        ready=counts[_READY],
                        filling=counts[_FILLING],
                        discarding=counts[_DISCARDING] + state.detached,
                        claimed=claimed,
                        page_bytes=state.spec.page_bytes,
                    )
                )
        return RunnerStats(self.config.name, self.namespace, tuple(pools), dict(self._metrics.snapshot()))

    def close(self, on_quiescent: Callable[[], None] | None = None) -> None:
        """Wait for in-flight operations and leases, call ``on_quiescent``, then free the arenas.

        ``on_quiescent`` is where a data plane deregisters the arenas: after nothing can touch
        them, before their memory goes back.

        Raises:
            KvcrError: operations still touch kvcr memory after the budget; memory is kept.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            # A peer may be reading leased slots right now: wait for leases to end too.
            now = self._clock.now()
            wait_s = self.config.budget.abandon_s
            for held in self._leases.values():
                wait_s = max(wait_s, held.lease.expires_at - now)
            # Bounded in real time too, so an injected clock that never moves cannot hang close().
            give_up = time.monotonic() + wait_s
            while (self._inflight or self._leases) and time.monotonic() < give_up:
                self._expire_leases(self._clock.now())
                if self._inflight or self._leases:
                    self._quiet.wait(timeout=0.05)
            if self._inflight or self._leases:
                raise KvcrError(
                    f"close: {self._inflight} operations and {len(self._leases)} leases still touch kvcr "
                    "memory; memory kept"
                )
            for state in self._pools.values():
                state.entries = {}
        if on_quiescent is not None:
            on_quiescent()
        self._release_arenas()

    # ------------------------------------------------------------------ internals

    def _expire_leases(self, now: float) -> int:
        expired = [lid for lid, held in self._leases.items() if held.lease.expired(now)]
        for lease_id in expired:
            self._drop_claims(self._leases.pop(lease_id))
        if expired:
            self._metrics.increment("kvcr_leases_expired_total", len(expired))
            self._quiet.notify_all()
        return len(expired)

    def _drop_claims(self, held: _HeldLease) -> None:
        for state, entry in held.claims:
            entry.claims -= 1
            if entry.claims == 0 and entry.state is _DISCARDING:
                self._free_slot(state, entry)

    def _release_arenas(self) -> None:
        for state in self._pools.values():
            if state.arena is not None:
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

    def _physical(self, pool: str) -> _Pool:
        state = self._pools.get(pool)
        if state is None:
            raise LayoutError(f"unknown pool {pool!r}; this runner has {sorted(self._pools)}")
        if state.arena is None:
            raise LayoutError(f"pool {pool!r} is logical: it holds no bytes to back up or restore")
        return state

    def _host(self, state: _Pool) -> tuple[RegionDescriptor, ...]:
        host = state.host
        if host is None:
            raise LayoutError(f"pool {state.spec.name!r} has no registered host regions")
        return host

    @staticmethod
    def _check_batch(page_hashes: Sequence[str], host_slots: Sequence[int], host: tuple[RegionDescriptor, ...]) -> None:
        if len(page_hashes) != len(host_slots):
            raise LayoutError(f"{len(page_hashes)} page hashes but {len(host_slots)} host slots")
        if not host_slots:
            return
        limit = host[0].count
        low, high = min(host_slots), max(host_slots)
        if low < 0 or high >= limit:
            raise LayoutError(f"host slot {low if low < 0 else high} is outside the host pool's {limit} pages")

    @staticmethod
    def _moves(
        dst_regions: Sequence[RegionDescriptor],
        src_regions: Sequence[RegionDescriptor],
        slot_pairs: Sequence[tuple[int, int]],
    ) -> list[Move]:
        """Merged moves for (dst slot, src slot) pairs across every component."""
        moves: list[Move] = []
        for dst, src in zip(dst_regions, src_regions, strict=True):
            d_base, d_stride, s_base, s_stride = dst.base, dst.stride, src.base, src.stride
            addresses = [(d_base + d * d_stride, s_base + s * s_stride) for d, s in slot_pairs]
            moves.extend(Move(d, s, n) for d, s, n in merge_runs(addresses, dst.piece_bytes))
        return moves

    def _reserve(self, state: _Pool, count: int, *, protect: Sequence[str]) -> list[int]:
        """Up to ``count`` free slots, evicting unclaimed READY pages the policy picks first."""
        arena = state.arena
        assert arena is not None
        slots = arena.take(count)
        short = count - len(slots)
        if short <= 0:
            return slots
        self._expire_leases(self._clock.now())  # expired leases must not pin pages
        protected = set(protect)
        entries = state.entries
        victims: list[str] = []
        for page in state.policy.victims():
            entry = entries[page]
            if entry.state is _READY and entry.claims == 0 and page not in protected:
                victims.append(page)
                if len(victims) == short:
                    break
        freed = []
        for page in victims:
            state.policy.remove(page)
            entry = entries.pop(page)
            entry.state = _FREE  # READY -> FREE, checked by the loop above
            freed.append(entry.slot)
        arena.give_back_many(freed)
        if victims:
            self._inventory.publish(InventoryEvent(InventoryKind.REMOVED, state.spec.name, tuple(victims)))
            self._metrics.increment("kvcr_evicted_pages_total", len(victims), {"pool": state.spec.name})
        slots.extend(arena.take(short))
        return slots

    def _free_slot(self, state: _Pool, entry: _Entry) -> None:
        if entry.state is _DISCARDING:
            state.detached -= 1
        entry.state = check_transition(entry.state, _FREE)
        assert state.arena is not None
        state.arena.give_back(entry.slot)

    def _finish_backup(
        self,
        state: _Pool,
        fills: list[tuple[int, str, _Entry]],
        copied: bool,
        results: list[bool],
        page_hashes: Sequence[str],
        parent: str | None,
    ) -> None:
        entries = state.entries
        stored: list[tuple[int, str]] = []
        for i, page, entry in fills:
            if entry.state is _DISCARDING:  # cleared while we copied
                self._free_slot(state, entry)
                continue
            if copied:
                entry.state = check_transition(entry.state, _READY)
                results[i] = True
                stored.append((i, page))
            else:
                if entries.get(page) is entry:
                    del entries[page]
                self._free_slot(state, entry)
        pool = state.spec.name
        ready = []
        for i, page in enumerate(page_hashes):
            held = entries.get(page)
            if held is not None and held.state is _READY:
                ready.append(page)
                results[i] = True  # also a page listed twice in one batch
        if ready:
            state.policy.touch(self._aligned(state, ready))
        for run in _contiguous_runs(stored):
            first = run[0][0]
            self._inventory.publish(
                InventoryEvent(
                    InventoryKind.STORED,
                    pool,
                    tuple(page for _, page in run),
                    page_hashes[first - 1] if first else parent,
                )
            )
        labels = {"pool": pool}
        self._metrics.increment("kvcr_backup_pages_total", len(stored), labels)
        if not copied and fills:
            self._metrics.increment("kvcr_backup_failed_pages_total", len(fills), labels)

    def _aligned(self, state: _Pool, pages: list[str]) -> list[str]:
        """``pages`` preceded by their resident ancestors, root first (prefix-recency alignment)."""
        first = state.entries.get(pages[0])
        lineage = self._ancestors(state, first.parent if first is not None else None, exclude=pages)
        return [*lineage, *pages] if lineage else pages

    def _ancestors(self, state: _Pool, parent: str | None, exclude: Sequence[str] = ()) -> list[str]:
        """READY ancestors reached through parent links from ``parent``, root first."""
        entries = state.entries
        lineage: list[str] = []
        seen = set(exclude)
        while parent is not None and len(lineage) < self.config.max_alignment_depth and parent not in seen:
            entry = entries.get(parent)
            if entry is None or entry.state is not _READY:
                break
            lineage.append(parent)
            seen.add(parent)
            parent = entry.parent
        lineage.reverse()
        return lineage


def _contiguous_runs(items: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """Split (index, page) pairs into runs of consecutive indices."""
    runs: list[list[tuple[int, str]]] = []
    for item in items:
        if runs and runs[-1][-1][0] + 1 == item[0]:
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs
