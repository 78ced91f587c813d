"""The target side of the peer protocol: lease pages from a source, read them into host pages.

One restore (DESIGN §5) costs one control round trip on its critical path: HELLO once per link
(cached, bounded LRU), LEASE the pages (the reply carries everything the read needs: slots and
digests), one batched data-plane read per ``max_pages_per_read`` pages, RELEASE sent one-way
(the lease also expires on its own). A read is accepted only if it completed before
``sent + lease - margin`` on our clock and, with ``verify_bytes``, only if the delivered bytes
match the digest the source computed at backup, bound to the key we asked for.

Every failure is a miss, never an exception to the caller: a dead, slow, refusing or
incompatible peer, a stale hint, a failed, late or corrupt read. The whole read has one
operation deadline (not one per batch). A read from a peer whose given-up reads may still land
(``PeerInfo.late_writes``) lands in kvcr-owned staging memory, quarantined if it never settles,
and is copied into the host pages only after DONE: such a peer costs a miss, never the worker.
A direct read that cannot be confirmed stopped even after tearing the peer down is UNCERTAIN:
the caller must not hand those host pages to the engine (the SGLang backend fail-stops).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvcr.domain.layout import PieceRun, slot_runs
from kvcr.domain.outcomes import RESTORED, Outcome, PageOutcome, failed, miss, uncertain
from kvcr.domain.residency import lease_accepts
from kvcr.ports.clock import Clock
from kvcr.ports.control import ControlChannel
from kvcr.ports.dataplane import DataPlane, PeerInfo, TransferState
from kvcr.ports.errors import PeerRefused, TransportError
from kvcr.ports.memory import HostMemory, Move
from kvcr.ports.metric_catalogue import FailureReason, Path, Result
from kvcr.ports.metric_catalogue import MetricName as M
from kvcr.ports.metrics import Metrics
from kvcr.runner import protocol
from kvcr.runner.protocol import NONCE_BYTES, Hello, HelloReply, Lease, LeaseReply, PoolWire, RefusalCode, Refused
from kvcr.runner.runner import KvcrRunner
from kvcr.runner.staging import StagingBuffer, StagingPool

log = logging.getLogger(__name__)

LANDINGS = ("auto", "direct", "staged")
_STALE = miss("source does not hold it")
_RATE_WEIGHT = 0.3  # EWMA weight of the newest read in a link's throughput estimate
_RESULTS = {
    Outcome.RESTORED: Result.OK,
    Outcome.MISS: Result.MISS,
    Outcome.FAILED: Result.FAILED,
    Outcome.UNCERTAIN: Result.UNCERTAIN,
}


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """How a target reads from peers (timings live in the runner's ``Timing``).

    landing: ``auto`` lands reads in the engine's pages unless the peer's transport may write
        after kvcr gave up (then ``staged``); ``direct`` always lands in the engine's pages
        (a read that cannot be stopped then ends the worker); ``staged`` always stages.
    recompute_tokens_per_s: the replica's prefill rate; a remote read whose estimated time
        exceeds recomputing its tokens is skipped (a miss). 0 turns the check off.
    tokens_per_page: tokens in one page (for that estimate).
    max_links / link_idle_s: open peer links kept, least recently used first out; idle close.
    """

    max_pages_per_read: int = 128
    landing: str = "auto"
    recompute_tokens_per_s: float = 0.0
    tokens_per_page: int = 0
    max_links: int = 64
    link_idle_s: float = 300.0
    staging_buffers: int = 4


@dataclass
class _Link:
    endpoint: str
    session: int
    incarnation: str
    peer: PeerInfo
    pools: dict[str, PoolWire]
    staged: bool
    last_used: float
    bytes_per_s: float = 0.0  # 0: no estimate yet


@dataclass(frozen=True, slots=True)
class PoolRead:
    """Pages of one pool to read, with the host slots they land in."""

    pool: str
    page_hashes: Sequence[str]
    host_slots: Sequence[int]


@dataclass
class RemoteLease:
    """Pages a source holds for us until ``sent_at + ttl - margin`` on our clock."""

    endpoint: str
    lease_id: int
    sent_at: float
    ttl_s: float
    slots: dict[tuple[str, str], int]  # (pool, page hash) -> source slot
    digests: dict[tuple[str, str], bytes] = field(default_factory=dict)
    link: _Link | None = None
    released: bool = False

    def holds(self, pool: str, page_hash: str) -> bool:
        return (pool, page_hash) in self.slots

    def usable_until(self, margin_s: float) -> float:
        """The last moment (our clock) a read under this lease may finish."""
        return self.sent_at + self.ttl_s - margin_s


@dataclass
class _Wanted:
    pool: str
    index: int
    page: str
    host_slot: int
    src_slot: int


class PeerClient:
    """Leases and reads pages from peer runners. Thread-safe.

    Args:
        host_ids: per pool, the data-plane region ids of its host regions (where reads land).
    """

    def __init__(
        self,
        runner: KvcrRunner,
        control: ControlChannel,
        data_plane: DataPlane,
        memory: HostMemory,
        clock: Clock,
        metrics: Metrics,
        settings: PeerSettings,
        host_ids: Callable[[str], tuple[int, ...]],
        staging: StagingPool,
    ) -> None:
        self._runner = runner
        self._control = control
        self._data_plane = data_plane
        self._memory = memory
        self._clock = clock
        self._metrics = metrics
        self.settings = settings
        self._timing = runner.config.timing
        self._verify = runner.config.verify_bytes
        self._host_ids = host_ids
        self._staging = staging
        self._incarnation = secrets.token_hex(16)
        self._links: OrderedDict[str, _Link] = OrderedDict()
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._quarantine: list[tuple[int, list[StagingBuffer]]] = []  # (handle, its staging buffers)
        self._specs = {p.name: p for p in runner.pools}
        self._page_bytes = {p.name: p.page_bytes for p in runner.pools}

    def alive(self, lease: RemoteLease) -> bool:
        """Whether a read under ``lease`` could still be accepted."""
        return not lease.released and self._clock.now() < lease.usable_until(self._timing.lease_margin_s)

    @property
    def quarantined(self) -> int:
        """Transfers that could not be confirmed stopped (their destinations are unsafe)."""
        with self._lock:
            return len(self._quarantine)

    @property
    def links(self) -> int:
        with self._lock:
            return len(self._links)

    # ------------------------------------------------------------------ lease

    def lease(self, endpoint: str, requests: Sequence[tuple[str, Sequence[str]]]) -> RemoteLease | None:
        """Lease (pool, page hashes) from the source at ``endpoint``; None when nothing usable came back."""
        wanted = [(pool, list(pages)) for pool, pages in requests if pages]
        if not wanted:
            return None
        deadline = self._clock.now() + self._timing.operation_s
        for _ in range(2):  # a second try only after the source forgot our session (it restarted)
            link = self._link(endpoint, deadline)
            if link is None:
                return None
            asked = [(pool, pages) for pool, pages in wanted if pool in link.pools]
            if not asked:
                self._count_miss(FailureReason.INCOMPATIBLE, sum(len(p) for _, p in wanted))
                return None
            if self._slower_than_recompute(link, asked):
                self._count_miss(FailureReason.SLOWER_THAN_RECOMPUTE, sum(len(p) for _, p in asked))
                return None
            nonce = secrets.token_bytes(NONCE_BYTES)
            message = Lease(
                nonce,
                link.session,
                round(self._timing.lease_s * 1000),
                [(link.pools[pool].pool_id, pages) for pool, pages in asked],
            )
            sent_at = self._clock.now()
            reply = self._call(endpoint, message, nonce, deadline)
            if isinstance(reply, Refused) and reply.code == RefusalCode.UNKNOWN_SESSION:
                self._forget(endpoint)
                continue
            if not isinstance(reply, LeaseReply):
                return None
            return self._granted(link, asked, reply, sent_at)
        return None

    def _granted(
        self, link: _Link, asked: list[tuple[str, list[str]]], reply: LeaseReply, sent_at: float
    ) -> RemoteLease | None:
        shapes_match = len(reply.slots) == len(asked) and len(reply.digests) == len(asked)
        if shapes_match:
            for (_, pages), pool_slots, pool_digests in zip(asked, reply.slots, reply.digests, strict=True):
                if len(pool_slots) != len(pages) or len(pool_digests) != len(pages):
                    shapes_match = False
        if not shapes_match:
            log.warning("kvcr: peer %s answered a LEASE with the wrong shape; ignored", link.endpoint)
            self._send_release(link, reply.lease_id)
            self._count_miss(FailureReason.MALFORMED_REPLY, sum(len(p) for _, p in asked))
            return None
        slots: dict[tuple[str, str], int] = {}
        digests: dict[tuple[str, str], bytes] = {}
        limits = {name: wire.slots for name, wire in link.pools.items()}
        for (pool, pages), granted, given in zip(asked, reply.slots, reply.digests, strict=True):
            limit = limits[pool]
            for page, slot, digest in zip(pages, granted, given, strict=True):
                if 0 <= slot < limit:
                    slots[(pool, page)] = slot
                    digests[(pool, page)] = digest
        total = sum(len(p) for _, p in asked)
        if total > len(slots):  # a stale hint: the source no longer holds these
            self._metrics.increment(M.PAGES, total - len(slots), {"path": Path.REMOTE_RESTORE, "outcome": Result.MISS})
        lease = RemoteLease(link.endpoint, reply.lease_id, sent_at, reply.ttl_ms / 1000, slots, digests, link)
        if not slots:
            lease.released = True
            self._send_release(link, reply.lease_id)
            return None
        return lease

    def release(self, lease: RemoteLease) -> None:
        """Tell the source it may let go, one-way (best effort; the lease also expires)."""
        if lease.released:
            return
        lease.released = True
        if lease.link is not None:
            self._send_release(lease.link, lease.lease_id)

    # ------------------------------------------------------------------ read

    def read(self, lease: RemoteLease, requests: Sequence[PoolRead]) -> dict[str, list[PageOutcome]]:
        """Read leased pages into host slots, ``max_pages_per_read`` pages per transfer; one outcome per page.

        Pages are taken in order (each pool's leading pages first), so a failed transfer leaves
        the earlier, completed ones usable. The whole call has one operation deadline.
        """
        self.reap()
        outcomes: dict[str, list[PageOutcome]] = {r.pool: [_STALE] * len(r.page_hashes) for r in requests}
        link = lease.link
        if link is None or lease.released:
            return {pool: [miss("lease released")] * len(o) for pool, o in outcomes.items()}
        if self._newer(link) is not None:  # the source restarted since: its slots are another process's
            return {pool: [miss("the source restarted since the lease")] * len(o) for pool, o in outcomes.items()}
        now = self._clock.now()
        give_up = min(now + self._timing.operation_s, lease.usable_until(self._timing.lease_margin_s))
        wanted: list[_Wanted] = []
        for request in requests:
            geometry = link.pools.get(request.pool)
            if geometry is None:
                outcomes[request.pool] = [miss("source has no such pool")] * len(request.page_hashes)
                continue
            host = self._runner.pool_host_regions(request.pool)
            if [r.piece_bytes for r in host] != list(geometry.pieces):
                outcomes[request.pool] = [miss("geometry differs from the source")] * len(request.page_hashes)
                continue
            slots = lease.slots
            for index, (page, host_slot) in enumerate(zip(request.page_hashes, request.host_slots, strict=True)):
                src_slot = slots.get((request.pool, page))
                if src_slot is not None:
                    wanted.append(_Wanted(request.pool, index, page, host_slot, src_slot))
        step = self.settings.max_pages_per_read
        for start in range(0, len(wanted), step):
            chunk = wanted[start : start + step]
            results, moved = self._read_chunk(lease, link, chunk, give_up)
            for item, outcome in zip(chunk, results, strict=True):
                outcomes[item.pool][item.index] = outcome
            if not moved:
                break  # the rest stays a miss: do not pile transfers on a failing peer
        self._count(outcomes, requests, lease)
        self._metrics.observe(M.RESTORE_SECONDS, self._clock.now() - now, {"path": Path.REMOTE_RESTORE})
        return outcomes

    def _count(self, outcomes: dict[str, list[PageOutcome]], requests: Sequence[PoolRead], lease: RemoteLease) -> None:
        """Count each page's outcome once: pages of a linked pool the lease lacks were counted at grant."""
        metrics = self._metrics
        leased = lease.slots
        linked = lease.link.pools if lease.link is not None else {}
        for request in requests:
            page_bytes = self._page_bytes.get(request.pool, 0)
            tally: dict[Result, int] = {}
            pool = request.pool
            for page, outcome in zip(request.page_hashes, outcomes.get(pool, ()), strict=False):
                if pool in linked and (pool, page) not in leased:
                    continue
                result = _RESULTS[outcome.outcome]
                tally[result] = tally.get(result, 0) + 1
            for result, pages in tally.items():
                metrics.increment(M.PAGES, pages, {"path": Path.REMOTE_RESTORE, "outcome": result})
                if result is not Result.MISS:
                    metrics.increment(M.BYTES, pages * page_bytes, {"path": Path.REMOTE_RESTORE, "outcome": result})

    def restore(self, endpoint: str, requests: Sequence[PoolRead]) -> dict[str, list[PageOutcome]]:
        """Lease, read and release in one call."""
        lease = self.lease(endpoint, [(r.pool, r.page_hashes) for r in requests])
        if lease is None:
            return {r.pool: [miss("peer unavailable")] * len(r.page_hashes) for r in requests}
        try:
            return self.read(lease, requests)
        finally:
            self.release(lease)

    def reap(self) -> int:
        """Release quarantined reads that ended after all (their source came back); returns those left."""
        with self._lock:
            held = list(self._quarantine)
        ended = []
        for handle, buffers in held:
            try:
                state = self._data_plane.poll(handle)
            except TransportError:
                continue
            if state.terminal:
                self._data_plane.release(handle)
                for buffer in buffers:
                    self._staging.release_quarantined(buffer)
                ended.append(handle)
        with self._lock:
            self._quarantine = [q for q in self._quarantine if q[0] not in ended]
            return len(self._quarantine)

    def close(self) -> None:
        """Forget every link (their data-plane peers and control connections)."""
        with self._lock:
            endpoints = list(self._links)
        for endpoint in endpoints:
            self._forget(endpoint)

    # ------------------------------------------------------------------ transfers

    def _read_chunk(
        self, lease: RemoteLease, link: _Link, chunk: list[_Wanted], give_up: float
    ) -> tuple[list[PageOutcome], bool]:
        """One transfer: per page its outcome, and whether the transfer itself completed."""
        if self._clock.now() >= give_up:
            return [miss("lease expired before the read")] * len(chunk), False
        by_pool: dict[str, list[_Wanted]] = {}
        for item in chunk:
            by_pool.setdefault(item.pool, []).append(item)
        buffers: dict[str, StagingBuffer] = {}
        if link.staged:
            for pool in by_pool:
                buffer = self._staging.take(self._specs[pool])
                if buffer is None:
                    for taken in buffers.values():
                        self._staging.give_back(taken)
                    self._count_miss(FailureReason.NO_STAGING, len(chunk))
                    return [miss("no staging memory free")] * len(chunk), False
                buffers[pool] = buffer
        runs: list[PieceRun] = []
        for pool, items in by_pool.items():
            src_ids = link.pools[pool].regions
            if link.staged:
                dst_ids = buffers[pool].ids
                pairs = [(item.src_slot, k) for k, item in enumerate(items)]
            else:
                dst_ids = self._host_ids(pool)
                pairs = [(item.src_slot, item.host_slot) for item in items]
            for src_first, dst_first, count in slot_runs(pairs):
                runs.extend(
                    PieceRun(src, src_first, dst, dst_first, count) for src, dst in zip(src_ids, dst_ids, strict=True)
                )
        started = self._clock.now()
        verdict, settled = self._transfer(lease, link, runs, give_up, staged=link.staged)
        if not verdict.restored:
            for buffer in buffers.values():
                if settled:
                    self._staging.give_back(buffer)
                else:
                    self._staging.quarantine(buffer)  # late bytes land where nobody reads
            if not settled:
                with self._lock:
                    handle = self._quarantine[-1][0]
                    self._quarantine[-1] = (handle, list(buffers.values()))
            return [verdict] * len(chunk), False
        page_bytes = self._page_bytes
        nbytes = sum(page_bytes[item.pool] for item in chunk)
        self._learn_rate(link, nbytes, self._clock.now() - started)
        if not link.staged:
            return self._checked(lease, chunk, lambda item: None), True
        try:
            return self._land_staged(by_pool, buffers, lease, chunk), True
        finally:
            for buffer in buffers.values():
                self._staging.give_back(buffer)

    def _land_staged(
        self,
        by_pool: dict[str, list[_Wanted]],
        buffers: dict[str, StagingBuffer],
        lease: RemoteLease,
        chunk: list[_Wanted],
    ) -> list[PageOutcome]:
        """Verify staged pages, then copy the good ones into their host pages."""
        positions = {id(item): k for items in by_pool.values() for k, item in enumerate(items)}
        outcomes = self._checked(lease, chunk, lambda item: buffers[item.pool].extents(positions[id(item)]))
        moves: list[Move] = []
        for item, outcome in zip(chunk, outcomes, strict=True):
            if not outcome.restored:
                continue
            host = self._runner.pool_host_regions(item.pool)
            staged = buffers[item.pool].extents(positions[id(item)])
            moves.extend(
                Move(r.base + item.host_slot * r.stride, address, nbytes)
                for r, (address, nbytes) in zip(host, staged, strict=True)
            )
        try:
            self._memory.copy(moves)
        except TransportError as exc:
            log.warning("kvcr: copying staged pages into host pages failed: %s", exc)
            return [failed("staged copy failed")] * len(chunk)
        return outcomes

    def _checked(
        self,
        lease: RemoteLease,
        chunk: list[_Wanted],
        staged: Callable[[_Wanted], list[tuple[int, int]] | None],
    ) -> list[PageOutcome]:
        """RESTORED per page, unless its delivered bytes differ from the source's digest for that key."""
        if not self._verify:
            return [RESTORED] * len(chunk)
        outcomes: list[PageOutcome] = []
        bad = 0
        for item in chunk:
            expected = lease.digests.get((item.pool, item.page), b"")
            extents = staged(item)
            if extents is None:
                actual = self._runner.host_digest(item.pool, item.host_slot, item.page)
            else:
                actual = self._runner.digest_extents(item.pool, extents, item.page)
            if expected and actual == expected:
                outcomes.append(RESTORED)
            else:
                bad += 1
                outcomes.append(failed("bytes differ from the source's digest"))
        if bad:
            self._metrics.increment(M.VERIFICATION_FAILURES, bad, {"path": Path.REMOTE_RESTORE})
            self._fail(FailureReason.VERIFICATION)
            log.error("kvcr: %d pages read from %s failed verification; reported as misses", bad, lease.endpoint)
        return outcomes

    def _transfer(
        self, lease: RemoteLease, link: _Link, runs: list[PieceRun], give_up: float, *, staged: bool
    ) -> tuple[PageOutcome, bool]:
        """Post one read and wait for it; returns (outcome, whether its destination is settled)."""
        try:
            handle = self._data_plane.read(link.peer.name, runs, lease=lease.lease_id)
        except TransportError as exc:
            log.info("kvcr: read from %s refused: %s", lease.endpoint, exc)
            self._mark_down(lease.endpoint, "read refused", link)
            return miss("peer unavailable"), True
        state = self._wait(handle, give_up)
        completed_at = self._clock.now()
        if state is TransferState.PENDING:
            return self._give_up(lease, handle, staged=staged, timed_out_at=give_up)
        self._data_plane.release(handle)
        if state is not TransferState.DONE:
            self._mark_down(lease.endpoint, f"read {state.value}", link)
            return failed(f"read {state.value}"), True
        if not lease_accepts(lease.sent_at, lease.ttl_s, self._timing.lease_margin_s, completed_at):
            return failed("read finished after the lease"), True
        return RESTORED, True

    def _give_up(
        self, lease: RemoteLease, handle: int, *, staged: bool, timed_out_at: float
    ) -> tuple[PageOutcome, bool]:
        """A read outlived its deadline: stop it, tear the peer down if needed, and say whether it settled."""
        expired = timed_out_at == lease.usable_until(self._timing.lease_margin_s)
        why = failed("read would outlive the lease" if expired else "read timed out")
        state = self._data_plane.cancel(handle)
        if not state.terminal:
            # Drop the link and disconnect its peer (the strongest stop the transport has).
            self._mark_down(lease.endpoint, "a read stalled", lease.link)
            # A transport that fences on disconnect says so at once; give it a moment, no more.
            state = self._wait(handle, self._clock.now() + 0.5 if not staged else self._clock.now())
        self._fail(FailureReason.LEASE_EXPIRED if expired else FailureReason.TIMEOUT)
        if state.terminal:
            self._data_plane.release(handle)  # a late DONE stays a failure
            return why, True
        with self._lock:
            self._quarantine.append((handle, []))
        self._fail(FailureReason.UNCERTAIN)
        if staged:
            log.warning("kvcr: a read from %s never stopped; its staging buffer is quarantined", lease.endpoint)
            return miss("read stalled (staged, quarantined)"), False
        log.error(
            "kvcr: read %d from %s could not be confirmed stopped; its host pages are unsafe", handle, lease.endpoint
        )
        return uncertain("transfer could not be confirmed stopped"), False

    def _wait(self, handle: int, until: float) -> TransferState:
        """Poll until terminal or ``until``: a burst of polls (they drive progress), then backoff."""
        spins = 0
        pause = 20e-6
        while True:
            state = self._data_plane.poll(handle)
            if state is not TransferState.PENDING and state is not TransferState.UNCERTAIN:
                return state
            if self._clock.now() >= until:
                return TransferState.PENDING if state is TransferState.UNCERTAIN else state
            spins += 1
            if spins > 64:
                # Yield the core (a CMA read needs no progress from us); an injected clock moves on.
                self._clock.sleep(pause)
                pause = min(pause * 2, 200e-6)

    # ------------------------------------------------------------------ links

    def _link(self, endpoint: str, deadline: float) -> _Link | None:
        now = self._clock.now()
        with self._lock:
            link = self._links.get(endpoint)
            if link is not None:
                link.last_used = now
                self._links.move_to_end(endpoint)
                return link
            if now < self._down_until.get(endpoint, 0.0):
                return None
        self._close_idle(now)
        nonce = secrets.token_bytes(NONCE_BYTES)
        hello = Hello(nonce, self._data_plane.name, self._incarnation, dict(self._runner.namespaces))
        reply = self._call(endpoint, hello, nonce, deadline)
        if not isinstance(reply, HelloReply):
            if isinstance(reply, Refused) and reply.code == RefusalCode.NAMESPACE:
                self._mark_down(endpoint, "no pool namespace in common")
            return None
        mine = self._runner.namespaces
        # Checked here too: a peer that shares no namespace with us must never get a link; nor may a
        # pool description that does not fit our pool (reads are planned from its regions and sizes).
        pools = {p.name: p for p in reply.pools if mine.get(p.name) == p.namespace and self._fits(p)}
        if not pools:
            self._mark_down(endpoint, "no pool namespace in common")
            return None
        try:
            timeout = min(self._timing.connect_s, max(0.0, deadline - self._clock.now()))
            peer = self._data_plane.connect(reply.data_plane, timeout)
        except TransportError as exc:
            self._mark_down(endpoint, f"cannot connect its data plane: {exc}")
            return None
        landing = self.settings.landing
        staged = landing == "staged" or (landing == "auto" and peer.late_writes)
        link = _Link(endpoint, reply.session, reply.incarnation, peer, pools, staged, self._clock.now())
        evicted: list[tuple[str, _Link]] = []
        with self._lock:
            self._links[endpoint] = link
            while len(self._links) > self.settings.max_links:
                oldest = next(iter(self._links))
                evicted.append((oldest, self._links.pop(oldest)))
        for old, old_link in evicted:
            self._drop(old, old_link)  # both halves: the control connection and the data-plane peer
        return link

    def _fits(self, wire: PoolWire) -> bool:
        spec = self._specs.get(wire.name)
        return (
            spec is not None
            and wire.slots > 0
            and len(wire.regions) == len(spec.components)
            and list(wire.pieces) == [c.piece_bytes for c in spec.components]
        )

    def _close_idle(self, now: float) -> None:
        idle: list[tuple[str, _Link]] = []
        with self._lock:
            for endpoint, link in list(self._links.items()):
                if now - link.last_used < self.settings.link_idle_s:
                    break  # ordered by use: the rest are fresher
                idle.append((endpoint, self._links.pop(endpoint)))
        for endpoint, link in idle:
            self._drop(endpoint, link)

    def _call(self, endpoint: str, request: Hello | Lease, nonce: bytes, deadline: float) -> object:
        """One round trip, bounded by the control deadline; None (peer marked down) on failure."""
        timeout = min(self._timing.control_s, deadline - self._clock.now())
        if timeout <= 0:
            return None
        try:
            frame = self._control.request(endpoint, protocol.encode(request), timeout)
            reply = protocol.decode(frame)
        except protocol.FrameError:
            self._mark_down(endpoint, "unreadable reply")
            return None
        except PeerRefused as exc:
            self._mark_down(endpoint, f"refused: {exc}")
            return None
        except TransportError as exc:
            self._mark_down(endpoint, str(exc))
            return None
        if isinstance(reply, Refused):
            self._fail(FailureReason.PEER_REFUSED)
            if reply.code != RefusalCode.UNKNOWN_SESSION:
                self._mark_down(endpoint, f"refused ({_refusal_name(reply.code)})")
            return reply
        if getattr(reply, "nonce", None) != nonce:
            # A reply to another request (or a replayed one): never act on it.
            self._fail(FailureReason.UNBOUND_REPLY)
            self._mark_down(endpoint, "reply does not answer our request")
            return None
        return reply

    def _send_release(self, link: _Link, lease_id: int) -> None:
        if lease_id:
            self._control.send(link.endpoint, protocol.encode(protocol.Release(link.session, [lease_id])))

    def _newer(self, link: _Link) -> _Link | None:
        """The link of a newer incarnation that answered HELLO at ``link``'s endpoint since, if any."""
        with self._lock:
            current = self._links.get(link.endpoint)
        if current is None or current is link or current.incarnation == link.incarnation:
            return None
        return current

    def _mark_down(self, endpoint: str, why: str, failed: _Link | None = None) -> None:
        """Skip ``endpoint`` for ``retry_after_s`` and drop its link, control connection and data-plane peer.

        ``failed``: the link a failed read used. When a newer incarnation of the source answered HELLO
        since, the failure is its predecessor's: only the old data-plane peer is disconnected (when the
        transport names the two apart), and the new process is neither skipped nor dropped.
        """
        newer = self._newer(failed) if failed is not None else None
        if failed is not None and newer is not None:
            log.info(
                "kvcr: a read from %s's previous incarnation failed (%s); its new one is not skipped", endpoint, why
            )
            if failed.peer.name != newer.peer.name:
                with contextlib.suppress(TransportError):
                    self._data_plane.disconnect(failed.peer.name)
            return
        log.info("kvcr: peer %s skipped for %.1fs: %s", endpoint, self._timing.retry_after_s, why)
        self._fail(FailureReason.PEER_UNAVAILABLE)
        with self._lock:
            link = self._links.pop(endpoint, None)
            now = self._clock.now()
            self._down_until[endpoint] = now + self._timing.retry_after_s
            self._down_until = {e: t for e, t in self._down_until.items() if t > now}
            down = len(self._down_until)
        self._metrics.set_gauge(M.PEERS_QUARANTINED, down)
        if link is not None:
            self._drop(endpoint, link)

    def _forget(self, endpoint: str) -> None:
        with self._lock:
            link = self._links.pop(endpoint, None)
        if link is not None:
            self._drop(endpoint, link)

    def _drop(self, endpoint: str, link: _Link | None = None) -> None:
        if link is not None:
            with contextlib.suppress(TransportError):
                self._data_plane.disconnect(link.peer.name)
        self._control.forget(endpoint)

    # ------------------------------------------------------------------ estimates

    def _learn_rate(self, link: _Link, nbytes: int, elapsed: float) -> None:
        if elapsed <= 0 or nbytes <= 0:
            return
        rate = nbytes / elapsed
        link.bytes_per_s = rate if not link.bytes_per_s else (1 - _RATE_WEIGHT) * link.bytes_per_s + _RATE_WEIGHT * rate

    def _slower_than_recompute(self, link: _Link, asked: list[tuple[str, list[str]]]) -> bool:
        settings = self.settings
        if settings.recompute_tokens_per_s <= 0 or settings.tokens_per_page <= 0 or not link.bytes_per_s:
            return False
        pages = max(len(p) for _, p in asked)
        nbytes = sum(self._specs[pool].page_bytes * len(p) for pool, p in asked)
        transfer_s = nbytes / link.bytes_per_s
        recompute_s = pages * settings.tokens_per_page / settings.recompute_tokens_per_s
        return transfer_s > recompute_s

    def _count_miss(self, reason: FailureReason, pages: int) -> None:
        self._fail(reason)
        self._metrics.increment(M.PAGES, pages, {"path": Path.REMOTE_RESTORE, "outcome": Result.MISS})

    def _fail(self, reason: FailureReason) -> None:
        self._metrics.increment(M.FAILURES, 1, {"path": Path.REMOTE_RESTORE, "reason": reason})


def _refusal_name(code: int) -> str:
    try:
        return RefusalCode(code).name.lower()
    except ValueError:
        return "unknown"
