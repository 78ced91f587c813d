"""Local-then-remote restores for an engine: what is available, and reading it into host pages.

An engine's query and read name pools and page keys; each pool may have a *source* (the peer
endpoint holding its bytes, with the router identities a hint says it holds), and a source may
name the next one to ask (``then``: a hint with several holders, in the router's order). A page
is available for a pool when kvcr's own DRAM holds it, or a source leased it (at query time,
through the :class:`PrefetchBook`, or at read time). Pages a source does not lease (it is dead,
refuses, or no longer holds them) are asked of the next source that covers them, in the same
call. Reads take local pages from DRAM and the rest from the leases, one data-plane read per
lease, and never go past the first page that is available nowhere (an engine consumes only the
leading run).

Every page a hint names and a source is asked for is counted once per ask in
``kvcr_hinted_pages_total{outcome}``: ``leased``, ``missing`` (the source answered without it:
a stale hint) or ``unreachable`` (no lease at all); per source the same tallies are kept for
``stats`` (an endpoint is never a metric label).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from kvcr.domain.boundaries import leading_run
from kvcr.domain.keys import router_id
from kvcr.domain.outcomes import Outcome, PageOutcome
from kvcr.ports.metric_catalogue import HintedOutcome, MetricName
from kvcr.ports.metrics import Metrics
from kvcr.runner.peer_client import PeerClient, PoolRead, RemoteLease
from kvcr.runner.prefetch import Page, PrefetchBook
from kvcr.runner.runner import KvcrRunner

MAX_TALLIED_SOURCES = 64
"""Sources tallied one by one in ``stats``; later ones share the ``"other"`` row (hints come from requests)."""


@dataclass(frozen=True, slots=True)
class Source:
    """Where a pool's missing pages may come from; ``covered`` are the router ids a hint names (None: any).

    ``then`` is the next source to ask for pages this one does not lease.
    """

    endpoint: str
    covered: frozenset[int] | None = None
    then: Source | None = None

    def covers(self, page: str) -> bool:
        return self.covered is None or router_id(page) in self.covered

    def chain(self) -> Iterator[Source]:
        """This source, then each next one, in order."""
        source: Source | None = self
        while source is not None:
            yield source
            source = source.then

    @property
    def hinted(self) -> bool:
        """Whether a hint named these pages (not our own writer rank, which holds every page)."""
        return self.covered is not None


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Per pool, per page: restored or not; ``uncertain`` when a read could not be confirmed stopped."""

    restored: dict[str, list[bool]]
    uncertain: str | None = None


