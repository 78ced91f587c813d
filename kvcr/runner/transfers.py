"""A target's data-plane reads under a lease: one transfer per chunk, where it lands, and what it cost.

A chunk of leased pages becomes one posted read (runs merged per component), waited on until the
read ends or its deadline (the operation's, or the lease's own end). A read that lands in the
engine's host pages (``direct``) is checked in place; one from a peer whose given-up reads may
still land (``staged``) goes into kvcr-owned staging memory and reaches the host pages only after
DONE and its digest check. A read that outlives its deadline is cancelled; one that cannot be
confirmed stopped is quarantined with its staging buffers (late bytes land where nobody reads)
and reaped when it ends after all; a direct one is UNCERTAIN, and its host pages are unsafe.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcr.domain.deadlines import Timing
from kvcr.domain.layout import PieceRun, slot_runs
from kvcr.domain.outcomes import RESTORED, PageOutcome, failed, miss, uncertain
from kvcr.domain.pools import PoolSpec
from kvcr.domain.residency import lease_accepts
from kvcr.ports.clock import Clock
from kvcr.ports.dataplane import DataPlane, SharedBoards, TransferState
from kvcr.ports.errors import TransportError
from kvcr.ports.memory import HostMemory, Move
from kvcr.ports.metric_catalogue import FailureReason, Path
from kvcr.ports.metric_catalogue import MetricName as M
from kvcr.ports.metrics import Metrics
from kvcr.runner.peer_links import Link, RemoteLease, SourceLinks, board_layout_of, count_failure, count_miss
from kvcr.runner.runner import KvcrRunner
from kvcr.runner.staging import StagingBuffer, StagingPool

log = logging.getLogger(__name__)

_CORRUPT = failed("bytes differ from the source's digest")
_UNSIGNED = failed("the source sent no digest for the page (verify_bytes off there?)")
_OTHER_DIGEST = failed("the source digests pages with another page_digest")
_MOVED = miss("the source reused the slot during the read")


@dataclass(frozen=True, slots=True)
class PoolRead:
    """Pages of one pool to read, with the host slots they land in."""

    pool: str
    page_hashes: Sequence[str]
    host_slots: Sequence[int]


@dataclass(frozen=True, slots=True)
class Wanted:
    """Leased pages of one pool to read, as parallel arrays (no object per page on the hot path).

    ``indices``: each page's position in its request (a ``range`` when they follow each other);
    ``pages``: their keys; ``host_slots``: where they land; ``src_slots``: where the source keeps
    them; ``digests``: what the source vouched for each (empty: none).
    """

    pool: str
    indices: Sequence[int]
    pages: Sequence[str]
    host_slots: Sequence[int]
    src_slots: Sequence[int]
    digests: Sequence[bytes]

    def __len__(self) -> int:
        return len(self.indices)

    def cut(self, start: int, stop: int) -> Wanted:
        """Pages ``start:stop`` of these."""
        return Wanted(
            self.pool,
            self.indices[start:stop],
            self.pages[start:stop],
            self.host_slots[start:stop],
            self.src_slots[start:stop],
            self.digests[start:stop],
        )


def chunks(wanted: Sequence[Wanted], step: int) -> list[list[Wanted]]:
    """``wanted`` in order, cut into transfers of at most ``step`` pages (one may span pools)."""
    if len(wanted) == 1 and 0 < len(wanted[0]) <= step:  # the common case: one pool's pages, one transfer
        return [list(wanted)]
    out: list[list[Wanted]] = [[]]
    room = step
    for part in wanted:
        start = 0
        while start < len(part):
            if room == 0:
                out.append([])
                room = step
            taken = min(room, len(part) - start)
            out[-1].append(part if taken == len(part) else part.cut(start, start + taken))
            start += taken
            room -= taken
    return [chunk for chunk in out if chunk]


def _runs(sides: list[tuple[Sequence[int], Sequence[int]]]) -> list[tuple[int, int, int]]:
    """(src first, dst first, count) runs of one pool's pages: one run, found without a per-page loop, when
    both sides count up by one (the common case: a prefix leased in order into consecutive host pages)."""
    if len(sides) == 1:
        src, dst = sides[0]
        if src and _counts_up(src) and _counts_up(dst):
            return [(src[0], dst[0], len(src))]
    return slot_runs(pair for src, dst in sides for pair in zip(src, dst, strict=True))


def _counts_up(slots: Sequence[int]) -> bool:
    """Whether ``slots`` is first, first + 1, ... (compared in C, not page by page in Python)."""
    if isinstance(slots, range):
        return slots.step == 1
    first = slots[0]
    if slots[-1] - first != len(slots) - 1:
        return False
    steps = range(first, first + len(slots))
    return (slots if isinstance(slots, list) else list(slots)) == list(steps)


def _as_found(lease: RemoteLease, part: Wanted) -> tuple[list[int], list[int]]:
    """A part's source slots and, per slot, the generation its board lookup found them at."""
    assert lease.board is not None
    found, gens = lease.board[part.pool]
    src = part.src_slots if isinstance(part.src_slots, list) else list(part.src_slots)
    if part.src_slots is not found:  # not the pages in the order they were found: by slot
        by_slot = dict(zip(found, gens, strict=True))
        return src, [by_slot[slot] for slot in src]
    return src, gens if isinstance(gens, list) else list(gens)


