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

import logging
import secrets
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcr.domain.outcomes import RESTORED, Outcome, PageOutcome, miss
from kvcr.ports.clock import Clock
from kvcr.ports.control import ControlChannel
from kvcr.ports.dataplane import DataPlane, SharedBoards
from kvcr.ports.errors import TransportError
from kvcr.ports.memory import HostMemory
from kvcr.ports.metric_catalogue import FailureReason, Path, Result
from kvcr.ports.metric_catalogue import MetricName as M
from kvcr.ports.metrics import Metrics
from kvcr.runner.peer_links import Granted, Link, RemoteLease, SourceLinks, board_layout_of, count_miss
from kvcr.runner.protocol import NONCE_BYTES, Lease, LeaseReply, RefusalCode, Refused
from kvcr.runner.runner import KvcrRunner
from kvcr.runner.served_reports import ServedReports
from kvcr.runner.staging import StagingPool
from kvcr.runner.transfers import PoolRead, Transfers, Wanted, chunks

__all__ = ["LANDINGS", "PeerClient", "PeerSettings", "PoolRead", "RemoteLease"]

log = logging.getLogger(__name__)

LANDINGS = ("auto", "direct", "staged")
_STALE = miss("source does not hold it")
_RESULTS = {
    Outcome.RESTORED: Result.OK,
    Outcome.MISS: Result.MISS,
    Outcome.FAILED: Result.FAILED,
    Outcome.UNCERTAIN: Result.UNCERTAIN,
}
# The labels every restore emits, built once (a restore's own bookkeeping is part of its latency).
_OUTCOME_LABELS = {result: {"path": Path.REMOTE_RESTORE, "outcome": result} for result in Result}
_RESTORE_LABELS = {"path": Path.REMOTE_RESTORE}


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


