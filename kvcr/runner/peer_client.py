"""The target side of the peer protocol: lease pages from a source, read them into host pages.

Flow for one restore (DESIGN §5): HELLO once per source (cached), LEASE the block keys, one
batched one-sided READ from the granted slots straight into our host pages, poll to a terminal
state, accept the bytes only if the read completed before ``sent + lease - margin`` on our
clock, then RELEASE (fire and forget: the lease also expires on its own).

Every failure is a miss, never an exception to the caller: a dead, slow, refusing or
incompatible peer, a stale hint (the source no longer holds the page), a failed or late read.
A read whose cancellation cannot be confirmed is UNCERTAIN: its handle is quarantined, never
released, and the caller must not hand those host pages to the engine.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcr.domain.layout import CopyRun, merge_runs
from kvcr.domain.outcomes import RESTORED, PageOutcome, failed, miss, uncertain
from kvcr.domain.residency import lease_accepts
from kvcr.ports.clock import Clock
from kvcr.ports.control import ControlChannel
from kvcr.ports.dataplane import DataPlane, TransferState
from kvcr.ports.errors import PeerRefused, TransportError
from kvcr.ports.metrics import Metrics
from kvcr.runner.protocol import Codec, Hello, HelloReply, Lease, LeaseReply, PoolGeometryWire, Release
from kvcr.runner.runner import KvcrRunner

log = logging.getLogger(__name__)

_STALE = miss("source does not hold it")


@dataclass(frozen=True, slots=True)
class PeerSettings:
    """Timing of peer restores, in seconds."""

    operation_s: float = 5.0
    abandon_s: float = 10.0
    lease_s: float = 10.0
    lease_margin_s: float = 0.5
    retry_after_s: float = 1.0  # how long a failed peer is skipped before we dial it again
    verify_bytes: bool = False
    max_pages_per_read: int = 128


@dataclass
class _Link:
    endpoint: str
    peer: str
    incarnation: str
    pools: dict[str, PoolGeometryWire]


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
    checksums: dict[tuple[str, str], bytes] = field(default_factory=dict)
    link: _Link | None = None
    released: bool = False

    def holds(self, pool: str, page_hash: str) -> bool:
        return (pool, page_hash) in self.slots

    def usable_until(self, margin_s: float) -> float:
        """The last moment (our clock) a read under this lease may finish."""
        return self.sent_at + self.ttl_s - margin_s


class PeerClient:
    """Leases and reads pages from peer runners. Thread-safe."""

    def __init__(
        self,
        runner: KvcrRunner,
        control: ControlChannel,
        data_plane: DataPlane,
        codec: Codec,
        clock: Clock,
        metrics: Metrics,
        settings: PeerSettings,
    ) -> None:
        self._runner = runner
        self._control = control
        self._data_plane = data_plane
        self._codec = codec
        self._clock = clock
        self._metrics = metrics
        self.settings = settings
        self._links: dict[str, _Link] = {}
        self._down_until: dict[str, float] = {}
        self._lock = threading.Lock()
        self._quarantine: list[int] = []

    def alive(self, lease: RemoteLease) -> bool:
        """Whether a read under ``lease`` could still be accepted."""
        return not lease.released and self._clock.now() < lease.usable_until(self.settings.lease_margin_s)

    @property
    def quarantined(self) -> int:
        """Transfers that could not be confirmed stopped (their destinations are unsafe)."""
        with self._lock:
            return len(self._quarantine)

    # ------------------------------------------------------------------ lease

    def lease(self, endpoint: str, pages: Sequence[tuple[str, str]]) -> RemoteLease | None:
        """Lease (pool, page hash) pages from the source at ``endpoint``; None when unusable."""
        if not pages:
            return None
        deadline = self._clock.now() + self.settings.operation_s
        link = self._link(endpoint, deadline)
        if link is None:
            return None
        keys = [str(self._runner.block_key(pool, page)) for pool, page in pages]
        sent_at = self._clock.now()
        request = Lease(keys, round(self.settings.lease_s * 1000), checksums=self.settings.verify_bytes)
        reply = self._call(endpoint, request, deadline)
        if not isinstance(reply, LeaseReply):
            return None
        if reply.incarnation != link.incarnation:
            # The source restarted since we said HELLO: its data-plane metadata is stale.
            self._forget(endpoint)
            self._send_release(endpoint, reply.lease_id)
            self._metrics.increment("kvcr_peer_restarts_seen_total")
            return self.lease(endpoint, pages) if self._clock.now() < deadline else None
        if len(reply.slots) != len(keys):
            log.warning("peer %s answered %d slots for %d keys", endpoint, len(reply.slots), len(keys))
            self._send_release(endpoint, reply.lease_id)
            return None
        slots = {page: slot for page, slot in zip(pages, reply.slots, strict=True) if slot >= 0}
        checksums = {}
        if self.settings.verify_bytes and len(reply.checksums) == len(keys):
            checksums = {page: digest for page, digest in zip(pages, reply.checksums, strict=True) if digest}
        self._metrics.increment("kvcr_remote_leased_pages_total", len(slots))
        self._metrics.increment("kvcr_remote_stale_pages_total", len(pages) - len(slots))
        lease = RemoteLease(endpoint, reply.lease_id, sent_at, reply.ttl_ms / 1000, slots, checksums, link)
        if not slots:
            self.release(lease)
        return lease

    def release(self, lease: RemoteLease) -> None:
        """Tell the source it may let go (best effort; the lease also expires)."""
        if lease.released:
            return
        lease.released = True
        if lease.slots:
            self._send_release(lease.endpoint, lease.lease_id)

    # ------------------------------------------------------------------ read

    def read(self, lease: RemoteLease, requests: Sequence[PoolRead]) -> dict[str, list[PageOutcome]]:
        """Read leased pages into host slots, ``max_pages_per_read`` pages per transfer; one outcome per page.

        Pages are taken in order (each pool's leading pages first), so a failed transfer leaves
        the earlier, completed ones usable.
        """
        outcomes: dict[str, list[PageOutcome]] = {r.pool: [_STALE] * len(r.page_hashes) for r in requests}
        link = lease.link
        if link is None or lease.released:
            return {pool: [miss("lease released")] * len(o) for pool, o in outcomes.items()}
        wanted: list[tuple[str, int, str, int]] = []  # (pool, index, page hash, host slot)
        for request in requests:
            geometry = link.pools.get(request.pool)
            if geometry is None:
                outcomes[request.pool] = [miss("source has no such pool")] * len(request.page_hashes)
                continue
            host = self._runner.pool_host_regions(request.pool)
            if [r.piece_bytes for r in host] != list(geometry.pieces):
                outcomes[request.pool] = [miss("geometry differs from the source")] * len(request.page_hashes)
                continue
            for index, (page, host_slot) in enumerate(zip(request.page_hashes, request.host_slots, strict=True)):
                if (request.pool, page) in lease.slots:
                    wanted.append((request.pool, index, page, host_slot))
        step = self.settings.max_pages_per_read
        for start in range(0, len(wanted), step):
            chunk = wanted[start : start + step]
            verdict = self._transfer(lease, link, self._runs(lease, link, chunk))
            for pool, index, page, host_slot in chunk:
                outcome = verdict
                if verdict.restored and lease.checksums:
                    expected = lease.checksums.get((pool, page))
                    if expected is None or self._runner.host_checksum(pool, host_slot) != expected:
                        outcome = failed("bytes differ from the source's checksum")
                outcomes[pool][index] = outcome
            if not verdict.restored:
                break  # the rest stays a miss: do not pile transfers on a failing peer
        restored = sum(o.restored for outs in outcomes.values() for o in outs)
        self._metrics.increment("kvcr_restore_pages_total", restored, {"source": "remote"})
        return outcomes

    def _runs(self, lease: RemoteLease, link: _Link, pages: Sequence[tuple[str, int, str, int]]) -> list[CopyRun]:
        """Merged copy runs from the source's leased slots to our host slots, every component."""
        pieces: dict[tuple[str, str, int], list[tuple[int, int]]] = {}
        for pool, _, page, host_slot in pages:
            geometry = link.pools[pool]
            slot = lease.slots[(pool, page)]
            for k, region in enumerate(self._runner.pool_host_regions(pool)):
                group = pieces.setdefault((geometry.labels[k], region.label, region.piece_bytes), [])
                group.append((region.offset(host_slot), slot * geometry.strides[k]))
        return [
            CopyRun(src_label, src_off, dst_label, dst_off, length)
            for (src_label, dst_label, nbytes), pairs in pieces.items()
            for dst_off, src_off, length in merge_runs(pairs, nbytes)
        ]

    def restore(self, endpoint: str, requests: Sequence[PoolRead]) -> dict[str, list[PageOutcome]]:
        """Lease, read and release in one call."""
        pages = [(r.pool, page) for r in requests for page in r.page_hashes]
        lease = self.lease(endpoint, pages)
        if lease is None:
            return {r.pool: [miss("peer unavailable")] * len(r.page_hashes) for r in requests}
        try:
            return self.read(lease, requests)
        finally:
            self.release(lease)

    # ------------------------------------------------------------------ internals

    def _transfer(self, lease: RemoteLease, link: _Link, runs: list[CopyRun]) -> PageOutcome:
        settings = self.settings
        now = self._clock.now()
        usable_until = lease.usable_until(settings.lease_margin_s)
        give_up = min(now + settings.operation_s, usable_until)
        if now >= usable_until:
            return miss("lease expired before the read")
        try:
            handle = self._data_plane.read(link.peer, runs)
        except TransportError as exc:
            log.info("read from %s refused: %s", lease.endpoint, exc)
            self._forget(lease.endpoint)
            return miss("peer unavailable")
        state = self._wait(handle, give_up)
        completed_at = self._clock.now()
        if state is TransferState.PENDING:
            state = self._data_plane.cancel(handle)
            if state is TransferState.UNCERTAIN or state is TransferState.PENDING:
                state = self._wait(handle, now + settings.abandon_s)
            if not state.terminal:
                with self._lock:
                    self._quarantine.append(handle)
                self._metrics.increment("kvcr_transfers_uncertain_total")
                log.error(
                    "read %d from %s could not be confirmed stopped; destination pages are unsafe",
                    handle,
                    lease.endpoint,
                )
                return uncertain("transfer could not be confirmed stopped")
            self._data_plane.release(handle)
            self._metrics.increment("kvcr_transfers_timed_out_total")
            # A late DONE stays a failure.
            return failed("read would outlive the lease" if give_up == usable_until else "read timed out")
        self._data_plane.release(handle)
        if state is not TransferState.DONE:
            self._forget(lease.endpoint)
            return failed(f"read {state.value}")
        if not lease_accepts(lease.sent_at, lease.ttl_s, settings.lease_margin_s, completed_at):
            return failed("read finished after the lease")
        return RESTORED

    def _wait(self, handle: int, until: float) -> TransferState:
        """Poll until terminal or ``until``: a burst of polls (they drive progress), then backoff."""
        spins = 0
        pause = 20e-6
        while True:
            state = self._data_plane.poll(handle)
            if state is not TransferState.PENDING and state is not TransferState.UNCERTAIN:
                return state
            if self._clock.now() >= until:
                return state
            spins += 1
            if spins > 64:
                # Yield the core (a CMA read needs no progress from us); an injected clock moves on.
                self._clock.sleep(pause)
                pause = min(pause * 2, 200e-6)

    def _link(self, endpoint: str, deadline: float) -> _Link | None:
        with self._lock:
            link = self._links.get(endpoint)
            if link is not None:
                return link
            if self._clock.now() < self._down_until.get(endpoint, 0.0):
                return None
        reply = self._call(endpoint, Hello(self._runner.namespace, self._data_plane.name), deadline)
        if not isinstance(reply, HelloReply):
            return None
        if reply.namespace != self._runner.namespace:
            self._mark_down(endpoint, "namespace mismatch")
            return None
        try:
            peer = self._data_plane.connect(reply.data_plane)
        except TransportError as exc:
            self._mark_down(endpoint, f"cannot connect its data plane: {exc}")
            return None
        link = _Link(endpoint, peer, reply.incarnation, {g.pool: g for g in reply.pools})
        with self._lock:
            self._links[endpoint] = link
        return link

    def _call(self, endpoint: str, request: Lease | Hello, deadline: float) -> object:
        timeout = deadline - self._clock.now()
        if timeout <= 0:
            return None
        try:
            frame = self._control.request(endpoint, self._codec.encode(request), timeout)
            return self._codec.decode_reply(frame)
        except PeerRefused as exc:
            self._metrics.increment("kvcr_peer_refusals_total")
            self._mark_down(endpoint, str(exc))
        except TransportError as exc:
            self._mark_down(endpoint, str(exc))
        return None

    def _send_release(self, endpoint: str, lease_id: int) -> None:
        with contextlib.suppress(TransportError):  # the lease expires on the source anyway
            self._control.request(endpoint, self._codec.encode(Release(lease_id)), 0.5)

    def _mark_down(self, endpoint: str, why: str) -> None:
        log.info("peer %s unusable for %.1fs: %s", endpoint, self.settings.retry_after_s, why)
        self._metrics.increment("kvcr_peer_failures_total")
        with self._lock:
            self._links.pop(endpoint, None)
            self._down_until[endpoint] = self._clock.now() + self.settings.retry_after_s

    def _forget(self, endpoint: str) -> None:
        with self._lock:
            link = self._links.pop(endpoint, None)
        if link is not None:
            with contextlib.suppress(TransportError):
                self._data_plane.disconnect(link.peer)