def _moved_unless(still: list[bool]) -> list[bool]:
    """Per page, whether its slot moved, from the board's per-page "still there" answer."""
    return [False] * len(still) if all(still) else [not same for same in still]


class Transfers:
    """Reads leased pages, chunk by chunk. Thread-safe.

    Args:
        host_ids: per pool, the data-plane region ids of its host regions (where direct reads land).
    """

    def __init__(
        self,
        runner: KvcrRunner,
        links: SourceLinks,
        data_plane: DataPlane,
        memory: HostMemory,
        clock: Clock,
        metrics: Metrics,
        staging: StagingPool,
        host_ids: Callable[[str], tuple[int, ...]],
    ) -> None:
        self._runner = runner
        self._links = links
        self._data_plane = data_plane
        self._boards = data_plane if isinstance(data_plane, SharedBoards) else None
        self._memory = memory
        self._clock = clock
        self._metrics = metrics
        self._staging = staging
        self._host_ids = host_ids
        self._timing: Timing = runner.config.timing
        self._verify = runner.config.verify_bytes
        self._specs: dict[str, PoolSpec] = {p.name: p for p in runner.pools}
        self._page_bytes = {p.name: p.page_bytes for p in runner.pools}  # a spec sums its components each time
        self._lock = threading.Lock()
        self._quarantine: list[tuple[int, list[StagingBuffer]]] = []  # (handle, its staging buffers)

    @property
    def quarantined(self) -> int:
        """Transfers that could not be confirmed stopped (their destinations are unsafe)."""
        with self._lock:
            return len(self._quarantine)

    def reap(self) -> int:
        """Release quarantined reads that ended after all (their source came back); returns those left."""
        if not self._quarantine:  # every read asks first; a list read without the lock is at worst one read late
            return 0
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

    def read_chunk(
        self, lease: RemoteLease, link: Link, chunk: list[Wanted], give_up: float
    ) -> tuple[list[PageOutcome], bool]:
        """One transfer: per page (in chunk order) its outcome, and whether the transfer itself completed."""
        total = sum(len(part) for part in chunk)
        if self._clock.now() >= give_up:
            return [miss("lease expired before the read")] * total, False
        if lease.board is not None and not link.staged and self._boards is not None:
            return self._read_found(lease, link, chunk, total, self._boards)
        buffers: dict[str, StagingBuffer] = {}
        if link.staged:
            for pool in dict.fromkeys(part.pool for part in chunk):
                buffer = self._staging.take(self._specs[pool])
                if buffer is None:
                    for taken in buffers.values():
                        self._staging.give_back(taken)
                    count_miss(self._metrics, FailureReason.NO_STAGING, total)
                    return [miss("no staging memory free")] * total, False
                buffers[pool] = buffer
        staged_at = self._staged_positions(chunk) if link.staged else []
        sides: dict[str, list[tuple[Sequence[int], Sequence[int]]]] = {}  # per pool, (source, destination) slots
        for part, first in zip(chunk, staged_at or [0] * len(chunk), strict=True):
            dst = range(first, first + len(part)) if link.staged else part.host_slots
            sides.setdefault(part.pool, []).append((part.src_slots, dst))
        runs: list[PieceRun] = []
        for pool, pool_sides in sides.items():
            src_ids = link.pools[pool].regions
            dst_ids = buffers[pool].ids if link.staged else self._host_ids(pool)
            for src_first, dst_first, count in _runs(pool_sides):
                runs += [
                    PieceRun(src, src_first, dst, dst_first, count) for src, dst in zip(src_ids, dst_ids, strict=True)
                ]
        started = self._clock.now()
        verdict, unsettled = self._transfer(lease, link, runs, give_up, staged=link.staged)
        if not verdict.restored:
            for buffer in buffers.values():
                if unsettled is None:
                    self._staging.give_back(buffer)
                else:
                    self._staging.quarantine(buffer)  # late bytes land where nobody reads
            if unsettled is not None:
                with self._lock:
                    self._quarantine.append((unsettled, list(buffers.values())))
            return [verdict] * total, False
        self._learn(link, chunk, started)
        moved = self._moved(lease, link, chunk) if lease.board is not None else None
        if not link.staged:
            return self._checked(lease, chunk, None, moved), True
        try:
            return self._land_staged(chunk, buffers, staged_at, lease, moved), True
        finally:
            for buffer in buffers.values():
                self._staging.give_back(buffer)

    def _read_found(
        self, lease: RemoteLease, link: Link, chunk: list[Wanted], total: int, boards: SharedBoards
    ) -> tuple[list[PageOutcome], bool]:
        """Pages found on slot boards, copied and re-checked by the plane in one call per pool.

        A same-host copy is synchronous and cannot stall, so there is no transfer to post, wait on
        or give up on; a page whose slot moved on during the copy is a miss (``_checked``).
        """
        started = self._clock.now()
        still: list[bool] = []
        for part in chunk:
            wire = link.pools[part.pool]
            src, gens = _as_found(lease, part)
            components = list(zip(wire.regions, self._host_ids(part.pool), strict=True))
            hosts = part.host_slots if isinstance(part.host_slots, list) else list(part.host_slots)
            try:
                got = boards.board_read(
                    link.peer.name, wire.board, board_layout_of(wire.slots), components, src, hosts, gens
                )
            except TransportError as exc:
                return [self._refused(lease, link, exc)] * total, False
            if got is None:  # the source is gone: as a failed posted read
                self._links.mark_down(lease.endpoint, "read failed", link)
                return [failed("read failed")] * total, False
            still += got
        self._learn(link, chunk, started)
        return self._checked(lease, chunk, None, _moved_unless(still)), True

    def _learn(self, link: Link, chunk: list[Wanted], started: float) -> None:
        """Fold a completed chunk's bytes and time into the link's throughput estimate."""
        page_bytes = self._page_bytes
        link.learn_rate(sum(page_bytes[part.pool] * len(part) for part in chunk), self._clock.now() - started)

    def _refused(self, lease: RemoteLease, link: Link, exc: TransportError) -> PageOutcome:
        """The data plane refused a read of ``link``: the source is skipped, its pages are misses."""
        log.info("kvcr: read from %s refused: %s", lease.endpoint, exc)
        self._links.mark_down(lease.endpoint, "read refused", link)
        return miss("peer unavailable")

    @staticmethod
    def _staged_positions(chunk: list[Wanted]) -> list[int]:
        """Where each part's first page sits in its pool's staging buffer: dense from 0 in chunk order."""
        used: dict[str, int] = {}
        firsts = []
        for part in chunk:
            first = used.get(part.pool, 0)
            firsts.append(first)
            used[part.pool] = first + len(part)
        return firsts

    def _moved(self, lease: RemoteLease, link: Link, chunk: list[Wanted]) -> list[bool]:
        """Per page of a chunk found on slot boards: whether its slot moved on (evicted, refilled) since."""
        boards = self._boards
        moved: list[bool] = []
        for part in chunk:
            wire = link.pools[part.pool]
            src, gens = _as_found(lease, part)
            still = None
            if boards is not None:
                try:
                    still = boards.board_still(link.peer.name, wire.board, board_layout_of(wire.slots), src, gens)
                except (ValueError, TransportError):
                    still = None
            moved += [True] * len(src) if still is None else _moved_unless(still)
        return moved

    def _land_staged(
        self,
        chunk: list[Wanted],
        buffers: dict[str, StagingBuffer],
        staged_at: list[int],
        lease: RemoteLease,
        moved: list[bool] | None,
    ) -> list[PageOutcome]:
        """Verify staged pages, then copy the good ones into their host pages."""
        outcomes = self._checked(lease, chunk, (buffers, staged_at), moved)
        moves: list[Move] = []
        at = 0
        for part, first in zip(chunk, staged_at, strict=True):
            host = self._runner.pool_host_regions(part.pool)
            buffer = buffers[part.pool]
            for k, host_slot in enumerate(part.host_slots):
                if not outcomes[at + k].restored:
                    continue
                moves.extend(
                    Move(r.base + host_slot * r.stride, address, nbytes)
                    for r, (address, nbytes) in zip(host, buffer.extents(first + k), strict=True)
                )
            at += len(part)
        try:
            self._memory.copy(moves)
        except TransportError as exc:
            log.warning("kvcr: copying staged pages into host pages failed: %s", exc)
            return [failed("staged copy failed")] * len(outcomes)
        return outcomes

    def _checked(
        self,
        lease: RemoteLease,
        chunk: list[Wanted],
        staged: tuple[dict[str, StagingBuffer], list[int]] | None,
        moved: list[bool] | None = None,
    ) -> list[PageOutcome]:
        """RESTORED per page, unless its slot ``moved`` during the read (a miss) or its delivered bytes
        differ from the source's digest for that key."""
        total = sum(len(part) for part in chunk)
        if not self._verify:
            if moved is None or not any(moved):
                return [RESTORED] * total
            return [_MOVED if m else RESTORED for m in moved]
        outcomes: list[PageOutcome] = []
        bad = unsigned = other = 0
        expected_bytes = actual_bytes = 0
        runner = self._runner
        for n, part in enumerate(chunk):
            pool = part.pool
            given = zip(part.pages, part.host_slots, part.digests, strict=True)
            for k, (page, host_slot, expected) in enumerate(given):
                if moved is not None and moved[len(outcomes)]:  # one outcome per page so far: this page's index
                    outcomes.append(_MOVED)
                    continue
                if not expected:  # fail closed: a page nobody vouches for is not served
                    unsigned += 1
                    outcomes.append(_UNSIGNED)
                    continue
                if staged is None:
                    actual = runner.host_digest(pool, host_slot, page)
                else:
                    buffers, staged_at = staged
                    actual = runner.digest_extents(pool, buffers[pool].extents(staged_at[n] + k), page)
                if actual == expected:
                    outcomes.append(RESTORED)
                elif len(actual) != len(expected):  # another algorithm: a setting differs, not the bytes
                    other += 1
                    expected_bytes, actual_bytes = len(expected), len(actual)
                    outcomes.append(_OTHER_DIGEST)
                else:
                    bad += 1
                    outcomes.append(_CORRUPT)
        if bad or unsigned or other:
            self._metrics.increment(M.VERIFICATION_FAILURES, bad + unsigned + other, {"path": Path.REMOTE_RESTORE})
            count_failure(self._metrics, FailureReason.VERIFICATION)
        if other:
            log.error(
                "kvcr: %d pages read from %s carry %d-byte digests where page_digest here makes %d-byte ones: "
                "set page_digest the same on every replica; reported as misses",
                other,
                lease.endpoint,
                expected_bytes,
                actual_bytes,
            )
        if bad:
            log.error("kvcr: %d pages read from %s failed verification; reported as misses", bad, lease.endpoint)
        if unsigned:
            log.error(
                "kvcr: %d pages read from %s came without a digest (is verify_bytes off there?); reported as misses",
                unsigned,
                lease.endpoint,
            )
        return outcomes

    def _transfer(
        self, lease: RemoteLease, link: Link, runs: list[PieceRun], give_up: float, *, staged: bool
    ) -> tuple[PageOutcome, int | None]:
        """Post one read and wait for it; returns its outcome and, if it never settled, its handle."""
        try:
            handle = self._data_plane.read(link.peer.name, runs, lease=lease.lease_id)
        except TransportError as exc:
            return self._refused(lease, link, exc), None
        state = self._wait(handle, give_up)
        completed_at = self._clock.now()
        if state is TransferState.PENDING:
            return self._give_up(lease, handle, staged=staged, timed_out_at=give_up)
        self._data_plane.release(handle)
        if state is not TransferState.DONE:
            self._links.mark_down(lease.endpoint, f"read {state.value}", link)
            return failed(f"read {state.value}"), None
        if not lease_accepts(lease.sent_at, lease.ttl_s, self._timing.lease_margin_s, completed_at):
            return failed("read finished after the lease"), None
        return RESTORED, None

    def _give_up(
        self, lease: RemoteLease, handle: int, *, staged: bool, timed_out_at: float
    ) -> tuple[PageOutcome, int | None]:
        """A read outlived its deadline: stop it, tear the peer down if needed; its handle if it never settled.

        The caller quarantines a handle that never settled (with its staging buffers)."""
        expired = timed_out_at == lease.usable_until(self._timing.lease_margin_s)
        why = failed("read would outlive the lease" if expired else "read timed out")
        state = self._data_plane.cancel(handle)
        if not state.terminal:
            # Drop the link and disconnect its peer (the strongest stop the transport has).
            self._links.mark_down(lease.endpoint, "a read stalled", lease.link)
            # A transport that fences on disconnect says so at once; give it a moment, no more.
            state = self._wait(handle, self._clock.now() + 0.5 if not staged else self._clock.now())
        count_failure(self._metrics, FailureReason.LEASE_EXPIRED if expired else FailureReason.TIMEOUT)
        if state.terminal:
            self._data_plane.release(handle)  # a late DONE stays a failure
            return why, None
        count_failure(self._metrics, FailureReason.UNCERTAIN)
        if staged:
            log.warning("kvcr: a read from %s never stopped; its staging buffer is quarantined", lease.endpoint)
            return miss("read stalled (staged, quarantined)"), handle
        log.error(
            "kvcr: read %d from %s could not be confirmed stopped; its host pages are unsafe", handle, lease.endpoint
        )
        return uncertain("transfer could not be confirmed stopped"), handle

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