class Restorer:
    """Answers an engine's hit queries and reads, local first, then from peers. Thread-safe."""

    def __init__(
        self,
        runner: KvcrRunner,
        client: PeerClient | None,
        book: PrefetchBook | None,
        metrics: Metrics | None = None,
    ) -> None:
        self._runner = runner
        self._client = client
        self._book = book
        self._metrics = metrics
        self._tally_lock = threading.Lock()
        self._tally: dict[str, dict[str, int]] = {}

    def presence(
        self,
        keys: Sequence[str],
        pools: Sequence[str],
        sources: Mapping[str, Source | None],
        *,
        request: str | None = None,
        evidence: Sequence[str] = (),
        min_pages: int = 0,
    ) -> dict[str, list[bool]]:
        """Per pool, per page: available locally or leased now from the pool's source.

        Pages are leased only inside the span every ``evidence`` pool (physical ALL_PAGES) could
        still cover, so a query never pins pages past the first page no one has, and only when that
        span reaches ``min_pages`` (below it the engine prefetches nothing: SGLang's
        ``prefetch_threshold``), so a source never leases what no one will read. Leases are booked
        for the read only under a ``request`` id (the engine then says when it cuts the hit or ends
        the prefetch); without one they are released before this returns and the read leases anew.
        """
        runner = self._runner
        local = {pool: runner.exists(pool, keys) for pool in pools}
        if self._client is None or self._book is None:
            return local
        book = self._book
        held = {pool: book.booked(pool, keys) for pool in pools}
        candidate = {pool: _reachable(keys, local[pool], held[pool], sources.get(pool)) for pool in pools}
        span = min((leading_run(candidate[p]) for p in evidence), default=len(keys))
        leasable = span if span >= min_pages else 0
        # Inside the span a booked page is present; past it only local pages count.
        present = {
            pool: [here or (i < span and b) for i, (here, b) in enumerate(zip(local[pool], held[pool], strict=True))]
            for pool in pools
        }
        # neither here nor booked, yet reachable: a source's hint covers it
        wanted = {pool: [i for i in range(leasable) if candidate[pool][i] and not present[pool][i]] for pool in pools}
        pages = {pool: [keys[i] for i in idx] for pool, idx in wanted.items()}
        for lease, asked in self._lease_along(pages, sources):
            booked: list[Page] = []
            for pool, _ in asked:
                for i in wanted[pool]:
                    if not present[pool][i] and lease.holds(pool, keys[i]):
                        present[pool][i] = True
                        booked.append((pool, keys[i]))
            if request is None:
                self._client.release(lease)  # nothing would release it early: hold nothing past this call
            else:
                book.add(lease, booked, request)
        return present

    def _lease_along(
        self, wanted: Mapping[str, list[str]], sources: Mapping[str, Source | None]
    ) -> Iterator[tuple[RemoteLease, list[tuple[str, list[str]]]]]:
        """Lease each pool's ``wanted`` pages down its source chain.

        One LEASE per endpoint per step of the chains; a page the step's source does not lease
        is asked of the pool's next source that covers it. Yields each lease with what was asked.
        """
        client = self._client
        assert client is not None
        steps = {pool: (source, list(wanted.get(pool, ()))) for pool, source in sources.items() if source is not None}
        while steps:
            by_source: dict[str, list[tuple[str, list[str]]]] = {}
            for pool, (source, pages) in steps.items():
                asked = [page for page in pages if source.covers(page)]
                if asked:
                    by_source.setdefault(source.endpoint, []).append((pool, asked))
            leased: set[Page] = set()
            for endpoint, asked_pools in by_source.items():
                lease = client.lease(endpoint, asked_pools)
                got = {(p, k) for p, pages in asked_pools for k in pages if lease is not None and lease.holds(p, k)}
                leased |= got
                # pages, not pools: count the first pool a hint named (every pool asks for the same pages)
                hinted = next(((p, pages) for p, pages in asked_pools if steps[p][0].hinted), None)
                if hinted is not None:
                    pool, pages = hinted
                    self._count_ask(endpoint, len(pages), sum((pool, k) in got for k in pages), lease is None)
                if lease is not None:
                    yield lease, asked_pools
            nxt: dict[str, tuple[Source, list[str]]] = {}
            for pool, (source, pages) in steps.items():
                rest = [page for page in pages if (pool, page) not in leased]
                if source.then is not None and rest:
                    nxt[pool] = (source.then, rest)
            steps = nxt

    def _count_ask(self, endpoint: str, asked: int, leased: int, unreachable: bool) -> None:
        """Count ``asked`` hinted pages asked of ``endpoint``: leased, missing, or all unreachable."""
        if unreachable:
            counts = {HintedOutcome.UNREACHABLE: asked}
        else:
            counts = {HintedOutcome.LEASED: leased, HintedOutcome.MISSING: asked - leased}
        with self._tally_lock:
            key = endpoint if endpoint in self._tally or len(self._tally) < MAX_TALLIED_SOURCES else "other"
            row = self._tally.setdefault(key, {o.value: 0 for o in HintedOutcome})
            for outcome, n in counts.items():
                row[outcome.value] += n
        if self._metrics is not None:
            for outcome, n in counts.items():
                if n:
                    self._metrics.increment(MetricName.HINTED_PAGES, n, {"outcome": outcome})

    def hinted_by_source(self) -> dict[str, dict[str, int]]:
        """Per source endpoint: hinted pages asked of it, leased, missing (stale hint) or unreachable."""
        with self._tally_lock:
            return {endpoint: dict(row) for endpoint, row in self._tally.items()}

    def read(
        self,
        requests: Mapping[str, tuple[Sequence[str], Sequence[int]]],
        sources: Mapping[str, Source | None],
    ) -> ReadResult:
        """Restore each pool's pages into its host slots: local pages from DRAM, the rest from peers.

        Without a peer client or a book only local pages are read, as :meth:`presence` counts only those.
        """
        runner, client, book = self._runner, self._client, self._book
        if client is None or book is None:
            local = {pool: runner.restore(pool, keys, slots) for pool, (keys, slots) in requests.items()}
            return ReadResult({pool: [o.restored for o in outcomes] for pool, outcomes in local.items()})
        restored: dict[str, list[bool]] = {}
        remote: dict[str, tuple[list[str], list[int], list[int]]] = {}
        for pool, (keys, slots) in requests.items():
            outcomes = runner.restore(pool, keys, slots)
            done = [o.restored for o in outcomes]
            restored[pool] = done
            if not all(done):
                reach = self._reach(book, pool, keys, done, sources.get(pool))
                missing = [i for i in range(reach) if not done[i]]
                if missing:
                    remote[pool] = ([keys[i] for i in missing], [slots[i] for i in missing], missing)
        if not remote:
            return ReadResult(restored)
        return self._read_remote(client, book, remote, restored, sources)

    def _reach(
        self, book: PrefetchBook, pool: str, keys: Sequence[str], done: Sequence[bool], source: Source | None
    ) -> int:
        """How far a pool's read may go: up to the first page neither restored, booked nor covered."""
        return leading_run(_reachable(keys, done, book.booked(pool, keys), source))

    def _read_remote(
        self,
        client: PeerClient,
        book: PrefetchBook,
        remote: Mapping[str, tuple[list[str], list[int], list[int]]],
        restored: dict[str, list[bool]],
        sources: Mapping[str, Source | None],
    ) -> ReadResult:
        wanted: list[Page] = [(pool, page) for pool, (pages, _, _) in remote.items() for page in pages]
        taken = book.take(wanted)
        booked = {item for _, items in taken for item in items}
        uncertain: str | None = None
        # What the hit query leased is read before anything else is asked: a source that refuses the
        # rest (closing, say) has its link dropped, which must not cost the pages it already leased.
        for lease, items in taken:
            uncertain = self._read_lease(client, lease, set(items), remote, restored, book) or uncertain
        # Not booked (no hit query before, or its lease ran out): lease now, down each pool's sources.
        fresh = {pool: [page for page in pages if (pool, page) not in booked] for pool, (pages, _, _) in remote.items()}
        for lease, pool_pages in self._lease_along(fresh, sources):
            held = {(pool, page) for pool, pages in pool_pages for page in pages if lease.holds(pool, page)}
            uncertain = self._read_lease(client, lease, held, remote, restored, None) or uncertain
        return ReadResult(restored, uncertain)

    @staticmethod
    def _read_lease(
        client: PeerClient,
        lease: RemoteLease,
        items: set[Page],
        remote: Mapping[str, tuple[list[str], list[int], list[int]]],
        restored: dict[str, list[bool]],
        book: PrefetchBook | None,
    ) -> str | None:
        """Read ``items`` of one lease into their slots, then give it back (to ``book``, or release it)."""
        reads = []
        positions: dict[str, list[int]] = {}
        for pool, (pages, slots, where) in remote.items():
            chosen = [k for k, page in enumerate(pages) if (pool, page) in items]
            if chosen:
                reads.append(PoolRead(pool, [pages[k] for k in chosen], [slots[k] for k in chosen]))
                positions[pool] = [where[k] for k in chosen]
        try:
            outcomes = client.read(lease, reads)
        finally:
            if book is not None:
                book.done(items)
            else:
                client.release(lease)
        return _apply(outcomes, positions, restored)

    def finish(self, request: str) -> None:
        """The engine's prefetch for ``request`` ended: release what it never read."""
        if self._book is not None:
            self._book.finish(request)

    @property
    def booked(self) -> int:
        """Remote pages leased at hit-query time and not read yet."""
        return len(self._book) if self._book is not None else 0

    def close(self) -> None:
        """Release every booked lease (the engine is going away)."""
        if self._book is not None:
            self._book.close()

    def trim(self, request: str, keep: Sequence[str]) -> None:
        """The engine cut ``request``'s hit to ``keep``: release the rest."""
        if self._book is not None:
            self._book.trim(request, keep)


def _apply(
    outcomes: Mapping[str, list[PageOutcome]], positions: Mapping[str, list[int]], restored: dict[str, list[bool]]
) -> str | None:
    uncertain: str | None = None
    for pool, where in positions.items():
        for position, outcome in zip(where, outcomes.get(pool, ()), strict=False):
            if outcome.outcome is Outcome.UNCERTAIN:
                uncertain = f"a read into host pages of pool {pool!r} could not be confirmed stopped ({outcome.reason})"
            restored[pool][position] = outcome.restored
    return uncertain


def _reachable(keys: Sequence[str], known: Sequence[bool], booked: Sequence[bool], source: Source | None) -> list[bool]:
    """Per page, whether it may be had: known here, booked at hit-query time, or covered by a source's hint.

    The one rule for "a peer may supply this page", used by the hit query and by how far a read goes.
    """
    chain = tuple(source.chain()) if source is not None else ()
    return [
        here or held or any(s.covers(page) for s in chain) for page, here, held in zip(keys, known, booked, strict=True)
    ]
