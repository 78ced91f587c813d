"""Local-then-remote restores for an engine: what is available, and reading it into host pages.

An engine's query and read name pools and page keys; each pool may have a *source* (the peer
endpoint holding its bytes, with the router identities a hint says it holds). A page is
available for a pool when kvcr's own DRAM holds it, or its source leased it (at query time,
through the :class:`PrefetchBook`). Reads take local pages from DRAM and the rest from the
leases, one data-plane read per lease, and never go past the first page that is available
nowhere (an engine consumes only the leading run).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvcr.domain.boundaries import leading_run
from kvcr.domain.keys import router_id
from kvcr.domain.outcomes import Outcome, PageOutcome
from kvcr.runner.peer_client import PeerClient, PoolRead, RemoteLease
from kvcr.runner.prefetch import Page, PrefetchBook
from kvcr.runner.runner import KvcrRunner


@dataclass(frozen=True, slots=True)
class Source:
    """Where a pool's missing pages may come from; ``covered`` are the router ids a hint names (None: any)."""

    endpoint: str
    covered: frozenset[int] | None = None

    def covers(self, page: str) -> bool:
        return self.covered is None or router_id(page) in self.covered


@dataclass(frozen=True, slots=True)
class ReadResult:
    """Per pool, per page: restored or not; ``uncertain`` when a read could not be confirmed stopped."""

    restored: dict[str, list[bool]]
    uncertain: str | None = None


class Restorer:
    """Answers an engine's hit queries and reads, local first, then from peers. Thread-safe."""

    def __init__(self, runner: KvcrRunner, client: PeerClient | None, book: PrefetchBook | None) -> None:
        self._runner = runner
        self._client = client
        self._book = book

    def presence(
        self,
        keys: Sequence[str],
        pools: Sequence[str],
        sources: Mapping[str, Source | None],
        *,
        request: str | None = None,
        evidence: Sequence[str] = (),
    ) -> dict[str, list[bool]]:
        """Per pool, per page: available locally or leased now from the pool's source.

        Pages are leased only inside the span every ``evidence`` pool (physical ALL_PAGES) could
        still cover, so a query never pins pages past the first page no one has. Leases are booked
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
        # Inside the span a booked page is present; past it only local pages count.
        present = {
            pool: [here or (i < span and b) for i, (here, b) in enumerate(zip(local[pool], held[pool], strict=True))]
            for pool in pools
        }
        by_source: dict[str, list[tuple[str, list[int]]]] = {}
        for pool in pools:
            source = sources.get(pool)
            if source is None:
                continue
            # neither here nor booked, yet reachable: its source's hint covers it
            wanted = [i for i in range(span) if candidate[pool][i] and not present[pool][i]]
            if wanted:
                by_source.setdefault(source.endpoint, []).append((pool, wanted))
        for endpoint, wanted_pools in by_source.items():
            lease = self._client.lease(endpoint, [(pool, [keys[i] for i in idx]) for pool, idx in wanted_pools])
            if lease is None:
                continue
            booked: list[Page] = []
            for pool, idx in wanted_pools:
                for i in idx:
                    if lease.holds(pool, keys[i]):
                        present[pool][i] = True
                        booked.append((pool, keys[i]))
            if request is None:
                self._client.release(lease)  # nothing would release it early: hold nothing past this call
            else:
                book.add(lease, booked, request)
        return present

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
        batches: list[tuple[RemoteLease, set[Page], bool]] = [
            (lease, set(items), True) for lease, items in book.take(wanted)
        ]
        booked = {item for _, items, _ in batches for item in items}
        unbooked: dict[str, list[tuple[str, list[str]]]] = {}
        for pool, (pages, _, _) in remote.items():
            source = sources.get(pool)
            if source is None:
                continue
            # Not booked (no hit query before, or its lease ran out): lease now, one round trip.
            fresh = [page for page in pages if (pool, page) not in booked and source.covers(page)]
            if fresh:
                unbooked.setdefault(source.endpoint, []).append((pool, fresh))
        for endpoint, pool_pages in unbooked.items():
            lease = client.lease(endpoint, pool_pages)
            if lease is not None:
                batches.append((lease, {(pool, page) for pool, pages in pool_pages for page in pages}, False))
        uncertain: str | None = None
        for lease, items, from_book in batches:
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
                if from_book:
                    book.done(items)
                else:
                    client.release(lease)
            uncertain = uncertain or _apply(outcomes, positions, restored)
        return ReadResult(restored, uncertain)

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
    """Per page, whether it may be had: known here, booked at hit-query time, or covered by its source's hint.

    The one rule for "a peer may supply this page", used by the hit query and by how far a read goes.
    """
    return [
        here or held or (source is not None and source.covers(page))
        for page, here, held in zip(keys, known, booked, strict=True)
    ]