class PeerClient:
    """Leases and reads pages from peer runners. Thread-safe.

    The two halves it drives: ``SourceLinks`` (sessions with sources: HELLO, control calls, down-time)
    and ``Transfers`` (the data-plane reads, staging and quarantine).

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
        self._clock = clock
        self._metrics = metrics
        self.settings = settings
        self._timing = runner.config.timing
        self._specs = {p.name: p for p in runner.pools}
        self._page_bytes = {p.name: p.page_bytes for p in runner.pools}
        self._links = SourceLinks(
            control,
            data_plane,
            clock,
            metrics,
            timing=self._timing,
            namespaces=runner.namespaces,
            specs=self._specs,
            landing=settings.landing,
            max_links=settings.max_links,
            link_idle_s=settings.link_idle_s,
        )
        self._transfers = Transfers(runner, self._links, data_plane, memory, clock, metrics, staging, host_ids)
        self._boards = data_plane if isinstance(data_plane, SharedBoards) else None
        self._served = ServedReports(self._links.send_served)

    def alive(self, lease: RemoteLease) -> bool:
        """Whether a read under ``lease`` could still be accepted."""
        return not lease.released and self._clock.now() < lease.usable_until(self._timing.lease_margin_s)

    @property
    def quarantined(self) -> int:
        """Transfers that could not be confirmed stopped (their destinations are unsafe)."""
        return self._transfers.quarantined

    @property
    def links(self) -> int:
        return len(self._links)

    def connect_ahead(self, endpoints: Sequence[str]) -> threading.Thread | None:
        """Link to ``endpoints`` now, in the background, and keep those links however idle.

        The first contact with a peer (HELLO, the data plane's connect) is the slowest part of a
        restore from it; made here, a hint naming the peer later finds the link ready (a hit query
        that asks while it is being made waits for it). A peer that does not answer is skipped for
        ``peer_retry_ms`` like any other and linked on its first hint. Returns the thread.
        """
        wanted = list(dict.fromkeys(endpoints))
        if not wanted:
            return None

        def run() -> None:
            for endpoint in wanted:
                self._links.keep(endpoint)
                deadline = self._clock.now() + self._timing.operation_s
                if self._links.get(endpoint, deadline) is None:
                    log.info("kvcr: could not link to %s ahead of need; its first hint will", endpoint)

        thread = threading.Thread(target=run, name="kvcr-connect-ahead", daemon=True)
        thread.start()
        return thread

    # ------------------------------------------------------------------ lease

    def lease(self, endpoint: str, requests: Sequence[tuple[str, Sequence[str]]]) -> RemoteLease | None:
        """Lease (pool, page hashes) from the source at ``endpoint``; None when nothing usable came back."""
        wanted = [(pool, list(pages)) for pool, pages in requests if pages]
        if not wanted:
            return None
        deadline = self._clock.now() + self._timing.operation_s
        for _ in range(2):  # a second try only after the source forgot our session (it restarted)
            link = self._links.get(endpoint, deadline)
            if link is None:
                return None
            asked = [(pool, pages) for pool, pages in wanted if pool in link.pools]
            if not asked:
                count_miss(self._metrics, FailureReason.INCOMPATIBLE, sum(len(p) for _, p in wanted))
                return None
            if self._slower_than_recompute(link, asked):
                count_miss(self._metrics, FailureReason.SLOWER_THAN_RECOMPUTE, sum(len(p) for _, p in asked))
                return None
            found = self._from_board(link, asked)
            if found is not None:
                return found
            nonce = secrets.token_bytes(NONCE_BYTES)
            session = link.lease_session(sum(len(pages) for _, pages in asked))
            message = Lease(
                nonce,
                session,
                round(self._timing.lease_s * 1000),
                [(link.pools[pool].pool_id, pages) for pool, pages in asked],
            )
            sent_at = self._clock.now()
            reply = self._links.call(endpoint, message, nonce, deadline, link)
            if isinstance(reply, Refused) and reply.code == RefusalCode.UNKNOWN_SESSION:
                self._links.forget(endpoint)
                continue
            if not isinstance(reply, LeaseReply):
                return None
            return self._granted(link, asked, reply, sent_at, session)
        return None

    def _granted(
        self, link: Link, asked: list[tuple[str, list[str]]], reply: LeaseReply, sent_at: float, session: int
    ) -> RemoteLease | None:
        shapes_match = len(reply.slots) == len(asked) and len(reply.digests) == len(asked)
        if shapes_match:
            for (_, pages), pool_slots, pool_digests in zip(asked, reply.slots, reply.digests, strict=True):
                if len(pool_slots) != len(pages) or len(pool_digests) != len(pages):
                    shapes_match = False
        if not shapes_match:
            log.warning("kvcr: peer %s answered a LEASE with the wrong shape; ignored", link.endpoint)
            self._links.send_release(link, reply.lease_id, session)
            count_miss(self._metrics, FailureReason.MALFORMED_REPLY, sum(len(p) for _, p in asked))
            return None
        order: dict[str, Granted] = {}
        for (pool, pages), granted, given in zip(asked, reply.slots, reply.digests, strict=True):
            limit = link.pools[pool].slots
            if granted and (min(granted) < -1 or max(granted) >= limit):  # not slots of that pool: not granted
                granted = [slot if 0 <= slot < limit else -1 for slot in granted]
            order[pool] = (pages, granted, given)
        lease = RemoteLease(link.endpoint, reply.lease_id, sent_at, reply.ttl_ms / 1000, order, link, session=session)
        held = lease.held_pages
        total = sum(len(p) for _, p in asked)
        if total > held:  # a stale hint: the source no longer holds these
            self._metrics.increment(M.PAGES, total - held, {"path": Path.REMOTE_RESTORE, "outcome": Result.MISS})
        if not held:
            lease.released = True
            self._links.send_release(link, reply.lease_id, session)
            return None
        return lease

    def _from_board(self, link: Link, asked: list[tuple[str, list[str]]]) -> RemoteLease | None:
        """Every asked page found on the source's slot boards, as a lease nothing pins; else None.

        Only for a source whose data plane maps its boards (same host). Partly found is not
        enough: the LEASE round trip it would still take is the cost the board exists to avoid.
        """
        boards = self._boards
        if boards is None:
            return None
        sent_at = self._clock.now()
        order: dict[str, Granted] = {}
        gens: dict[str, tuple[Sequence[int], Sequence[int]]] = {}
        for pool, pages in asked:
            wire = link.pools[pool]
            if wire.board < 0:
                return None
            try:
                hits = boards.board_lookup(link.peer.name, wire.board, board_layout_of(wire.slots), pages)
            except (ValueError, TransportError):  # ValueError: not all canonical keys; LEASE answers those
                return None
            if hits is None or not hits.complete:
                return None
            order[pool] = (pages, hits.slots, hits.digests)
            gens[pool] = (hits.slots, hits.gens)
        return RemoteLease(link.endpoint, 0, sent_at, self._timing.lease_s, order, link, board=gens)

    def release(self, lease: RemoteLease) -> None:
        """Tell the source it may let go, one-way (best effort; the lease also expires).

        A lease found on slot boards pins nothing: the source only hears how many pages it served.
        """
        if lease.released:
            return
        lease.released = True
        link = lease.link
        if link is None:
            return
        if lease.board is not None:
            self._served.add(
                link, [(link.pools[pool].pool_id, len(pages)) for pool, (pages, _, _) in lease.order.items()]
            )
            return
        self._links.send_release(link, lease.lease_id, lease.session)

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
        if self._links.newer(link) is not None:  # the source restarted since: its slots are another process's
            return {pool: [miss("the source restarted since the lease")] * len(o) for pool, o in outcomes.items()}
        now = self._clock.now()
        give_up = min(now + self._timing.operation_s, lease.usable_until(self._timing.lease_margin_s))
        wanted: list[Wanted] = []
        leased: dict[str, Sequence[int]] = {}  # per pool read, its source slots (-1: not in the lease)
        for request in requests:
            geometry = link.pools.get(request.pool)
            if geometry is None:
                outcomes[request.pool] = [miss("source has no such pool")] * len(request.page_hashes)
                continue
            src, digests = lease.granted(request.pool, request.page_hashes)
            leased[request.pool] = src
            host = self._runner.pool_host_regions(request.pool)
            if [r.piece_bytes for r in host] != list(geometry.pieces):
                outcomes[request.pool] = [miss("geometry differs from the source")] * len(request.page_hashes)
                continue
            pages, hosts = request.page_hashes, request.host_slots
            if len(hosts) != len(pages):
                raise ValueError(f"{len(pages)} pages but {len(hosts)} host slots for pool {request.pool!r}")
            if -1 not in src:
                wanted.append(Wanted(request.pool, range(len(pages)), pages, hosts, src, digests))
                continue
            keep = [i for i, slot in enumerate(src) if slot >= 0]
            if keep:
                wanted.append(
                    Wanted(
                        request.pool,
                        keep,
                        [pages[i] for i in keep],
                        [hosts[i] for i in keep],
                        [src[i] for i in keep],
                        [digests[i] for i in keep],
                    )
                )
        for chunk in chunks(wanted, self.settings.max_pages_per_read):
            results, moved = self._transfers.read_chunk(lease, link, chunk, give_up)
            at = 0
            for part in chunk:
                got = results[at : at + len(part)]
                at += len(part)
                into = outcomes[part.pool]
                if isinstance(part.indices, range) and part.indices.step == 1:
                    into[part.indices.start : part.indices.stop] = got
                else:
                    for index, outcome in zip(part.indices, got, strict=True):
                        into[index] = outcome
            if not moved:
                break  # the rest stays a miss: do not pile transfers on a failing peer
        self._count(outcomes, requests, leased)
        self._metrics.observe(M.RESTORE_SECONDS, self._clock.now() - now, _RESTORE_LABELS)
        return outcomes

    def _count(
        self, outcomes: dict[str, list[PageOutcome]], requests: Sequence[PoolRead], leased: dict[str, Sequence[int]]
    ) -> None:
        """Count each page's outcome once: pages of a linked pool the lease lacks were counted at grant."""
        metrics = self._metrics
        for request in requests:
            pool = request.pool
            page_bytes = self._page_bytes.get(pool, 0)
            got = outcomes.get(pool, [])
            src = leased.get(pool)
            tally: dict[Result, int] = {}
            if got.count(RESTORED) == len(got):  # every page restored (so every one was leased)
                tally[Result.OK] = len(got)
            else:
                for k, outcome in enumerate(got):
                    if src is not None and k < len(src) and src[k] < 0:
                        continue
                    result = _RESULTS[outcome.outcome]
                    tally[result] = tally.get(result, 0) + 1
            for result, pages in tally.items():
                if not pages:
                    continue
                metrics.increment(M.PAGES, pages, _OUTCOME_LABELS[result])
                if result is not Result.MISS:
                    metrics.increment(M.BYTES, pages * page_bytes, _OUTCOME_LABELS[result])

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
        return self._transfers.reap()

    def close(self) -> None:
        """Forget every link (their data-plane peers and control connections), after the last SERVED reports."""
        self._served.close()
        self._links.close()

    # ------------------------------------------------------------------ estimates

    def _slower_than_recompute(self, link: Link, asked: list[tuple[str, list[str]]]) -> bool:
        settings = self.settings
        if settings.recompute_tokens_per_s <= 0 or settings.tokens_per_page <= 0 or not link.bytes_per_s:
            return False
        pages = max(len(p) for _, p in asked)
        nbytes = sum(self._specs[pool].page_bytes * len(p) for pool, p in asked)
        transfer_s = nbytes / link.bytes_per_s
        recompute_s = pages * settings.tokens_per_page / settings.recompute_tokens_per_s
        return transfer_s > recompute_s
